"""What the GPU-shaped targets' reports say about serving their files."""
from __future__ import annotations


def host_sync_note(request, proto) -> list[str]:
    """A file with a subgraph that reads on the host a value ONNX Runtime CUDA computes on the GPU
    (runtimes/common/host_reads.py replays its placement; since the Loop bodies read their scalars
    from their own Shape, only Sandwich's distance-table length, from the positions' values) needs
    host-synchronous launches on ONNX Runtime CUDA (measured on ORT 1.31.1: benchmarks/gpu_cure.md)."""
    from ...runners import runtimes_common

    risky = runtimes_common("host_reads").risky_host_reads(proto) if proto.functions else []
    if not risky:
        return []
    return ["on ONNX Runtime CUDA serve this file with CUDA_LAUNCH_BLOCKING=1 set before the process's first session "
            "(our runners do): a subgraph of it reads on the host a value ONNX Runtime CUDA computes on the GPU "
            f"({risky[0].split(': ', 1)[1]}), which it can read stale with asynchronous launches (docs/gpu.md)"]

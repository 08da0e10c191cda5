"""What the GPU-shaped targets' reports say about serving their files."""
from __future__ import annotations


def host_sync_note(request, proto) -> list[str]:
    """A file whose blocked Loop reads per-block bounds on the host (runtimes/common/host_reads.py)
    needs host-synchronous launches on ONNX Runtime CUDA (measured on ORT 1.31.1:
    benchmarks/gpu_parity_async.md)."""
    from ...runners import runtimes_common

    if not proto.functions or not runtimes_common("host_reads").risky_host_reads(proto):
        return []
    return ["on ONNX Runtime CUDA serve this file with CUDA_LAUNCH_BLOCKING=1 set before the process's first session "
            "(our runners do): its blocked Loop reads per-block bounds on the host, which ONNX Runtime CUDA can read "
            "stale with asynchronous launches (docs/gpu.md)"]

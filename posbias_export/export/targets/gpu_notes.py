"""What the blocked targets' reports say about serving their files on ONNX Runtime CUDA."""
from __future__ import annotations


def host_sync_note(request, proto) -> list[str]:
    """A file ONNX Runtime CUDA can run wrong with its default asynchronous launches
    (runtimes/common/host_reads.py, measured on ORT 1.31.1: benchmarks/gpu_cure_loops.md): one with
    a subgraph that reads on the host a value ONNX Runtime computes on the GPU (since the Loop
    bodies read their scalars from their own Shape, only Sandwich's distance-table length, from the
    positions' values), or with the portable blocked body, which still raced without such a read.
    Such a file needs host-synchronous launches there; the GPU targets' other files do not."""
    from ...runners import runtimes_common

    reads = runtimes_common("host_reads")
    risky = reads.risky_host_reads(proto) if proto.functions else []
    if risky:
        why = (f"a subgraph of it reads on the host a value ONNX Runtime computes on the GPU "
               f"({risky[0].split(': ', 1)[1]}), which it can read stale")
    elif proto.functions and reads.unfused_loops(proto):
        why = ("its portable blocked attention still gave wrong blocks now and then (the GPU targets' files do not: "
               "export with --target cuda-ort for a GPU)")
    else:
        return []
    return [f"on ONNX Runtime CUDA serve this file with CUDA_LAUNCH_BLOCKING=1 set before the process's first session "
            f"(our runners do): with its default asynchronous launches {why} (docs/gpu.md)"]

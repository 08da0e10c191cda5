"""One exported attention file on ONNX Runtime CUDA, at several lengths, in its own process.

Run by path (python posbias_export/bench/gpu_worker.py model.onnx --lengths ... --dtype ...), so
ONNX Runtime's arena and CUDA context are this file's alone. Inputs and output live on the GPU
(IOBinding): the timings are the graph, not PCIe copies. Prints one JSON line per length:
times (seconds per forward after one warm-up), gpu_bytes (this process's GPU memory after the
runs, minus what it held before the first input: ONNX Runtime's arena keeps its peak, and the
lengths run in increasing order), provider (must be CUDAExecutionProvider), or error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

DTYPES = {"float16": np.float16, "float32": np.float32}


def process_gpu_bytes() -> int | None:
    """This process's GPU memory as the driver sees it (NVML), or None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid():
            return int(proc.usedGpuMemory or 0)
    return 0


def load_runner(relative: str):
    """A runner script of runtimes/ as a module (posbias_export must be importable: installed, or
    PYTHONPATH set to the checkout as on the GPU machine)."""
    from posbias_export.runners import runtimes_common

    return runtimes_common("loading").load_runner(relative)


def cuda_session(model: str, tf32: bool = False):
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    ort.set_default_logger_severity(3)  # a failing length is reported in its JSON row, once
    runner = load_runner("ort/run.py")  # the runners' session and provider options: what is timed is what is served
    opts = runner.session_options(ort)
    (name, cuda), cpu = runner.provider_list("cuda", tf32)
    # kSameAsRequested: the arena grows by what is asked, not to the next power of two, so the
    # memory column is what the graph needs (the default doubling reached 22 GB at 16384)
    cuda = {**cuda, "arena_extend_strategy": "kSameAsRequested"}
    session = ort.InferenceSession(model, opts, providers=[(name, cuda), cpu])
    active = session.get_providers()[0]
    if active != "CUDAExecutionProvider":
        raise RuntimeError(f"CUDA provider did not load (session runs on {active})")
    return session


def time_length(session, length: int, heads: int, head_dim: int, dtype, repeats: int) -> list[float]:
    import onnxruntime as ort

    rng = np.random.default_rng(length)
    binding = session.io_binding()
    for name in ("query", "key", "value"):
        x = rng.standard_normal((1, heads, length, head_dim)).astype(dtype)
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    binding.bind_output(session.get_outputs()[0].name, "cuda", 0)
    session.run_with_iobinding(binding)  # warm-up: arena growth, kernel selection
    binding.synchronize_outputs()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--lengths", required=True, help="comma-separated, increasing")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    session = cuda_session(args.model)
    before = process_gpu_bytes()
    for length in sorted(int(n) for n in args.lengths.split(",")):
        row = {"length": length}
        try:
            row["times"] = time_length(session, length, args.heads, args.head_dim, DTYPES[args.dtype], args.repeats)
            after = process_gpu_bytes()
            row["gpu_bytes"] = None if after is None or before is None else after - before
        except Exception as err:  # noqa: BLE001 - one failing length (e.g. out of memory) is a result
            row["error"] = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One exported attention file on ONNX Runtime CUDA, at several lengths, in its own process.

Run by path (python posbias_export/bench/gpu_worker.py model.onnx --lengths ... --dtype ...), so
ONNX Runtime's arena and CUDA context are this file's alone. Inputs and output live on the GPU
(IOBinding): the timings are the graph, not PCIe copies. Prints one JSON line per length:
times (seconds per forward after one warm-up), gpu_bytes (this process's GPU memory after the
runs, minus what it held before the first input: ONNX Runtime's arena keeps its peak, and the
lengths run in increasing order), provider (must be CUDAExecutionProvider), or error.

--profile: after every length is timed (and its memory read), one more line per length with
what ran: ONNX Runtime's profiler (ms per operator type, a fresh session) and, where PyTorch
with CUDA is importable, the CUDA kernels its profiler (CUPTI, process-wide) saw in the same
runs: the name of the attention kernel each cell ran (flash, memory-efficient, cuDNN, unfused).
--provider cpu runs the same steps on ORT CPU (the rehearsal before a GPU lease).
"""
from __future__ import annotations

import argparse
import contextlib
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


def served_providers(model: str, provider: str, tf32: bool = False) -> list:
    """The runners' providers (what is timed is what is served), the CUDA arena growing by what
    is asked (kSameAsRequested) and not to the next power of two, so the memory column is what
    the graph needs (the default doubling reached 22 GB at 16384)."""
    runner = load_runner("ort/run.py")
    providers = runner.provider_list(provider, tf32)
    if provider == "cpu":
        return providers
    runner.host_synchronous_cuda(model)  # as served (CUDA_LAUNCH_BLOCKING=0 in the environment times without it)
    (name, cuda), cpu = providers
    return [(name, {**cuda, "arena_extend_strategy": "kSameAsRequested"}), cpu]


def cuda_session(model: str, tf32: bool = False, provider: str = "cuda"):
    import onnxruntime as ort

    if provider == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    ort.set_default_logger_severity(3)  # a failing length is reported in its JSON row, once
    opts = load_runner("ort/run.py").session_options(ort)
    session = ort.InferenceSession(model, opts, providers=served_providers(model, provider, tf32))
    active = session.get_providers()[0]
    if provider == "cuda" and active != "CUDAExecutionProvider":
        raise RuntimeError(f"CUDA provider did not load (session runs on {active})")
    return session


def feeds(length: int, heads: int, head_dim: int, dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(length)
    return {name: rng.standard_normal((1, heads, length, head_dim)).astype(dtype) for name in ("query", "key", "value")}


def time_length(session, length: int, heads: int, head_dim: int, dtype, repeats: int) -> list[float]:
    import onnxruntime as ort

    device = "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    binding = session.io_binding()
    for name, x in feeds(length, heads, head_dim, dtype).items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x, device, 0))
    binding.bind_output(session.get_outputs()[0].name, device, 0)
    session.run_with_iobinding(binding)  # warm-up: arena growth, kernel selection
    binding.synchronize_outputs()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - start)
    return times


class CudaKernels:
    """Context manager: the CUDA kernels launched in this process while it is open, by total
    device time (PyTorch's profiler over CUPTI sees ONNX Runtime's launches too). `names` stays
    None where PyTorch or CUDA is missing; `error` says why a trace failed."""

    def __init__(self):
        self.names, self.error, self._prof = None, None, None

    def __enter__(self):
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if torch.cuda.is_available():
                self._prof = profile(activities=[ProfilerActivity.CUDA])
                self._prof.__enter__()
        except Exception as err:  # noqa: BLE001 - the timings stand without kernel names
            self.error = str(err)[:200]
        return self

    def __exit__(self, *exc):
        if self._prof is None:
            return False
        self._prof.__exit__(*exc)
        try:
            totals = {}
            for e in self._prof.events():
                if str(getattr(e, "device_type", "")).endswith("CUDA"):
                    us = e.time_range.elapsed_us()  # a kernel's own span (device events carry it)
                    totals[e.name] = totals.get(e.name, 0.0) + us
            self.names = [{"kernel": k[:160], "us": round(v, 1)} for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:8]]
        except Exception as err:  # noqa: BLE001
            self.error = str(err)[:200]
        return False


def profile_length(model: str, provider: str, length: int, heads: int, head_dim: int, dtype) -> dict:
    """What one forward at this length ran: ORT's ops (ms per type) and, on CUDA, the kernels."""
    import onnxruntime as ort

    from posbias_export.bench.profile import profile

    kernels = CudaKernels() if provider == "cuda" else contextlib.nullcontext()
    result = profile(model, feeds(length, heads, head_dim, dtype), runs=1, providers=served_providers(model, provider),
                     options=load_runner("ort/run.py").session_options(ort), during=kernels)
    row = {"length": length, "ort_ops_ms": {r["op"]: round(r["us"] / 1e3, 3) for r in result["ops"][:8]},
           "wall_ms": round(result["wall_us"] / 1e3, 3)}
    if provider == "cuda":
        row["cuda_kernels"] = kernels.names
        row["cuda_kernels_error"] = kernels.error
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--lengths", required=True, help="comma-separated, increasing")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--profile", action="store_true", help="after the timings, one line per length with what ran")
    args = p.parse_args(argv)
    session = cuda_session(args.model, provider=args.provider)
    before = process_gpu_bytes() if args.provider == "cuda" else None
    lengths = sorted(int(n) for n in args.lengths.split(","))
    for length in lengths:
        row = {"length": length}
        try:
            row["times"] = time_length(session, length, args.heads, args.head_dim, DTYPES[args.dtype], args.repeats)
            after = process_gpu_bytes()
            row["gpu_bytes"] = None if after is None or before is None else after - before
        except Exception as err:  # noqa: BLE001 - one failing length (e.g. out of memory) is a result
            row["error"] = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        print(json.dumps(row), flush=True)
    if args.profile:
        del session  # its arena: the profiled sessions get the memory the timed one had
        os.environ["ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO"] = "1"  # MHA / GQA print the kernel they pick
        for length in lengths:
            try:
                row = profile_length(args.model, args.provider, length, args.heads, args.head_dim, DTYPES[args.dtype])
            except Exception as err:  # noqa: BLE001 - a length that failed to run has no profile either
                row = {"length": length, "profile_error": str(err).strip()[:300]}
            print(json.dumps({"length": length, "profile": row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much memory a run may take, asked before a large allocation so that a request too big for
the machine is one line, not std::bad_alloc from inside the runtime; and how much this process
holds (the benchmarks' memory columns)."""
from __future__ import annotations

import os

from .tensor_io import RunnerError


def available_bytes() -> int:
    """Memory a run may use: MemAvailable (Linux), else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 << 30


def check_allocation(need: int, what: str, advice: str) -> None:
    """RunnerError when `what` needs more than this machine has free."""
    free = available_bytes()
    if need > free:
        raise RunnerError(f"{what} needs {need / 1e9:.3g} GB, more than the {free / 1e9:.3g} GB this machine has "
                          f"free; {advice}")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss_now() -> int:
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    # VmHWM belongs to this process image; getrusage's ru_maxrss survives exec and would
    # report the (larger) parent that spawned us.
    return _status_bytes("VmHWM")


def process_gpu_bytes() -> int | None:
    """This process's GPU memory as the driver sees it (NVML), or None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    return next((int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                 if p.pid == os.getpid()), 0)


def return_free_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).
    Loading a model frees its parsed protobuf after the weights are copied out, and glibc keeps
    those pages, most of all in the per-thread arenas of a server's worker threads: a served
    jina-v2-base replica held ~200 MB more than the same session made in a plain process. Every
    runner's session (ort/run.py create_session) returns them too: that model's one-file
    model.onnx at 8192 tokens peaked its process at 1332 MiB before, 1174 MiB after."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator returns pages itself
        return
    if trim is not None:
        trim(0)

"""How much memory a run may take, asked before a large allocation so that a request too big for
the machine is one line, not std::bad_alloc from inside the runtime."""
from __future__ import annotations

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

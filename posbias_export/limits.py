"""Size guards: a request whose memory estimate exceeds what this machine has is refused up
front with the estimate (one line), instead of a traceback minutes later or a machine swapping
for hours. Each room estimates its own work; `--ignore-size-limits` (IGNORE_FLAG) lets a user
who knows better try anyway."""
from __future__ import annotations

IGNORE_FLAG = "--ignore-size-limits"
MAX_INDEX = 1 << 30  # the largest block or length an exported graph's int32-safe index math takes


class TooBig(ValueError):
    """A request this machine cannot hold (ValueError: every command reports it as one line)."""


def available_bytes() -> int:
    """Memory a run may use: MemAvailable (Linux), else 8 GiB (the runners' rule, runtimes/common/memory.py)."""
    from .runners import runtimes_common

    return runtimes_common("memory").available_bytes()


def total_memory_share(share: float = 0.7) -> int:
    """What one benchmark configuration may use: 70% of this machine's memory."""
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return int(share * total_kib * 1024)


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n < 1e12 else f"{n / 1e12:.3g} TB"


def check_fits(need: float, what: str, ignore: bool = False) -> None:
    """Refuse `what` when it needs more memory than is available (unless `ignore`)."""
    have = available_bytes()
    if need > have and not ignore:
        raise TooBig(f"{what} needs about {gigabytes(need)} of memory, more than the {gigabytes(have)} available here "
                     f"(pass {IGNORE_FLAG} to try anyway)")


def check_index(value: int, what: str) -> None:
    """Lengths, blocks and table rows an export or a runtime indexes with int32 arithmetic."""
    if value > MAX_INDEX:
        raise TooBig(f"{what} must be at most 2^30 ({MAX_INDEX}), got {value}")


def attention_bytes(batch: int, heads: int, q_len: int, k_len: int, itemsize: int = 4, copies: int = 3) -> float:
    """Scores, bias and probabilities of one attention call over [q_len, k_len] (`copies` of
    them alive at once)."""
    return float(batch) * heads * q_len * k_len * itemsize * copies

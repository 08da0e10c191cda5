"""What every benchmark cell holds, whatever it measures: the repeated times of one
configuration in its own process, that process's peak RSS, or why it did not run."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Measured:
    times: list[float] = field(default_factory=list)  # seconds per run, after a warm-up
    peak_rss: int | None = None  # bytes
    skipped: str | None = None  # why it did not run (predicted memory) or how it failed

    @property
    def ok(self) -> bool:
        return bool(self.times)

    @property
    def min(self) -> float | None:
        return min(self.times) if self.times else None

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

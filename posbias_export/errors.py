"""Turning exceptions into the one line a user reads."""
from __future__ import annotations


class ExportCheckError(RuntimeError):
    """The exporter produced something we refuse to ship (defined here, torch-free, so the
    command line can catch it without importing the exporter)."""


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of an exception's message (libraries write pages), or its type."""
    line = next((l.strip() for l in str(err).splitlines() if l.strip()), type(err).__name__)
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


class UsageError(Exception):
    """A usage problem on the command line: reported as one line, exit code 2."""

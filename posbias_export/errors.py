"""Turning exceptions into the one line a user reads."""
from __future__ import annotations

import re


class ExportCheckError(RuntimeError):
    """The exporter produced something we refuse to ship (defined here, torch-free, so the
    command line can catch it without importing the exporter)."""


ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of an exception's message (libraries write pages), or its type;
    a first line that only announces the next ("Validation error for field 'n_head':") takes
    the next one along. Terminal colours (torch's exporter writes them) are dropped."""
    lines = [l.strip() for l in ANSI_COLOUR.sub("", str(err)).splitlines() if l.strip()] or [type(err).__name__]
    line = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


class UsageError(Exception):
    """A usage problem on the command line: reported as one line, exit code 2."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cause_line(err: BaseException, limit: int = 300) -> str:
    """The line that names what went wrong: the first line of the innermost exception in the
    __cause__ / __context__ chain (libraries wrap the cause in generic text: torch.onnx.export's
    "Failed to export the model with torch.export. This is step 1/3 ..."), colour codes removed."""
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for candidate in reversed(chain):
        line = _ANSI.sub("", first_line(candidate)).strip()
        if line and line != type(candidate).__name__:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return _ANSI.sub("", first_line(chain[0], limit))

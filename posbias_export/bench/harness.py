"""What every benchmark shares, one of each:

- a measurement in a child process (`run_child`): its peak RSS is its own, and its last line of
  stdout is one JSON object (or {"error": one line}); `measured_python` adds a wrapper that reads
  the child's peak by wait4 (a child forked from a large process counts its pages until exec);
- the median of repeats;
- the results written as markdown + JSON side by side (`write_results`), rows of an earlier run
  kept where a slow benchmark measures in parts (`kept_rows`), and the prose a person wrote about
  the results (below PROSE_MARK in the markdown) kept when the file is regenerated: what we know
  of a number lives in benchmarks/*.md, not in code.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


PROSE_MARK = "<!-- written by hand below this line: kept when the file is regenerated -->"


class ChildFailed(RuntimeError):
    """A measurement's child process failed; the message is one line. `reason`: what happened,
    without the command (whose paths are this machine's)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def run_child(cmd: list[str], timeout: float) -> dict:
    """Run `cmd`; its last stdout line parsed as JSON. ChildFailed (one line) for a timeout, a
    kill, a non-zero exit, no output or a reported {"error": ...}."""
    return _run(cmd, timeout)[0]


def _run(cmd: list[str], timeout: float) -> tuple[dict, str]:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"timed out after {timeout:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = ([line for line in proc.stderr.splitlines() if line.strip()] or ["no message"])[-1]
        raise ChildFailed("killed (out of memory?)" if proc.returncode < 0 else
                          f"failed (exit {proc.returncode}): {tail[:200]}")
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise ChildFailed(f"no result line: {lines[-1][:200]}") from None
    if isinstance(result, dict) and "error" in result:
        raise ChildFailed(f"error: {result['error']}")
    return result, proc.stderr


_WAIT4 = ("import os, subprocess, sys, time, json\n"
          "t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, text=True)\n"
          "out = p.stdout.read(); _, status, usage = os.wait4(p.pid, 0)\n"
          "print(json.dumps({'s': time.perf_counter() - t, 'kb': usage.ru_maxrss, "
          "'rc': os.waitstatus_to_exitcode(status), 'out': out}))\n")


def measured_python(args: list[str], timeout: float = 3600, program: str = sys.executable) -> tuple[float, float, str]:
    """PROGRAM ARGS (default: this Python) in a child: (seconds, peak RSS in GB, its stdout).
    ChildFailed with the child's last words when it fails (a kill: the signal and its peak RSS)."""
    got, stderr = _run([sys.executable, "-c", _WAIT4, program, *args], timeout)
    if got["rc"]:
        how = (f"killed by signal {-got['rc']} at {got['kb'] / 1e6:.1f} GB of peak RSS" if got["rc"] < 0
               else f"exited {got['rc']}")
        reason = f"{how}: {stderr.strip()[-500:]}" if stderr.strip() else how
        raise ChildFailed(f"{' '.join(map(str, args[:4]))}... {reason}", reason)
    return got["s"], got["kb"] / 1e6, got["out"]


def median(times) -> float | None:
    return statistics.median(times) if times else None


@dataclass(kw_only=True)
class Measured:
    """What every benchmark cell holds, whatever it measures: the repeated times of one
    configuration in its own process, that process's peak RSS, or why it did not run."""

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
        return median(self.times)


def one_line(text: str, limit: int = 200) -> str:
    """A failure's words for a table cell: the last non-empty line (a traceback's is the error)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[-1] if lines else "no message")[:limit].replace("|", "/")


def failure(err: BaseException, limit: int = 300) -> str:
    """A failed measurement as its row's words: the end of the last line of a child's reason
    (without the command, whose paths are this machine's) or of the error (ONNX Runtime's line
    starts with a source path and ends with what happened)."""
    text = getattr(err, "reason", None) or str(err) or type(err).__name__
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[-limit:].replace("|", "/")


def run_into(cell: Measured, cmd: list, timeout: float) -> dict | None:
    """A worker (bench/worker.py) in its own process, its times and peak RSS into `cell`; a failure
    (killed for memory, an error) is the cell's `skipped`. Returns the worker's row, or None."""
    try:
        got = run_child(cmd, timeout)
    except ChildFailed as err:
        cell.skipped = one_line(err.reason, 300)
        return None
    cell.times, cell.peak_rss = got["times"], got["peak_rss"]
    return got


def md_table(header: list[str], rows) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def targets_section(verdicts) -> list[str]:
    """The "## Targets" table: rows of (target, measured, met) or (model, target, measured, met)."""
    model = ["model"] if verdicts and len(verdicts[0]) == 4 else []
    return ["", "## Targets", ""] + md_table(model + ["target", "measured", "verdict"],
                                           [[*v[:-1], "met" if v[-1] else "NOT met"] for v in verdicts])


def kept_rows(path: Path, measured: set[str], key: str = "name") -> list[dict]:
    """The rows of an earlier results JSON (a list of objects) whose `key` this run does not
    measure. ValueError (one line) for a file of another shape: it is not ours to overwrite."""
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} is not a results file of this benchmark (not JSON); move it away") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and key in r for r in rows):
        raise ValueError(f"{path} is not a results file of this benchmark (a list of rows with a {key!r}); "
                         "move it away")
    return [r for r in rows if r[key] not in measured]


def kept_prose(md_path: Path) -> str:
    """What a person wrote below PROSE_MARK in the existing markdown (empty if none)."""
    if not md_path.is_file():
        return ""
    text = md_path.read_text()
    return text.split(PROSE_MARK, 1)[1].strip("\n") if PROSE_MARK in text else ""


def write_results(out_dir: Path, stem: str, data, markdown: str) -> list[Path]:
    """out_dir/stem.md (the prose below PROSE_MARK of the previous file kept) and stem.json,
    each written atomically. Returns [md, json]."""
    from ..export.files import write_text_atomic

    md_path, json_path = Path(out_dir) / f"{stem}.md", Path(out_dir) / f"{stem}.json"
    prose = kept_prose(md_path)
    text = markdown.rstrip("\n") + "\n" + (f"\n{PROSE_MARK}\n\n{prose}\n" if prose else "")
    write_text_atomic(json_path, json.dumps(data, indent=1))
    write_text_atomic(md_path, text)
    return [md_path, json_path]

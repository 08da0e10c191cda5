"""Where ONNX Runtime spends the time of one attention forward: its built-in profiler
(SessionOptions.enable_profiling), node events summed by operator type."""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

CONTAINER_OPS = ("If", "Loop", "Scan")


def profile(model: str | os.PathLike, feeds: dict[str, np.ndarray], runs: int = 2, providers=None,
            options=None, during=None) -> dict:
    """Run `runs` profiled forwards after one warm-up; returns per-op-type totals (microseconds,
    averaged per forward), the number of kernel calls and the wall time per forward.
    providers / options: the session's (default ORT CPU, fresh options); during: a context
    manager wrapped around the timed runs (the GPU worker's CUDA kernel trace)."""
    import contextlib

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = options or ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort_profile")
        session = ort.InferenceSession(str(model), options, providers=providers or ["CPUExecutionProvider"])
        session.run(None, feeds)  # warm-up, in the trace too: we drop it below by run index
        with during or contextlib.nullcontext():
            for _ in range(runs):
                session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    model_runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    timed = model_runs[1:]  # skip the warm-up
    start = min(e["ts"] for e in timed)
    per_op: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") != "Node" or e["ts"] < start or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        per_op[op] += e["dur"] / runs
        calls[op] += 1
    wall = sum(e["dur"] for e in timed) / len(timed)
    # If and Loop events span the kernels of their subgraphs: report them apart, never summed.
    containers = {op: per_op.pop(op) for op in CONTAINER_OPS if op in per_op}
    kernels = sum(per_op.values())
    rows = sorted(per_op.items(), key=lambda kv: -kv[1])
    return {
        "wall_us": wall,
        "kernel_us": kernels,
        "containers": [{"op": op, "us": us, "calls": calls[op] // runs} for op, us in containers.items()],
        "ops": [{"op": op, "us": us, "share": us / kernels if kernels else 0.0, "calls": calls[op] // runs}
                for op, us in rows],
    }


def markdown(result: dict, title: str) -> str:
    spans = ", ".join(f"{c['op']} {c['us'] / 1e6:.3f} s" for c in result["containers"]) or "none"
    lines = [f"### {title}", "",
             f"Wall time per forward {result['wall_us'] / 1e6:.3f} s; operator kernels {result['kernel_us'] / 1e6:.3f} s; "
             f"control-flow spans (they contain those kernels): {spans}. The gap between the kernels and "
             "the spans is the Loop's own work: feeding each iteration, collecting scan outputs.", "",
             "| op | s per forward | share of kernel time | calls |", "|---|---|---|---|"]
    for row in result["ops"]:
        lines.append(f"| {row['op']} | {row['us'] / 1e6:.3f} | {100 * row['share']:.1f}% | {row['calls']} |")
    return "\n".join(lines) + "\n"

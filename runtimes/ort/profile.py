#!/usr/bin/env python3
"""Where ONNX Runtime spends the time of one forward, from its own profiler
(SessionOptions.enable_profiling): kernel time summed by operator type, per forward.

    python runtimes/ort/profile.py model.onnx [inputs.npz | inputs/] [--past N] [--source S]
                                   [--runs 4] [--threads N] [--json]

Without inputs, a cached decoder's steady decode step is profiled: one new token after --past
cached tokens (a seq2seq decoder's encoder states --source long); the cache holds zeros, as
time does not depend on values. Needs onnxruntime and numpy.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.cache import is_cross_cache  # noqa: E402
from common.feeds import ONNX_TYPE_TO_NUMPY  # noqa: E402
from common.runner_cli import OneLineParser  # noqa: E402
from common.tensor_io import RunnerError, data_sets, read_tensors  # noqa: E402

CONTAINER_OPS = ("If", "Loop", "Scan")  # their events span the kernels of their subgraphs
# kernels that read no tensor data (a shape) or hand back their input's buffer (ONNX Runtime aliases
# these): their tensors' bytes are not moved, so they are left out of the bytes a forward moves
NO_DATA_OPS = ("Shape", "Size", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")


def profile(model, feeds: dict[str, np.ndarray], runs: int = 2, providers=None, options=None, during=None) -> dict:
    """Run `runs` profiled forwards after one warm-up; per-op-type totals (microseconds, averaged
    per forward), the kernel calls per forward, the bytes its kernels read and wrote (ONNX
    Runtime's activation and output sizes: what a forward moves through memory, the measure of a
    bandwidth-bound graph) and the wall time per forward. providers /
    options: the session's (default ORT CPU, fresh options); during: a context manager around
    the timed runs (the GPU tools' CUDA kernel trace)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = options or ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort_profile")
        session = ort.InferenceSession(str(model), options, providers=providers or ["CPUExecutionProvider"])
        session.run(None, feeds)  # the warm-up is in the trace too: dropped below by run index
        with during or contextlib.nullcontext():
            for _ in range(runs):
                session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    timed = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][1:]
    start = min(e["ts"] for e in timed)
    per_op: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    moved: dict[str, float] = defaultdict(float)  # bytes each op type's kernels read and wrote, per forward
    for e in events:
        if e.get("cat") == "Node" and e["ts"] >= start and e.get("name", "").endswith("_kernel_time"):
            args = e.get("args", {})
            op = args.get("op_name", "?")
            per_op[op] += e["dur"] / runs
            calls[op] += 1
            if op not in NO_DATA_OPS and op not in CONTAINER_OPS:
                moved[op] += (int(args.get("activation_size", 0)) + int(args.get("output_size", 0))) / runs
    containers = {op: per_op.pop(op) for op in CONTAINER_OPS if op in per_op}  # apart, never summed
    kernels = sum(per_op.values())
    return {
        "wall_us": sum(e["dur"] for e in timed) / len(timed),
        "kernel_us": kernels,
        "containers": [{"op": op, "us": us, "calls": calls[op] // runs} for op, us in containers.items()],
        "ops": [{"op": op, "us": us, "share": us / kernels if kernels else 0.0, "calls": calls[op] // runs,
                 "bytes": moved.get(op, 0.0)} for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])],
        "bytes": sum(moved.values()),  # every kernel's inputs and outputs (views and shapes left out)
    }


def decode_step_feeds(inputs, past: int, source: int | None = None) -> dict[str, np.ndarray]:
    """One steady decode step's feeds for a cached decoder, from its session inputs: token 5,
    a mask over past + 1, zero caches `past` long (a cross-attention cache `source` long) and,
    with `source`, zero encoder states and a full encoder mask."""
    names = {i.name for i in inputs}
    feeds = {"input_ids": np.array([[5]], np.int64)}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((1, past + 1), np.int64)
    if source is not None:
        states = [i for i in inputs if i.name == "encoder_hidden_states"]
        if not states:
            raise RunnerError("--source is for a seq2seq decoder (an encoder_hidden_states input); this file has none")
        width = states[0].shape[-1]
        feeds["encoder_hidden_states"] = np.zeros((1, source, width), np.float32)
        feeds["encoder_attention_mask"] = np.ones((1, source), np.int64)
    if "use_cache_branch" in names:  # the clients' T5 decoder: a steady step reads its cached cross-attention
        feeds["use_cache_branch"] = np.array([True])
    for i in inputs:
        if i.name not in feeds:  # a cache [batch, heads, length, head size]: batch 1, every symbol the length
            length = source if is_cross_cache(i.name) else past
            shape = [1] + [length if isinstance(d, str) or d is None else d for d in i.shape[1:]]
            feeds[i.name] = np.zeros(shape, ONNX_TYPE_TO_NUMPY.get(i.type, np.float32))
    return feeds


def markdown(result: dict, title: str) -> str:
    spans = ", ".join(f"{c['op']} {c['us'] / 1e6:.3f} s" for c in result["containers"]) or "none"
    lines = [f"### {title}", "",
             f"Wall time per forward {result['wall_us'] / 1e6:.3f} s; operator kernels {result['kernel_us'] / 1e6:.3f} s; "
             f"control-flow spans (they contain those kernels): {spans}. The gap between the kernels and "
             "the spans is the Loop's own work: feeding each iteration, collecting scan outputs.", "",
             "| op | s per forward | share of kernel time | calls | GB read + written |", "|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['us'] / 1e6:.3f} | {100 * r['share']:.1f}% | {r['calls']} | {r.get('bytes', 0) / 1e9:.2f} |"
              for r in result["ops"]]
    return "\n".join(lines) + "\n"


def side_by_side(columns: dict[str, dict], top: int = 8) -> list[str]:
    """A markdown table of step profiles ({"wall_ms", "ops": {op: ms}}), one column each: the `top`
    operators by their largest column, then the rest summed and the wall time."""
    largest: dict[str, float] = {}
    for got in columns.values():
        for op, ms in got["ops"].items():
            largest[op] = max(largest.get(op, 0.0), ms)
    ops = sorted(largest, key=lambda op: -largest[op])[:top]
    rows = [[op, *(got["ops"].get(op, 0.0) for got in columns.values())] for op in ops]
    rows.append(["other operators", *(sum(ms for op, ms in got["ops"].items() if op not in ops) for got in columns.values())])
    rows.append(["step wall time", *(got["wall_ms"] for got in columns.values())])
    return (["| operator | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
            + ["| " + " | ".join([row[0], *(f"{ms:.2f}" for ms in row[1:])]) + " |" for row in rows])


def bounded(least: int):
    """An argparse type: an integer >= least, up to 2**20 (a count or a length past it is a typo)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not least <= value <= 1 << 20:
            raise argparse.ArgumentTypeError(f"expected an integer in [{least}, {1 << 20}], got {value}")
        return value
    return parse


def main(argv=None) -> int:
    p = OneLineParser(prog="profile", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("inputs", nargs="?", help=".npz or a folder of input_N.pb (default: a decode step's feeds)")
    p.add_argument("--past", type=bounded(0), default=512, help="cached tokens before the profiled decode step")
    p.add_argument("--source", type=bounded(1), help="a seq2seq decoder's encoder length")
    p.add_argument("--runs", type=bounded(1), default=4)
    p.add_argument("--threads", type=bounded(0), default=0, help="ONNX Runtime threads (0: its own choice)")
    p.add_argument("--json", action="store_true", help="the totals as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        import onnxruntime as ort

        ort.set_default_logger_severity(4)  # its log lines would come before our one line
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.intra_op_num_threads = args.threads
        if args.inputs:
            feeds = read_tensors(data_sets(args.inputs)[0][1], "input", None)
        else:
            inputs = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"]).get_inputs()
            feeds = decode_step_feeds(inputs, args.past, args.source)
        result = profile(args.model, feeds, runs=args.runs, options=options)
    except (RunnerError, OSError, ValueError) as err:
        print(f"profile: error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
        return 2
    except Exception as err:  # the runtime's own message, as one line
        print(f"profile: error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else markdown(result, Path(args.model).name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

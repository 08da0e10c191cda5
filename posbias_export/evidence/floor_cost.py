"""What the softmax floor costs: the same attention files before and after it, side by side on
ONNX Runtime CPU in a default session (what clients get) and with session.set_denormal_as_zero.

Each file in BEFORE has its namesake in AFTER (exports of one model from two checkouts). For every
pair and length: a fresh process per (file, session), one warm-up, `--runs` timed forwards, two
interleaved rounds (before, after, before, after) so that drift hits both; the median of the
forwards. An attention file gets query, key, value [1, H, L, d] N(0, 1), as the attention bench
feeds; a cached decoder (--kv-cache) a prompt of L random tokens, then `--runs` one-token steps
after two warm-up steps, its cache kept as `generate` keeps it (an in-place file's in one buffer;
runtimes/ort/generate.py, whose session options are the runners' with the flag on or off).

    python -m posbias_export.evidence.floor_cost BEFORE_DIR AFTER_DIR [--lengths 8192] [--runs 3] [--out benchmarks/softmax_floor_cpu.md]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from posbias_export.environment import cpu_vendor, describe
from posbias_export.bench.harness import write_results

SESSIONS = ("defaults", "flag")
# one process per (file, length, session): its own session, a warm-up, then `runs` timed forwards
_WORKER = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
from posbias_export.bench.worker import timed
from posbias_export.parity import load_runner
from posbias_export.runners import runtimes_common
path, length, runs, session_kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(0)
options = ort.SessionOptions()
if session_kind == "flag":
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
names = {i.name for i in session.get_inputs()}
if "input_ids" not in names:  # attention alone
    shape = lambda dims: [1] + [length if isinstance(d, str) or d is None else d for d in dims[1:]]  # batch 1
    feeds = {i.name: rng.standard_normal(shape(i.shape), dtype=np.float32) for i in session.get_inputs()}
    times, _ = timed(lambda: session.run(None, feeds), runs)  # after one warm-up
elif not any(n.startswith("past") for n in names):  # an encoder (an embedder): one text of `length` tokens
    inputs = runtimes_common("inputs")
    declared = [(i.name, i.shape, np.int64) for i in session.get_inputs()]
    ids = rng.integers(3, 1000, (1, length))
    feeds = inputs.feeds_for(declared, inputs.Case(ids, np.ones_like(ids)))
    times, _ = timed(lambda: session.run(None, feeds), runs)
else:  # a cached decoder: a prompt of `length` tokens, then steps
    del session
    generate = load_runner("ort/generate.py")
    decoder = generate.CachedDecoder(path, "cpu", denormal_as_zero=session_kind == "flag")
    step = generate.stepper(decoder, 1, length + runs + 3)
    ids = rng.integers(0, decoder.vocab or 256, (1, length + runs + 2))
    step(ids[:, :length], np.ones((1, length), np.int64))
    times = []
    for t in range(length, length + runs + 2):
        start = time.perf_counter()
        step(ids[:, t:t + 1], np.ones((1, t + 1), np.int64))
        times.append(time.perf_counter() - start)
    times = times[2:]  # a session's first steps allocate
print(json.dumps({"times": times}))
"""


def measure(path: Path, length: int, runs: int, session: str) -> list[float]:
    out = subprocess.run([sys.executable, "-c", _WORKER, str(path), str(length), str(runs), session],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["times"]


def compare(before: Path, after: Path, length: int, runs: int, rounds: int = 2) -> dict[str, dict[str, float]]:
    """session -> {"before", "after"}: median seconds over `rounds` interleaved rounds."""
    got = {(s, side): [] for s in SESSIONS for side in ("before", "after")}
    for _ in range(rounds):
        for session in SESSIONS:
            for side, path in (("before", before), ("after", after)):
                got[session, side] += measure(path, length, runs, session)
    return {s: {side: statistics.median(got[s, side]) for side in ("before", "after")} for s in SESSIONS}


def main() -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="a folder of attention files without the floor")
    p.add_argument("after", type=Path, help="the same files' names, with it")
    p.add_argument("--lengths", default="8192")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="benchmarks/softmax_floor_cpu.md")
    p.add_argument("--note", default="", help="how the two folders were made (written under the header)")
    args = p.parse_args()
    names = sorted(f.name for f in args.before.glob("*.onnx") if (args.after / f.name).is_file())
    if not names:
        p.error(f"no file of {args.before} has a namesake in {args.after}")
    rows, results = [], {}
    for length in (int(x) for x in args.lengths.split(",")):
        for name in names:
            ms = compare(args.before / name, args.after / name, length, args.runs)
            d, f = ms["defaults"], ms["flag"]
            rows.append(f"| {Path(name).stem} | {length} | {d['before']:.3f} | {d['after']:.3f} | "
                        f"{d['after'] / d['before']:.2f}x | {f['before']:.3f} | {f['after']:.3f} | "
                        f"{d['after'] / f['after']:.2f}x |")
            results[f"{name}@{length}"] = ms
    text = "\n".join([
        "# The softmax floor's cost on ONNX Runtime CPU (default session and flag)", "",
        f"Generated by `python -m posbias_export.evidence.floor_cost {args.before.name} {args.after.name} --lengths {args.lengths}`. "
        f"{describe()} CPU vendor: {cpu_vendor()}.", "",
        *([args.note, ""] if args.note else []),
        "before: the files without the floor; after: the same exports with it (every softmax floored at its row's "
        "maximum minus 64). Batch 1: attention alone gets query/key/value N(0, 1); a cached "
        "decoder a prompt of L random tokens, then one-token steps (a step's seconds; its cache kept as `generate` "
        "keeps it, in generate's session options with the flag on or off); an embedder one text of L tokens. A fresh "
        "process and session "
        f"per cell, {args.runs} timed forwards after a warm-up, two interleaved rounds; median seconds. `default`: "
        "ONNX Runtime's default session (what clients get); `flag`: session.set_denormal_as_zero=1. The last column "
        "is what a default session loses to subnormal floats with the floor (1.00x: nothing).", "",
        "| file | L | default before s | default after s | after / before | flag before s | flag after s | "
        "after: default / flag |", "|---|---|---|---|---|---|---|---|", *rows, ""])
    out = Path(args.out)
    write_results(out.parent, out.stem, results, text)  # the prose below the mark stays
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do the runners' ONNX Runtime session options cost anything on CPU? (issue: runner hardening)

    python -m posbias_export.evidence.session_options [--out benchmarks/session_options.md] [--decoder FILE --prompts 512,4096]

Exports the default language model and the cuda-ort ALiBi attention file, then times each in
ONE session per option set, lengths in ascending then descending order (as a server sees them),
the option sets interleaved round by round so that machine noise hits both alike. Reports the
median per length and the ratio of the runners' options (memory patterns and, on CPU, planned
memory reuse off) to ORT's defaults. --decoder: an in-place cache file (--kv-cache --target ort,
e.g. of BLOOM-560m's configuration): after one prefill per prompt length, decode steps with planned
memory reuse on and off, one session each, in alternating rounds of 5 steps; median ms per step,
wall and the process's CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from posbias_export.environment import describe
from posbias_export.export.files import write_text_atomic
from posbias_export.parity import load_runner

FILES = {"lm (portable, default)": [], "attention (cuda-ort)": ["--arch", "attention", "--target", "cuda-ort"]}
LENGTHS = {"lm (portable, default)": (64, 512, 2048), "attention (cuda-ort)": (256, 1024, 4096)}


def feeds(session, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(length)
    out = {}
    for i in session.get_inputs():
        if i.type == "tensor(int64)":
            out[i.name] = rng.integers(0, 64, size=(1, length), dtype=np.int64)
        else:
            shape = [1 if d == "batch" else length if isinstance(d, str) else d for d in i.shape]
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/session_options.md")
    p.add_argument("--rounds", type=int, default=15)  # 5 rounds spread one row 0.84-1.17x run to run
    p.add_argument("--decoder", help="an in-place cache file (--kv-cache --target ort): decode steps, reuse on and off")
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 4096])
    args = p.parse_args()
    runner = load_runner("ort/run.py")
    options = {"ORT defaults": ort.SessionOptions(), "runners' options": runner.session_options(ort)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in FILES.items():
            path = Path(tmp) / "model.onnx"
            subprocess.run([sys.executable, "-m", "posbias_export", "--bias", "alibi", "--out", str(path), *extra], check=True,
                           capture_output=True)
            sessions = {name: ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
                        for name, opts in options.items()}
            lengths = LENGTHS[label]
            inputs = {n: feeds(next(iter(sessions.values())), n) for n in lengths}
            times = {(name, n): [] for name in sessions for n in lengths}
            for _ in range(args.rounds):
                for name, session in sessions.items():
                    for n in (*lengths, *reversed(lengths)):
                        start = time.perf_counter()
                        session.run(None, inputs[n])
                        times[name, n].append(time.perf_counter() - start)
            for n in lengths:
                base, ours = (statistics.median(times[name, n]) for name in options)
                rows.append(f"| {label} | {n} | {base * 1e3:.1f} | {ours * 1e3:.1f} | {ours / base:.2f} |")
    decode = decode_rows(args.decoder, args.prompts, args.rounds) if args.decoder else []
    print(write_text_atomic(args.out, report(rows, args.rounds, decode, args.decoder)).read_text())
    return 0


def decode_rows(path: str, prompts: list[int], rounds: int, steps: int = 5) -> list[str]:
    """Decode steps with the runners' options, planned memory reuse on and off (the first round
    not counted: a new session's first steps allocate)."""
    runner = load_runner("ort/run.py")
    sessions = {}
    for reuse in (True, False):
        opts = runner.session_options(ort)
        opts.enable_mem_reuse = reuse
        sessions[reuse] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    first = sessions[True]
    outputs = [o.name for o in first.get_outputs()]
    present_of = {o: "past_" + o[len("present_"):] for o in outputs if o.startswith("present_")}
    pasts = {i.name: i.shape for i in first.get_inputs() if i.name.startswith("past_")}
    def step_feeds(ids, total):
        return {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64)}

    rows = []
    for prompt in prompts:
        state, times = {}, {(reuse, kind): [] for reuse in sessions for kind in ("wall", "cpu")}
        capacity = prompt + rounds * steps + 1
        ids = np.random.default_rng(prompt).integers(0, 1000, (1, prompt), dtype=np.int64)
        for reuse, session in sessions.items():
            buffers = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, s[1], capacity, s[3]), np.float32))
                       for n, s in pasts.items()}
            runner._bound_call(session, {**step_feeds(ids, prompt), **buffers}, buffers, present_of, outputs)
            state[reuse] = [buffers, prompt]
        for r in range(rounds):
            for reuse, session in sessions.items():
                for _ in range(steps):
                    state[reuse][1] += 1
                    wall, cpu = time.perf_counter(), time.process_time()
                    runner._bound_call(session, {**step_feeds(np.array([[7]], np.int64), state[reuse][1]), **state[reuse][0]},
                                       state[reuse][0], present_of, outputs)
                    if r:
                        times[reuse, "wall"].append(time.perf_counter() - wall)
                        times[reuse, "cpu"].append(time.process_time() - cpu)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append(f"| {prompt} | {med[True, 'wall']:.1f} / {med[True, 'cpu']:.1f} | {med[False, 'wall']:.1f} / "
                    f"{med[False, 'cpu']:.1f} | {med[False, 'wall'] / med[True, 'wall']:.3f} / "
                    f"{med[False, 'cpu'] / med[True, 'cpu']:.3f} |")
    return rows


def report(rows: list[str], rounds: int, decode: list[str], decoder: str | None) -> str:
    head = ["# Session options on CPU", "", f"Generated by `python -m posbias_export.evidence.session_options`. {describe()}", "",
            "One session per option set, every length run in ascending then descending order, "
            f"{rounds} rounds interleaved; median ms per forward, batch 1.", ""]
    table = ["| file | length | ORT defaults (ms) | runners' options (ms) | ratio |", "|---|---|---|---|---|", *rows]
    lines = [*head, *table, "", "The runners' options: `enable_mem_pattern = False` and, on CPU, `enable_mem_reuse = "
             "False` (runtimes/ort/run.py `session_options`). The CUDA provider option `use_ep_level_unified_stream` "
             "is not measured here (no GPU).", ""]
    if decode:
        lines += ["## Decode steps: planned memory reuse on and off", "",
                  f"`{Path(decoder).name}` (an in-place cache file); after one prefill per prompt length, steps in "
                  f"alternating rounds of 5, {rounds - 1} rounds counted; median ms per step, wall / the process's CPU "
                  "time (2 threads).", "", "| prompt | reuse on | reuse off | off / on |", "|---|---|---|---|",
                  *decode, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

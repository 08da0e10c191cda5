"""The lease's order check (`correctness`, `race`): decide the order-dependent ORT CUDA failure (benchmarks/gpu_parity.md: the
portable ALiBi attention file, max error 5.4 at L=4096 when L=1024 ran first in one session).

Every case runs in a fresh process (one session, the lengths of its order in turn) and is judged
against ONNX Runtime CPU on the same inputs, each length in a fresh CPU session (that file passes
on CPU, 4.7e-06 against float64). Cases: each file x each session setting (ORT's defaults,
memory patterns off, one provider stream, both = what our runners serve with; graph
optimizations off, deterministic compute: the next suspects) x each order
(1024 then 4096, 4096 twice, 4096 alone), plus the defaults under CUDA_LAUNCH_BLOCKING=1, and
a failing case under compute-sanitizer's initcheck when it is on the PATH.

    python -m posbias_export.gpu.order run OUT FILE... [--provider cuda] [--small]   # on the GPU machine
    python -m posbias_export.gpu.order write OUT                                     # here: benchmarks/gpu_order.md
    python -m posbias_export.gpu.order case ...                                      # one case (run calls it)

--provider cpu --small is the rehearsal: the same cases on ORT CPU at 64 / 256 tokens.
data/alibi_attention_0f33d6a.onnx (beside this module) is the file that failed (exported at git 0f33d6a).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OLD_FILE = Path(__file__).with_name("data") / "alibi_attention_0f33d6a.onnx"
KNOBS = ("mem_pattern", "one_stream", "graph_opt", "deterministic", "no_mem_reuse", "cpu_arena_off", "copy_stream")
SETTINGS = {  # name -> the knobs set; ORT's defaults are memory patterns on, graph optimizations on
    "ort-defaults": {"mem_pattern", "graph_opt"},
    "mem-pattern-off": {"graph_opt"},
    "one-stream": {"mem_pattern", "graph_opt", "one_stream"},
    "served (both)": {"graph_opt", "one_stream"},  # what our runners serve with
    # if neither cures it: the graph as written (no fusions or constant folding), deterministic kernels
    "graph-opt-off": {"mem_pattern"},
    "deterministic": {"mem_pattern", "graph_opt", "deterministic"},
}
# The race step (--race): CUDA_LAUNCH_BLOCKING=1 cured the order error where no session setting did,
# so the candidates are what a missing synchronisation would need: buffers never reused (GPU
# memory, host memory), copies on their own stream, and the two environment variables that
# tell a device-side race (one hardware queue) from a host-side one (every launch synchronous).
RACE_SETTINGS = {
    "served (both)": ({"graph_opt", "one_stream"}, {}),
    "served, memory reuse off": ({"graph_opt", "one_stream", "no_mem_reuse"}, {}),
    "served, CPU arena off": ({"graph_opt", "one_stream", "cpu_arena_off"}, {}),
    "served, reuse and CPU arena off": ({"graph_opt", "one_stream", "no_mem_reuse", "cpu_arena_off"}, {}),
    "served, copies on their own stream": ({"graph_opt", "copy_stream"}, {}),
    "served, one hardware queue": ({"graph_opt", "one_stream"}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    "served, launches blocking": ({"graph_opt", "one_stream"}, {"CUDA_LAUNCH_BLOCKING": "1"}),
}
RACE_ORDERS = {"17 alone": [17], "1024 alone": [1024], "1024->4096": [1024, 4096]}
# what failed on the first lease: the portable ALiBi file (after 1024), the slim-table cuda-ort files
RACE_FILES = ("alibi_float32_portable.onnx", "kerple_log_float32_cuda-ort.onnx", "t5_float32_cuda-ort.onnx",
              "sandwich_float32_cuda-ort.onnx")
# CUDA without TF32 against ORT CPU, float32: both sit within the float32 policy of float64
# (3.1e-05 at 4096, parity/tolerance.py), so they differ by at most twice that; the failure
# measured 5.4. 1e-4 separates the two with room on both sides.
AGREE = 1e-4


def orders(small: bool) -> dict[str, list[int]]:
    short, long = (64, 256) if small else (1024, 4096)
    return {f"{short}->{long}": [short, long], f"{long}->{long}": [long, long], f"{long} alone": [long]}


def inputs(path: str, length: int) -> dict[str, np.ndarray]:
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    rng = np.random.default_rng(length)
    feeds = {}
    for i in graph.input:  # query, key, value: [batch, H, seq, d]
        dims = [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]
        dims[2] = length
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        feeds[i.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def session(path: str, provider: str, knobs=frozenset({"graph_opt", "one_stream"})):
    import onnxruntime as ort

    if provider == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    opts = ort.SessionOptions()
    opts.enable_mem_pattern = "mem_pattern" in knobs
    opts.use_deterministic_compute = "deterministic" in knobs
    opts.enable_mem_reuse = "no_mem_reuse" not in knobs
    opts.enable_cpu_mem_arena = "cpu_arena_off" not in knobs
    if "graph_opt" not in knobs:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    one_stream = "one_stream" in knobs
    opts.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if provider == "cuda":
        cuda = {"use_tf32": "0", **({"use_ep_level_unified_stream": "1"} if one_stream else {}),
                **({"do_copy_in_default_stream": "0"} if "copy_stream" in knobs else {})}
        providers = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    s = ort.InferenceSession(path, opts, providers=providers)
    active = s.get_providers()[0]
    if (provider == "cuda") != (active == "CUDAExecutionProvider"):
        raise RuntimeError(f"{provider} requested, session runs on {active}")
    return s


def reference(path: str, length: int, cache: Path) -> np.ndarray:
    """ORT CPU's output for this file and length, each length in its own session."""
    out = cache / f"{Path(path).stem}_{length}.npy"
    if not out.exists():
        np.save(out, session(path, "cpu").run(None, inputs(path, length))[0])
    return np.load(out)


def case(path: str, provider: str, lengths: list[int], knobs, cache: Path) -> list[dict]:
    s = session(path, provider, knobs)
    runs = []
    for length in lengths:
        got = s.run(None, inputs(path, length))[0]
        err = float(np.abs(got.astype(np.float64) - reference(path, length, cache)).max())
        runs.append({"length": length, "max_abs_vs_cpu": err, "agrees": bool(err <= AGREE)})
    return runs


def run_case(cache: Path, path: str, provider: str, order: list[int], setting: str, env: dict, prefix=(),
             timeout: float = 300, knobs=None) -> dict:
    knobs = SETTINGS[setting] if knobs is None else knobs
    cmd = [*prefix, sys.executable, "-m", "posbias_export.gpu.order", "case", path, "--provider", provider, "--cache", str(cache),
           "--lengths", ",".join(map(str, order)), "--knobs", ",".join(sorted(knobs))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired as err:
        proc = subprocess.CompletedProcess(cmd, 124, (err.stdout or b"").decode(errors="replace") if isinstance(
            err.stdout, bytes) else (err.stdout or ""), f"timed out after {timeout:.0f} s")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    row = {"file": Path(path).name, "setting": setting, "order": "->".join(map(str, order)) if len(order) > 1 else f"{order[0]} alone",
           "env": " ".join(f"{k}={v}" for k, v in env.items()), "tool": " ".join(prefix[:3]),
           "runs": rows[0] if rows else [], "rc": proc.returncode}
    if not rows:
        row["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    if prefix:
        row["tool_report"] = (proc.stdout + proc.stderr)[-4000:]
    print(json.dumps({k: v for k, v in row.items() if k != "tool_report"}), flush=True)
    return row


def race_files(folder: Path) -> list[str]:
    """RACE_FILES that the pack holds (a rehearsal's small pack has two families): each one
    missing is said on stderr, none at all is an error."""
    missing = [f for f in RACE_FILES if not (folder / f).is_file()]
    if missing:
        print(f"race: not in {folder}: {', '.join(missing)}", file=sys.stderr)
    if len(missing) == len(RACE_FILES):
        raise SystemExit(f"race: none of {', '.join(RACE_FILES)} in {folder}")
    return [str(folder / f) for f in RACE_FILES if f not in missing]


def run_race(out: Path, files: list[str], provider: str, cache: Path, workers: int = 12) -> None:
    """Each file x RACE_ORDERS x RACE_SETTINGS, each case its own process -> OUT/gpu_race.json."""
    from concurrent.futures import ThreadPoolExecutor

    cache.mkdir(parents=True, exist_ok=True)
    for path in files:
        for length in sorted({n for order in RACE_ORDERS.values() for n in order}):
            reference(path, length, cache)
    cases = [(path, order, name, knobs, env) for path in files for order in RACE_ORDERS.values()
             for name, (knobs, env) in RACE_SETTINGS.items()]
    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(lambda c: run_case(cache, c[0], provider, c[1], c[2], c[4], timeout=120, knobs=c[3]), cases))
    (out / "gpu_race.json").write_text(json.dumps({"provider": provider, "agree": AGREE, "rows": rows}, indent=1))


def run(out: Path, files: list[str], provider: str, small: bool, cache: Path | None = None, workers: int = 6) -> None:
    cache = cache or out / "cpu_ref"  # the CPU outputs (8 MB a length): outside $OUT on the GPU machine
    cache.mkdir(parents=True, exist_ok=True)
    from concurrent.futures import ThreadPoolExecutor

    for path in files:  # every CPU output before the cases: they read it, none writes it
        for length in sorted({n for order in orders(small).values() for n in order}):
            reference(path, length, cache)
    cases = [(path, order, setting, env) for path in files for order in orders(small).values()
             for setting, env in [*((s, {}) for s in SETTINGS), ("ort-defaults", {"CUDA_LAUNCH_BLOCKING": "1"})]]
    with ThreadPoolExecutor(workers) as pool:  # each case its own process and session: correctness, not timing
        rows = list(pool.map(lambda c: run_case(cache, c[0], provider, c[1], c[2], c[3]), cases))
    report = out / "gpu_order.json"
    report.write_text(json.dumps({"provider": provider, "agree": AGREE, "rows": rows}, indent=1))  # before the slow tool
    failing = next((r for r in rows if any(not x["agrees"] for x in r["runs"])), None)
    sanitizer = shutil.which("compute-sanitizer")
    if failing and sanitizer:
        order = [int(n) for n in failing["order"].replace(" alone", "").split("->")]
        path = next(f for f in files if Path(f).name == failing["file"])
        rows.append(run_case(cache, path, provider, order, failing["setting"], {},
                             prefix=(sanitizer, "--tool", "initcheck", "--print-limit", "20"), timeout=90))
    report.write_text(json.dumps({"provider": provider, "agree": AGREE, "rows": rows}, indent=1))


def verdict(row: dict) -> str:
    if not row["runs"]:
        return f"error: {row.get('error', '')}"
    return "agree" if all(x["agrees"] for x in row["runs"]) else "DIFFER"


def write(out: Path, dest: Path) -> None:
    data = json.loads((out / ("gpu_race.json" if (out / "gpu_race.json").exists() else "gpu_order.json")).read_text())
    lines = ["# The order-dependent ORT CUDA error: which setting cures it", "",
             "Generated by `python -m posbias_export.gpu.order run OUT FILE... --provider cuda` on the GPU machine, then "
             "`python -m posbias_export.gpu.order write OUT`. Each row: one fresh process and session running the lengths "
             f"in order; each output against ONNX Runtime CPU on the same inputs (agree: max abs <= {data['agree']:g}). "
             f"Provider: {data['provider']}.", "",
             "| file | session setting | order | env / tool | max abs vs CPU, each run | verdict |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        errs = ", ".join(f"{x['length']}: {x['max_abs_vs_cpu']:.1e}" for x in r["runs"]) or "-"
        lines.append(f"| {r['file']} | {r['setting']} | {r['order']} | {r['env'] or r['tool'] or '-'} | {errs} | {verdict(r)} |")
    for r in data["rows"]:
        if r.get("tool_report"):
            lines += ["", f"## {r['tool']} on {r['file']}, {r['order']}", "", "```", r["tool_report"].strip(), "```"]
    dest.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("files", nargs="*", default=[str(OLD_FILE)])
    r.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    r.add_argument("--small", action="store_true", help="64 and 256 tokens (the CPU rehearsal)")
    r.add_argument("--cache", type=Path, help="where the CPU outputs are kept (default OUT/cpu_ref)")
    r.add_argument("--workers", type=int, default=6, help="cases run at once, each in its own process")
    r.add_argument("--race", action="store_true", help="the cure candidates (RACE_SETTINGS x RACE_ORDERS) instead")
    r.add_argument("--race-models", type=Path, help="with --race: the attention files' folder (RACE_FILES in it)")
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "gpu_order.md")
    c = sub.add_parser("case")
    c.add_argument("file")
    c.add_argument("--provider", choices=("cpu", "cuda"), required=True)
    c.add_argument("--lengths", required=True)
    c.add_argument("--cache", type=Path, required=True)
    c.add_argument("--knobs", default="", help=f"comma-separated, from {', '.join(KNOBS)}")
    args = p.parse_args(argv)
    if args.part == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        if args.race:
            files = race_files(args.race_models) if args.race_models else args.files
            run_race(args.out, files, args.provider, args.cache or args.out / "cpu_ref", args.workers)
        else:
            run(args.out, args.files, args.provider, args.small, args.cache, args.workers)
    elif args.part == "write":
        write(args.out, args.dest)
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        knobs = {k for k in args.knobs.split(",") if k}
        if knobs - set(KNOBS):
            p.error(f"unknown knobs {sorted(knobs - set(KNOBS))}")
        print(json.dumps(case(args.file, args.provider, lengths, knobs, args.cache)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

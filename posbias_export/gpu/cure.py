"""The lease's `cure` step: where ONNX Runtime CUDA goes wrong on our files with asynchronous launches,
and which graph does not.

Each case is a fresh process that opens ONE session as our runners serve (runtimes/ort/run.py:
memory patterns off, one provider stream, TF32 off) and runs the lengths of its order in turn;
each output is judged against ONNX Runtime CPU on the same inputs, per block of 256 query rows
(which blocks are wrong says what raced). CUDA_LAUNCH_BLOCKING is set per case: 0 (what anyone
serving the file in their own process gets) or 1 (the runners' old cure, the control).

Files: the packed attention files (models/*.onnx) and the variants `variants` makes of them by
picking If branches (the same ops with less control flow: `loop` keeps the blocked Loop and drops
every If; `flat` keeps no control flow at all), plus the variants the `--pass` modules make. Beside
the matrix: ONNX Runtime's own log of where each file's nodes were placed and which copies between
host and device it added, per graph and subgraph (verbose session creation).

    python -m posbias_export.gpu.cure variants DIR            # DIR/models/*.onnx -> DIR/variants/*.onnx (+ CPU check)
    python -m posbias_export.gpu.cure run DIR OUT [--provider cuda] [--small] [--workers 14]
    python -m posbias_export.gpu.cure write OUT               # here: benchmarks/gpu_cure.md / .json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "runtimes"))

# float32 on CUDA without TF32 vs ORT CPU: both within the float32 policy (3.1e-05 at 4096); the
# race measured 1-5. float16 files: within 2e-3 of each other (float16's policy), far from 1.
AGREE = {"float32": 1e-4, "float16": 4e-3}
ROWS = 256  # the error profile's block of query rows
FILES = ("alibi_float32_portable", "alibi_float32_cuda-ort", "none_float32_cuda-ort", "kerple_log_float32_cuda-ort",
         "t5_float32_cuda-ort", "sandwich_float32_cuda-ort", "window_float32_cuda-ort", "alibi_float16_cuda-ort",
         "kerple_log_float16_cuda-ort", "window_float16_cuda-ort")
ORDERS = {"1024 alone": [1024], "1024->4096": [1024, 4096], "4096->17->1024->4096": [4096, 17, 1024, 4096]}
SMALL_ORDERS = {"64 alone": [64], "64->256": [64, 256], "256->17->64->256": [256, 17, 64, 256]}


# ---- variants: If branches picked by a rule (inlined first: ONNX Runtime inlines the functions too)

def _pick(graph, rule) -> None:
    """Replace every If in `graph` (recursively) by the nodes of the branch rule(if_node) names."""
    from onnx import helper

    from ..export.graph_order import subgraphs

    nodes = []
    for node in graph.node:
        for sub in subgraphs(node):
            _pick(sub, rule)
        if node.op_type != "If":
            nodes.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == rule(node))
        nodes.extend(branch.node)
        nodes.extend(helper.make_node("Identity", [o.name], [out]) for o, out in zip(branch.output, node.output))
    del graph.node[:]
    graph.node.extend(nodes)


def _branch_rule(kind: str):
    """then/else per If, by what its condition says: fits one block, whole sequence, has padding."""
    def rule(node) -> str:
        cond = node.input[0]
        if "whole" in cond:
            return "then_branch" if kind == "whole" else "else_branch"
        if "fits" in cond:
            return "then_branch" if kind == "flat" else "else_branch"
        if "padding" in cond:
            return "then_branch"  # the Loop that masks padding keys: right for every input
        raise ValueError(f"an If on {cond!r}: no rule")
    return rule


def variants(root: Path, kinds=("loop", "flat", "whole")) -> list[Path]:
    import onnx
    from onnx import inliner

    out = root / "variants"
    out.mkdir(exist_ok=True)
    made = []
    for name in FILES:
        src = root / "models" / f"{name}.onnx"
        if not src.exists():
            continue
        fused = name.split("_")[0] in ("alibi", "none", "window") and "cuda" in name
        for kind in (k for k in kinds if k != "whole" or fused):
            model = inliner.inline_local_functions(onnx.load(src))
            _pick(model.graph, _branch_rule(kind))
            onnx.checker.check_model(model)
            path = out / f"{name}__{kind}.onnx"
            onnx.save(model, path)
            made.append(path)
    return made


def base_of(path: Path) -> str:
    return path.stem.split("__")[0]


def check_variants(root: Path, lengths=(17, 64, 256)) -> list[str]:
    """Each variant against its file on ORT CPU (the same math: they must agree to rounding)."""
    problems = []
    for path in sorted((root / "variants").glob("*.onnx")):
        for n in lengths:
            want = _cpu(root / "models" / f"{base_of(path)}.onnx", n)
            got = _cpu(path, n)
            err = float(np.abs(got.astype(np.float64) - want).max())
            if err > AGREE[_dtype(path)]:
                problems.append(f"{path.name} at {n}: {err:.2e}")
    return problems


# ---- one case

def _dtype(path: Path) -> str:
    return "float16" if "float16" in path.name else "float32"


def inputs(path: Path, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(length)
    dtype = np.float16 if _dtype(path) == "float16" else np.float32
    return {name: rng.standard_normal((1, 8, length, 64)).astype(dtype) for name in ("query", "key", "value")}


def _cpu(path: Path, length: int) -> np.ndarray:
    from ort.run import create_session

    return create_session(str(path), "cpu").run(None, inputs(path, length))[0].astype(np.float64)


def reference(cache: Path, path: Path, length: int) -> np.ndarray:
    ref = cache / f"{base_of(path)}_{length}.npy"
    if not ref.exists():
        own = path if path.parent.name != "variants" else path.parent.parent / "models" / f"{base_of(path)}.onnx"
        np.save(ref, _cpu(own, length))  # a variant's reference is its file's
    return np.load(ref)


def case(path: Path, provider: str, lengths: list[int], cache: Path) -> list[dict]:
    from ort.run import create_session

    session = create_session(str(path), provider)
    runs = []
    for n in lengths:
        got = session.run(None, inputs(path, n))[0].astype(np.float64)
        err = np.abs(got - reference(cache, path, n)).max(axis=(0, 1, 3))  # per query row
        per_block = [float(err[i:i + ROWS].max()) for i in range(0, n, ROWS)]
        bad = [i for i, e in enumerate(per_block) if not e <= AGREE[_dtype(path)]]
        runs.append({"length": n, "max_abs_vs_cpu": float(np.nanmax(err)) if not np.isnan(err).all() else float("nan"),
                     "bad_blocks": bad, "blocks": len(per_block), "agrees": not bad})
    return runs


def run_case(path: Path, provider: str, order: str, lengths: list[int], blocking: str, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "posbias_export.gpu.cure", "case", str(path), "--provider", provider, "--cache", str(cache),
           "--lengths", ",".join(map(str, lengths))]
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": blocking}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
        error = None if rows else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    except subprocess.TimeoutExpired:
        rows, error = [], "timed out after 150 s"
    row = {"file": path.name, "order": order, "launch_blocking": blocking, "runs": rows[0] if rows else []}
    if error:
        row["error"] = error
    print(json.dumps(row), flush=True)
    return row


# ---- where ONNX Runtime placed the nodes and which copies it added (its verbose session log)

PLACEMENT = re.compile(r"(Memcpy|placed on|fallback to CPU|Force fallback|Node placements|All nodes placed|"
                       r"Number of nodes|ExecutionProvider\]|MemcpyToHost|MemcpyFromHost)", re.I)


def placement(path: Path, provider: str, logs: Path) -> dict:
    code = ("import sys, onnxruntime as o; sys.path.insert(0, %r); o.preload_dlls() if hasattr(o, 'preload_dlls') else 0; "
            "o.set_default_logger_severity(0); so = o.SessionOptions(); so.log_severity_level = 0; "
            "so.enable_mem_pattern = False; "
            "p = [('CUDAExecutionProvider', {'use_tf32': '0', 'use_ep_level_unified_stream': '1'}), 'CPUExecutionProvider'] "
            "if %r == 'cuda' else ['CPUExecutionProvider']; "
            "s = o.InferenceSession(%r, so, providers=p); print('ACTIVE', s.get_providers()[0])") % (
        str(ROOT / "runtimes"), provider, str(path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    (logs / f"{path.stem}.log").write_text(log)  # the whole verbose log: which node ran where, per subgraph
    lines = [line[-400:] for line in log.splitlines() if PLACEMENT.search(line)]
    return {"file": path.name, "rc": proc.returncode, "lines": lines[:400], "log_lines": len(log.splitlines()),
            "memcpy_lines": [line for line in lines if "Memcpy" in line][:60]}


def run(root: Path, out: Path, provider: str, small: bool, workers: int, extra=(), repeats: int = 1) -> None:
    cache = out / "cpu_ref"
    cache.mkdir(parents=True, exist_ok=True)
    files = [root / "models" / f"{n}.onnx" for n in FILES if (root / "models" / f"{n}.onnx").exists()]
    files += [Path(f) for f in extra]  # e.g. the control: a file exported before the cure
    files += sorted((root / "variants").glob("*.onnx"))
    orders = SMALL_ORDERS if small else ORDERS
    lengths = sorted({n for o in orders.values() for n in o})
    with ThreadPoolExecutor(workers) as pool:  # the CPU references first: the cases read them, none writes
        own = [f for f in files if f.parent.name != "variants"]
        list(pool.map(lambda a: reference(cache, *a), [(f, n) for f in own for n in lengths]))
        logs = out / "placement"
        logs.mkdir(exist_ok=True)
        places = list(pool.map(lambda f: placement(f, provider, logs), own))
        (out / "placement.json").write_text(json.dumps(places, indent=1))
        cases = [(f, o, orders[o], b) for f in files for o in orders
                 for b in (("0",) * repeats + ("1",) if f.parent.name != "variants" else ("0",) * repeats)]
        rows = list(pool.map(lambda c: run_case(c[0], provider, c[1], c[2], c[3], cache), cases))
    (out / "gpu_cure.json").write_text(json.dumps({"provider": provider, "agree": AGREE, "rows_per_block": ROWS,
                                                   "rows": rows}, indent=1))


def write(out: Path, dest: Path, timings: tuple[Path, Path] | None = None) -> None:
    from posbias_export.export.files import write_text_atomic

    data = json.loads((out / "gpu_cure.json").read_text())
    lines = ["# ONNX Runtime CUDA with asynchronous launches: which of our graphs it runs right", "",
             "Generated by `python -m posbias_export.gpu.cure run` on the GPU machine, then `python -m posbias_export.gpu.cure write OUT`. "
             "Each row: one fresh process and session (as the runners serve), the lengths of its order in turn; each "
             f"output against ONNX Runtime CPU on the same inputs, per block of {data['rows_per_block']} query rows "
             f"(agree: max abs <= {data['agree']['float32']:g} float32, {data['agree']['float16']:g} float16). "
             f"Provider: {data['provider']}. Variants (`file__kind`): `loop` the blocked Loop (the one that masks padding) with every If dropped, "
             "`flat` no control flow (one block for every length), `whole` the fused whole-sequence call alone.", "",
             "| file | CUDA_LAUNCH_BLOCKING | order | max abs vs CPU, each run | wrong blocks | verdict |",
             "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        errs = ", ".join(f"{x['length']}: {x['max_abs_vs_cpu']:.1e}" for x in r["runs"]) or "-"
        bad = "; ".join(f"{x['length']}: {x['bad_blocks']} of {x['blocks']}" for x in r["runs"] if x["bad_blocks"]) or "-"
        verdict = f"error: {r['error']}" if r.get("error") else (
            "agree" if all(x["agrees"] for x in r["runs"]) else "DIFFER")
        lines.append(f"| {r['file']} | {r['launch_blocking']} | {r['order']} | {errs} | {bad} | {verdict} |")
    places = out / "placement.json"
    if places.exists():  # where ONNX Runtime added host <-> device copies, per graph (its own warning lines)
        lines += ["", "## Copies between host and device ONNX Runtime added, per graph and subgraph", "",
                  "From each file's verbose session log (`main_graph` is the model's graph; `parts` / `query_blocks` / "
                  "`one_block` / `whole` are If branches; `query_block` is a Loop body).", "",
                  "| file | copies added, by graph (to the host / from the host) |", "|---|---|"]
        for place in json.loads(places.read_text()):
            lines.append(f"| {place['file']} | {', '.join(_copies_by_graph(place['lines'])) or 'none'} |")
        data["placement"] = [{"file": p["file"], "memcpy_lines": p["memcpy_lines"]} for p in json.loads(places.read_text())]
    if timings:  # the same files timed with asynchronous launches, then host-synchronous ones, in one call
        lines += _timing_table(*timings)
    write_text_atomic(dest, "\n".join(lines) + "\n")
    write_text_atomic(dest.with_suffix(".json"), json.dumps(data, indent=1) + "\n")


def _copies_by_graph(log_lines: list[str]) -> list[str]:
    """'graph: T to host / F from host' per graph, from the copy lines of a verbose session log
    (each graph's AddCopyNode lines come before its summary line)."""
    found, to_host, from_host = [], 0, 0
    for line in log_lines:
        if "AddCopyNode" in line:
            to_host += "MemcpyToHost" in line
            from_host += "MemcpyFromHost" in line
        summary = re.search(r"(\d+) Memcpy nodes are added to the graph (\S+)", line)
        if summary:
            found.append(f"{summary.group(2)}: {to_host} / {from_host}")
            to_host = from_host = 0
    return found


def _timing_table(async_dir: Path, blocking_dir: Path) -> list[str]:
    """gpu.session ort's rows (float16 cuda-ort attention files, batch 1, H=8, d=64, causal; ten
    repeats, median of the last eight) with CUDA_LAUNCH_BLOCKING=0 beside =1."""
    import statistics

    def rows(folder):
        return {(r["bias"], r["length"]): r for r in json.loads((folder / "gpu_ort.json").read_text()) if "times" in r}
    fast, slow = rows(async_dir), rows(blocking_dir)
    lines = ["", "## What host-synchronous launches cost (the runners' switch)", "",
             "`posbias_export.gpu.session ort` on the float16 `--target cuda-ort` attention files (causal, batch 1, H=8, d=64; "
             "ten runs each, median of the last eight, ms per forward), first with `CUDA_LAUNCH_BLOCKING=0`, then `=1`, "
             "in the same call, alone on the GPU.", "",
             "| family | L | asynchronous ms | host-synchronous ms | synchronous / asynchronous | GPU memory GB |",
             "|---|---|---|---|---|---|"]
    for key in sorted(fast, key=lambda k: (k[0], k[1])):
        if key not in slow:
            continue
        a, b = (statistics.median(r[key]["times"][2:]) * 1e3 for r in (fast, slow))
        lines.append(f"| {key[0]} | {key[1]} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {fast[key]['gpu_bytes'] / 1e9:.2f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    v = sub.add_parser("variants")
    v.add_argument("root", type=Path)
    v.add_argument("--check", action="store_true", help="each variant against its file on ORT CPU")
    v.add_argument("--kinds", default="loop,flat,whole", help="which variants (comma-separated)")
    r = sub.add_parser("run")
    r.add_argument("root", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    r.add_argument("--small", action="store_true", help="64 and 256 tokens (the CPU rehearsal)")
    r.add_argument("--workers", type=int, default=14)
    r.add_argument("--extra", nargs="*", default=[], help="more files judged as the models are (a control)")
    r.add_argument("--repeats", type=int, default=1, help="fresh processes per case with asynchronous launches "
                                                           "(the race was rare: 3 of 32 validate jobs)")
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "gpu_cure.md")
    w.add_argument("--timings", type=Path, nargs=2, metavar=("ASYNC", "BLOCKING"),
                   help="gpu.session ort folders timed with CUDA_LAUNCH_BLOCKING=0 and =1")
    c = sub.add_parser("case")
    c.add_argument("file", type=Path)
    c.add_argument("--provider", choices=("cpu", "cuda"), required=True)
    c.add_argument("--lengths", required=True)
    c.add_argument("--cache", type=Path, required=True)
    args = p.parse_args(argv)
    if args.part == "variants":
        made = variants(args.root, tuple(args.kinds.split(",")))
        print(f"{len(made)} variants")
        if args.check:
            problems = check_variants(args.root)
            print("\n".join(problems) or "every variant agrees with its file on ORT CPU")
            return 1 if problems else 0
    elif args.part == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.root, args.out, args.provider, args.small, args.workers, args.extra, args.repeats)
    elif args.part == "write":
        write(args.out, args.dest, tuple(args.timings) if args.timings else None)
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        print(json.dumps(case(args.file, args.provider, lengths, args.cache)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

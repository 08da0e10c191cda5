"""Issue 38, step 2: every file kind through `validate` (order protocol included) on ORT CPU, CUDA
and CUDA with TF32, against float64 PyTorch -> benchmarks/gpu_parity.md.

    python tools/gpu_parity.py build DIR [--small]          # export every file, DIR/jobs.json (CPU work)
    python tools/gpu_parity.py run DIR OUT [--jobs N] [--runtimes ...]   # the validate jobs, OUT/par/*.json
    python tools/gpu_parity.py write OUT...                 # here: benchmarks/gpu_parity.md / .json

Files: per family the default LM, its --target cuda-ort twin, its --kv-cache file and its
--bidirectional file; the attention files (H=8, d=64) of every family, portable / cuda /
cuda-ort, float32 and float16 (shared with the timings: gpu_attention.export_files); imported
BLOOM, MPT and Falcon folders (tiny configs, random weights) as float32 portable and float16
cuda-ort files; a T5 folder's encoder and decoder files, judged as a pair. Lengths 1, 17, 1024,
4096 (batch 3), then 16384 (attention files also 32768) at batch 1 in their own job, on the CUDA
provider alone for the attention and imported files. Short jobs run first. --small is
the CPU rehearsal: every kind once (ALiBi and T5 families), 1 / 17 / 64 and 128 tokens, ORT CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # hf_folders: the tiny imported models the suite uses

import gpu_attention as g  # noqa: E402
from posbias_export.biases import BIASES  # noqa: E402
from posbias_export.environment import describe_gpu, gpu_environment  # noqa: E402

GPU_RUNTIMES = "ort-cpu,ort-cuda,ort-cuda-tf32"
FLOAT16_RUNTIMES = "ort-cpu,ort-cuda"  # TF32 changes float32 matmuls only
SHORT, LONG, ATTENTION_LONG = "1,17,1024,4096", "16384", "16384,32768"
SMALL_SHORT, SMALL_LONG = "1,17,64", "128"
IMPORTED = ("bloom", "mpt", "falcon")


def _export(args: list[str]) -> str | None:
    """python -m posbias_export ARGS; None when it succeeded, else its one-line error."""
    proc = subprocess.run([sys.executable, "-m", "posbias_export", *args], capture_output=True, text=True, timeout=1800)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def _export_attention(bias: str, models: Path) -> str | None:
    code = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import gpu_attention as g; "
            f"g.export_files([{bias!r}], g.DTYPES, g.TARGETS, 8, 64, Path({str(models)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def plan(root: Path, small: bool) -> tuple[list[tuple[str, list[str]]], list[dict]]:
    """(exports to run, validate jobs): each export is (its file, the CLI arguments); a job's
    files and folder are relative to `root` (the files travel: `gpu_lease.sh pack`)."""
    short, long = (SMALL_SHORT, SMALL_LONG) if small else (SHORT, LONG)
    families = [b for b in BIASES if b in ("alibi", "t5")] if small else list(BIASES)
    exports, jobs = [], []

    def job(name, files, runtimes, lengths, batch, model=None):
        jobs.append({"name": name, "files": [str(Path(f).relative_to(root)) for f in files], "runtimes": runtimes,
                     "lengths": lengths, "batch": batch, "model": str(Path(model).relative_to(root)) if model else None})

    for b in families:
        for kind, extra in (("lm", []), ("lm_cuda-ort", ["--target", "cuda-ort"]), ("kv", ["--kv-cache"]),
                            ("bidirectional", ["--bidirectional"])):
            path = root / "lm" / f"{b}_{kind}.onnx"
            exports.append((str(path), ["--bias", b, *extra, "--out", str(path)]))
            job(f"{b}_{kind}", [path], GPU_RUNTIMES, short, 3)
            if kind in ("lm", "bidirectional"):
                job(f"{b}_{kind}_long", [path], GPU_RUNTIMES, long, 1)
    long_attention = []
    for dtype in g.DTYPES:
        for b in families:
            for target in ("portable", "cuda", "cuda-ort"):
                path = root / "models" / f"{b}_{dtype}_{target}.onnx"  # gpu_attention.export_files' name
                runtimes = GPU_RUNTIMES if dtype == "float32" else FLOAT16_RUNTIMES
                job(f"att_{b}_{dtype}_{target}", [path], runtimes, short, 1)
                # past 4096 on the CUDA provider alone: ORT CPU has its long-length tables already
                # (benchmarks/gpu_targets_cpu_parity.md, slim_table_long_parity.md)
                long_attention.append((f"att_{b}_{dtype}_{target}_long", [path], runtimes.replace("ort-cpu,", ""),
                                       SMALL_LONG if small else ATTENTION_LONG, 1))
    for kind in IMPORTED[:1] if small else IMPORTED:
        folder = root / "hf" / kind
        for dtype, target in (("float32", "portable"), ("float16", "cuda-ort")):
            path = root / "hf" / f"{kind}_{dtype}_{target}.onnx"
            exports.append((str(path), ["--model", str(folder), "--dtype", dtype, "--target", target,
                                        "--out", str(path)]))
            runtimes = GPU_RUNTIMES if dtype == "float32" else FLOAT16_RUNTIMES
            job(f"hf_{kind}_{dtype}_{target}", [path], runtimes, short, 3, folder)
            job(f"hf_{kind}_{dtype}_{target}_long", [path], runtimes.replace("ort-cpu,", ""), long, 1, folder)
    for args in sorted(long_attention, key=lambda a: "alibi" not in a[0]):  # the order failure's family first
        job(*args)
    t5 = root / "hf" / "t5_gated"
    exports.append((str(root / "hf" / "t5_files"), ["--model", str(t5), "--out-dir", str(root / "hf" / "t5_files")]))
    pair = [root / "hf" / "t5_files" / "encoder_model.onnx", root / "hf" / "t5_files" / "decoder_model_merged.onnx"]
    job("hf_t5_pair", pair, GPU_RUNTIMES, short, 3, t5)
    job("hf_t5_pair_long", pair, GPU_RUNTIMES.replace("ort-cpu,", ""), long, 1, t5)
    return exports, sorted(jobs, key=lambda j: j["name"].endswith("_long"))  # breadth first: a call cut short has it


def build(root: Path, small: bool, workers: int) -> None:
    import hf_folders

    for sub in ("lm", "models", "hf"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for kind in (*(IMPORTED[:1] if small else IMPORTED), "t5_gated"):
        if not (root / "hf" / kind).exists():
            hf_folders.save_tiny_model(kind, root / "hf" / kind)
    exports, jobs = plan(root, small)
    families = [b for b in BIASES if b in ("alibi", "t5")] if small else list(BIASES)
    todo = [(path, args) for path, args in exports if not Path(path).exists()]
    with ThreadPoolExecutor(workers) as pool:
        # the attention files of every target (the timings' plain form too), one process per family
        attention = [pool.submit(_export_attention, b, root / "models") for b in families]
        errors = dict(zip((p for p, _ in todo), pool.map(lambda e: _export(e[1]), todo)))
        errors.update({f"models/{b}": f.result() for b, f in zip(families, attention)})
    failed = {p: e for p, e in errors.items() if e}
    (root / "jobs.json").write_text(json.dumps({"jobs": jobs, "export_errors": failed}, indent=1))
    print(f"{len(jobs)} jobs, {len(todo)} exports, {len(failed)} failed", *failed.items(), sep="\n")


def job_bytes(job: dict, root: Path) -> float:
    """What a job's float64 reference and runtimes hold at its longest length (validate's own
    estimate; an imported model's: its float64 scores, bias and probabilities over every head,
    plus 2 GB)."""
    from posbias_export.limits import attention_bytes

    longest = max(int(n) for n in job["lengths"].split(","))
    if job["model"]:
        config = json.loads((root / job["model"] / "config.json").read_text())
        heads = next(config[k] for k in ("n_head", "num_attention_heads", "n_heads", "num_heads") if k in config)
        return 2e9 + attention_bytes(job["batch"], heads, longest, longest, itemsize=8)
    from posbias_export.export.metadata import read_metadata
    from posbias_export.parity.reference import read_onnx
    from posbias_export.validation import own_file_bytes

    meta = read_metadata(read_onnx(root / job["files"][0]))
    return own_file_bytes(meta, longest, job["batch"])


def run(root: Path, out: Path, workers: int, runtimes: str | None, only: str | None, deadline: float | None) -> int:
    """The validate jobs, short ones first, at most `workers` at a time and no more together
    than 70% of the memory available; a job whose report exists is done (a later call resumes);
    none starts after `deadline` seconds (the call then ends inside its limit)."""
    import threading
    import time

    from posbias_export.limits import available_bytes

    jobs = json.loads((root / "jobs.json").read_text())["jobs"]
    jobs = [j for j in jobs if (not only or only in j["name"]) and not (out / "par" / f"{j['name']}.json").exists()]
    (out / "par").mkdir(parents=True, exist_ok=True)
    (out / "machine.json").write_text(json.dumps(gpu_environment()))
    budget, started = 0.7 * available_bytes(), time.monotonic()
    held, lock = [0.0], threading.Condition()

    def one(j):
        need = min(job_bytes(j, root), budget)
        with lock:
            lock.wait_for(lambda: held[0] + need <= budget)
            held[0] += need
        try:
            if deadline is not None and time.monotonic() - started > deadline:
                print(j["name"], "not started: deadline", flush=True)
                return 0
            cmd = [sys.executable, "-m", "posbias_export", "validate", *(str(root / f) for f in j["files"]),
                   "--runtimes", runtimes or j["runtimes"], "--lengths", j["lengths"], "--batch", str(j["batch"]),
                   "--json", str(out / "par" / f"{j['name']}.json"),
                   *(["--model", str(root / j["model"])] if j["model"] else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            (out / "par" / f"{j['name']}.txt").write_text(proc.stdout + proc.stderr)
            print(j["name"], "rc", proc.returncode, f"{time.monotonic() - started:.0f} s", flush=True)
            return proc.returncode
        finally:
            with lock:
                held[0] -= need
                lock.notify_all()

    with ThreadPoolExecutor(workers) as pool:
        codes = list(pool.map(one, jobs))  # in plan order: the short jobs, then the long ones
    return max(codes, default=0)


def write(folders: list[Path], dest: Path = ROOT / "benchmarks") -> list[str]:
    """gpu_parity.md/.json from the validate reports of one or more calls (later folders' reports
    are re-runs). Returns the failures."""
    machine = next((json.loads((f / "machine.json").read_text()) for f in folders if (f / "machine.json").exists()), None)
    reports = [(i > 0, json.loads(p.read_text())) for i, f in enumerate(folders) for p in sorted(f.glob("par/*.json"))]
    lines = ["# Parity on the GPU: ONNX Runtime CPU, CUDA (TF32 off) and CUDA with TF32, against float64 PyTorch", "",
             "Generated by `python tools/gpu_parity.py build DIR && python tools/gpu_parity.py run DIR OUT` on the GPU "
             "machine (each job one `python -m posbias_export validate`, order protocol included), then "
             "`python tools/gpu_parity.py write OUT`. " + (describe_gpu(machine) if machine else "") +
             " LM files: the default byte-level decoder; attention files: H=8, d=64; imported: tiny BLOOM / MPT / "
             "Falcon / T5 folders (random weights), judged with `--model`. Budgets: the float32 policy, the TF32 "
             "policy for ort-cuda-tf32, the float16 policy for float16 files (parity/tolerance.py).", "",
             "| file | runtime | cases | worst max abs err | budget there | verdict |", "|---|---|---|---|---|---|"]
    failures = []
    for rerun, report in reports:
        for model in report["models"]:
            name = Path(model["model"]).name + (" (re-run)" if rerun else "")
            by_runtime: dict[str, list] = {}
            for c in model["cells"]:
                by_runtime.setdefault(c["runtime"], []).append(c)
            for runtime, cells in by_runtime.items():
                judged = [c for c in cells if "max_abs" in (c.get("parity") or {})]
                worst = max((c["parity"] for c in judged), key=lambda p: p["max_abs"] / max(p["budget_abs"], 1e-30),
                            default=None)
                bad = [c for c in cells if c["verdict"] != "pass"]
                failures += [f"{name} {runtime} {c['case']}: {c['verdict']}" + (
                    f", max abs err {c['parity']['max_abs']:.2e} (budget {c['parity']['budget_abs']:.2e})"
                    if "max_abs" in (c.get("parity") or {}) else "") for c in bad]
                err = f"{worst['max_abs']:.2e} | {worst['budget_abs']:.2e}" if worst else "- | -"
                lines.append(f"| {name} | {runtime} | {len(cells)} | {err} | {'FAIL' if bad else 'pass'} |")
    lines += ["", "## Failures", ""] + [f"- {x}" for x in failures or ["none"]]
    (dest / "gpu_parity.md").write_text("\n".join(lines) + "\n")
    (dest / "gpu_parity.json").write_text(json.dumps([r for _, r in reports], indent=1))
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--small", action="store_true")
    b.add_argument("--jobs", type=int, default=os.cpu_count())
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--jobs", type=int, default=6)
    r.add_argument("--runtimes", help="instead of each job's own (ort-cpu for the rehearsal)")
    r.add_argument("--only", help="the jobs whose name holds this")
    r.add_argument("--deadline", type=float, help="seconds after which no job starts")
    w = sub.add_parser("write")
    w.add_argument("out", type=Path, nargs="+")
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args(argv)
    if args.part == "build":
        build(args.dir, args.small, args.jobs)
        return 0
    if args.part == "run":
        return run(args.dir, args.out, args.jobs, args.runtimes, args.only, args.deadline)
    return 1 if write(args.out, args.dest) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The lease's `correctness` and `parity` steps: every GPU-target file kind through `validate`
(order protocol included) on ORT CPU, CUDA and CUDA with TF32, against float64 PyTorch (run on
the GPU there: --reference-device cuda) -> benchmarks/gpu_parity.md.

    python -m posbias_export.gpu.parity build DIR [--small]          # export every file, DIR/jobs.json (here)
    python -m posbias_export.gpu.parity run DIR OUT [--jobs N] [--cpu-only]   # the validate jobs, OUT/par/*.json
    python -m posbias_export.gpu.parity write OUT...                 # here: benchmarks/gpu_parity.md / .json

Files: the default LM of every family; the fused whole-sequence files (ALiBi and none, --target
cuda-ort, float32 and float16 attention, H=8, d=64); the slim-table files (KERPLE, T5, Sandwich,
the same); the window file (the same); an imported BLOOM (tiny config, random weights) float16
--target cuda-ort; the in-place cache files (--kv-cache --target ort: float32, float16, and an
int8 cache; the cache bound as one buffer on ort-cpu-shared / ort-cuda-shared); the --kv-cache file that `generate` compares.
Lengths 1, 17, 1024, 4096 (batch 3; attention files batch 1), then 16384 (attention files also
32768) in their own job on the CUDA provider alone. Short jobs first. --small is the CPU
rehearsal: ALiBi and T5, 1 / 17 / 64 and 128 tokens.
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

ROOT = Path(__file__).resolve().parents[2]

from posbias_export.gpu import attention as g
from posbias_export.biases import BIASES
from posbias_export.environment import describe_gpu, gpu_environment

GPU_RUNTIMES = "ort-cpu,ort-cuda,ort-cuda-tf32"
FLOAT16_RUNTIMES = "ort-cpu,ort-cuda"  # TF32 changes float32 matmuls only
SHORT, LONG, ATTENTION_LONG = "1,17,1024,4096", "16384", "16384,32768"
SMALL_SHORT, SMALL_LONG = "1,17,64", "128"


def _export(args: list[str]) -> str | None:
    """python -m posbias_export ARGS; None when it succeeded, else its one-line error."""
    proc = subprocess.run([sys.executable, "-m", "posbias_export", *args], capture_output=True, text=True, timeout=1800)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def _export_attention(bias: str, models: Path) -> str | None:
    code = (f"from pathlib import Path; from posbias_export.gpu import attention as g; "
            f"g.export_files([{bias!r}], g.DTYPES, ('cuda-ort',), 8, 64, Path({str(models)!r})); "
            f"{bias!r} == 'alibi' and g.export_files(['alibi'], ['float32'], ['portable'], 8, 64, Path({str(models)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


FUSED, SLIM, WINDOW = ("alibi", "none"), ("kerple_power", "kerple_log", "t5", "sandwich"), ("window",)


def attention_families(small: bool) -> list[str]:
    chosen = ("alibi", "t5") if small else (*FUSED, *SLIM, *WINDOW)
    return [b for b in BIASES if b in chosen]


def plan(root: Path, small: bool) -> tuple[list[tuple[str, list[str]]], list[dict]]:
    """(exports to run, validate jobs): each export is (its file, the CLI arguments); a job's
    files and folder are relative to `root` (the files travel: `gpu_lease.sh pack`)."""
    short, long = (SMALL_SHORT, SMALL_LONG) if small else (SHORT, LONG)
    families = attention_families(True) if small else list(BIASES)
    exports, jobs = [], []

    def job(name, files, runtimes, lengths, batch, model=None):
        jobs.append({"name": name, "files": [str(Path(f).relative_to(root)) for f in files], "runtimes": runtimes,
                     "lengths": lengths, "batch": batch, "model": str(Path(model).relative_to(root)) if model else None})

    for b in families:
        path = root / "lm" / f"{b}_lm.onnx"
        exports.append((str(path), ["--bias", b, "--out", str(path)]))
        job(f"{b}_lm", [path], GPU_RUNTIMES, short, 3)
        job(f"{b}_lm_long", [path], GPU_RUNTIMES, long, 1)  # the default file: ORT CPU at 16384 too
    kv = root / "lm" / "alibi_kv.onnx"  # what `generate --provider cpu|cuda` compares
    exports.append((str(kv), ["--bias", "alibi", "--kv-cache", "--out", str(kv)]))
    job("alibi_kv", [kv], GPU_RUNTIMES, short, 3)
    inplace = root / "lm" / "alibi_kv_inplace.onnx"
    exports.append((str(inplace), ["--bias", "alibi", "--kv-cache", "--target", "ort", "--out", str(inplace)]))
    job("alibi_kv_inplace", [inplace], "ort-cpu,ort-cpu-shared,ort-cuda,ort-cuda-shared", short, 3)
    for name, extra in (("float16", ["--dtype", "float16"]), ("int8", ["--kv-dtype", "int8"]),  # GQA's CUDA kernel, a compact cache
                        ("float16_int8", ["--dtype", "float16", "--kv-dtype", "int8"])):
        path = root / "lm" / f"alibi_kv_inplace_{name}.onnx"
        exports.append((str(path), ["--bias", "alibi", "--kv-cache", "--target", "ort", *extra, "--out", str(path)]))
        job(f"alibi_kv_inplace_{name}", [path], "ort-cpu,ort-cpu-shared,ort-cuda,ort-cuda-shared", short, 3)
    for dtype in g.DTYPES:
        for b in attention_families(small):
            path = root / "models" / f"{b}_{dtype}_cuda-ort.onnx"  # gpu_attention.export_files' name
            runtimes = GPU_RUNTIMES if dtype == "float32" else FLOAT16_RUNTIMES
            job(f"att_{b}_{dtype}_cuda-ort", [path], runtimes, short, 1)
            job(f"att_{b}_{dtype}_cuda-ort_long", [path], runtimes.replace("ort-cpu,", ""),
                SMALL_LONG if small else ATTENTION_LONG, 1)
    folder, path = root / "hf" / "bloom", root / "hf" / "bloom_float16_cuda-ort.onnx"
    exports.append((str(path), ["--model", str(folder), "--dtype", "float16", "--target", "cuda-ort", "--out", str(path)]))
    job("hf_bloom_float16_cuda-ort", [path], FLOAT16_RUNTIMES, short, 3, folder)
    job("hf_bloom_float16_cuda-ort_long", [path], "ort-cuda", long, 1, folder)
    return exports, sorted(jobs, key=lambda j: j["name"].endswith("_long"))  # breadth first: a call cut short has it


def build(root: Path, small: bool, workers: int) -> None:
    from posbias_export.hf.tiny import save_tiny_folder

    for sub in ("lm", "models", "hf"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    if not (root / "hf" / "bloom").exists():
        save_tiny_folder("bloom", root / "hf" / "bloom")
    exports, jobs = plan(root, small)
    todo = [(path, args) for path, args in exports if not Path(path).exists()]
    with ThreadPoolExecutor(workers) as pool:
        # the attention files (--target cuda-ort, both dtypes; ALiBi's portable one for the order check)
        attention = [pool.submit(_export_attention, b, root / "models") for b in attention_families(small)]
        errors = dict(zip((p for p, _ in todo), pool.map(lambda e: _export(e[1]), todo)))
        errors.update({f"models/{b}": f.result() for b, f in zip(attention_families(small), attention)})
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
    from posbias_export.export import FileContract
    from posbias_export.validation import own_file_bytes

    return own_file_bytes(FileContract.of_path(root / job["files"][0]), longest, job["batch"])


CPU_RUNTIMES = ("ort-cpu", "ort-cpu-shared")


def job_runtimes(job: dict, cpu_only: bool, no_cpu: bool = False) -> str:
    """The job's runtimes; for the CPU rehearsal, its CPU ones (ort-cpu where it has none);
    no_cpu: its GPU ones (a re-run after a fix to the CUDA runners)."""
    if no_cpu:
        return ",".join(r for r in job["runtimes"].split(",") if r not in CPU_RUNTIMES)
    if not cpu_only:
        return job["runtimes"]
    return ",".join(r for r in job["runtimes"].split(",") if r in CPU_RUNTIMES) or "ort-cpu"


def run(root: Path, out: Path, workers: int, cpu_only: bool, only: str | None, deadline: float | None,
        no_cpu: bool = False) -> int:
    """The validate jobs, short ones first, at most `workers` at a time and no more together
    than 70% of the memory available; a job whose report exists is done (a later call resumes);
    none starts after `deadline` seconds (the call then ends inside its limit). On the GPU the
    references run there too (--reference-device cuda)."""
    import threading
    import time

    from posbias_export.limits import available_bytes

    jobs = json.loads((root / "jobs.json").read_text())["jobs"]
    wanted = only.split(",") if only else []
    jobs = [j for j in jobs if (not wanted or any(w in j["name"] for w in wanted))
            and not (out / "par" / f"{j['name']}.json").exists()]
    (out / "par").mkdir(parents=True, exist_ok=True)
    (out / "machine.json").write_text(json.dumps(gpu_environment()))
    (out / "jobs.json").write_text((root / "jobs.json").read_text())  # what was planned: write() lists what did not run
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
            def validate(device):
                cmd = [sys.executable, "-m", "posbias_export", "validate", *(str(root / f) for f in j["files"]),
                       "--runtimes", job_runtimes(j, cpu_only, no_cpu), "--reference-device", device,
                       "--lengths", j["lengths"], "--batch", str(j["batch"]),
                       "--json", str(out / "par" / f"{j['name']}.json"),
                       *(["--model", str(root / j["model"])] if j["model"] else [])]
                return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

            # a job with an ORT CPU cell judges it against PyTorch CPU's float32 floor, as CI does (the
            # GPU's floor is tighter for Sandwich: gpu_parity.md); GPU-only jobs take the fast reference
            on_cpu = cpu_only or any(r in CPU_RUNTIMES for r in job_runtimes(j, cpu_only, no_cpu).split(","))
            proc = validate("cpu" if on_cpu else "cuda")
            report = out / "par" / f"{j['name']}.json"
            if not on_cpu and (proc.returncode == 2 or not report.exists()):  # the GPU reference broke: on the CPU
                first = proc.stdout + proc.stderr
                proc = validate("cpu")
                proc.stdout = f"--reference-device cuda: {first.strip().splitlines()[-1:]}\n" + proc.stdout
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


def write(folders: list[Path], dest: Path = ROOT / "benchmarks", labels: list[str] | None = None) -> list[str]:
    """gpu_parity.md/.json from the validate reports of one or more calls (later folders' reports
    are re-runs, named by `labels` when given). Returns the failures. What a person wrote below
    the prose mark of the existing file is kept."""
    from posbias_export.bench.harness import PROSE_MARK, kept_prose

    prose = kept_prose(dest / "gpu_parity.md")
    machine = next((json.loads((f / "machine.json").read_text()) for f in folders if (f / "machine.json").exists()), None)
    def label(i):
        return f" ({labels[i]})" if labels and labels[i] else (" (re-run)" if i > 0 else "")

    reports = [(label(i), portable_report(json.loads(p.read_text())))
               for i, f in enumerate(folders) for p in sorted(f.glob("par/*.json"))]
    lines = ["# Parity on the GPU: ONNX Runtime CPU, CUDA (TF32 off) and CUDA with TF32, against float64 PyTorch", "",
             "Generated by `tools/gpu_lease.sh` (`python -m posbias_export.gpu.parity run DIR OUT` on the GPU machine: each job "
             "one `python -m posbias_export validate --reference-device cuda`, order protocol included), then "
             "`python -m posbias_export.gpu.parity write OUT`. " + (describe_gpu(machine) if machine else "") +
             " LM files: the default byte-level decoder (batch 3; 16384 at batch 1); attention files: H=8, d=64, "
             "batch 1; the in-place cache file: prefill and one-token steps, its cache one buffer on the -shared "
             "runtimes; imported: a tiny BLOOM folder (random weights), judged with `--model`. References: float64 "
             "PyTorch on the GPU (TF32 off); budgets: the float32 policy, the TF32 policy for ort-cuda-tf32, the "
             "float16 policy for float16 files (parity/tolerance.py).", "",
             "| file | runtime | lengths (cells, order protocol included) | worst max abs err | budget there | verdict |", "|---|---|---|---|---|---|"]
    failures = []
    for rerun, report in reports:
        for model in report["models"]:
            name = Path(model["model"]).name + rerun
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
                lengths = sorted({int(m.group(1)) for c in cells if (m := re.search(r"L=(\d+)", c["case"]))})
                lines.append(f"| {name} | {runtime} | {','.join(map(str, lengths)) or '-'} ({len(cells)} cells) | {err} | "
                             f"{'FAIL' if bad else 'pass'} |")
    lines += ["", "## Failures", ""] + [f"- {x}" for x in failures or ["none"]]
    missing = not_run(folders)
    if missing:
        lines += ["", "## Not run", ""] + [f"- {x}" for x in missing]
    if prose:
        lines += ["", PROSE_MARK, "", prose]
    (dest / "gpu_parity.md").write_text("\n".join(lines) + "\n")
    (dest / "gpu_parity.json").write_text(json.dumps([r for _, r in reports], indent=1))
    return failures


def portable_report(report: dict) -> dict:
    """A validate report as it may be committed: each model named by its file, and every
    absolute path in a cell's text (the GPU machine's work folder) cut to its last part."""
    from posbias_export.environment import without_local_paths

    return {**report, "models": [{**m, "model": Path(m["model"]).name,
                                  "cells": [without_local_paths(c) for c in m["cells"]]} for m in report["models"]]}


def not_run(folders: list[Path]) -> list[str]:
    """The planned jobs without a report in any folder, each with why (its log's last line, or
    the call's deadline when it never started)."""
    planned = next((json.loads((f / "jobs.json").read_text())["jobs"] for f in folders if (f / "jobs.json").exists()), [])
    out = []
    for j in planned:
        if any((f / "par" / f"{j['name']}.json").exists() for f in folders):
            continue
        log = next((f / "par" / f"{j['name']}.txt" for f in folders if (f / "par" / f"{j['name']}.txt").exists()), None)
        last = (log.read_text().strip().splitlines() or ["no output"])[-1][:200] if log else "not started before the deadline"
        out.append(f"{j['name']} ({', '.join(j['files'])}; {j['lengths']}): {last}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--small", action="store_true")
    b.add_argument("--jobs", type=int, default=os.cpu_count())
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--jobs", type=int, default=6)
    r.add_argument("--cpu-only", action="store_true", help="each job's CPU runtimes, references on the CPU (the rehearsal)")
    r.add_argument("--only", help="the jobs whose name holds one of these (comma-separated)")
    r.add_argument("--no-cpu", action="store_true", help="each job's GPU runtimes only (a re-run after a CUDA fix)")
    r.add_argument("--deadline", type=float, help="seconds after which no job starts")
    w = sub.add_parser("write")
    w.add_argument("out", type=Path, nargs="+")
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks")
    w.add_argument("--labels", help="comma-separated, one per OUT folder: how its rows are named")
    args = p.parse_args(argv)
    if args.part == "build":
        build(args.dir, args.small, args.jobs)
        return 0
    if args.part == "run":
        return run(args.dir, args.out, args.jobs, args.cpu_only, args.only, args.deadline, args.no_cpu)
    return 1 if write(args.out, args.dest, args.labels.split(",") if args.labels else None) else 0


if __name__ == "__main__":
    sys.exit(main())

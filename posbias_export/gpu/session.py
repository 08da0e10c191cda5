"""The lease's `timings` and `torch_timings` steps, alone on the GPU: our float16 --target cuda-ort
attention files on ONNX Runtime CUDA (each file in its own worker process, profiled after its
timings: ORT's operators, the CUDA kernels, the kernel its attention op chose) against compiled
FlexAttention, fused SDPA and PyTorch eager, each in the cells the targets read.

    python -m posbias_export.gpu.session ort OUT --models DIR [--provider cuda|cpu] [--small]
    python -m posbias_export.gpu.session torch OUT [--warm]     # --warm: each cell once (compiles, fills the caches)
    python -m posbias_export.gpu.session write OUT_1 OUT_2 ...  # here: benchmarks/gpu_attention.md / .json

--provider cpu --small is the rehearsal (ORT CPU at 64 / 256 tokens, the same workers and writer).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posbias_export.gpu import attention as g
from posbias_export.environment import describe_gpu, gpu_environment

HEADS, HEAD_DIM, REPEATS = 8, 64, 10
ROOT = Path(__file__).resolve().parents[2]
# The targets' cells (gpu_attention.target_rows): the fused families at 4096 and 16384, the table
# families at 16384, and each at 32768 for its peak memory; then what each is held to.
ORT_GRID = {"alibi": (4096, 16384, 32768), "none": (4096, 16384, 32768), "kerple_log": (16384, 32768),
            "t5": (16384, 32768)}
SMALL_GRID = {"alibi": (64, 256), "t5": (64, 256)}
TORCH_GRID = {"alibi": ((4096, 16384), ("flex", "torch-sdpa", "torch-eager")), "none": ((4096, 16384), ("torch-sdpa",)),
              "kerple_log": ((16384,), ("flex",)), "t5": ((16384,), ("flex",))}


def part_ort(out: Path, models: Path, provider: str = "cuda", small: bool = False, biases: str | None = None) -> None:
    rows = []
    for bias, lengths in (SMALL_GRID if small else ORT_GRID).items():  # written after each file: a cut call keeps it
        if biases and bias not in biases.split(","):
            continue
        got = g.run_ort(models / f"{bias}_float16_cuda-ort.onnx", lengths, "float16", HEADS, HEAD_DIM, REPEATS,
                        timeout=120, provider=provider, profile=True)
        rows += [{"bias": bias, "dtype": "float16", "config": "ort-cuda-ort", **r} for r in got]
        print("ort", bias, [(r["length"], g.median(r["times"]) if r.get("times") else r.get("error")) for r in got],
              flush=True)
        (out / "gpu_ort.json").write_text(json.dumps(rows))


def part_torch(out: Path, warm: bool = False, flex_only: bool = False) -> None:
    rows = []
    for bias, (lengths, configs) in TORCH_GRID.items():
        if flex_only and configs != ("flex",):
            continue  # the table families' compiled Flex alone (a second lease)
        rows += g.torch_cells(bias, "float16", lengths, HEADS, HEAD_DIM, 1 if warm else REPEATS, configs)
        print("torch", bias, [(r["config"], r["length"], g.median(r["times"]) if r.get("times") else r.get("error"))
                              for r in rows if r["bias"] == bias], flush=True)
        if not warm:
            (out / "gpu_torch.json").write_text(json.dumps({"rows": rows}))


def part_write(folders: list[Path], dest: Path) -> list[Path]:
    """gpu_attention.md/.json from the parts' JSON (the first folder holding each part)."""
    def first(name):
        return next((json.loads((f / name).read_text()) for f in folders if (f / name).exists()), None)

    ort, torch_part, machine = first("gpu_ort.json") or [], first("gpu_torch.json") or {}, first("machine.json")
    rows = ort + torch_part.get("rows", [])
    result = {"rows": rows, "flex_vs_float64_1024": torch_part.get("flex_vs_float64_1024", {}),
              "heads": HEADS, "head_dim": HEAD_DIM, "lengths": sorted({r["length"] for r in rows})}
    description = describe_gpu(machine) + " ONNX Runtime: the runners' session and provider options (use_tf32=0, one " \
        "provider stream, memory patterns off), arena_extend_strategy kSameAsRequested." if machine else None
    return g.write(result, dest, {"description": description} if description else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    o = sub.add_parser("ort")
    o.add_argument("out", type=Path)
    o.add_argument("--models", type=Path, required=True, help="where the attention files are (gpu.parity build)")
    o.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    o.add_argument("--small", action="store_true", help="64 and 256 tokens (the CPU rehearsal)")
    o.add_argument("--biases", help="comma-separated: only these families' files")
    t = sub.add_parser("torch")
    t.add_argument("out", type=Path)
    t.add_argument("--warm", action="store_true", help="each cell once: compiles, fills the caches, writes nothing")
    t.add_argument("--flex-only", action="store_true", help="the table families' compiled Flex cells only")
    w = sub.add_parser("write")
    w.add_argument("out", type=Path, nargs="+")
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args(argv)
    if args.part == "write":
        part_write(args.out, args.dest)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "machine.json").write_text(json.dumps(gpu_environment()))
    if args.part == "ort":
        part_ort(args.out, args.models, args.provider, args.small, args.biases)
    else:
        part_torch(args.out, args.warm, args.flex_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

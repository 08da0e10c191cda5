"""Issue 38, step 3: `bench --device cuda` in parts, one GPU call each (tools/gpu_lease.sh), so a
call cut short by its time limit still returns what it measured: the ONNX Runtime cells (each
file in its own worker process, profiled after its timings, float16 GPU targets once more with
cuDNN SDPA off) and the PyTorch cells (eager with the bias, fused SDPA without, compiled Flex).

    python tools/gpu_session.py ort OUT [--models DIR] [--provider cuda|cpu] [--lengths ...]
    python tools/gpu_session.py torch OUT [--lengths ...]
    python tools/gpu_session.py write OUT_1 OUT_2 ...   # here: benchmarks/gpu_attention.md / .json

--provider cpu --lengths 64,256 is the rehearsal (ORT CPU, the same workers and writer).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gpu_attention as g
from posbias_export.biases import BIASES
from posbias_export.environment import describe_gpu, gpu_environment

HEADS, HEAD_DIM, REPEATS = 8, 64, 10
ROOT = Path(__file__).resolve().parents[1]


def part_ort(out: Path, models: Path, provider: str = "cuda", lengths=g.LENGTHS, biases=BIASES) -> None:
    files = g.export_files(biases, g.DTYPES, g.TARGETS, HEADS, HEAD_DIM, models)
    files = {key: path for key, path in files.items() if key[2] != "portable" or key[0] == "alibi"}  # the old anchor: ALiBi is enough
    rows = []
    for key, path in files.items():  # written after every file: a call cut short keeps what it measured
        rows += g.ort_cells({key: path}, lengths, HEADS, HEAD_DIM, REPEATS, provider=provider,
                            progress=lambda m: print(m, flush=True))
        (out / "gpu_ort.json").write_text(json.dumps(rows))


def part_torch(out: Path, lengths=g.LENGTHS, biases=BIASES) -> None:
    rows, checks = [], {}
    for bias in biases:
        for dtype in g.DTYPES:
            rows += g.torch_cells(bias, dtype, lengths, HEADS, HEAD_DIM, REPEATS)
            print("torch", bias, dtype, flush=True)
        try:
            checks[bias] = g.flex_check(bias, HEADS, HEAD_DIM)
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            checks[bias] = float("nan")
            print("flex check", bias, err, flush=True)
        (out / "gpu_torch.json").write_text(json.dumps({"rows": rows, "flex_vs_float64_1024": checks}))


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    o = sub.add_parser("ort")
    o.add_argument("out", type=Path)
    o.add_argument("--models", type=Path, help="where the attention files are (exported there if missing)")
    o.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    o.add_argument("--lengths", default=",".join(map(str, g.LENGTHS)))
    o.add_argument("--biases", default=",".join(BIASES))
    t = sub.add_parser("torch")
    t.add_argument("out", type=Path)
    t.add_argument("--lengths", default=",".join(map(str, g.LENGTHS)))
    w = sub.add_parser("write")
    w.add_argument("out", type=Path, nargs="+")
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args(argv)
    if args.part == "write":
        part_write(args.out, args.dest)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "machine.json").write_text(json.dumps(gpu_environment()))
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.part == "ort":
        part_ort(args.out, args.models or args.out / "models", args.provider, lengths, args.biases.split(","))
    else:
        part_torch(args.out, lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())

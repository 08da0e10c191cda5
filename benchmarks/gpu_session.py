"""What one lease of the GPU machine runs (see benchmarks/README or the issue notes): parts of
`bench --device cuda`, the parity matrix on ort-cpu / ort-cuda / ort-cuda-tf32, the CUDA tests,
decode and generate on CUDA. Each part writes JSON/logs under the folder given; the markdown is
written afterwards from the JSON (gpu_attention.write), so parts may run in separate calls.

    python benchmarks/gpu_session.py ort OUT [models_dir]    # ONNX Runtime CUDA timings
    python benchmarks/gpu_session.py torch OUT               # PyTorch eager / SDPA / Flex timings
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from posbias_export.bench import gpu_attention as g
from posbias_export.biases import BIASES

HEADS, HEAD_DIM, REPEATS = 8, 64, 10


def part_ort(out: Path, models: Path) -> None:
    files = g.export_files(BIASES, g.DTYPES, g.TARGETS, HEADS, HEAD_DIM, models)
    rows = []
    for (bias, dtype, target), path in files.items():
        if target == "portable" and bias != "alibi":
            continue  # the portable file is the old anchor: ALiBi is enough
        these = [n for n in g.LENGTHS if n <= 1024] if target == "plain" else (
            [n for n in g.LENGTHS if n <= 4096] if target == "portable" else list(g.LENGTHS))
        got = g.run_ort(path, these, dtype, HEADS, HEAD_DIM, REPEATS)
        rows += [{"bias": bias, "dtype": dtype, "config": f"ort-{target}", **r} for r in got]
        print(bias, dtype, target, [(r["length"], round(g.median(r["times"]) * 1e3, 3) if r.get("times") else r.get("error"))
                                    for r in got], flush=True)
    (out / "gpu_ort.json").write_text(json.dumps(rows))


def part_torch(out: Path) -> None:
    rows, checks = [], {}
    for bias in BIASES:
        for dtype in g.DTYPES:
            rows += g.torch_cells(bias, dtype, g.LENGTHS, HEADS, HEAD_DIM, REPEATS)
            print("torch", bias, dtype, flush=True)
        try:
            checks[bias] = g.flex_check(bias, HEADS, HEAD_DIM)
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            checks[bias] = float("nan")
            print("flex check", bias, err, flush=True)
        # after every bias: a call cut short by its time limit still returns what it measured
        (out / "gpu_torch.json").write_text(json.dumps({"rows": rows, "flex_vs_eager_float32_1024": checks}))


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if part == "ort":
        part_ort(out, Path(sys.argv[3]) if len(sys.argv) > 3 else out / "models")
    else:
        part_torch(out)

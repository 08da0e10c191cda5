"""What one lease of the GPU machine runs (see benchmarks/README or the issue notes): parts of
`bench --device cuda`, the parity matrix on ort-cpu / ort-cuda / ort-cuda-tf32, the CUDA tests,
decode and generate on CUDA. Each part writes JSON/logs under the folder given; the markdown is
written afterwards from the JSON (gpu_attention.write), so parts may run in separate calls.

    python tools/gpu_session.py ort OUT [models_dir]    # ONNX Runtime CUDA timings
    python tools/gpu_session.py torch OUT               # PyTorch eager / SDPA / Flex timings
    python tools/gpu_session.py write OUT_1 OUT_2 ...    # here: gpu_attention.md and gpu_parity.md
                                                             # from the calls' JSON (parity*.tar.gz unpacked)
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
        (out / "gpu_torch.json").write_text(json.dumps({"rows": rows, "flex_vs_float64_1024": checks}))


GPU_MACHINE = ("Machine: one NVIDIA H100 80GB HBM3 (driver 580.159), 16 CPU cores; onnxruntime-gpu 1.31.1 (CUDA "
               "provider, use_tf32=0, arena_extend_strategy kSameAsRequested), PyTorch 2.11.0+cu130; one run, "
               "2026-11-23 (tools/gpu_lease.sh).")


FINDINGS = """
## What holds the targets (measured in the same lease)

- The fused op is not the cost. One com.microsoft.MultiHeadAttention node with a prebuilt float16
  bias, timed alone: 0.19 ms at 4096x4096, 0.63 ms at 4096 queries x 16384 keys, 0.64 ms at
  2048 x 32768 (ONNX Attention-23: 0.45, 1.68, 2.38 ms; float32 either: 1.7, 6.7, 5.8 ms).
  A causal 16384 is four such blocks of growing width: ~1.5 ms of MHA.
- The graph around it is: `none` (no bias to compute; a zero table with the causal mask) costs
  4.6 ms (cuda-ort) at 16384 and ALiBi 8.5 ms, so ~3 ms is the Loop's structure (slices of q, k, v
  and the mask, BSNH transposes for MultiHeadAttention, BlockAssemble, 36 host-device Memcpy nodes
  placed by ONNX Runtime around the shape arithmetic of the blocked body) and ~4 ms the bias: the
  distance table [H, rows, M] in float16 is built once by one Gather (from the family's function on
  a [H, T] vector), then each block copies its slice, and ONNX has no strided view to avoid that copy.
- Block size (ALiBi fp16 cuda-ort, 16384): 1024 rows 12.8 ms, 2048 rows 9.0 ms, 4096 rows 9.6 ms.
- Memory at 32768 (6.6 GB, target 4): the typed table (1.1 GB), its int64 Gather index (0.6 GB),
  a block's slice (1.1 GB) and the float32 vector work are live together; T5 reaches 13 GB (its
  bucket function's intermediates are not on the vector path: not diagnosed).
- L=1024: the GPU files take the one-block branch (family function on the whole [H, L, L], masks,
  Cast, the fused op): 0.3-0.4 ms against the plain form's 0.2-0.3 ms, the difference being
  kernel launches (If, masking, casts, transposes) at a size where each costs more than its work.
- Known failures: the float32 window cuda-ort file fails at 16384 and 32768 on ORT CUDA ("Unexpected
  input data type. Actual: (tensor(float16)), expected: (tensor(float))" inside the Loop; it runs on
  ORT CPU and its float16 twin runs on CUDA); not diagnosed for lack of GPU time.
"""


PARITY_NOTES = """
The failing cell is reproducible and order-dependent: the portable ALiBi attention file on ORT CUDA at
L=4096 fails (max abs err ~5) when the same session ran L=1024 first; run alone, 4096 passes (3.6e-06,
second call). The same file passes on ORT CPU, with TF32 on, and at 16384; the GPU-shaped ALiBi files
(cuda, cuda-ort) pass. Not diagnosed for lack of GPU time: the portable ALiBi body is the only one that
takes the key-row shortcut. The validate jobs of sandwich/t5/window at 16384 and of the t5/window LM
files overran the first call's time limit and ran in a second call (rows marked re-run).

The CUDA tests of the suite (`pytest tests/test_runtimes.py -k "cuda or tf32"` on that machine, torch
2.11): 9 passed, 2 skipped (the two that check the error path of a CPU-only onnxruntime skip when a CUDA
provider is present). `generate --provider cuda` on the ALiBi --kv-cache file: the 300 generated bytes
equal the CPU run's (cmp), the cache bound as OrtValues on the GPU between steps.
"""


def part_write(folders: list[Path]) -> None:
    """benchmarks/gpu_attention.md from gpu_ort.json + gpu_torch.json, gpu_parity.md/.json from
    the validate reports (par/*.json, later folders' reports listed as re-runs)."""
    ort = next(json.loads((f / "gpu_ort.json").read_text()) for f in folders if (f / "gpu_ort.json").exists())
    torch_part = next(json.loads((f / "gpu_torch.json").read_text()) for f in folders if (f / "gpu_torch.json").exists())
    result = {"rows": ort + torch_part["rows"], "flex_vs_float64_1024": torch_part["flex_vs_float64_1024"],
              "heads": HEADS, "head_dim": HEAD_DIM, "lengths": list(g.LENGTHS)}
    md, _ = g.write(result, Path("benchmarks"), {"description": GPU_MACHINE})
    md.write_text(md.read_text() + FINDINGS)
    reports = [(i > 0, json.loads(p.read_text())) for i, f in enumerate(folders) for p in sorted(f.glob("par/*.json"))]
    lines = ["# Parity on the GPU: ONNX Runtime CPU, CUDA (TF32 off) and CUDA with TF32, against float64 PyTorch", "",
             "Generated by `python -m posbias_export validate FILE --runtimes ... --lengths ... --batch N --json ...` "
             "(tools/gpu_lease.sh). " + GPU_MACHINE + " LM files: the default byte-level decoder (dim 128, "
             "4 heads, 2 layers), batch 3; attention files: H=8, d=64, batch 1; portable = the default export, "
             "cuda / cuda-ort = `--target cuda` / `--target cuda-ort`. Budgets: the float32 policy (from PyTorch "
             "float32's own error), the TF32 policy for ort-cuda-tf32, the float16 policy for float16 files "
             "(parity/tolerance.py).", "",
             "| file | runtime | lengths | worst max abs err | budget there | verdict |", "|---|---|---|---|---|---|"]
    failures = []
    for rerun, report in reports:
        for model in report["models"]:
            name = Path(model["model"]).name + (" (re-run)" if rerun else "")
            by_runtime: dict[str, list] = {}
            for cell in model["cells"]:
                by_runtime.setdefault(cell["runtime"], []).append(cell)
            for runtime, cells in by_runtime.items():
                worst = max((c["parity"] for c in cells), key=lambda p: p["max_abs"] / max(p["budget_abs"], 1e-30))
                bad = [c for c in cells if c["verdict"] != "pass"]
                failures += [f"{name} {runtime} {c['case']}: max abs err {c['parity']['max_abs']:.2e} "
                             f"(budget {c['parity']['budget_abs']:.2e})" for c in bad]
                lengths = ",".join(c["case"].split()[0][2:] for c in cells)
                lines.append(f"| {name} | {runtime} | {lengths} | {worst['max_abs']:.2e} | {worst['budget_abs']:.2e} | "
                             f"{'FAIL' if bad else 'pass'} |")
    lines += ["", "## Failures", ""] + [f"- {x}" for x in failures or ["none"]] + [PARITY_NOTES]
    Path("benchmarks/gpu_parity.md").write_text("\n".join(lines) + "\n")
    Path("benchmarks/gpu_parity.json").write_text(json.dumps([r for _, r in reports], indent=1))


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    if part == "write":
        part_write([Path(a) for a in sys.argv[2:]])
        sys.exit(0)
    out.mkdir(parents=True, exist_ok=True)
    if part == "ort":
        part_ort(out, Path(sys.argv[3]) if len(sys.argv) > 3 else out / "models")
    else:
        part_torch(out)

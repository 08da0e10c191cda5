"""Attention on the GPU, side by side in one run (`bench --device cuda`): our exports on ONNX
Runtime CUDA (the GPU-shaped targets cuda and cuda-ort, and the portable file) against PyTorch
eager with the same bias, PyTorch's fused causal SDPA without a bias, and FlexAttention with the
bias as a score_mod. Causal, batch 1, [1, H, L, d]; float16 and float32; GPU memory included.

ONNX Runtime runs each file in its own process (gpu_worker.py: its arena and context alone);
PyTorch runs here. FlexAttention's score_mod: ALiBi's closed form (slope * (kv - q)); any other
relative family reads a [H, L] table of its own bias per distance (the family's from_positions),
under a causal block mask (a local window: the window's block mask, which skips blocks).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..export.files import write_text_atomic

GPU_WORKER = Path(__file__).with_name("gpu_worker.py")
LENGTHS = (1024, 4096, 16384, 32768)
DTYPES = ("float16", "float32")
TARGETS = ("cuda", "cuda-ort", "portable", "plain")  # plain: the portable target's plain form, at 1024 and 4096 only
TORCH_CONFIGS = ("torch-eager", "torch-sdpa", "flex")
EAGER_BYTES_PER_SCORE = 12  # eager's float32 bias + scores + probabilities; decides what to skip
EAGER_BUDGET = 48 << 30


def export_files(biases, dtypes, targets, heads: int, head_dim: int, out_dir: Path) -> dict:
    """(bias, dtype, target) -> path of the attention-arch export."""
    from ..export import export_onnx
    from ..nn import ModelConfig, build_model

    files = {}
    for bias in biases:
        model = build_model(ModelConfig(bias=bias, num_heads=heads, dim=heads * head_dim), arch="attention")
        for dtype in dtypes:
            for target in targets:
                path = out_dir / f"{bias}_{dtype}_{target}.onnx"
                if not path.exists():
                    kwargs = {"attention": "plain"} if target == "plain" else {"target": target}
                    export_onnx(model, path, dtype=dtype, check_growth=False, **kwargs)
                files[bias, dtype, target] = path
    return files


def run_ort(path: Path, lengths, dtype: str, heads: int, head_dim: int, repeats: int, timeout: float = 600) -> list[dict]:
    cmd = [sys.executable, str(GPU_WORKER), str(path), "--lengths", ",".join(map(str, lengths)), "--dtype", dtype,
           "--heads", str(heads), "--head-dim", str(head_dim), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = {r["length"] for r in rows}
    why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    rows += [{"length": n, "error": why} for n in lengths if n not in done]
    return rows


def flex_score_mod(bias, length: int, device):
    """A score_mod adding the family's bias: None where the bias only masks (the block mask does
    it), the family's closed form where it has one, else a per-distance table."""
    import torch

    if bias.mask_only:
        return None
    closed = bias.score_mod(device)
    if closed is not None:
        return closed
    q = torch.tensor([length - 1], device=device)
    row = bias.to(device).from_positions(q, torch.arange(length, device=device))[..., 0, :]  # [H|1, L]: g(L-1-j)
    table = row.flip(-1).float().expand(bias.num_heads, length).contiguous()  # [H, L]: table[h, d] = g_h(d)

    def by_distance(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx]
    return by_distance


def flex_wanted(bias: str, dtype: str, length: int) -> bool:
    """FlexAttention compiles per shape and score_mod: ALiBi everywhere (the targets' anchor),
    the others in float16 at 4096 and 16384."""
    return bias == "alibi" or (dtype == "float16" and length in (4096, 16384))


def torch_cells(bias_name: str, dtype: str, lengths, heads: int, head_dim: int, repeats: int) -> list[dict]:
    import torch
    from torch.nn import functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..nn import ModelConfig, build_model

    device = "cuda"
    tdtype = getattr(torch, dtype)
    model = build_model(ModelConfig(bias=bias_name, num_heads=heads, dim=heads * head_dim), arch="attention")
    model = model.to(device=device, dtype=tdtype).eval()
    bias = model.bias if hasattr(model, "bias") else next(m for m in model.modules() if hasattr(m, "lookback"))
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for length in lengths:
        gen = torch.Generator(device=device).manual_seed(length)
        q, k, v = (torch.randn(1, heads, length, head_dim, device=device, dtype=tdtype, generator=gen) for _ in range(3))
        reach = bias.lookback

        def causal(b, h, q_idx, kv_idx):
            allowed = q_idx >= kv_idx
            return allowed if reach is None else allowed & (q_idx - kv_idx <= reach)

        runs = {"torch-sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        if EAGER_BYTES_PER_SCORE * heads * length * length <= EAGER_BUDGET:
            runs["torch-eager"] = lambda: model(q, k, v)
        if flex_wanted(bias_name, dtype, length):
            block_mask = create_block_mask(causal, 1, 1, length, length, device=device)
            score_mod = flex_score_mod(bias, length, device)
            runs["flex"] = lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        for config in TORCH_CONFIGS:
            row = {"bias": bias_name, "dtype": dtype, "config": config, "length": length}
            if config == "flex" and config not in runs:
                continue  # not in the measured grid (each shape and score_mod costs a compile)
            if config not in runs:
                row["error"] = f"skipped: eager holds ~{EAGER_BYTES_PER_SCORE * heads * length ** 2 / 1e9:.0f} GB of scores"
                rows.append(row)
                continue
            try:
                with torch.no_grad():
                    runs[config]()  # warm-up (and compile)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    times = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        runs[config]()
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                row.update(times=times, gpu_bytes=torch.cuda.max_memory_allocated() - base)
            except Exception as err:  # noqa: BLE001 - out of memory etc. is a result
                row["error"] = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                torch.cuda.empty_cache()
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def flex_check(bias_name: str, heads: int, head_dim: int, length: int = 1024) -> float:
    """max |flex - eager| in float32 at `length`: the score_mod computes the family's bias."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..nn import ModelConfig, build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model(ModelConfig(bias=bias_name, num_heads=heads, dim=heads * head_dim), arch="attention").cuda().eval()
    bias = model.bias if hasattr(model, "bias") else next(m for m in model.modules() if hasattr(m, "lookback"))
    q, k, v = (torch.randn(1, heads, length, head_dim, device="cuda") for _ in range(3))
    reach = bias.lookback

    def causal(b, h, q_idx, kv_idx):
        allowed = q_idx >= kv_idx
        return allowed if reach is None else allowed & (q_idx - kv_idx <= reach)

    mask = create_block_mask(causal, 1, 1, length, length, device="cuda")
    score_mod = flex_score_mod(bias, length, "cuda")
    with torch.no_grad():
        got = torch.compile(flex_attention)(q, k, v, score_mod=score_mod, block_mask=mask)
        want = model(q, k, v)
    return float((got - want).abs().max())


def median(times) -> float | None:
    return statistics.median(times) if times else None


def run(biases, lengths, dtypes, targets, heads: int, head_dim: int, repeats: int, work_dir: Path, progress=print) -> dict:
    files = export_files(biases, dtypes, targets, heads, head_dim, work_dir)
    rows = []
    for (bias, dtype, target), path in files.items():
        # the plain form's [H, L, L] scores pass ONNX Runtime CUDA's 2^31-element limit at 16384
        these = [n for n in lengths if n <= 4096] if target in ("plain", "portable") else lengths
        for r in run_ort(path, these, dtype, heads, head_dim, repeats):
            rows.append({"bias": bias, "dtype": dtype, "config": f"ort-{target}", **r})
        progress(f"ort {bias} {dtype} {target}: " + ", ".join(
            f"{r['length']}: {median(r['times']) * 1e3:.2f} ms" if r.get("times") else f"{r['length']}: {r['error']}"
            for r in rows[-len(these):]))
    checks = {}
    for bias in biases:
        for dtype in dtypes:
            rows += torch_cells(bias, dtype, lengths, heads, head_dim, repeats)
            progress(f"torch {bias} {dtype} done")
        checks[bias] = flex_check(bias, heads, head_dim)
    return {"rows": rows, "flex_vs_eager_float32_1024": checks, "heads": heads, "head_dim": head_dim,
            "lengths": list(lengths)}


# --- results ------------------------------------------------------------------------------
FLEX_RATIO_BEST, FLEX_RATIO_STANDARD, BIAS_OVER_ALIBI = 3.0, 8.0, 2.0
MEMORY_TARGET_BYTES, MEMORY_TARGET_LENGTH = 4e9, 32768


def cell(rows, bias, dtype, config, length) -> dict | None:
    return next((r for r in rows if (r["bias"], r["dtype"], r["config"], r["length"]) == (bias, dtype, config, length)), None)


def ms(row) -> str:
    if row is None:
        return "not run"
    if not row.get("times"):
        return row.get("error", "failed")[:60]
    gb = "" if row.get("gpu_bytes") is None else f" / {row['gpu_bytes'] / 1e9:.2f} GB"
    return f"{median(row['times']) * 1e3:.2f}{gb}"


def targets(result: dict) -> list[dict]:
    rows, out = result["rows"], []

    def t(row):
        return median(row["times"]) if row and row.get("times") else None

    def check(name, value, limit, unit="x"):
        out.append({"target": name, "measured": value, "limit": limit, "met": value is not None and value <= limit,
                    "unit": unit})

    biases = sorted({r["bias"] for r in rows})
    for length in (4096, 16384):
        flex = t(cell(rows, "alibi", "float16", "flex", length))
        best = min(filter(None, (t(cell(rows, "alibi", "float16", f"ort-{g}", length)) for g in ("cuda", "cuda-ort"))),
                   default=None)
        std = t(cell(rows, "alibi", "float16", "ort-cuda", length))
        check(f"ALiBi fp16 L={length}: best export / Flex <= {FLEX_RATIO_BEST:g}x",
              best / flex if best and flex else None, FLEX_RATIO_BEST)
        if length == 16384:
            check(f"ALiBi fp16 L={length}: standard-ops export (cuda) / Flex <= {FLEX_RATIO_STANDARD:g}x",
                  std / flex if std and flex else None, FLEX_RATIO_STANDARD)
    for target in ("cuda", "cuda-ort"):
        alibi = t(cell(rows, "alibi", "float16", f"ort-{target}", 16384))
        for bias in biases:
            mine = t(cell(rows, bias, "float16", f"ort-{target}", 16384))
            check(f"{bias} fp16 L=16384 ({target}) / ALiBi's <= {BIAS_OVER_ALIBI:g}x",
                  mine / alibi if mine and alibi else None, BIAS_OVER_ALIBI)
        for bias in biases:
            row = cell(rows, bias, "float16", f"ort-{target}", MEMORY_TARGET_LENGTH)
            gb = row.get("gpu_bytes") if row and row.get("times") else None
            check(f"{bias} fp16 L={MEMORY_TARGET_LENGTH} runs ({target}), GPU memory <= 4 GB",
                  None if gb is None else gb / 1e9, MEMORY_TARGET_BYTES / 1e9, " GB")
        for bias in biases:
            for dtype in ("float16", "float32"):
                mine, plain = t(cell(rows, bias, dtype, f"ort-{target}", 1024)), t(cell(rows, bias, dtype, "ort-plain", 1024))
                if plain:
                    check(f"{bias} {dtype} L=1024 ({target}) / plain form <= 1x", mine / plain if mine else None, 1.0)
    return out


def write(result: dict, out_dir: Path, machine: dict | None = None) -> list[Path]:
    """gpu_attention.md/.json. `machine`: the GPU machine's description when the JSON parts were
    measured elsewhere (benchmarks/gpu_session.py); by default this machine's."""
    from ..environment import describe, environment

    machine = machine or environment()
    checks = targets(result)
    json_path, md_path = out_dir / "gpu_attention.json", out_dir / "gpu_attention.md"
    write_text_atomic(json_path, json.dumps({"machine": machine, **result, "targets": checks}, indent=1))
    rows, lengths = result["rows"], result["lengths"]
    configs = [c for c in ("ort-cuda", "ort-cuda-ort", "ort-portable", "ort-plain", *TORCH_CONFIGS)
               if any(r["config"] == c for r in rows)]
    lines = ["# Attention on the GPU: ONNX Runtime CUDA vs PyTorch (eager, fused SDPA, FlexAttention)", "",
             "Generated by `python -m posbias_export bench --device cuda` (or benchmarks/gpu_session.py, the same cells "
             "in parts, one GPU call each). Attention alone, causal, batch 1, "
             f"H={result['heads']}, d={result['head_dim']}; ms per forward (median of 10 after a warm-up; IOBinding, "
             "tensors on the GPU) / GPU memory beyond the inputs' process baseline (ONNX Runtime: the process's "
             "growth, NVML; PyTorch: peak allocated). ort-cuda: `--target cuda` (ONNX Attention-23 per block); "
             "ort-cuda-ort: `--target cuda-ort` (com.microsoft.MultiHeadAttention); ort-portable: the default "
             "export; torch-sdpa has no bias (the fused limit); flex: FlexAttention with the bias as score_mod.",
             machine.get("description") or describe(machine), "",
             "FlexAttention's score_mod for families other than ALiBi reads a [H, L] table by distance "
             "(table[h, q - kv]); measured here, that gather form runs far slower than ALiBi's closed form "
             "(KERPLE log fp16 16384: ~118 ms): the anchor for the targets is ALiBi's Flex time.", ""]
    for dtype in sorted({r["dtype"] for r in rows}):
        lines += [f"## {dtype}", "", "| bias | L | " + " | ".join(configs) + " |", "|---|---|" + "---|" * len(configs)]
        for bias in sorted({r["bias"] for r in rows}):
            for length in lengths:
                lines.append(f"| {bias} | {length} | " + " | ".join(ms(cell(rows, bias, dtype, c, length)) for c in configs) + " |")
        lines.append("")
    lines += ["FlexAttention's score_mod checked against PyTorch eager (float32, L=1024, max abs diff): "
              + ", ".join(f"{b} {e:.1e}" for b, e in result.get("flex_vs_eager_float32_1024", {}).items()), "",
              "## Targets", "", "| target | measured | limit | met |", "|---|---|---|---|"]
    for c in checks:
        measured = "not measured" if c["measured"] is None else f"{c['measured']:.2f}{c['unit']}"
        lines.append(f"| {c['target']} | {measured} | {c['limit']:g}{c['unit']} | {'yes' if c['met'] else 'NO'} |")
    write_text_atomic(md_path, "\n".join(lines) + "\n")
    return [md_path, json_path]


def run_and_write(biases, lengths=None, heads: int = 8, head_dim: int = 64, repeats: int = 10, out_dir="benchmarks",
                  progress=print) -> list[Path]:
    """`bench --device cuda`: needs a CUDA GPU visible to PyTorch; lengths default to LENGTHS."""
    import tempfile

    import torch

    from ..export.files import output_folder

    if not torch.cuda.is_available():
        raise ValueError("bench --device cuda needs a CUDA GPU visible to PyTorch")
    out = output_folder(out_dir)
    with tempfile.TemporaryDirectory(prefix="posbias-gpu-") as tmp:
        result = run(biases, lengths or LENGTHS, DTYPES, TARGETS, heads, head_dim, max(repeats, 10), Path(tmp),
                     progress=progress)
    return write(result, out)

"""Attention on the GPU, side by side in one run: our exports on ONNX
Runtime CUDA (the GPU-shaped targets cuda and cuda-ort, and the portable file) against PyTorch
eager with the same bias, PyTorch's fused causal SDPA without a bias, and FlexAttention with the
bias as a score_mod. Causal, batch 1, [1, H, L, d]; float16 and float32; GPU memory included.

ONNX Runtime runs each file in its own process (bench/worker.py, the CPU bench's worker: its
arena and context alone; gpu.profile then says what ran);
PyTorch runs here. FlexAttention's score_mod: ALiBi's closed form (slope * (kv - q)); any other
relative family reads a [H, L] table of its own bias per distance (the family's from_positions),
under a causal block mask (a local window: the window's block mask, which skips blocks).

    python -m posbias_export.gpu.attention [--biases alibi,t5] [--lengths 1024,4096] [--out-dir benchmarks]

On a lease the same work runs in parts, one GPU call each (posbias_export.gpu.session, gpu_lease.sh).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from posbias_export.bench.harness import median
from posbias_export.export.files import write_text_atomic


def attention_bias(model):
    """The model's bias module (an attention-only model holds one, shared by its layers)."""
    from posbias_export.biases import AttentionBias

    return next(m for m in model.modules() if isinstance(m, AttentionBias))

WORKER = Path(__file__).parents[1] / "bench" / "worker.py"
LENGTHS = (1024, 4096, 16384, 32768)
DTYPES = ("float16", "float32")
TARGETS = ("cuda", "cuda-ort", "portable", "plain")  # plain: the portable target's plain form, at 1024 only (lengths_for)
TORCH_CONFIGS = ("torch-eager", "torch-sdpa", "flex")
# cuDNN SDPA (preferred by recent ORT on SM90 for float16) switched off by ORT's own variable:
# the same file again as config "ort-<target>" + NO_CUDNN
NO_CUDNN, NO_CUDNN_ENV = "-nocudnn", {"ORT_ENABLE_CUDNN_FLASH_ATTENTION": "0"}
# the same file timed without host-synchronous launches (CUDA_LAUNCH_BLOCKING unset): faster, but
# ONNX Runtime CUDA then races on files with control flow (benchmarks/gpu_race.md)
ASYNC = "-async"
EAGER_BYTES_PER_SCORE = 12  # eager's float32 bias + scores + probabilities; decides what to skip
EAGER_BUDGET = 48 << 30


def export_files(biases, dtypes, targets, heads: int, head_dim: int, out_dir: Path) -> dict:
    """(bias, dtype, target) -> path of the attention-arch export."""
    from posbias_export.export import export_onnx
    from posbias_export.nn import ModelConfig, build_model

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


def run_ort(path: Path, lengths, dtype: str, heads: int, head_dim: int, repeats: int, timeout: float = 600,
            env: dict | None = None, provider: str = "cuda", profile: bool = False) -> list[dict]:
    """One file in a worker process (the CPU bench's worker, every length in increasing order).
    env: extra variables (ORT_ENABLE_CUDNN_FLASH_ATTENTION=0 for the run without cuDNN SDPA);
    profile: then each row gains what ran (gpu.profile) and the kernel choices ONNX Runtime's
    attention ops printed (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO)."""
    import os

    env = {**os.environ, **(env or {})}
    cmd = [sys.executable, str(WORKER), "--runner", "ort", "--model", str(path), "--dtype", dtype, "--heads", str(heads),
           "--head-dim", str(head_dim), "--repeats", str(repeats), "--provider", provider,
           *(f"--length={n}" for n in sorted(lengths))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = {r["length"] for r in rows}
    why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]  # whole: a cut text lost a real error
    rows += [{"length": n, "error": why} for n in lengths if n not in done]
    if not profile:
        return rows
    cmd = [sys.executable, "-m", "posbias_export.gpu.profile", str(path), "--lengths", ",".join(map(str, lengths)), "--dtype", dtype,
           "--heads", str(heads), "--head-dim", str(head_dim), "--provider", provider]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])})
    for extra in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")):
        next((r for r in rows if r["length"] == extra["length"]), {})["profile"] = extra["profile"]
    chosen = sorted({line.strip() for line in proc.stdout.splitlines() if "SdpaKernel=" in line})
    for r in rows if chosen else ():
        r["ort_kernel_choice"] = chosen
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
        # clamped: Flex evaluates score_mod on masked (future) positions of a partly kept block too
        return score + table[h, (q_idx - kv_idx).clamp(0, length - 1)]
    return by_distance


FLEX_SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}  # Triton's advice when its tiles overflow shared memory
FLEX_RECOMPILE_LIMIT = 256  # every (family, dtype, length) cell compiles once; the default 8 ran out after ALiBi's cells


def compiled_flex():
    """A fresh torch.compile'd flex_attention with room for every cell: when the recompile limit
    is used up, torch silently runs flex_attention eagerly, materialising the scores (13 bytes
    each), which is how the first gpu_attention.md measured 75-118 ms for eager Flex."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = FLEX_RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = FLEX_RECOMPILE_LIMIT * 4
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def ran_eagerly(row: dict, heads: int, length: int, dtype: str) -> bool:
    """A Flex cell whose peak memory reaches an eighth of the scores' size did not run compiled
    (a compiled Flex holds O(L d), never the L x L scores)."""
    itemsize = 2 if dtype == "float16" else 4
    return row.get("gpu_bytes", 0) >= heads * length * length * itemsize / 8


def flex_wanted(bias: str, dtype: str, length: int) -> bool:
    """FlexAttention compiles per shape and score_mod: ALiBi everywhere (the targets' anchor),
    the others in float16 at 4096 and 16384."""
    return bias == "alibi" or (dtype == "float16" and length in (4096, 16384))


def torch_cells(bias_name: str, dtype: str, lengths, heads: int, head_dim: int, repeats: int,
                configs=TORCH_CONFIGS) -> list[dict]:
    import torch
    from torch.nn import functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    from posbias_export.nn import ModelConfig, build_model

    device = "cuda"
    tdtype = getattr(torch, dtype)
    model = build_model(ModelConfig(bias=bias_name, num_heads=heads, dim=heads * head_dim), arch="attention")
    model = model.to(device=device, dtype=tdtype).eval()
    bias = attention_bias(model)
    flex = compiled_flex()  # per family and dtype: a reset, and room for every length
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
            options = {}  # Triton's default tiles, unless they overflow shared memory (below)
            runs["flex"] = lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options or None)
        for config in configs:
            row = {"bias": bias_name, "dtype": dtype, "config": config, "length": length}
            if config == "flex" and config not in runs:
                continue  # not in the measured grid (each shape and score_mod costs a compile)
            if config not in runs:
                row["error"] = f"skipped: eager holds ~{EAGER_BYTES_PER_SCORE * heads * length ** 2 / 1e9:.0f} GB of scores"
                rows.append(row)
                continue
            try:
                _time_cuda(runs[config], row, repeats, options if config == "flex" else None)
                if config == "flex" and ran_eagerly(row, heads, length, dtype):
                    row["error"] = f"flex ran eagerly (peak {row['gpu_bytes'] / 1e9:.2f} GB, the scores' size): not compiled"
                    del row["times"]
            except Exception as err:  # noqa: BLE001 - out of memory etc. is a result
                row["error"] = str(err).strip() or type(err).__name__  # whole: the first line alone hid real errors
                torch.cuda.empty_cache()
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _time_cuda(run, row: dict, repeats: int, flex_options: dict | None) -> None:
    """One warm-up (and compile), then `repeats` timed runs, each synchronised; the row gains its
    times and the peak GPU bytes above what was allocated before. flex_options: Flex's kernel
    options, made smaller when a table score_mod's float16 tiles outgrow H200's 227 KB."""
    import torch

    with torch.no_grad():
        try:
            run()
        except Exception as err:  # noqa: BLE001 - only Flex's out-of-resource is retried
            if flex_options is None or "out of resource" not in str(err):
                raise
            flex_options.update(FLEX_SMALL_TILES)
            row["kernel_options"] = dict(FLEX_SMALL_TILES)
            run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    row.update(times=times, gpu_bytes=torch.cuda.max_memory_allocated() - base)


def flex_check(bias_name: str, heads: int, head_dim: int, length: int = 1024) -> float:
    """max |compiled flex (float32) - float64 eager| at `length`: the score_mod computes the
    family's bias (eager float32 vs eager float32 read 0.0 when Flex had fallen back to eager)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from posbias_export.nn import ModelConfig, build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model(ModelConfig(bias=bias_name, num_heads=heads, dim=heads * head_dim), arch="attention").cuda().eval()
    bias = attention_bias(model)
    q, k, v = (torch.randn(1, heads, length, head_dim, device="cuda") for _ in range(3))
    reach = bias.lookback

    def causal(b, h, q_idx, kv_idx):
        allowed = q_idx >= kv_idx
        return allowed if reach is None else allowed & (q_idx - kv_idx <= reach)

    mask = create_block_mask(causal, 1, 1, length, length, device="cuda")
    score_mod = flex_score_mod(bias, length, "cuda")
    with torch.no_grad():
        got = compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask)
        want = model.double()(q.double(), k.double(), v.double())
    return float((got.double() - want).abs().max())


def lengths_for(target: str, lengths) -> list[int]:
    # the plain form's [H, L, L] scores pass ONNX Runtime CUDA's 2^31-element limit at 16384; the
    # plain form answers the L=1024 target, the portable file is the old anchor (to 4096)
    limit = {"plain": 1024, "portable": 4096}.get(target)
    return [n for n in lengths if limit is None or n <= limit]


def ort_cells(files: dict, lengths, heads: int, head_dim: int, repeats: int, provider: str = "cuda",
              progress=print) -> list[dict]:
    """Every file on ONNX Runtime (profiled after its timings); float16 GPU-target files once
    more with cuDNN SDPA off (config suffix NO_CUDNN)."""
    rows = []
    for (bias, dtype, target), path in files.items():
        these = lengths_for(target, lengths)
        runs = [("", None)] + ([(NO_CUDNN, NO_CUDNN_ENV)] if dtype == "float16" and target in ("cuda", "cuda-ort") else [])
        for suffix, env in runs:
            got = run_ort(path, these, dtype, heads, head_dim, repeats, env=env, provider=provider, profile=True)
            rows += [{"bias": bias, "dtype": dtype, "config": f"ort-{target}{suffix}", **r} for r in got]
            progress(f"ort {bias} {dtype} {target}{suffix}: " + ", ".join(
                f"{r['length']}: {median(r['times']) * 1e3:.2f} ms" if r.get("times") else f"{r['length']}: {r['error']}"
                for r in got))
    return rows


def run(biases, lengths, dtypes, targets, heads: int, head_dim: int, repeats: int, work_dir: Path, progress=print) -> dict:
    files = export_files(biases, dtypes, targets, heads, head_dim, work_dir)
    rows = ort_cells(files, lengths, heads, head_dim, repeats, progress=progress)
    checks = {}
    for bias in biases:
        for dtype in dtypes:
            rows += torch_cells(bias, dtype, lengths, heads, head_dim, repeats)
            progress(f"torch {bias} {dtype} done")
        checks[bias] = flex_check(bias, heads, head_dim)
    return {"rows": rows, "flex_vs_float64_1024": checks, "heads": heads, "head_dim": head_dim,
            "lengths": list(lengths)}


# --- results ------------------------------------------------------------------------------
# The targets (issue: attention at fused-kernel speed): ALiBi and none have a fused whole-sequence
# path without a bias tensor, so they are held to the fused kernels; the table families to
# compiled Flex reading the same per-distance table.
FLEX_RATIO_FEATURES, SDPA_RATIO_PLAIN, FLEX_RATIO_TABLE, PLAIN_RATIO_1024 = 1.5, 1.5, 3.0, 1.2
MEMORY_TARGET_BYTES, MEMORY_TARGET_LENGTH = 4e9, 32768
TARGET_LENGTH = 16384
NOT_MEASURED = "not measured"


def cell(rows, bias, dtype, config, length) -> dict | None:
    return next((r for r in rows if (r["bias"], r["dtype"], r["config"], r["length"]) == (bias, dtype, config, length)), None)


def ms(row) -> str:
    if row is None:
        return "not run"
    if not row.get("times"):
        return row.get("error", "failed")[:60]  # the table cell; the JSON keeps the whole text
    gb = "" if row.get("gpu_bytes") is None else f" / {row['gpu_bytes'] / 1e9:.2f} GB"
    return f"{median(row['times']) * 1e3:.2f}{gb}"


def target_rows(rows: list[dict], biases) -> list[dict]:
    """Each target with its measured value (None: not measured). rows=[] gives the list as it
    reads without a GPU."""
    out = []

    def t(row):
        return median(row["times"]) if row and row.get("times") else None

    def ratio(a, b):
        return a / b if a and b else None

    def check(name, value, limit, unit="x", row=None):
        out.append({"target": name, "measured": value, "limit": limit, "met": value is not None and value <= limit,
                    "unit": unit, "kernel": kernel_of(row)})

    def best_row(bias, dtype, length, suffix=""):  # the faster GPU target's cell
        timed = [r for g in ("cuda", "cuda-ort") if (r := cell(rows, bias, dtype, f"ort-{g}{suffix}", length)) and t(r)]
        return min(timed, key=t, default=None)

    def best(bias, dtype, length, suffix=""):
        return t(best_row(bias, dtype, length, suffix))

    n = TARGET_LENGTH
    settings = [("", "")] + ([(NO_CUDNN, " (cuDNN SDPA off)")] if any(r["config"].endswith(NO_CUDNN) for r in rows) else [])
    for suffix, label in settings:
        for bias in biases:
            mine = best_row(bias, "float16", n, suffix)
            if bias == "alibi":
                check(f"alibi fp16 L={n}{label}: export / compiled Flex <= {FLEX_RATIO_FEATURES:g}x",
                      ratio(t(mine), t(cell(rows, bias, "float16", "flex", n))), FLEX_RATIO_FEATURES, row=mine)
            elif bias == "none":
                check(f"none fp16 L={n}{label}: export / fused SDPA <= {SDPA_RATIO_PLAIN:g}x",
                      ratio(t(mine), t(cell(rows, bias, "float16", "torch-sdpa", n))), SDPA_RATIO_PLAIN, row=mine)
            else:
                check(f"{bias} fp16 L={n}{label}: export / compiled Flex (same table) <= {FLEX_RATIO_TABLE:g}x",
                      ratio(t(mine), t(cell(rows, bias, "float16", "flex", n))), FLEX_RATIO_TABLE, row=mine)
    for bias in biases:
        sized = [r for g in ("cuda", "cuda-ort")
                 if (r := cell(rows, bias, "float16", f"ort-{g}", MEMORY_TARGET_LENGTH)) and r.get("times")]
        small = min(sized, key=lambda r: r.get("gpu_bytes") or 0, default=None)
        check(f"{bias} fp16 L={MEMORY_TARGET_LENGTH}: GPU memory <= 4 GB",
              small["gpu_bytes"] / 1e9 if small and small.get("gpu_bytes") is not None else None,
              MEMORY_TARGET_BYTES / 1e9, " GB", row=small)
    for bias in biases if any(r["config"] == "ort-plain" for r in rows) else ():  # a grid without the plain form
        for dtype in DTYPES:
            check(f"{bias} {dtype} L=1024: export / plain form <= {PLAIN_RATIO_1024:g}x",
                  ratio(best(bias, dtype, 1024), t(cell(rows, bias, dtype, "ort-plain", 1024))), PLAIN_RATIO_1024)
    return out


def kernel_of(row: dict | None) -> str:
    """What ran in a profiled ORT cell: the longest CUDA kernel, and the kernel ONNX Runtime's
    attention op said it chose."""
    if not row or not row.get("profile"):
        return "-"
    kernels = [k for k in row["profile"].get("cuda_kernels") or [] if not k["kernel"].startswith("Memcpy")]  # not the inputs' copies
    top = "; ".join(f"{k['kernel'][:60]} {k['us']:.0f} us" for k in kernels[:2]) or \
        row["profile"].get("cuda_kernels_error", "-")[:60]
    choice = "; ".join(plain(c)[:70] for c in row.get("ort_kernel_choice", [])[:1])
    return f"{top}" + (f" (ORT: {choice})" if choice else "")


def plain(text: str) -> str:
    """ORT's debug lines without their terminal colours."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def targets(result: dict) -> list[dict]:
    return target_rows(result["rows"], sorted({r["bias"] for r in result["rows"]}))


def targets_markdown(checks: list[dict]) -> list[str]:
    lines = ["## Targets", "", "| target | measured | limit | met | kernel that ran (ours) |", "|---|---|---|---|---|"]
    for c in checks:
        measured = NOT_MEASURED if c["measured"] is None else f"{c['measured']:.2f}{c['unit']}"
        met = NOT_MEASURED if c["measured"] is None else ("yes" if c["met"] else "NO")
        lines.append(f"| {c['target']} | {measured} | {c['limit']:g}{c['unit']} | {met} | {c.get('kernel', '-')} |")
    return lines


def what_ran(rows: list[dict]) -> list[str]:
    """The profiled cells (gpu.profile) at 1024 and the target length (else the shortest
    and longest profiled): the CUDA kernels by device time, the kernel ONNX Runtime's attention op
    said it chose, and ORT's busiest operator types."""
    present = {r["length"] for r in rows if r.get("profile")}
    lengths = ({1024, TARGET_LENGTH} & present) or ({min(present), max(present)} if present else set())
    profiled = [r for r in rows if r.get("profile") and r["length"] in lengths]
    if not profiled:
        return []
    lines = ["", "## What ran (one profiled forward per cell)", "",
             "CUDA kernels: PyTorch's profiler (CUPTI) around ONNX Runtime's run, the three longest, us; "
             "ORT's choice: what its MultiHeadAttention / GroupQueryAttention printed "
             "(ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO); ORT ops: its profiler, ms per operator type.", "",
             "| bias | dtype | config | L | CUDA kernels | ORT's choice | ORT ops |", "|---|---|---|---|---|---|---|"]
    for r in sorted(profiled, key=lambda r: (r["bias"], r["dtype"], r["config"], r["length"])):
        p = r["profile"]
        kernels = "; ".join(f"{k['kernel'][:70]} {k['us']:.0f}" for k in (p.get("cuda_kernels") or [])[:3]) or \
            p.get("cuda_kernels_error") or p.get("profile_error", "-")[:80]
        choice = "; ".join(plain(c)[:90] for c in r.get("ort_kernel_choice", [])[:2]) or "-"
        ops = ", ".join(f"{op} {ms:.2f}" for op, ms in list(p.get("ort_ops_ms", {}).items())[:4]) or "-"
        lines.append(f"| {r['bias']} | {r['dtype']} | {r['config']} | {r['length']} | {kernels} | {choice} | {ops} |")
    return lines


def write(result: dict, out_dir: Path, machine: dict | None = None, stale: str | None = None) -> list[Path]:
    """gpu_attention.md/.json. `machine`: the GPU machine's description when the JSON parts were
    measured elsewhere (posbias_export.gpu.session); by default this machine's. `stale`: why the
    timings no longer describe today's files: the targets then read "not measured"."""
    from posbias_export.environment import describe, environment

    machine = machine or environment()
    checks = target_rows([], sorted({r["bias"] for r in result["rows"]})) if stale else targets(result)
    json_path, md_path = out_dir / "gpu_attention.json", out_dir / "gpu_attention.md"
    write_text_atomic(json_path, json.dumps({"machine": machine, **result, "targets": checks}, indent=1))
    rows, lengths = result["rows"], result["lengths"]
    configs = [c for c in ("ort-cuda", "ort-cuda-ort", f"ort-cuda-ort{ASYNC}", f"ort-cuda{NO_CUDNN}", f"ort-cuda-ort{NO_CUDNN}", "ort-portable",
                           "ort-plain", *TORCH_CONFIGS)
               if any(r["config"] == c for r in rows)]
    lines = ["# Attention on the GPU: ONNX Runtime CUDA vs PyTorch (eager, fused SDPA, FlexAttention)", "",
             "Generated by `python -m posbias_export bench --device cuda` (or posbias_export.gpu.session, the same cells "
             "in parts, one GPU call each). Attention alone, causal, batch 1, "
             f"H={result['heads']}, d={result['head_dim']}; ms per forward (median of 10 after a warm-up; IOBinding, "
             "tensors on the GPU) / GPU memory beyond the inputs' process baseline (ONNX Runtime: the process's "
             "growth, NVML; PyTorch: peak allocated). ort-cuda: `--target cuda` (ONNX Attention-23 per block); "
             "ort-cuda-ort: `--target cuda-ort` (com.microsoft.MultiHeadAttention); ort-portable: the default "
             "export; torch-sdpa has no bias (the fused limit); flex: FlexAttention with the bias as score_mod.",
             machine.get("description") or describe(machine), "",
             *([f"**These timings are stale: {stale}**", ""] if stale else []),
             "FlexAttention's score_mod for families other than ALiBi reads a [H, L] table by distance "
             "(table[h, clamp(q - kv)]), compiled once per cell (a fresh compile per family, room for every "
             "cell; a cell whose memory shows it ran eagerly is an error, not a time).", ""]
    for dtype in sorted({r["dtype"] for r in rows}):
        lines += [f"## {dtype}", "", "| bias | L | " + " | ".join(configs) + " |", "|---|---|" + "---|" * len(configs)]
        for bias in sorted({r["bias"] for r in rows}):
            for length in lengths:
                lines.append(f"| {bias} | {length} | " + " | ".join(ms(cell(rows, bias, dtype, c, length)) for c in configs) + " |")
        lines.append("")
    checked = result.get("flex_vs_float64_1024", {})
    lines += [*(["Compiled FlexAttention (float32) checked against a float64 eager run (L=1024, max abs diff): "
                 + ", ".join(f"{b} {e:.1e}" for b, e in checked.items()), ""] if checked else []),
              *targets_markdown(checks), *what_ran(rows)]
    write_text_atomic(md_path, "\n".join(lines) + "\n")
    return [md_path, json_path]


def run_and_write(biases, lengths=None, heads: int = 8, head_dim: int = 64, repeats: int = 10, out_dir="benchmarks",
                  progress=print) -> list[Path]:
    """The whole run: needs a CUDA GPU visible to PyTorch; lengths default to LENGTHS."""
    import tempfile

    import torch

    from posbias_export.export.files import output_folder

    if not torch.cuda.is_available():
        raise ValueError("the GPU attention benchmark needs a CUDA GPU visible to PyTorch")
    out = output_folder(out_dir)
    with tempfile.TemporaryDirectory(prefix="posbias-gpu-") as tmp:
        result = run(biases, lengths or LENGTHS, DTYPES, TARGETS, heads, head_dim, max(repeats, 10), Path(tmp),
                     progress=progress)
    return write(result, out)


def main(argv=None) -> int:
    import argparse

    from posbias_export.biases import BIASES

    def name_list(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    def int_list(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in name_list(text))

    p = argparse.ArgumentParser(prog="python -m posbias_export.gpu.attention", description=__doc__.splitlines()[0])
    p.add_argument("--biases", type=name_list, default=BIASES)
    p.add_argument("--lengths", type=int_list, default=None, help=f"default {','.join(map(str, LENGTHS))}")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks"))
    args = p.parse_args(argv)
    try:
        paths = run_and_write(args.biases, args.lengths, args.heads, args.head_dim, args.repeats, args.out_dir)
    except (ValueError, OSError) as err:
        print(f"gpu_attention: error: {err}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

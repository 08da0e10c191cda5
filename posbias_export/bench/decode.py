"""Decode benchmark: per-token latency of the --kv-cache export on ONNX Runtime vs PyTorch
eager with the same model and the same cache, measured side by side in one process."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..biases import BIASES
from ..environment import describe, environment
from ..export import export_onnx
from ..nn import ModelConfig, build_model
from ..parity import load_runner
from .harness import md_table, median, targets_section, write_results


def time_alternating(first, second, steps: int, chunk: int = 16, settle: int = 8) -> tuple[list[float], list[float]]:
    """Per-step seconds of two step functions run in alternating chunks (first, second, first,
    ...) until each has `steps` kept: both see the same machine load, which on a shared host
    drifts by 2x within a minute. The first `settle` steps of each chunk are not kept: after
    the other runtime ran, ONNX Runtime's first step takes ~1 ms and reaches its steady ~0.2 ms
    only after ~8 steps (measured at context 512; step by step, both ran 2-6x slower)."""
    times: tuple[list[float], list[float]] = ([], [])
    while len(times[0]) < steps:
        keep = min(chunk, steps - len(times[0]))
        for step, out in zip((first, second), times):
            for i in range(settle + keep):
                start = time.perf_counter()
                step()
                if i >= settle:
                    out.append(time.perf_counter() - start)
    return times


@torch.no_grad()
def measure(bias: str, contexts=(512, 4096), steps: int = 32, cfg_kwargs: dict | None = None, workdir=None,
            device: str = "cpu", target: str = "portable") -> list[dict]:
    """device cuda: ONNX Runtime's CUDA provider (cache bound on the GPU) against PyTorch eager
    on the GPU (a synchronize ends each timed step of both)."""
    gen = load_runner("ort/generate.py")
    cfg = ModelConfig(bias=bias, **(cfg_kwargs or {}))
    model = build_model(cfg, seed=0)
    path = Path(workdir) / f"{bias}_{target}_kv.onnx"
    export_onnx(model, path, kv_cache=True, check_growth=False, target=target)
    decoder = gen.CachedDecoder(str(path), provider=device)
    model = model.to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for context in contexts:
        ids = np.random.default_rng(context).integers(0, 256, (1, context)).astype(np.int64)
        # ONNX Runtime as generate runs it: prefill (untimed), then single-token steps with the
        # growing cache bound from each step's outputs to the next step's inputs.
        logits, past = decoder.step_on_device(ids, np.ones((1, context), np.int64), decoder.empty_cache(1))
        state = {"past": past, "len": context}

        def ort_step():
            nxt = np.array([[7]], np.int64)
            _, state["past"] = decoder.step_on_device(nxt, np.ones((1, state["len"] + 1), np.int64), state["past"])
            state["len"] += 1  # the logits come back to the host: the step has finished

        # PyTorch eager, same weights, same cache layout.
        t_ids = torch.from_numpy(ids).to(device)
        _, t_past = model.step(t_ids, torch.ones_like(t_ids), [(pk.to(device), pv.to(device)) for pk, pv in model.empty_past(1)])
        t_state = {"past": t_past, "len": context}

        def torch_step():
            nxt = torch.tensor([[7]], device=device)
            logits, t_state["past"] = model.step(nxt, torch.ones(1, t_state["len"] + 1, dtype=torch.int64, device=device),
                                                 t_state["past"])
            logits.cpu()  # as ORT's step: the logits reach the host
            sync()
            t_state["len"] += 1

        ort_times, torch_times = time_alternating(ort_step, torch_step, steps)
        ort_med, torch_med = median(ort_times), median(torch_times)
        rows.append({
            "bias": bias, "context": context, "steps": steps, "device": device, "target": target,
            "ort_ms_median": ort_med * 1e3, "ort_ms_min": min(ort_times) * 1e3,
            "torch_ms_median": torch_med * 1e3, "torch_ms_min": min(torch_times) * 1e3,
            "ort_tokens_per_s": 1.0 / ort_med, "torch_tokens_per_s": 1.0 / torch_med,
            "ort_over_torch": ort_med / torch_med,
        })
    return rows


def check_contexts(contexts, ignore: bool = False) -> None:
    """The longest context's KV cache (ONNX Runtime's and PyTorch's, the default model) and one
    prefill block's scores fit this machine."""
    from ..limits import attention_bytes, check_fits, check_index

    cfg, longest = ModelConfig(), max(contexts)
    check_index(longest, "a decode context")
    cache = 2 * 2 * cfg.num_layers * cfg.num_heads * longest * cfg.head_dim * 4.0  # both runtimes, keys and values
    check_fits(cache + attention_bytes(1, cfg.num_heads, min(longest, 256), longest) + 4.0 * longest * cfg.vocab_size,
               f"bench-decode from a {longest}-token context", ignore)


def run(biases=BIASES, contexts=(512, 4096), steps: int = 32, out_dir: str | None = "benchmarks", progress=None,
        device: str = "cpu", target: str = "portable", ignore_size_limits: bool = False) -> list[dict]:
    unknown = [b for b in biases if b not in BIASES]
    if unknown:
        raise ValueError(f"unknown bias {unknown[0]!r}; choose one of: {', '.join(BIASES)}")
    check_contexts(contexts, ignore_size_limits)
    if out_dir:
        from ..export.files import output_folder

        output_folder(out_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="posbias-decode-") as tmp:
        for bias in biases:
            rows += measure(bias, contexts, steps, workdir=tmp, device=device, target=target)
            if progress:
                progress(1)
    if out_dir:
        write_decode(rows, Path(out_dir), contexts, steps, device)
    return rows


TARGET_RATIO = 0.5  # ORT per-token time <= half of PyTorch eager's, every bias and context


def targets(rows: list[dict]) -> list[dict]:
    """One target per (bias, context): ORT / PyTorch median per-token time <= TARGET_RATIO."""
    return [{"target": f"{r['bias']} context {r['context']}: ORT <= {TARGET_RATIO:g}x PyTorch eager per token",
             "measured": r["ort_over_torch"], "met": r["ort_over_torch"] <= TARGET_RATIO} for r in rows]


GPU_TARGET_SPEEDUP = 1.5  # ORT CUDA tokens/s >= 1.5x PyTorch CUDA eager's


def gpu_targets(rows: list[dict]) -> list[dict]:
    return [{"target": f"{r['bias']} context {r['context']}: ORT CUDA tokens/s >= {GPU_TARGET_SPEEDUP:g}x PyTorch CUDA eager",
             "measured": r["ort_tokens_per_s"] / r["torch_tokens_per_s"],
             "met": r["ort_tokens_per_s"] >= GPU_TARGET_SPEEDUP * r["torch_tokens_per_s"]} for r in rows]


def write_decode(rows: list[dict], out_dir: Path, contexts, steps: int, device: str = "cpu") -> None:
    """decode.md/.json (CPU) or gpu_decode.md/.json (CUDA): the rows, the machine, the targets."""
    out_dir.mkdir(parents=True, exist_ok=True)
    machine, cfg, gpu = environment(), ModelConfig(), device == "cuda"
    checks = gpu_targets(rows) if gpu else targets(rows)
    stem = "gpu_decode" if gpu else "decode"
    model = f"Model: the default decoder (dim {cfg.dim}, {cfg.num_heads} heads, {cfg.num_layers} layers, byte vocab), float32"
    where = "ORT CUDA" if gpu else "ORT"
    torch_side = "PyTorch CUDA" if gpu else "PyTorch"
    if gpu:
        target = rows[0]["target"] if rows else "portable"
        head = ["# Decode on the GPU: ONNX Runtime CUDA vs PyTorch CUDA eager, KV cache", "",
                f"Generated by `python -m posbias_export bench-decode --device cuda --target {target} --contexts "
                f"{','.join(map(str, contexts))} --steps {steps}`.",
                f"{model} (TF32 off on both sides), batch 1. ONNX Runtime keeps the cache on the GPU between steps "
                "(IOBinding, outputs bound to the next step's inputs); each step's logits come back to the host on both "
                "sides."]
        ratio_name, ratio = "ORT / PyTorch tokens/s", lambda r: r["ort_tokens_per_s"] / r["torch_tokens_per_s"]
    else:
        head = ["# Decode benchmark: ONNX Runtime vs PyTorch eager, KV cache", "",
                f"Generated by `python -m posbias_export bench-decode --contexts {','.join(map(str, contexts))} "
                f"--steps {steps}`.",
                f"{model}, batch 1. Prefill of the context is untimed; then single-token steps with a growing cache,",
                "ORT and PyTorch alternating in chunks of 16 kept steps (after 8 settling steps each) in the same "
                "process. Ratio < 1: ONNX Runtime is faster."]
        ratio_name, ratio = "ORT / PyTorch", lambda r: r["ort_over_torch"]
    header = ["bias", "context", f"{where} ms/token (median, min)", f"{torch_side} ms/token (median, min)",
              "ORT tokens/s", "PyTorch tokens/s", ratio_name]
    lines = head + [describe(machine), ""] + md_table(header, [
        [r["bias"], r["context"], f"{r['ort_ms_median']:.2f}, {r['ort_ms_min']:.2f}", f"{r['torch_ms_median']:.2f}, "
         f"{r['torch_ms_min']:.2f}", f"{r['ort_tokens_per_s']:.0f}", f"{r['torch_tokens_per_s']:.0f}", f"{ratio(r):.2f}"]
        for r in rows])
    lines += targets_section([(t["target"], f"{t['measured']:.2f}x", t["met"]) for t in checks])
    write_results(out_dir, stem, {"machine": machine, "rows": rows, "targets": checks}, "\n".join(lines) + "\n")

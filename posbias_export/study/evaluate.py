"""Perplexity vs length through an exported ONNX model on ONNX Runtime, over non-overlapping
windows of the held-out split, cross-checked against PyTorch on the same windows."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..parity import load_model_file, reference_model
from .corpus import read_corpus, split

TOKENS_PER_BATCH = 8192  # windows per ORT call: keeps the [B, H, L, L] scores small


@dataclass
class LengthResult:
    length: int
    windows: int
    ort_ppl: float | None
    torch_ppl: float | None
    rel_diff: float | None
    ort_tokens_per_s: float | None
    note: str = ""


def windows_of(heldout: np.ndarray, length: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping windows from the start of the held-out text, [N, length] int64."""
    count = min(len(heldout) // length, max(1, max_tokens // length))
    return heldout[: count * length].astype(np.int64).reshape(count, length)


def mean_nll(logits: np.ndarray, windows: np.ndarray) -> tuple[float, int]:
    """Sum of next-byte negative log-likelihoods (float64) and the count, every position scored."""
    logits = logits[:, :-1].astype(np.float64)  # [N, L-1, V]: predicts bytes 1..L-1
    targets = windows[:, 1:]
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((log_z - picked).sum()), targets.size


def evaluate(model_path: str | Path, corpus: str | Path, lengths=(64, 128, 256, 512, 1024), max_tokens: int = 16384,
             checkpoint: str | None = None, torch_check: bool = True, progress=None,
             reference: torch.nn.Module | None = None) -> list[LengthResult]:
    """`reference`: the PyTorch model to cross-check with (default: rebuilt from the metadata)."""
    contract = load_model_file(model_path).contract
    if contract.arch != "lm" or contract.kv_cache:
        raise ValueError("evaluate needs a plain lm export (no --kv-cache, not a block)")
    cfg = contract.config
    limit = contract.max_positions
    heldout = split(read_corpus(corpus)[0])[1]
    too_long = [n for n in lengths if n > len(heldout)]
    if too_long:  # checked before any work: not even one window of that length exists
        raise ValueError(f"length {too_long[0]} is longer than the corpus's held-out split ({len(heldout)} bytes)")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    model = reference if reference is not None else (reference_model(contract, checkpoint) if torch_check else None)
    results = []
    for length in lengths:
        if limit is not None and length > limit:
            results.append(LengthResult(length, 0, None, None, None, None, f"beyond the learned position table ({limit})"))
            continue
        windows = windows_of(heldout, length, max_tokens)
        per_call = max(1, TOKENS_PER_BATCH // length)
        nll = count = 0.0
        torch_nll = 0.0
        elapsed = 0.0
        for start in range(0, len(windows), per_call):
            chunk = windows[start:start + per_call]
            t0 = time.perf_counter()
            logits = session.run(None, {"input_ids": chunk})[0]
            elapsed += time.perf_counter() - t0
            part, n = mean_nll(logits, chunk)
            nll, count = nll + part, count + n
            if model is not None:
                with torch.no_grad():
                    torch_nll += mean_nll(model(torch.from_numpy(chunk)).numpy(), chunk)[0]
        ort_ppl = float(np.exp(nll / count))
        torch_ppl = float(np.exp(torch_nll / count)) if model is not None else None
        rel = abs(ort_ppl - torch_ppl) / torch_ppl if torch_ppl else None
        results.append(LengthResult(length, len(windows), ort_ppl, torch_ppl, rel, windows.size / elapsed))
        if progress:
            progress(1)
    return results


def as_json(results: list[LengthResult]) -> list[dict]:
    return [asdict(r) for r in results]


def format_results(results: list[LengthResult]) -> str:
    """The terminal table of `evaluate`."""
    lines = [f"{'length':>7} {'windows':>7} {'ORT ppl':>9} {'torch ppl':>9} {'rel diff':>9} {'ORT tok/s':>10}"]
    for r in results:
        if r.ort_ppl is None:
            lines.append(f"{r.length:>7} {'-':>7} {r.note}")
        else:
            lines.append(f"{r.length:>7} {r.windows:>7} {r.ort_ppl:>9.4f} {r.torch_ppl:>9.4f} {r.rel_diff:>9.1e} "
                         f"{r.ort_tokens_per_s:>10.0f}")
    return "\n".join(lines)


def evaluate_to_files(model_path, corpus, lengths=(64, 128, 256, 512, 1024), max_tokens: int = 16384,
                      checkpoint=None, json_path=None, progress=None) -> list[LengthResult]:
    """`evaluate`: the results, also written as JSON when asked (outputs checked before any work)."""
    from ..export.files import check_outputs, write_text_atomic

    check_outputs([json_path], [model_path, corpus, checkpoint])
    results = evaluate(model_path, corpus, lengths, max_tokens, checkpoint, progress=progress)
    if json_path:
        write_text_atomic(json_path, json.dumps(as_json(results), indent=1))
    return results

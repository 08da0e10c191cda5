"""Byte-level training on a text corpus, on the CPU: deterministic for a seed, tqdm progress,
safetensors checkpoint plus a model card (config, corpus and its hash, steps, seed, command,
final loss). Held-out text is the last 10% of the corpus, never trained on."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from ..biases import BIASES, NO_BIAS, bias_class
from ..export.files import check_outputs, write_text_atomic
from ..nn import ModelConfig, build_model, non_finite_tensor, save_checkpoint
from .corpus import HELDOUT_FRACTION, read_corpus, split

# Position schemes that are not bias families: no bias, plus a position encoding. With the
# families these are the names models/ uses.
SCHEMES = {"rope": {"bias": NO_BIAS, "rope": True}, "sinusoidal": {"bias": NO_BIAS, "position": "sinusoidal"},
           "learned": {"bias": NO_BIAS, "position": "learned"}}


def scheme_fields(scheme: str, train_len: int) -> dict:
    """ModelConfig fields for a bias family or a scheme trained at `train_len`."""
    if scheme in SCHEMES:
        fields = dict(SCHEMES[scheme])
    elif scheme in BIASES:
        fields = {"bias": scheme, "bias_params": bias_class(scheme).params_for_training(train_len)}
    else:
        raise ValueError(f"unknown bias or scheme {scheme!r}; choose one of: {', '.join(BIASES + tuple(SCHEMES))}")
    if fields.get("position") == "learned":
        fields["max_positions"] = train_len  # a table as long as training: beyond it, resize or refuse
    return fields


def scheme_of(cfg: ModelConfig) -> str:
    """The scheme name of a config: its bias family, or the position encoding it adds."""
    if cfg.bias != NO_BIAS or cfg.position == "none" and not cfg.rope:
        return cfg.bias
    return "rope" if cfg.rope else cfg.position


def train(cfg: ModelConfig, corpus: str | Path, train_len: int = 64, steps: int = 2000, batch: int = 32,
          lr: float = 3e-3, seed: int = 0, progress: bool = True) -> tuple[torch.nn.Module, dict]:
    if train_len < 2 or steps < 1 or batch < 1 or not (lr > 0 and math.isfinite(lr)):
        raise ValueError("train_len >= 2, steps >= 1, batch >= 1 and a finite lr > 0 are required")
    data, digest = read_corpus(corpus)
    train_data = torch.from_numpy(split(data)[0].astype(np.int64))
    if len(train_data) <= train_len + 1:
        raise ValueError(f"corpus too small for train_len {train_len}")
    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    from tqdm import tqdm

    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"train {cfg.bias}/{cfg.position}{'+rope' if cfg.use_rope else ''}", disable=not progress or None)
    for step in bar:
        offsets = torch.randint(0, len(train_data) - train_len - 1, (batch,), generator=gen)
        windows = torch.stack([train_data[o:o + train_len + 1] for o in offsets.tolist()])  # [B, T+1]
        logits = model(windows[:, :-1])  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):  # diverged (lr far too large): nothing worth saving
            raise ValueError(f"training diverged at step {step + 1} (loss {losses[-1]}): lower --lr (got {lr:g}); "
                             "no checkpoint written")
        if step % 50 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    model.eval()
    bad = non_finite_tensor(model)
    if bad:
        raise ValueError(f"training left NaN or infinity in {bad}: lower --lr (got {lr:g}); no checkpoint written")
    card = {
        "config": cfg.to_dict(), "corpus": Path(corpus).name, "corpus_sha256": digest, "corpus_bytes": int(len(data)),
        "heldout": f"last {HELDOUT_FRACTION:.0%} of the corpus", "train_len": train_len, "steps": steps,
        "batch": batch, "lr": lr, "seed": seed, "final_loss": float(np.mean(losses[-50:])),
        "train_seconds": round(time.perf_counter() - start, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    return model, card


def save_trained(model: torch.nn.Module, card: dict, out: str | Path, command: str) -> None:
    """<out>.safetensors (card in its metadata) and <out>.md, a readable model card."""
    out = Path(out)
    card = {**card, "command": command}
    save_checkpoint(model, out.with_suffix(".safetensors"), extra={"posbias.card": json.dumps(card, sort_keys=True)})
    cfg = card["config"]
    scheme = scheme_of(model.cfg)
    lines = [f"# Model card: {out.name}", "", f"Position scheme: **{scheme}**. Byte-level decoder LM "
             f"({card['params']:,} parameters: dim {cfg['dim']}, {cfg['num_heads']} heads, {cfg['num_layers']} layers).", "",
             "| field | value |", "|---|---|"]
    for key in ("corpus", "corpus_sha256", "corpus_bytes", "heldout", "train_len", "steps", "batch", "lr", "seed",
                "final_loss", "train_seconds", "command"):
        lines.append(f"| {key} | `{card[key]}` |")
    lines += ["", "Config:", "", "```json", json.dumps(cfg, indent=1, sort_keys=True), "```", ""]
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines))


def train_to_files(scheme: str, corpus: str | Path, out: str | Path, *, train_len: int = 64, steps: int = 600,
                   batch: int = 32, lr: float = 3e-3, seed: int = 0, heads: int = 4, dim: int = 128, layers: int = 2,
                   command: str = "") -> tuple[Path, dict]:
    """`train`: a model of `scheme` (a bias family or a position scheme) trained on the corpus,
    saved as <out>.safetensors and <out>.md; outputs are checked before any training."""
    fields = scheme_fields(scheme, train_len)
    out = Path(out)
    paths = [out.with_suffix(".safetensors"), out.with_suffix(".md")]
    check_outputs(paths, [corpus])
    cfg = ModelConfig(num_heads=heads, dim=dim, num_layers=layers, **fields)
    model, card = train(cfg, corpus, train_len, steps, batch, lr, seed)
    save_trained(model, card, out, command)
    return paths[0], card

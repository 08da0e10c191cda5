"""The PyTorch side of generation, for the tests: greedy decoding with the same KV cache and left
padding as runtimes/ort/generate.py, the reference that ONNX Runtime must match token for token."""
from __future__ import annotations

import torch

from posbias_export.nn import DecoderLM


@torch.no_grad()
def greedy_generate(model: DecoderLM, prompts: list[bytes], max_new_tokens: int) -> list[bytes]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt))
        mask[row, width - len(prompt):] = 1
    past = model.empty_past(len(prompts), next(model.parameters()).dtype)
    out = torch.zeros(len(prompts), max_new_tokens, dtype=torch.int64)
    for step in range(max_new_tokens):
        logits, past = model.step(ids, mask, past)  # [B, L, V]
        ids = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out[:, step] = ids[:, 0]
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.int64)], dim=1)
    return [bytes(row.tolist()) for row in out]

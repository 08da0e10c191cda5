#!/usr/bin/env python3
"""Greedy encoder-decoder generation (T5) with two exported files on ONNX Runtime:

    encoder.onnx: input_ids, attention_mask [B, Le] -> last_hidden_state [B, Le, D]
    decoder.onnx: input_ids [B, L], attention_mask [B, P+L], encoder_hidden_states,
                  encoder_attention_mask, past_key.N / past_value.N -> logits, presents

onnxruntime and numpy only; used from Python (greedy_generate), as the tests do. The encoder
runs once; each step feeds the decoder one token and its cache.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.loading import load_runner  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402

create_session = load_runner("ort/run.py").create_session


def greedy_generate(encoder_path: str, decoder_path: str, input_ids: np.ndarray, attention_mask: np.ndarray,
                    max_new_tokens: int, start_token: int = 0, min_new_tokens: int = 0, eos_token: int | None = None,
                    provider: str = "cpu") -> np.ndarray:
    """input_ids, attention_mask [B, Le] int64 -> generated tokens [B, max_new_tokens] (greedy;
    `eos_token` is forbidden for the first `min_new_tokens` steps, as transformers does)."""
    encoder, decoder = create_session(encoder_path, provider), create_session(decoder_path, provider)
    names = {i.name: i for i in decoder.get_inputs()}
    if "encoder_hidden_states" not in names or "past_key.0" not in names:
        raise RunnerError(f"{decoder_path} is not a cached T5 decoder (export it with --model DIR --part decoder)")
    layers = sum(1 for n in names if n.startswith("past_key."))
    heads, head_dim = names["past_key.0"].shape[1], names["past_key.0"].shape[3]
    batch = input_ids.shape[0]
    states = encoder.run(None, {"input_ids": input_ids, "attention_mask": attention_mask})[0]
    past = [np.zeros((batch, heads, 0, head_dim), np.float32) for _ in range(2 * layers)]
    step = np.full((batch, 1), start_token, np.int64)
    tokens = []
    for index in range(max_new_tokens):
        feeds = {"input_ids": step, "attention_mask": np.ones((batch, index + 1), np.int64),
                 "encoder_hidden_states": states, "encoder_attention_mask": attention_mask}
        feeds.update({f"past_{kind}.{i // 2}": past[i] for i, kind in zip(range(2 * layers), ["key", "value"] * layers)})
        logits, *past = decoder.run(None, feeds)
        last = logits[:, -1]
        if eos_token is not None and index < min_new_tokens:
            last[:, eos_token] = -np.inf
        step = last.argmax(-1)[:, None].astype(np.int64)
        tokens.append(step)
    return np.concatenate(tokens, axis=1)

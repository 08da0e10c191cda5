"""An embedder folder's engine: texts (or token ids) in, one normalised vector each out, the inputs
of concurrent requests grouped into batches by a token budget.

A batch of inputs padded to its longest costs (rows x longest) tokens of activations (our file's
attention is blocked, so memory is linear in that product: 1.29 GB for jina-v2-base at 8192 tokens,
benchmarks/embedders.md). `token_batches` packs the waiting inputs, shortest first, into batches
whose padded size stays within the budget; an input longer than the budget runs alone (never
refused below the model's maximum). Pooling is the folder's (mean over the mask, or CLS), then L2
normalisation: what its clients (fastembed, sentence-transformers, transformers.js) compute.
"""
from __future__ import annotations

import numpy as np

from ..runners import runtimes_common
from .folder import ServedFolder


def runner(relative: str):
    """A runner script of runtimes/ as a module (no torch: a replica is numpy and onnxruntime)."""
    return runtimes_common("loading").load_runner(relative)

# bytes of working memory one token of a padded batch costs at jina-v2-base's width (hidden 768, 12
# heads): its activations and the feed-forward's (~60 KB) and its share of an attention block's scores
# (12 heads x 256 rows x 4 bytes x ~4 live copies, ~50 KB). Scaled by hidden size for other widths.
BYTES_PER_TOKEN_AT_768 = 110_000
# On a CPU a padded batch of more tokens than this costs more per input, not less: jina-v2-base on
# 2 EPYC cores takes 0.233 s for 1 x 128 tokens, 0.237 s an input at 4 x 128, 0.277 at 16 x 128;
# 1.19 s for 1 x 512, 1.31 an input at 2 x 512, 1.75 at 4 x 512 (the activations leave the caches).
# Short inputs still share a batch (and a request's overhead); a long one runs alone.
CPU_BATCH_TOKENS = 512


def default_budget(context: int, hidden: int, available: int) -> int:
    """Tokens per batch: the machine's free memory's bound (a quarter of it over the bytes a token
    costs) or CPU_BATCH_TOKENS, the smaller. An input longer than the budget runs alone (token_batches),
    up to the model's context: the budget groups inputs, it never refuses one."""
    per_token = BYTES_PER_TOKEN_AT_768 * max(hidden, 1) / 768
    return int(max(1, min(CPU_BATCH_TOKENS, available // 4 / per_token)))


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped so that each group's rows x longest <= budget (an input longer
    than the budget alone), shortest first (rows padded to similar lengths waste least)."""
    batches, current, longest = [], [], 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = max(lengths[index], 1)
        if current and max(longest, n) * (len(current) + 1) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, n)
    return batches + ([current] if current else [])


class EmbedderEngine:
    """One replica's model: a session over the folder's file and its tokenizer."""

    def __init__(self, folder: ServedFolder, threads: int = 0):
        from tokenizers import Tokenizer

        self.folder = folder
        self.session = runner("ort/run.py").create_session(str(folder.files["model"]), "cpu", threads)
        self.inputs = {i.name for i in self.session.get_inputs()}
        if any(name.startswith("past_key_values.") for name in self.inputs):  # the folder's files disagree
            raise ValueError(f"{folder.files['model']} takes a KV cache (a decoder's file) beside modules.json "
                             "(an embedder's): write the folder again with --out-dir")
        self.tokenizer = Tokenizer.from_file(str(folder.files["tokenizer"]))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.vocab = self.tokenizer.get_vocab_size()
        self.dimension = self.session.get_outputs()[0].shape[-1]
        # activations scaled per call (int8 from quantize_dynamic): an input's vector would depend on
        # the others padded beside it, so each input runs alone (common/graph_facts.py)
        facts = runtimes_common("graph_facts").read_graph_facts(folder.files["model"])
        self.inputs_apart = facts is not None and facts.scales_per_call

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """One padded batch (right padding, as embedding servers batch) -> [N, D] float32, pooled
        and L2-normalised."""
        width = max(max(len(r) for r in rows), 1)
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros_like(ids)
        for k, row in enumerate(rows):
            ids[k, :len(row)], mask[k, :len(row)] = row, 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        states = self.session.run(None, {k: v for k, v in feeds.items() if k in self.inputs})[0]  # [N, L, D]
        if self.folder.pooling == "cls":
            pooled = states[:, 0]
        else:
            weights = mask[..., None].astype(np.float32)
            pooled = (states * weights).sum(1) / np.maximum(weights.sum(1), 1.0)
        norms = np.linalg.norm(pooled, axis=-1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)

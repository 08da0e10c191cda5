"""The parity policy for a quantized embedder (an encoder file alone, --quantize int8 / int4).

What an embedding user is given is not each hidden state but the embedding: the mean of the valid
tokens' last hidden states, L2-normalised (what sentence-transformers, fastembed and transformers.js
compute from the file). So a quantized embedder is judged per row of the batch on the cosine of
its embedding to the float64 reference's, on the same tokens:
- int8 >= 0.99, int4 >= 0.97 (the scheme's Policy.min_cosine). A cosine c moves a normalised
  embedding by sqrt(2 (1 - c)): 0.14 and 0.24 of its length, small beside the distances between
  unrelated texts' embeddings (cosines of 0.2-0.8), so rankings by similarity hold. Published
  quantized embedders sit at these figures: a careful int8 embedder measures min cosine 0.987 to
  float, block-32 int4 0.93-0.95 on a decoder-class embedder with activation outliers; fastembed's
  own parity checks accept 0.90. We promise more, as BERT-sized encoders reach it.
- the worst per-token cosine is reported, not judged (one token's state may move more than the
  mean of hundreds).
A NaN anywhere fails.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..export.quantize.schemes import SCHEMES


@dataclass
class EmbeddingParity:
    scheme: str
    cosine_min: float
    cosine_mean: float
    token_cosine_min: float
    budget_cosine: float
    passed: bool
    nan: bool

    def as_dict(self) -> dict:
        return asdict(self)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two [N, D] arrays."""
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def pooled(states: np.ndarray, rows: np.ndarray, batch: int) -> np.ndarray:
    """[N, D] valid tokens' states of a batch (rows: each token's row) -> [B, D] mean per row."""
    sums = np.zeros((batch, states.shape[-1]))
    np.add.at(sums, rows, states)
    return sums / np.bincount(rows, minlength=batch)[:, None]


def judge(actual: np.ndarray, ref: np.ndarray, keep: np.ndarray, scheme: str) -> EmbeddingParity:
    """A quantized encoder's states on the valid tokens `actual` [N, D] against the float64
    reference's `ref` [N, D]; keep [B, L]: which positions they are."""
    budget = SCHEMES[scheme].policy.min_cosine
    actual, ref = np.asarray(actual, np.float64), np.asarray(ref, np.float64)
    if actual.shape != ref.shape:
        raise ValueError(f"shape mismatch: runtime gave {actual.shape}, reference {ref.shape}")
    if np.isnan(actual).any():
        nan = float("nan")
        return EmbeddingParity(scheme, nan, nan, nan, budget, False, True)
    rows = np.nonzero(keep)[0]
    got = cosines(pooled(actual, rows, keep.shape[0]), pooled(ref, rows, keep.shape[0]))
    return EmbeddingParity(scheme, float(got.min()), float(got.mean()), float(cosines(actual, ref).min()), budget,
                           bool(got.min() >= budget), False)

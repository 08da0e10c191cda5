"""The parity policy for quantized files (--quantize int8 / int4): they cannot meet the float32
budget (their weights are rounded on purpose), so they are judged by what quantization
promises a user of a language model: the same predictions, the same perplexity.

The inputs are text the float model writes itself (`sampled_ids_cached`: tokens sampled at
temperature 1 from the float model), and the file's logits are measured against the float
model's (float64 reference, the same inputs), per position:
- KL(float || quantized), in nats, averaged over positions. On text drawn from the float
  model, the mean KL is exactly how many nats the quantized model's cross-entropy is higher,
  i.e. its perplexity on that text is exp(KL) times the float model's. So the budget is the
  perplexity promise written in nats: int8 within 1% (log 1.01 = 0.00995), int4 within 3%
  (log 1.03 = 0.0296), the figures ONNX Runtime's quantizers reach with their defaults on our
  trained ALiBi checkpoint (+0.1% int8, +0.9% int4 on held-out text). (Uniformly random
  tokens are not such text: there a trained model is off its distribution and int4's KL
  measured 0.017-0.030 on the ALiBi checkpoint; they would judge the inputs, not the file.)
- top-1 agreement on positions where the float model is decided (its top token at least
  0.5 probability): there a quantized file must pick the same token in 99% (int8) / 95%
  (int4) of positions. Positions where the float model hesitates flip under any noise and
  say nothing; a file with no decided position is judged by KL alone. A handful of decided
  positions (a short case) cannot show a rate: the file fails only when the 95% Wilson
  upper bound of its agreement is below the budget (1 flip in 12 passes, 0 in 12 fails).
- the largest logit error relative to the logit scale (std of the float logits): reported,
  not judged (a single outlier logit in an unlikely token does not change a prediction).
A NaN anywhere fails. Perplexity on held-out text is measured by `bench-quant`
(benchmarks/quantized.md) against the same 1% / 3% targets.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..export.quantize.schemes import SCHEMES


POLICIES = {name: cls.policy for name, cls in SCHEMES.items()}  # each scheme's class holds its own


@dataclass
class QuantizedParity:
    scheme: str
    kl_mean: float
    kl_max: float
    top1_decided: float | None  # None: no decided position
    decided_positions: int
    top1_all: float
    logit_error_rel: float
    budget_kl: float
    budget_top1: float
    passed: bool
    nan: bool

    def as_dict(self) -> dict:
        return asdict(self)


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def judge(actual: np.ndarray, ref: np.ndarray, scheme: str) -> QuantizedParity:
    """A quantized file's logits `actual` against the float reference `ref` (same shape, last
    axis the vocabulary), under the scheme's policy."""
    policy = POLICIES[scheme]
    actual = np.asarray(actual, np.float64)
    ref = np.asarray(ref, np.float64)
    if actual.shape != ref.shape:
        raise ValueError(f"shape mismatch: runtime gave {actual.shape}, reference {ref.shape}")
    a, r = actual.reshape(-1, actual.shape[-1]), ref.reshape(-1, ref.shape[-1])
    nan = bool(np.isnan(a).any())
    if nan or not r.size:
        return QuantizedParity(scheme, float("nan") if nan else 0.0, float("nan") if nan else 0.0, None, 0,
                               0.0, float("nan") if nan else 0.0, policy.max_kl, policy.min_top1, not nan, nan)
    lr, la = log_softmax(r), log_softmax(a)
    kl = (np.exp(lr) * (lr - la)).sum(-1)  # [positions]
    same = r.argmax(-1) == a.argmax(-1)
    decided = np.exp(lr.max(-1)) >= policy.decided
    top1 = float(same[decided].mean()) if decided.any() else None
    scale = float(r.std()) or 1.0
    top1_ok = top1 is None or wilson_upper(top1, int(decided.sum())) >= policy.min_top1
    passed = float(kl.mean()) <= policy.max_kl and top1_ok
    return QuantizedParity(scheme, float(kl.mean()), float(kl.max()), top1, int(decided.sum()), float(same.mean()),
                           float(np.abs(a - r).max() / scale), policy.max_kl, policy.min_top1, passed, nan)


def wilson_upper(rate: float, n: int, z: float = 1.96) -> float:
    """Upper end of the Wilson score interval of a proportion `rate` seen in `n` trials."""
    centre = rate + z * z / (2 * n)
    spread = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return (centre + spread) / (1 + z * z / n)


@torch.no_grad()
def sampled_ids_cached(lm: torch.nn.Module, batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """[batch, length] int64 tokens the model writes itself: a uniformly drawn first token, then
    each next one sampled at temperature 1, through the model's cache path (one token per step;
    ours and the imported decoders, whose cache equals the full forward by test): linear, not
    quadratic, in `length` (1024 tokens: seconds instead of ~50 s recomputing every prefix)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, 1), generator=gen)
    past, out = lm.empty_past(batch), [ids]
    while sum(t.shape[1] for t in out) < length:
        total = sum(t.shape[1] for t in out)
        logits, past = lm.step(out[-1], torch.ones(batch, total, dtype=torch.int64), past)
        out.append(torch.multinomial(torch.softmax(logits[:, -1].double(), -1), 1, generator=gen))
    return torch.cat(out, 1).numpy().astype(np.int64)

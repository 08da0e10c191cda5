"""The parity policy: how far a runtime may be from the float64 reference, and the measurement
(numbers here, verdicts returned to callers).

Policy: measure every runtime against a float64 PyTorch reference. A runtime
passes when, elementwise, |out - ref64| <= factor * E32 + atol + rtol * |ref64|, where E32 is
the max abs error of PyTorch float32 against the same float64 reference on the same inputs:
the error that float32 arithmetic itself makes on this model and input. A runtime executing
the same graph in float32 differs from PyTorch only in accumulation order and kernel
rounding, which is of the same size, hence factor 4 for headroom; atol is a floor for
outputs where PyTorch happens to be nearly exact; rtol scales with the output.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    factor: float = 4.0
    atol: float = 1e-5
    rtol: float = 1e-5
    why: str = "float32: same graph, different kernels and accumulation order"


FLOAT32 = Tolerance()
# float16 (weights and activations in fp16; scores, bias and softmax stay float32): judged
# against E16, PyTorch float16's own error vs float64 on the same inputs. Both round to fp16
# at the same points; kernels may accumulate in different precisions, hence factor 2, and
# a floor of 1e-3 (about 2 fp16 ulps at |x| ~ 1). Measured at L=2048 (dim 128, 2 layers):
# ORT fp16 error ~1.2e-3, PyTorch fp16 ~1.8e-3, logits up to ~2.4.
FLOAT16 = Tolerance(factor=2.0, atol=1e-3, rtol=1e-3, why="float16 vs float64, relative to PyTorch float16's own error")


# OpenVINO's bf16 mode: judged against PyTorch bfloat16's own error (unit roundoff 2^-8).
BFLOAT16 = Tolerance(factor=2.0, atol=1e-2, rtol=1e-2, why="bfloat16 inference vs float64, relative to PyTorch bfloat16's error")


# CUDA's TF32 matmuls (float32 range, 10 explicit mantissa bits: unit roundoff 2^-11, as in
# float16): judged against PyTorch float16's own error. float16 rounds every weight and
# activation to 10 bits, TF32 only the matmul inputs, so E16 bounds TF32's error from above;
# the floor is float16's. Measured on an H100 (onnxruntime-gpu 1.31): TF32 errors 7e-4 to
# 1.1e-3 on the default LM exports at up to 4096 tokens, where float32 gives ~1e-6.
TF32 = Tolerance(factor=2.0, atol=1e-3, rtol=1e-3, why="TF32 matmuls vs float64, relative to PyTorch float16's error")


@dataclass
class Parity:
    max_abs: float
    max_rel: float
    where: tuple[int, ...]  # index of the worst element (largest excess over the budget)
    budget_abs: float  # allowed abs error at that index
    torch32_err: float
    passed: bool
    nan: bool

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        verdict = "pass" if self.passed else "FAIL"
        return (f"{verdict}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} at {self.where} "
                f"(budget there {self.budget_abs:.3g}; torch fp32 err {self.torch32_err:.3g})")


def compare(actual: np.ndarray, ref64: np.ndarray, torch32: np.ndarray | None, tol: Tolerance = FLOAT32) -> Parity:
    """Measure `actual` against the float64 reference and judge it under `tol`; `torch32` is
    PyTorch's output in the runtime's precision (float32, or float16 for FLOAT16)."""
    actual = np.asarray(actual, dtype=np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    if actual.shape != ref64.shape:
        raise ValueError(f"shape mismatch: runtime gave {actual.shape}, reference {ref64.shape}")
    e32 = float(np.max(np.abs(np.asarray(torch32, np.float64) - ref64))) if torch32 is not None and ref64.size else 0.0
    err = np.abs(actual - ref64)
    budget = tol.factor * e32 + tol.atol + tol.rtol * np.abs(ref64)
    nan = bool(np.isnan(actual).any())
    if ref64.size == 0:
        return Parity(0.0, 0.0, (), 0.0, e32, not nan, nan)
    excess = np.where(np.isnan(err), np.inf, err - budget)
    worst = np.unravel_index(int(np.argmax(excess)), err.shape)
    rel = err / np.maximum(np.abs(ref64), 1e-12)
    return Parity(
        max_abs=float(np.nanmax(err)) if not nan else float("nan"),
        max_rel=float(np.nanmax(rel)) if not nan else float("nan"),
        where=tuple(int(i) for i in worst),
        budget_abs=float(budget[worst]),
        torch32_err=e32,
        passed=(not nan) and bool(np.all(excess <= 0)),
        nan=nan,
    )

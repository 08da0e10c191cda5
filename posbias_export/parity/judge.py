"""The judge: ONE routine that turns runtime outputs into verdicts, for every kind of matrix.

A matrix is cases x runtimes. What differs between our own files, an imported model's files and
a T5 encoder-decoder is only how the cases and their references are built (parity/matrix.py,
hf/validate.py, hf/validate_seq2seq.py) and how a runtime's outputs are obtained (one file's
runner, or an encoder's outputs fed to a decoder); the judging is this module's:

    for each runtime run:  for each case:  reference.select(output) -> policy.judge(...) -> Cell

A `Reference` is typed: the float64 outputs on the judged positions, PyTorch's own outputs in
the precisions a policy may ask for (the floor of parity/tolerance.py), and how the judged
positions are picked out of a runtime's output (real tokens of a left-padded batch, a file that
returns the last position only). A policy is float (tolerance.py), quantized (quantized.py)
or, for a quantized embedder, on its embeddings (embedding.py).
"""
from __future__ import annotations

import dataclasses

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from .runs import NOT_RUN, Cell, Matrix, RuntimeRun
from .embedding import judge as judge_embedding
from .quantized import judge as judge_quantized
from .tolerance import BFLOAT16, FLOAT16, FLOAT32, TF32, Tolerance, compare

Floor = np.ndarray | Callable[[], np.ndarray]


@dataclass
class Reference:
    """What one case's outputs are judged against.

    ref64: the float64 reference on the judged positions ([N, ...] when `keep` picks them,
    else the output's own shape). floors: precision name ("float32", "float16", "bfloat16")
    -> PyTorch's output in that precision on the same positions, or a function computing it
    (made on first use: most runs never ask for bfloat16). keep: [B, L] bool, the positions
    judged (None: the whole output). last: the file returns the last position only
    ([B, 1, ...]), placed at the last column of `keep`."""

    ref64: np.ndarray
    floors: dict[str, Floor] = field(default_factory=dict)
    keep: np.ndarray | None = None
    last: bool = False

    def floor(self, precision: str) -> np.ndarray | None:
        value = self.floors.get(precision)
        if callable(value):
            value = self.floors[precision] = value()
        return value

    def select(self, got: np.ndarray) -> np.ndarray | str:
        """The judged part of a runtime's output, or an error line."""
        if self.keep is None:
            if got.shape != self.ref64.shape:
                return f"error: output has shape {list(got.shape)}, expected {list(self.ref64.shape)}"
            return got
        rows, cols = self.keep.shape
        shape = list(got.shape)
        if self.last and got.shape[:2] == (rows, 1):  # [B, 1, V] -> [B, L, V] with the last column filled
            got = np.concatenate([np.zeros((rows, cols - 1, *got.shape[2:]), got.dtype), got], 1)
        if got.shape[:2] != (rows, cols) or got[self.keep].shape != self.ref64.shape:
            return (f"error: output has shape {shape}, expected [{rows}, {cols}"
                    f"{''.join(f', {d}' for d in self.ref64.shape[1:])}]")
        return got[self.keep]


@dataclass
class Case:
    name: str  # "L=17 B=3", or the user's inputs file
    feeds: dict[str, np.ndarray]  # what a runtime is fed (a pipeline's first file)
    reference: Reference


@dataclass(frozen=True)
class FloatPolicy:
    """parity/tolerance.py: a runtime's error within a multiple of PyTorch's own error in the
    runtime's precision (the file's dtype; bfloat16 for OpenVINO's bf16 mode; TF32 judged
    against float16, which bounds it), plus a floor. `tolerances`: a fixed tolerance per case
    name (transformers' row, whose ALiBi floor grows with the length)."""

    dtype: str = "float32"
    tolerances: dict[str, Tolerance] = field(default_factory=dict)
    # a float32 file whose attention and cache are float16 (--kv-dtype float16): judged as a
    # float16 file, against PyTorch float16's error, which rounds all that this file rounds and more
    float16_cache: bool = False
    # per case: float32 rounding the file's own graph makes and PyTorch's floor does not see (an
    # absolute-position key row: hf/validate.py), added to a float32 runtime's floor
    extra_atol: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.dtype}, float16 cache" if self.float16_cache else self.dtype

    def judge(self, precision: str, got: np.ndarray, reference: Reference, case: str):
        if self.float16_cache:
            return compare(got, reference.ref64, reference.floor("float16"), FLOAT16)
        if case in self.tolerances:
            return compare(got, reference.ref64, reference.floor(self.dtype), self.tolerances[case])
        if precision == "bfloat16":
            return compare(got, reference.ref64, reference.floor("bfloat16"), BFLOAT16)
        if precision == "tf32" and self.dtype == "float32":  # a float16 file has no float32 matmul
            return compare(got, reference.ref64, reference.floor("float16"), TF32)
        tol = FLOAT16 if self.dtype == "float16" else FLOAT32
        if self.dtype == "float32" and self.extra_atol.get(case):
            tol = dataclasses.replace(tol, atol=tol.atol + self.extra_atol[case],
                                      why=f"{tol.why}; + {self.extra_atol[case]:.2g} for the file's absolute key row")
        return compare(got, reference.ref64, reference.floor(self.dtype), tol)


@dataclass(frozen=True)
class QuantizedPolicy:
    """parity/quantized.py: the scheme's perplexity and top-1 promise against float64 logits; an
    embedder's (embeddings=True: a quantized encoder alone) parity/embedding.py: its pooled
    embeddings by cosine to float64's."""

    dtype: str
    scheme: str
    embeddings: bool = False

    @property
    def label(self) -> str:
        return f"{self.dtype} {self.scheme}" + (" (embeddings)" if self.embeddings else "")

    def judge(self, precision: str, got: np.ndarray, reference: Reference, case: str):
        if self.embeddings:
            return judge_embedding(got, reference.ref64, reference.keep, self.scheme)
        return judge_quantized(got, reference.ref64, self.scheme)


def policy_for(dtype: str, scheme: str | None, embeddings: bool = False, float16_cache: bool = False):
    """embeddings: a quantized encoder alone is judged on what its users get from it;
    float16_cache: a float32 file with --kv-dtype float16 (quantized weights: the scheme's policy)."""
    return QuantizedPolicy(dtype, scheme, embeddings) if scheme else FloatPolicy(dtype, float16_cache=float16_cache)


def judge(matrix: Matrix, runs: Iterable[RuntimeRun], cases: list[Case], policy, order_label: str | None = None,
          progress=None) -> Matrix:
    """Every run's outputs on every case, judged under `policy`, appended to `matrix` as cells
    (then the run's order-protocol cells). An output that is a string is a verdict already (a
    reference row that cannot run a case: "not run: ...")."""
    for run in runs:
        for index, case in enumerate(cases):
            if run.problem:
                matrix.cells.append(Cell(run.name, case.name, policy.label, run.problem))
                continue
            got = run.outputs[index]
            if isinstance(got, str):
                matrix.cells.append(Cell(run.name, case.name, policy.label, got))
                continue
            got = case.reference.select(got)
            if isinstance(got, str):
                matrix.cells.append(Cell(run.name, case.name, policy.label, got))
                continue
            verdict = policy.judge(run.precision, got, case.reference, case.name)
            matrix.cells.append(Cell(run.name, case.name, policy.label, "pass" if verdict.passed else "FAIL",
                                     verdict.as_dict()))
        matrix.cells += run.order_cells(order_label or policy.label)
        if progress and run.runtime is not None:
            progress(1)
    return matrix


__all__ = ["NOT_RUN", "Case", "FloatPolicy", "QuantizedPolicy", "Reference", "judge", "policy_for"]

"""Count the subnormal floats a model's attention makes: the ONNX reference evaluator with every
Softmax, every MatMul and the fused attention ops (contrib_ops.py) watched, inside local functions,
Loop bodies and If branches too.

Why: a float32 below 2^-126 (float16: 2^-14) costs Intel cores a slow assist per operand in every
session that does not set session.set_denormal_as_zero, which no client sets. A softmax makes
them when a score sits 87-104 below its row's maximum (a far key under ALiBi); the MatMul with V
then reads them. Our files floor their scores so that none appears (biases/base.py: SCORE_FLOOR);
tests/test_subnormals.py holds them to it.

    counts = count_subnormals(onnx.load("model.onnx"), feeds)
    counts.softmax_outputs, counts.matmul_inputs, counts.fused_probabilities, counts.where()

numpy and onnx only, like the evaluator. The counts are the math's, not a runtime's: the values
ONNX Runtime computes differ from these by rounding, not by 10^-30.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx.reference.ops.op_matmul import MatMul
from onnx.reference.ops.op_softmax import Softmax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from contrib_ops import ContribEvaluator, GroupQueryAttention, MultiHeadAttention  # noqa: E402

# dtype -> (its bits as an unsigned integer, the exponent field's mask, the mantissa's mask)
_FIELDS = {np.dtype(np.float32): (np.uint32, 0x7F800000, 0x007FFFFF), np.dtype(np.float16): (np.uint16, 0x7C00, 0x03FF)}


def subnormals(x) -> int:
    """How many entries of x are subnormal (exponent field zero, mantissa not): read from the
    bits, so a thread that treats subnormal operands as zero (DAZ) still sees them. 0 for other
    dtypes."""
    x = np.asarray(x)
    if x.dtype not in _FIELDS:
        return 0
    unsigned, exponent, mantissa = _FIELDS[x.dtype]
    bits = np.ascontiguousarray(x).view(unsigned)
    return int(np.count_nonzero(((bits & exponent) == 0) & ((bits & mantissa) != 0)))


@dataclass
class Counts:
    softmax_outputs: int = 0  # subnormal probabilities out of Softmax nodes
    matmul_inputs: int = 0  # subnormal operands of MatMul nodes
    fused_probabilities: int = 0  # subnormal probabilities inside MultiHeadAttention / GroupQueryAttention
    values_seen: int = 0  # every probability and operand inspected
    by_op: Counter = field(default_factory=Counter)  # op type -> subnormals (MatMul's by operand: "MatMul[0]")

    @property
    def total(self) -> int:
        return self.softmax_outputs + self.matmul_inputs + self.fused_probabilities

    def where(self) -> str:
        parts = ", ".join(f"{op} {n}" for op, n in sorted(self.by_op.items()) if n)
        return f"{self.total} subnormal of {self.values_seen} values inspected ({parts or 'none'})"


_COUNTS: list[Counts] = []  # the counts being filled (one evaluation at a time, as the evaluator runs)


def _note(kind: str, op: str, x) -> None:
    n = subnormals(x)
    counts = _COUNTS[-1]
    counts.values_seen += np.asarray(x).size
    setattr(counts, kind, getattr(counts, kind) + n)
    counts.by_op[op] += n


class WatchedSoftmax(Softmax):
    op_domain = ""

    def _run(self, x, axis=None):
        (y,) = super()._run(x, axis=axis)
        _note("softmax_outputs", "Softmax", y)
        return (y,)


class WatchedMatMul(MatMul):
    op_domain = ""

    def _run(self, a, b):
        _note("matmul_inputs", "MatMul[0]", a)
        _note("matmul_inputs", "MatMul[1]", b)
        return super()._run(a, b)


class _WatchedFused:
    """The fused ops' probabilities and the values they multiply (their own MatMul with V)."""

    def probabilities(self, scores):
        probs = super().probabilities(scores)
        _note("fused_probabilities", type(self).__name__, probs)
        return probs

    def weighted(self, probs, v):
        _note("matmul_inputs", f"{type(self).__name__}.v", v)
        return super().weighted(probs, v)


class WatchedMultiHeadAttention(_WatchedFused, MultiHeadAttention):
    pass


class WatchedGroupQueryAttention(_WatchedFused, GroupQueryAttention):
    pass


# the evaluator finds an op by its class's name
for _op, _name in ((WatchedSoftmax, "Softmax"), (WatchedMatMul, "MatMul"), (WatchedMultiHeadAttention, "MultiHeadAttention"),
                   (WatchedGroupQueryAttention, "GroupQueryAttention")):
    _op.__name__ = _name


class WatchingEvaluator(ContribEvaluator):
    OPS = [WatchedSoftmax, WatchedMatMul, WatchedMultiHeadAttention, WatchedGroupQueryAttention]


def flushes_subnormals() -> bool:
    """Whether this thread reads and writes subnormal floats as zero (x86 FTZ/DAZ): ONNX Runtime
    sets both on the thread that creates a session with session.set_denormal_as_zero, for the rest
    of the process, so numpy here would then never make the values this module counts."""
    return float(np.exp(np.float32(-95.0))) == 0.0


def count_subnormals(model, feeds: dict[str, np.ndarray]) -> tuple[Counts, list[np.ndarray]]:
    """Run `model` (a ModelProto) on `feeds` with the reference evaluator and count the
    subnormal Softmax outputs, MatMul operands and fused-attention probabilities: (counts, outputs).
    In a process whose thread flushes subnormals (flushes_subnormals) the count runs in a fresh
    one, where numpy makes them as a client's session would."""
    if flushes_subnormals():
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_count_serialized, model.SerializeToString(), feeds).result()
    return _count(model, feeds)


def _count_serialized(model_bytes: bytes, feeds):
    import onnx

    return _count(onnx.load_from_string(model_bytes), feeds)


def _count(model, feeds):
    if flushes_subnormals():
        raise RuntimeError("this process flushes subnormal floats to zero: nothing could be counted")
    _COUNTS.append(Counts())
    try:
        outputs = WatchingEvaluator(model).run(None, feeds)
        return _COUNTS[-1], outputs
    finally:
        _COUNTS.pop()

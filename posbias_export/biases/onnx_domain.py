"""The `posbias` ONNX function domain (version 1) shared by the bias families' ONNX Script
functions, and the distance helper they call. Opset 18 ops only, so the functions run on
every runtime that runs our opset-18 models."""
from __future__ import annotations

from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

DOMAIN = "posbias"
VERSION = 1
STANDARD_DOMAINS = ("", "ai.onnx")
posbias = Opset(DOMAIN, VERSION)


@script(posbias, default_opset=op)
def RelativeDistance(q_pos: INT64, k_pos: INT64) -> FLOAT:
    """i - j as float32, [..., Lq] x [..., Lk] -> [..., Lq, Lk].

    PyTorch: (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).float()
    """
    rel = op.Sub(op.Unsqueeze(q_pos, [-1]), op.Unsqueeze(k_pos, [-2]))  # [..., Lq, Lk]
    return op.Cast(rel, to=1)  # FLOAT; exact for |i - j| < 2^24

"""Quantized weights, one module per job: the schemes a user names with --quantize (schemes.py:
options, flags, the policy that judges them, the ops that show them in a graph), the streamed
quantizers an export runs weight by weight (streamed.py for both schemes, streamed_int8.py's
skeleton for int8, slabs.py reading a weight a few rows at a time), the whole-file quantizer the
streamed ones are checked against (whole.py), and the in-place cache made int8 (kv_int8.py)."""
from .schemes import SCHEMES, Int4, Int8, Scheme, checked_scheme, coarser, scheme

__all__ = ["SCHEMES", "Int4", "Int8", "Scheme", "checked_scheme", "coarser", "scheme"]

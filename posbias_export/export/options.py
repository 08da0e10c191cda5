"""How to export: ONE value, built by the command line (or a caller of the API), carried by the
request to every pass. A new option is a field here and a flag in commands/export.py; the
passes read it from `request.options`. What a value cannot be is refused here in one line;
what a model cannot be exported as is refused by its spec (signature.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .quantize.schemes import Scheme

DTYPE_NAMES = ("float32", "float16")
LOGITS = ("all", "last")  # a cached decoder's logits: every position, or the last one (generation)
KV_DTYPES = ("float", "float16", "int8")  # a cached decoder's cache: the model's float dtype, float16
# with float32 weights (kv_float16.py), or int8 (kv_int8.py)


@dataclass(frozen=True)
class ExportOptions:
    opset: int | None = None  # None: the target's (targets.py)
    dtype: str = "float32"  # weights and activations; float16 keeps scores, bias and softmax in float32
    trace_len: int = 16
    target: str | None = "portable"  # portable, cuda, cuda-ort, ort (targets/); None: ship's default (hf/ship.py)
    attention: str | None = None  # blocked or plain; None: the opset's and target's default
    block: int | None = None  # blocked form: query rows per block
    inline_functions: bool = False  # the posbias.* functions expanded into standard ops
    check_growth: bool = True  # the second trace that catches initializers sized by the trace length
    attention_mask: bool = False  # an attention_mask [B, L] input (our own models)
    kv_cache: bool = False  # a cached decoder (prefill and decode in one file)
    logits: str = "all"  # "last": a cached decoder's last position only, [B, 1, V]
    quantize: Scheme | None = None  # int8 / int4 weights (schemes.py)
    part: str = "encoder"  # a T5 folder: which half
    context_length: int | None = None  # --out-dir: genai_config.json's context_length
    kv_dtype: str = "float"  # "float16" / "int8": an in-place file's KV cache (kv_float16.py, kv_int8.py)
    external_data: bool = False  # the tensors in <file>.data at any size (else only past files.EXTERNAL_DATA_THRESHOLD)

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if isinstance(self.trace_len, bool) or not isinstance(self.trace_len, int) or self.trace_len < 2:
            raise ValueError(f"trace_len must be an integer >= 2 (1 would specialize the axis), got {self.trace_len!r}")
        if self.logits not in LOGITS:
            raise ValueError(f"logits must be one of {', '.join(LOGITS)}, got {self.logits!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.quantize is not None and not isinstance(self.quantize, Scheme):
            raise ValueError(f"quantize must be a scheme (posbias_export.export.schemes.scheme('int4')), "
                             f"got {self.quantize!r}")

    @property
    def last_logits(self) -> bool:
        return self.logits == "last"

    def replace(self, **changes) -> "ExportOptions":
        return dataclasses.replace(self, **changes)


def options_from(options: ExportOptions | None, fields: dict) -> ExportOptions:
    """The API's convenience: an ExportOptions, or its fields as keywords (not both)."""
    if options is not None and fields:
        raise ValueError(f"give options or keyword options, not both ({', '.join(fields)})")
    if options is not None:
        return options
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ExportOptions)})
    if unknown:
        raise TypeError(f"unknown export option(s): {', '.join(unknown)}")
    return ExportOptions(**fields)

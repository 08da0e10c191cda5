"""ModelConfig: one small dataclass for the byte-level models this package builds and trains.

The bias family's own hyper-parameters live in `bias_params`, validated by the family (see
biases/); files and checkpoints written before that carried them as top-level fields
(`window`, `sandwich_dim`, ...), which `from_dict` still reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..biases import DEFAULT_BIAS, bias_class, hyper_parameter_fields, make_params
from .positions import POSITIONS, ROPE_SCALINGS

ARCHS = ("lm", "block", "attention")


@dataclass
class ModelConfig:
    bias: str = DEFAULT_BIAS
    num_heads: int = 4
    dim: int = 128
    num_layers: int = 2
    causal: bool = True
    vocab_size: int = 256  # byte-level
    mlp_ratio: int = 4
    rope: bool | None = None  # None: the family decides (on for window, Su's super-baseline)
    rope_base: float = 10000.0
    bias_params: dict = field(default_factory=dict)  # the family's hyper-parameters; defaults filled in
    position: str = "none"  # absolute encoding added to the embeddings: none, sinusoidal, learned
    max_positions: int = 1024  # learned table size
    rope_scaling: str = "none"  # none, linear (position interpolation), ntk (base scaling)
    rope_factor: float = 1.0
    logn_train_len: int = 0  # > 0: scale queries by max(1, log_{L_train}(n))

    def __post_init__(self):
        bias_class(self.bias)  # unknown names: ValueError listing the choices
        self.bias_params = make_params(self.bias, self.bias_params).as_dict()
        for name in ("num_heads", "dim", "num_layers", "vocab_size", "mlp_ratio", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.use_rope and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got dim/num_heads = {self.head_dim}")
        if not (self.rope_base > 1.0):
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {', '.join(POSITIONS)}, got {self.position!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        if not (self.rope_factor >= 1.0):
            raise ValueError(f"rope_factor must be >= 1, got {self.rope_factor}")
        if self.logn_train_len < 0 or self.logn_train_len == 1:
            raise ValueError(f"logn_train_len must be 0 (off) or >= 2, got {self.logn_train_len}")
        if self.position == "sinusoidal" and self.dim % 2:
            raise ValueError(f"sinusoidal positions need an even dim, got {self.dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def use_rope(self) -> bool:
        return bias_class(self.bias).uses_rope if self.rope is None else bool(self.rope)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        legacy = {f.metadata["legacy_key"]: (family, f.name) for family, f in hyper_parameter_fields()
                  if f.metadata.get("legacy_key")}
        params = dict(data.pop("bias_params", None) or {})
        for key, (family, param) in legacy.items():
            if key in data:
                value = data.pop(key)
                if family == data.get("bias", DEFAULT_BIAS):
                    params.setdefault(param, value)  # other families' old fields had no effect
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**data, bias_params=params)

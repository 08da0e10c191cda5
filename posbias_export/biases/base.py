"""What every bias family declares, and the conventions all of them share.

A family is one module in this package holding one `AttentionBias` subclass with a `name`:
its hyper-parameters (a `BiasParams` dataclass), whether it is learned, its PyTorch form
(`from_positions`), its ONNX Script twin (`function`), its float64 oracle (`reference`) and
the properties other code asks about (`lookback`, `key_row_function`, `symmetric`,
`uses_rope`). Defining the subclass registers it; nothing outside this package names a family.

Conventions: keys sit at positions 0..Lk-1 and queries are the LAST Lq of them (a decode step
and a prefill share one code path); a bias is additive, before softmax; masks use finite
values, never -inf.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx
import torch
from torch import nn

FLOAT32_LOWEST = float(np.finfo(np.float32).min)  # a masked key: finite, so a fully masked row is uniform, not NaN
# Added to masked scores in the blocked form: absorbs any score (exp(-1e30 - max) == 0) yet stays
# finite even on top of FLOAT32_LOWEST, so a fully masked row cannot become NaN.
MASK_PENALTY = -1e30
# Every softmax we write floors its scores at (row maximum - SCORE_FLOOR) first (floor_scores; the
# ONNX twin is posbias.FlooredSoftmax). Why: a score 87-104 below its row's maximum gives a
# probability below float32's smallest normal number (2^-126), and Intel cores take a slow assist
# on every subnormal operand (in the Softmax and again in the MatMul with V: 2-8x a block's time
# in a default ONNX Runtime session). Floored, each probability is at least e^-64 / W for W keys:
# normal up to W = e^23 keys, and its products with values above 1e-10 stay normal too. What it
# changes: a key whose weight was below e^-64 = 1.6e-28 of the row's largest gets that weight, so
# an output moves by at most W * 1.6e-28 * max|v| (2.6e-24 * max|v| at 16384 keys), 2^-56 of
# float32's resolution: outputs are bit for bit those of the unfloored softmax in practice.
# Masked keys (MASK_PENALTY, FLOAT32_LOWEST) are raised with them; a fully masked row's maximum
# is itself masked, so that row stays as it was (uniform).
SCORE_FLOOR = 64.0
# A fused attention op (ONNX Runtime's GroupQueryAttention and MultiHeadAttention, ONNX Attention)
# softmaxes inside, where no floor can reach, and gets the family's bias as it is. A floor on the
# bias alone (raising it to -32, as 844dbc3 did) is not exact: a far key's weight is e^(raw q.k +
# bias), and a row's raw scores can be tens of nats apart (a sharp model, an attention sink), so a
# key whose true bias is -100 came back with e^-32 x e^(raw) and moved outputs by up to 10 logits
# after a 1024-token prompt (tests/test_long_prompt_exactness.py). Exactness wins: those files can
# make subnormal probabilities in a default session on Intel; our sessions and genai_config set
# session.set_denormal_as_zero (hf/cpu_notes.py says how each client does).

FAMILIES: dict[str, type["AttentionBias"]] = {}  # filled as family classes are defined


def query_key_positions(q_len, k_len, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys sit at 0..k_len-1; queries are the LAST q_len of them (prefill and decode share one path)."""
    k_pos = torch.arange(k_len, device=device)  # [Lk]
    q_pos = torch.arange(k_len - q_len, k_len, device=device)  # [Lq]
    return q_pos, k_pos


def relative_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every (query, key) pair: [..., Lq] x [..., Lk] -> [..., Lq, Lk] int64."""
    return q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)


def mask_value(dtype: torch.dtype = torch.float32) -> float:
    """The dtype's lowest finite value: a fully masked row stays finite (uniform), never NaN."""
    return torch.finfo(dtype).min


def floor_scores(scores: torch.Tensor) -> torch.Tensor:
    """scores [..., W] floored at each row's maximum minus SCORE_FLOOR (see there): the softmax
    of the result has no subnormal probability. A float64 reference stays the paper's formula.

    ONNX: posbias.FlooredSoftmax (export/targets/blocked_script.py)"""
    if scores.dtype == torch.float64:
        return scores
    return torch.maximum(scores, scores.amax(-1, keepdim=True) - SCORE_FLOOR)


# the largest value a hyper-parameter takes unless its family says less: sizes that become
# tensors (T5's offset table, 2 * max_distance + 1 entries) stay far below memory
HYPER_MAXIMUM = 1 << 20


def hyper_parameter(default: int, help: str, *, minimum: int = 1, maximum: int = HYPER_MAXIMUM, even: bool = False,
                    alias: str | None = None, legacy_key: str | None = None):
    """A family hyper-parameter: an integer with a default and bounds (`maximum`: what its
    tensors can hold). `alias` is a CLI flag kept for compatibility (e.g. --window);
    `legacy_key` the ModelConfig field that held it before hyper-parameters moved into their
    family (old checkpoints and files carry it)."""
    meta = {"help": help, "minimum": minimum, "maximum": maximum, "even": even, "alias": alias,
            "legacy_key": legacy_key}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class BiasParams:
    """Base of every family's hyper-parameters: integer fields declared with hyper_parameter()
    are checked here; a family adds cross-field rules in check()."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if value < f.metadata.get("minimum", 1):
                raise ValueError(f"{f.name} must be >= {f.metadata.get('minimum', 1)}, got {value}")
            if value > f.metadata.get("maximum", HYPER_MAXIMUM):
                raise ValueError(f"{f.name} must be <= {f.metadata.get('maximum', HYPER_MAXIMUM)}, got {value}")
            if f.metadata.get("even") and value % 2:
                raise ValueError(f"{f.name} must be even, got {value}")
        self.check()

    def check(self) -> None:
        """Rules that involve several fields; raise ValueError."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class RegistryError(ValueError):
    """Two families claim the same name, function, CLI flag or legacy config key."""


def _claims(cls) -> set[tuple[str, str]]:
    """What a family takes for itself in shared namespaces: (what, value) pairs."""
    claims = {("name", cls.name), ("ONNX function name", cls.function_name), ("summary", cls.summary)}
    for f in dataclasses.fields(cls.Params):
        claims |= {(what, f.metadata[key]) for key, what in (("alias", "flag"), ("legacy_key", "legacy config key"))
                   if f.metadata.get(key)}
    return claims


def check_unique(cls) -> None:
    """Refuse a family that claims what a registered one has: a copied file that kept the
    original's --flag would break --help, one that kept its legacy key would silently hand old
    checkpoints' values to the copy, one that kept its summary would ship the original's
    description (README's table would show two families adding the same thing)."""
    mine = _claims(cls)
    for other in FAMILIES.values():
        if (other.__module__, other.__qualname__) == (cls.__module__, cls.__qualname__):
            continue  # the same class defined again (a module reloaded)
        shared = sorted(mine & _claims(other))
        if shared:
            what, value = shared[0]
            raise RegistryError(f"bias families {other.name!r} ({other.__module__}) and {cls.name!r} "
                                f"({cls.__module__}) both claim the {what} {value!r}; give the new family its own")


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\W]+", name) if part)


class AttentionBias(nn.Module):
    """An additive, pre-softmax attention bias. Pure: nothing is cached in forward.

    forward(q_len, k_len) -> float32 Tensor [H or 1, q_len, k_len]
    from_positions(q_pos [..., Lq], k_pos [..., Lk]) -> [..., H or 1, Lq, Lk]
    reference(q_pos [Lq], k_pos [Lk]) -> float64 numpy [H or 1, Lq, Lk], from the paper's formula
    """

    name: ClassVar[str] = ""  # registry key, CLI choice, metadata value; "" for an abstract base
    summary: ClassVar[str] = ""  # what it adds to a score, one line (README's generated family table)
    paper: ClassVar[str] = ""  # where it comes from
    test_tier: ClassVar[str] = "default"  # "extended": its cells in the grid tests run under -m slow only
    Params: ClassVar[type[BiasParams]] = BiasParams  # hyper-parameters (none by default)
    learned: ClassVar[bool] = False  # trained tensors: a per-layer init seed, one function node per layer
    symmetric: ClassVar[bool] = True  # bidirectional form: bias(i, j) == bias(j, i)
    uses_rope: ClassVar[bool] = False  # the family's model rotates q and k (RoPE) unless told otherwise
    head_independent: ClassVar[bool] = False  # output [.., 1, Lq, Lk] instead of [.., H, Lq, Lk]
    # bias(i, j) depends on i - j alone (a Toeplitz matrix): the blocked form evaluates the
    # family's function once per distance, a [H, N] row, and gathers each block from it.
    relative: ClassVar[bool] = False
    rank: ClassVar[int] = 100  # order in BIASES (then the name)
    function: ClassVar[Any] = None  # the @onnxscript.script twin in domain posbias
    function_name: ClassVar[str] = ""  # FunctionProto name; default: the name in CamelCase
    # Causal shortcut for the blocked form: a function (q_pos_b, k_pos_b, *function tensors) ->
    # [.., H, 1, W] that equals the bias up to a per-query-row constant (softmax ignores those).
    key_row_function: ClassVar[Any] = None
    key_row_exact: ClassVar[bool] = False  # the key row IS the bias (no per-row constant): bidirectional too
    # The bidirectional bias is the causal one mirrored, bias(i, j) = bias(max(i, j), min(i, j))
    # (ALiBi's -m|i - j|): keys after a query then take the key row negated (blocked form, two-sided fold).
    key_row_mirrors: ClassVar[bool] = False
    # The bias only masks (no bias, or a local window): a FlexAttention baseline needs no
    # score_mod, its block mask does the work.
    mask_only: ClassVar[bool] = False
    # The causal bias is -s_h (i - j), s_h the family's first function tensor [H] (ALiBi): the
    # GPU targets carry it as features of the queries and keys inside one fused causal kernel.
    slope_features: ClassVar[bool] = False

    def __init_subclass__(cls, family: bool = True, **kwargs):
        """family=False: a bias one imported model needs (Falcon's rounded ALiBi), with its own
        functions but outside the registry: not a --bias choice, not in the shared library
        (the export attaches its functions itself, see export/pipeline.py)."""
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            return  # an abstract helper base, not a family
        if "function_name" not in cls.__dict__:
            cls.function_name = _camel(cls.name)
        if cls.function is None:
            raise TypeError(f"bias family {cls.name!r} declares no ONNX Script function")
        if family and not cls.__dict__.get("summary"):  # inherited would be a copy's: README would show it twice
            raise TypeError(f"bias family {cls.name!r} declares no summary of its own (what it adds to a score, one "
                            "line: README's family table)")
        if cls.test_tier not in ("default", "extended"):
            raise TypeError(f"bias family {cls.name!r}: test_tier must be 'default' or 'extended', got {cls.test_tier!r}")
        if not family:
            return
        check_unique(cls)
        FAMILIES[cls.name] = cls

    def __init__(self, num_heads: int, causal: bool = True, params: BiasParams | None = None, seed: int = 0):
        super().__init__()
        if isinstance(num_heads, bool) or int(num_heads) < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if params is not None and not isinstance(params, self.Params):
            raise TypeError(f"{self.name} takes {self.Params.__name__}, got {type(params).__name__}")
        self.num_heads = int(num_heads)
        self.causal = bool(causal)
        self.params = params if params is not None else self.Params()

    def forward(self, q_len, k_len, device=None) -> torch.Tensor:
        q_pos, k_pos = query_key_positions(q_len, k_len, device=device or self._device())
        return self.from_positions(q_pos, k_pos)

    def from_positions(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reference(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        """float64 oracle from the paper's formula (learned values read from this module)."""
        raise NotImplementedError

    def compute(self, q_pos: torch.Tensor, k_pos: torch.Tensor, as_function: bool = False) -> torch.Tensor:
        """from_positions; with as_function (a trace for ONNX export), ONE posbias.<Family> node
        whose body is attached afterwards as a model-local function."""
        if as_function:
            tensors, attrs = self.function_inputs()
            # float32 whatever the model dtype: the bias is computed and added in float32
            tensors = [t.float() if t.is_floating_point() else t for t in tensors]
            shape = [*q_pos.shape[:-1], self.output_heads, q_pos.shape[-1], k_pos.shape[-1]]
            return torch.onnx.ops.symbolic(
                f"posbias::{self.function_name}", [q_pos, k_pos, *tensors], attrs,
                dtype=torch.float32, shape=shape, version=1,
            )
        return self.from_positions(q_pos, k_pos)

    @property
    def output_heads(self) -> int:
        return 1 if self.head_independent else self.num_heads

    @property
    def lookback(self) -> int | None:
        """How many keys before its own position a query can attend to (None: all)."""
        return None

    @property
    def far_distance(self) -> int | None:
        """A distance from which the bias stops changing, on each side of the diagonal (None: it
        changes at every distance). The portable body then adds that constant inside the MatMul
        for the keys that far from every query of a block, and slices its table only for the
        others (export/targets/blocked_script.py: NearFarScores); tests/test_biases.py checks the
        claim against the family's float64 oracle."""
        return None

    @property
    def lookahead(self) -> int | None:
        """How many keys after its own position a query can attend to (None: all). Causal: 0;
        bidirectional: the look-back mirrored (a symmetric window), else all."""
        return 0 if self.causal else self.lookback

    def score_mod(self, device=None):
        """A closed-form FlexAttention score_mod adding this bias, (score, b, h, q_idx, kv_idx) ->
        score, or None: a baseline then reads the family's values per distance from a table."""
        return None

    def function_inputs(self) -> tuple[list[torch.Tensor], dict]:
        """Tensors after (q_pos, k_pos), and attributes, for `function`."""
        return [], {}

    @classmethod
    def function_protos(cls) -> list[onnx.FunctionProto]:
        """This family's FunctionProtos, named after the family (a copied family file gets
        its own names), the bias function first, then the key-row shortcut if any."""
        protos = []
        for fn, name in ((cls.function, cls.function_name), (cls.key_row_function, cls.key_row_name())):
            if fn is not None:
                proto = fn.to_function_proto()
                proto.name = name
                protos.append(proto)
        return protos

    @classmethod
    def key_row_name(cls) -> str | None:
        return None if cls.key_row_function is None else cls.function_name + "KeyRow"

    def uses_key_row(self) -> bool:
        """The blocked form takes the key-row shortcut: causal, or a row that is exact anyway."""
        return self.key_row_function is not None and (self.causal or self.key_row_exact)

    @classmethod
    def reach(cls) -> int:
        """A distance past everything the family's defaults name (a window, a last bucket, a
        sinusoid period): twice the largest hyper-parameter default, at least 64. Declarations
        (symmetric, relative, lookback) are judged over spans this long, where a short span
        could make any variant look symmetric or relative."""
        return max([64] + [2 * f.default for f in dataclasses.fields(cls.Params)])

    @classmethod
    def params_for_training(cls, train_len: int) -> dict:
        """Hyper-parameters a model trained at `train_len` should get (default: none)."""
        return {}

    def _device(self):
        for t in list(self.parameters()) + list(self.buffers()):
            return t.device
        return None

    def _apply(self, fn, recurse: bool = True):
        """The dtype rule: a family's own tensors stay float32 when the model is cast below it
        (model.half() for a float16 export casts every module), so a family always computes
        from float32 tensors and returns a float32 bias (tests/test_biases.py checks each one at
        float16). Device moves, and float64 for the reference, apply as usual."""
        def keep_float32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t.is_floating_point() and not _below_float32(t.dtype) and _below_float32(out.dtype):
                return t.to(out.device)  # the move applies, the cast does not (no float16 rounding)
            return out

        return super()._apply(keep_float32, recurse)


def _below_float32(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32

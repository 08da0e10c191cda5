"""The registry of imported architectures and what they share: the base class with the export
contract (ImportedModel: an architecture registers itself by its model_type) and CausalLM.

Every imported model mirrors its transformers class's parameter names, so weights map one to
one (weights.py), and has our own DecoderLM's two calls, one return type each:
`forward(input_ids, attention_mask=None, settings=EAGER) -> logits` and, for a causal LM,
`step(input_ids, attention_mask, past, settings=EAGER) -> (logits, presents)`, so the export
signatures, the KV-cache wrapper and the float64 reference are the same code. The layers' shared
pieces (head reshapes, self-attention, RMSNorm, slopes) are in blocks.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ..nn.attention import EAGER, AttentionSettings


ARCHITECTURES: dict[str, type["ImportedModel"]] = {}  # model_type -> the class that imports it
PARTS: dict[tuple[str, str], type["ImportedModel"]] = {}  # (model_type, part) -> a part of such a folder (T5's decoder)


@dataclass(frozen=True)
class Shape:
    """What the export signature and the KV cache need to know of an imported model."""

    num_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    num_kv_heads: int | None = None  # heads of the KV cache (fewer for multi-query / grouped layouts)


class ImportedModel(nn.Module):
    """Base of the models read from a Hugging Face folder. A subclass with a `model_type`
    registers itself as that architecture (everything else reads ARCHITECTURES); part="name"
    registers it as a part of such a folder instead (the T5 decoder: --part decoder)."""

    model_type: ClassVar[str] = ""  # transformers' model_type
    bias_name: ClassVar[str] = ""
    arch: ClassVar[str] = "lm"  # "lm": input_ids -> logits; "encoder": input_ids -> last_hidden_state
    # what its file takes and gives (export/roles.py), and the inputs it takes beyond the role's
    role: ClassVar[str] = "causal-lm"
    extra_inputs: ClassVar[tuple[str, ...]] = ()
    causal: ClassVar[bool] = True
    # positions cumsum(mask) - 1 (BLOOM, Falcon: what their layers pass self_attention), else the
    # key indices (MPT); an in-place cache's function is made for the one the model uses
    positions_from_mask: ClassVar[bool] = True
    transformers_class: ClassVar[str] = "AutoModelForCausalLM"  # what validate --model compares with
    optimum_task: ClassVar[str] = "text-generation"
    # The config's sizes, checked against the weights' shapes before anything is built:
    # our name -> config attribute (vocab, hidden, heads, layers), the [vocab, hidden] weight,
    # the per-layer key prefix whose indices are counted, whether heads must divide hidden.
    sizes: ClassVar[dict[str, str]] = {}
    embedding_key: ClassVar[str] = ""
    layer_key: ClassVar[str] = ""
    heads_divide_hidden: ClassVar[bool] = True
    tied_keys: ClassVar[tuple[str, ...]] = ()  # transformers keys that may repeat a tied tensor
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()  # keys of parts this model does not contain (a T5 decoder)
    config_model_type: ClassVar[str | None] = None  # transformers' config class to read config.json with (None: model_type)

    def __init_subclass__(cls, part: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("model_type"):
            return
        table, key = (ARCHITECTURES, cls.model_type) if part is None else (PARTS, (cls.model_type, part))
        previous = table.get(key)
        if previous is not None and (previous.__module__, previous.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"two imported models claim {key!r}: {previous.__module__} and {cls.__module__}")
        table[key] = cls

    def __init__(self, config, shape: Shape):
        super().__init__()
        self.config, self.shape = config, shape
        self.num_heads, self.head_dim, self.num_layers, self.vocab_size = (shape.num_heads, shape.head_dim,
                                                                           shape.num_layers, shape.vocab_size)
        self.num_kv_heads = shape.num_kv_heads or shape.num_heads

    @classmethod
    def claims(cls, raw: dict, path) -> bool:
        """Whether a folder (its raw config.json) is this architecture: its model_type, and no
        custom code (an architecture we implement ourselves may claim a folder that has some)."""
        return raw.get("model_type") == cls.model_type and not raw.get("auto_map")

    @classmethod
    def key_prefix(cls, shapes) -> str:
        """What the folder's tensor names start with before ours (a checkpoint saved from a
        wrapper carries its attribute name, e.g. "bert.")."""
        return ""

    @classmethod
    def check_config(cls, config, where) -> str | None:
        """Why this config cannot be imported (one line), or None."""
        return None

    @classmethod
    def check_sizes(cls, config, shapes: dict[str, tuple[int, ...]], where, part: str = "encoder") -> None:
        """Before any module is built: the config's sizes are positive integers that fit
        together and match the weights' shapes (a config that says 10^7 layers or a 10^12-token
        vocabulary is refused here, not after allocating for it). `part` picks a registered part."""
        from .folder import FolderError

        target = PARTS.get((cls.model_type, part), cls) if part != "encoder" else cls
        values = {name: getattr(config, attr, None) for name, attr in target.sizes.items()}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FolderError(f"{where}: config {target.sizes[name]} must be a positive integer, got {value!r}")
        if target.heads_divide_hidden and values["hidden"] % values["heads"]:
            raise FolderError(f"{where}: config {target.sizes['hidden']} ({values['hidden']}) is not divisible by "
                              f"{target.sizes['heads']} ({values['heads']})")
        prefix = target.key_prefix(shapes)
        embedding_key = prefix + target.embedding_key
        embedding = shapes.get(embedding_key)
        if embedding is None:
            raise FolderError(f"{where}: weight {embedding_key} is missing (not a {cls.model_type} checkpoint?)")
        if tuple(embedding) != (values["vocab"], values["hidden"]):
            raise FolderError(f"{where}: the config says {target.sizes['vocab']} x {target.sizes['hidden']} = "
                              f"[{values['vocab']}, {values['hidden']}], the weight {embedding_key} is "
                              f"{list(embedding)}: the config does not describe these weights")
        pattern = re.compile(re.escape(prefix + target.layer_key).replace(r"\{\}", r"(\d+)"))
        layers = {int(m.group(1)) for key in shapes if (m := pattern.match(key))}
        if len(layers) != values["layers"]:
            raise FolderError(f"{where}: the config says {target.sizes['layers']} = {values['layers']}, the weights "
                              f"hold {len(layers)} layers: the config does not describe these weights")

    @property
    def output_name(self) -> str:
        from ..export.roles import role

        return role(self.role).outputs[0]

    @classmethod
    def from_folder(cls, source) -> "ImportedModel":
        """Our module for a folder's config (weights are loaded afterwards)."""
        return cls(source.config)

    @classmethod
    def tiny_transformers_model(cls, tf, vocab: int, hidden: int, heads: int, layers: int, max_len: int, **config):
        """A random transformers model of this architecture (benchmarks and tests make folders of
        them); `config`: more fields of its config (token ids, untied heads)."""
        raise NotImplementedError

    def transformers_bias_magnitude(self, length: int) -> float:
        """The largest |bias| transformers materialises in float32 at this length (0 where its
        bias is exact or computed as ours is); see hf/validate.py."""
        return 0.0

    default_quant_block = None  # int4's weights per scale when none is asked: the scheme's own (32)
    default_quant_head = None  # int4's head precision when none is asked: the scheme's own (int4)

    def transformers_table_bytes(self) -> float:
        """What transformers' own forward allocates whatever the input length (a position table
        sized by the config), checked before its row runs in validate."""
        return 0.0

    def file_bias_magnitude(self, length: int) -> float:
        """The largest |bias| our exported file adds to a float32 score at this length (0 where
        its key row is relative to the block, as ALiBi's is); see hf/validate.py."""
        return 0.0

    def shipped_config(self, config: dict) -> dict:
        """config.json as a serving folder carries it: describing the files beside it (which the
        clients read to shape the cache they feed). The same as the folder's by default."""
        return config

    def serving_files(self) -> dict[str, dict]:
        """JSON files a serving folder adds for the clients of this architecture (path -> content)."""
        return {}

    def export_note(self) -> str | None:
        """What an export's report adds for this architecture, if anything."""
        return None

    def max_length(self) -> int | None:
        """The longest input transformers' own implementation accepts (None: no limit)."""
        return None

    def as_trained(self, reference):
        """transformers' model of this folder, made to compute what the weights were trained
        with where transformers departs from the config (the reference our files are judged by)."""
        return reference

    def weight_key(self, name: str) -> str:
        """The transformers key of our parameter `name` (the same unless a model renames)."""
        return name

    def weight_rows(self, name: str) -> tuple[int, int, int] | None:
        """(start, stop, rows of the whole): the rows of the folder tensor `weight_key(name)` that
        parameter `name` takes, where one stored tensor fills several parameters; None: all of it."""
        return None

    def empty_past(self, batch: int, dtype: torch.dtype = torch.float32) -> list:
        shape = (batch, self.num_kv_heads, 0, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(self.num_layers)]


class CausalLM(ImportedModel):
    """BLOOM, MPT, Falcon: embeddings -> layers (each with its slice of the KV cache) -> final norm
    -> a head tied to the embeddings, or its own lm_head.
    input_ids [B, L], attention_mask [B, P + L] -> logits [B, L, V] (+ presents with past)."""

    tied_keys = ("lm_head.weight",)
    last_logits_only = False  # set on an export copy: logits [B, 1, V] of the last position (--logits last)

    def add_head(self, config) -> None:
        self.tied = config.tie_word_embeddings
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, settings: AttentionSettings = EAGER) -> torch.Tensor:
        """input_ids [B, L], attention_mask [B, L] or None -> logits [B, L, V]."""
        return self.run(input_ids, attention_mask, None, settings)[0]

    def step(self, input_ids, attention_mask, past: list, settings: AttentionSettings = EAGER) -> tuple[torch.Tensor, list]:
        """The cache path: new tokens [B, L], attention_mask [B, P + L], past one (k, v) pair per
        layer -> (logits [B, L, V], presents)."""
        return self.run(input_ids, attention_mask, past, settings)

    def run(self, input_ids, attention_mask, past, settings) -> tuple[torch.Tensor, list]:
        """The embeddings, then decode(): each architecture's own."""
        raise NotImplementedError

    def decode(self, x, layers, final_norm, embedding: nn.Embedding, attention_mask, past, settings):
        """x [B, L, D] through the layers and the head -> (logits [B, L, V], presents)."""
        presents = []
        for index, layer in enumerate(layers):
            x, present = layer(x, attention_mask, None if past is None else past[index], settings)
            presents.append(present)
        if self.last_logits_only:  # generation reads the last position only: [B, 1, D], no [B, L, V] tensor
            x = x[:, -1:]
        x = final_norm(x)
        logits = F.linear(x, embedding.weight) if self.tied else self.lm_head(x)  # [B, L, V]
        return logits, presents

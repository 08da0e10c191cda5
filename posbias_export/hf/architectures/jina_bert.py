"""JinaBERT v2 (jina-embeddings-v2: small, base, the de / es / zh / code models): a BERT with
bidirectional ALiBi and a gated feed-forward, 8192 tokens of context. transformers has no
implementation and the folders map to custom code (auto_map); we never run it. A folder is
recognised by its config (model_type bert, position_embedding_type alibi) and its tensor names,
and rebuilt here from the published description of both layouts:

- base (jina-bert-implementation): post-LN BERT; attention's output LayerNorm over dense +
  residual; the feed-forward `mlp.gated_layers` (2 x intermediate, no bias), act(first half) *
  second half, `mlp.wo`, `mlp.layernorm` over wo + residual;
- code (jina-bert-v2-qk-post-norm): LayerNorms on the query and key projections
  (`attention.self.layer_norm_q/k`, over the whole width, before the heads split);
  `layer_norm_1` over the layer input + the attention block's output; `mlp.up_gated_layer`, up
  (first half) * act(second half), `mlp.down_layer`; `layer_norm_2` over that + its input.

Embeddings: word + token type (no positions: ALiBi), LayerNorm. The bias is -m_h |i - j| with
the ALiBi paper's slopes (interleaved for head counts that are not powers of two, as BLOOM's).
feed_forward_type geglu: exact GELU; reglu: ReLU. Checkpoints may carry a `bert.` prefix."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ...biases import create_bias
from ...nn.attention import EAGER
from ..blocks import bloom_style_slopes, merge_heads, self_attention, split_heads
from ..imported import ImportedModel, Shape

ACTIVATIONS = {"geglu": F.gelu, "reglu": F.relu}
BASE_KEY, CODE_KEY = "mlp.gated_layers.weight", "mlp.up_gated_layer.weight"
# what the published folders' auto_map names (written into the tiny folders, never imported)
REMOTE_CODE = {"base": "jinaai/jina-bert-implementation", "code": "jinaai/jina-bert-v2-qk-post-norm"}


def layout_of(names) -> str | None:
    """"base" or "code" from the tensor names, None for neither."""
    names = list(names)
    if any(n.endswith(CODE_KEY) for n in names):
        return "code"
    if any(n.endswith(BASE_KEY) for n in names):
        return "base"
    return None


class JinaSelfAttention(nn.Module):
    def __init__(self, config, bias, qk_norm: bool):
        super().__init__()
        D = config.hidden_size
        self.num_heads, self.bias = config.num_attention_heads, bias
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        if qk_norm:
            self.layer_norm_q = nn.LayerNorm(D, eps=config.layer_norm_eps)
            self.layer_norm_k = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, x, attention_mask, settings):
        q, k = self.query(x), self.key(x)
        if self.qk_norm:  # over the whole width, before the heads split
            q, k = self.layer_norm_q(q), self.layer_norm_k(k)
        q, k, v = (split_heads(t, self.num_heads) for t in (q, k, self.value(x)))  # [B, H, L, d]
        y, _ = self_attention(q, k, v, attention_mask, None, self.bias, settings)
        return merge_heads(y)


class JinaAttention(nn.Module):
    def __init__(self, config, bias, qk_norm: bool):
        super().__init__()
        self.self = JinaSelfAttention(config, bias, qk_norm)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, attention_mask, settings):
        y = self.self(x, attention_mask, settings)
        return self.output.LayerNorm(self.output.dense(y) + x)


# The checkpoints' one [2I, D] gated weight is two [I, D] parameters here (rows of the same
# tensor, read where they lie): no [L, 2I] product is ever made, which at 8192 tokens was the
# largest tensor of a layer (benchmarks/embedders.md), and each half is a MatMul weight the
# quantizers take. (our parameter, the checkpoint's tensor, which half) per layout:
SPLIT_WEIGHTS = {"base": {"mlp.gate.weight": ("mlp.gated_layers.weight", 0), "mlp.up.weight": ("mlp.gated_layers.weight", 1)},
                 "code": {"mlp.up.weight": ("mlp.up_gated_layer.weight", 0), "mlp.gate.weight": ("mlp.up_gated_layer.weight", 1)}}


class GatedMLP(nn.Module):
    """base: act(gate) * up (the checkpoint's first and second halves), wo, LayerNorm over + residual."""

    def __init__(self, config):
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size
        self.act = ACTIVATIONS[config.feed_forward_type]
        self.gate, self.up = nn.Linear(D, I, bias=False), nn.Linear(D, I, bias=False)
        self.wo = nn.Linear(I, D)
        self.layernorm = nn.LayerNorm(D, eps=config.layer_norm_eps)

    def forward(self, x):
        return self.layernorm(self.wo(self.act(self.gate(x)) * self.up(x)) + x)


class UpGatedMLP(nn.Module):
    """code: up (the first half) * act(gate, the second half), down_layer (no norm of its own)."""

    def __init__(self, config):
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size
        self.act = ACTIVATIONS[config.feed_forward_type]
        self.up, self.gate = nn.Linear(D, I, bias=False), nn.Linear(D, I, bias=False)
        self.down_layer = nn.Linear(I, D)

    def forward(self, x):
        return self.down_layer(self.up(x) * self.act(self.gate(x)))


class JinaLayer(nn.Module):
    def __init__(self, config, bias, layout: str):
        super().__init__()
        code = layout == "code"
        self.code = code
        self.attention = JinaAttention(config, bias, qk_norm=code)
        if code:
            self.layer_norm_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.layer_norm_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.mlp = UpGatedMLP(config)
        else:
            self.mlp = GatedMLP(config)

    def forward(self, x, attention_mask, settings):
        a = self.attention(x, attention_mask, settings)
        if not self.code:
            return self.mlp(a)
        h = self.layer_norm_1(x + a)
        return self.layer_norm_2(h + self.mlp(h))


class JinaBert(ImportedModel):
    """input_ids, attention_mask, token_type_ids [B, L] -> last_hidden_state [B, L, hidden]."""

    model_type = "jina_bert"  # our name: the folder says "bert" and maps to custom code
    config_model_type = "bert"
    bias_name = "alibi"
    sizes = {"vocab": "vocab_size", "hidden": "hidden_size", "heads": "num_attention_heads",
             "layers": "num_hidden_layers"}
    embedding_key = "embeddings.word_embeddings.weight"
    layer_key = "encoder.layer.{}."
    arch = "encoder"
    role = "encoder"
    extra_inputs = ("token_type_ids",)
    causal = False
    positions_from_mask = False
    transformers_class = None  # none installable: validate judges against this module in float64
    optimum_task = "feature-extraction"
    ignored_prefixes = ("pooler.", "cls.", "bert.pooler.", "embeddings.position_ids", "bert.embeddings.position_ids")

    def __init__(self, config, layout: str = "base", prefix: str = ""):
        H = config.num_attention_heads
        super().__init__(config, Shape(H, config.hidden_size // H, config.num_hidden_layers, config.vocab_size))
        self.layout, self.prefix = layout, prefix
        self.alibi = create_bias("alibi", H, causal=False)
        self.alibi.slopes.copy_(bloom_style_slopes(H))  # the paper's slopes, interleaved as BLOOM's
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embeddings.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(JinaLayer(config, self.alibi, layout) for _ in range(config.num_hidden_layers))

    @classmethod
    def claims(cls, raw: dict, path) -> bool:
        """A BERT config with ALiBi positions whose weights have one of the two layouts' tensors
        (its auto_map, if any, is not run)."""
        from ..folder import tensor_names

        if raw.get("model_type") != "bert" or raw.get("position_embedding_type") != "alibi":
            return False
        return layout_of(tensor_names(Path(path))) is not None

    @classmethod
    def key_prefix(cls, shapes) -> str:
        return "bert." if "bert." + cls.embedding_key in shapes else ""

    @classmethod
    def check_config(cls, config, where) -> str | None:
        kind = getattr(config, "feed_forward_type", None)
        if kind not in ACTIVATIONS:
            return f"{where}: JinaBERT feed_forward_type {kind!r} is not one of {', '.join(ACTIVATIONS)}"
        return None

    @classmethod
    def from_folder(cls, source) -> "JinaBert":
        return cls(source.config, layout_of(source.state), cls.key_prefix(source.state))

    def _split(self, name: str):
        """(the checkpoint's tensor key, which half) for a half of a gated weight, else None."""
        head, _, tail = name.rpartition(".mlp.")
        found = SPLIT_WEIGHTS[self.layout].get("mlp." + tail) if head else None
        return None if found is None else (f"{head}.{found[0]}", found[1])

    def weight_key(self, name: str) -> str:
        split = self._split(name)
        return self.prefix + (name if split is None else split[0])

    def weight_rows(self, name: str) -> tuple[int, int, int] | None:
        split = self._split(name)
        if split is None:
            return None
        half = self.config.intermediate_size
        return split[1] * half, (split[1] + 1) * half, 2 * half

    def shipped_config(self, config: dict) -> dict:
        """The serving folder holds ONNX files, no code: its config maps to none (a client that
        honours auto_map would otherwise fetch the original custom code to read a config)."""
        return {k: v for k, v in config.items() if k != "auto_map"}

    def serving_files(self) -> dict[str, dict]:
        """sentence-transformers' description of the pipeline: the transformer, then mean pooling
        over the mask (the models' emb_pooler); clients normalise."""
        width = self.config.hidden_size
        return {"modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                                 {"idx": 1, "name": "1", "path": "1_Pooling",
                                  "type": "sentence_transformers.models.Pooling"}],
                "sentence_bert_config.json": {"max_seq_length": 8192, "do_lower_case": False},
                "1_Pooling/config.json": {"word_embedding_dimension": width, "pooling_mode_mean_tokens": True,
                                          "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False}}

    def export_note(self) -> str:
        return (f"JinaBERT v2 ({self.layout} layout) rebuilt by posbias_export's own implementation from the config and "
                "tensor names; the folder's custom code (auto_map) was not run")

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, settings=EAGER):
        e = self.embeddings
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = e.LayerNorm(e.word_embeddings(input_ids) + e.token_type_embeddings(types))  # [B, L, D]
        for layer in self.encoder.layer:
            x = layer(x, attention_mask, settings)
        return x

    @classmethod
    def tiny_transformers_model(cls, tf, vocab, hidden, heads, layers, max_len, layout: str = "base", **config):
        """No transformers class exists: our module with random weights, saved as the published
        folders are (config.json with their auto_map, model.safetensors under their names)."""
        fields = dict(model_type="bert", architectures=["JinaBertForMaskedLM"], vocab_size=vocab, hidden_size=hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
                      type_vocab_size=2, layer_norm_eps=1e-12, position_embedding_type="alibi",
                      feed_forward_type="geglu", emb_pooler="mean", max_position_embeddings=max_len, pad_token_id=0)
        fields.update(config)
        made = cls(tf.BertConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")}), layout)
        code = REMOTE_CODE[layout]
        fields["auto_map"] = {"AutoConfig": f"{code}--configuration_bert.JinaBertConfig",
                              "AutoModel": f"{code}--modeling_bert.JinaBertModel"}
        return TinyFolderModel(made, fields)


class TinyFolderModel(nn.Module):
    """Our module standing in for a transformers model in the tiny-folder factory: parameters
    to perturb, save_pretrained writing config.json and model.safetensors."""

    def __init__(self, model: ImportedModel, config: dict):
        super().__init__()
        self.model, self.fields = model, config

    def save_pretrained(self, folder) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.fields, indent=1))
        parts: dict[str, list] = {}  # a checkpoint tensor -> (first row, its rows), the halves of a gated weight too
        for name, param in self.model.named_parameters():
            rows = self.model.weight_rows(name)
            parts.setdefault(self.model.weight_key(name), []).append((rows[0] if rows else 0, param.detach()))
        state = {key: torch.cat([p for _, p in sorted(got, key=lambda x: x[0])]).contiguous() for key, got in parts.items()}
        save_file(state, str(folder / "model.safetensors"))

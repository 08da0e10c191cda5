"""Falcon with alibi=True (FalconForCausalLM) on our biased attention, names and layouts as
transformers' modeling_falcon: fused QKV in its three layouts (classic, multi-query, the new
grouped architecture), sequential or parallel attention/MLP, one or two LayerNorms.

Falcon's ALiBi is not BLOOM's. transformers computes it in bfloat16 whatever the model dtype:
bf16(bf16(slope) * bf16(position)), positions from cumsum(mask) - 1, then divides by sqrt(d).
At 8192 tokens that rounding moves a bias by up to 16 / sqrt(d) from the exact value, and a
file that drops it (Optimum's, measured 0.17 off in the logits) computes another model. The
rounding is not shift-invariant either, so positions must come from the mask. ONNX Runtime
has no bfloat16 Mul; OpenVINO's bf16 Convert truncates. The function below rounds in float32
arithmetic instead (Veltkamp's split: c = x * (2^16 + 1); x_bf16 = c - (c - x)), which is
round-to-nearest-even to 8 significant bits for the values a bias takes (checked against
torch's bfloat16 on every integer up to 2^20 in tests/test_hf_models.py).
"""
from __future__ import annotations

import math

import torch
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op
from torch import nn

from ...biases import AttentionBias
from ...biases.onnx_domain import posbias
from ..blocks import bloom_style_slopes, merge_heads, self_attention
from ..imported import CausalLM, Shape

BF16_SPLIT = 65537.0  # 2^16 + 1: keeps 24 - 16 = 8 significant bits


def round_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 rounded to bfloat16's 8 significant bits (round to nearest even)."""
    c = x * BF16_SPLIT
    return c - (c - x)


@script(posbias, default_opset=op)
def FalconAlibiKeyRow(q_pos_b: INT64, k_pos_b: INT64, slopes: FLOAT, sqrt_d: FLOAT) -> FLOAT:
    """Falcon's bias of each key, one row per head: bf16(slope * bf16(k_pos)) / sqrt(d) (slopes
    arrive rounded to bfloat16). [..., Bq] x [..., W] x [H] x [] -> [..., H, 1, W]"""
    pos = op.Cast(op.Unsqueeze(k_pos_b, [-2, -3]), to=1)  # [..., 1, 1, W]
    c = op.Mul(pos, op.Constant(value_float=65537.0))
    pos16 = op.Sub(c, op.Sub(c, pos))
    product = op.Mul(op.Reshape(slopes, [-1, 1, 1]), pos16)  # [..., H, 1, W]
    c2 = op.Mul(product, op.Constant(value_float=65537.0))
    return op.Div(op.Sub(c2, op.Sub(c2, product)), sqrt_d)


@script(posbias, default_opset=op)
def FalconAlibi(q_pos: INT64, k_pos: INT64, slopes: FLOAT, sqrt_d: FLOAT) -> FLOAT:
    """Falcon's bias for every (query, key): the key row, minus each query's own value (a
    per-row constant, which softmax ignores). The key row alone grows with the absolute
    position (slope * 1023 / sqrt(d) ~ 180 at 1024 tokens, where float16's step is 0.125); the
    difference is small near the diagonal, so a float16 bias (the GPU targets cast it) keeps
    its precision where the weights are. [..., Lq] x [..., Lk] x [H] x [] -> [..., H, Lq, Lk]."""
    row = FalconAlibiKeyRow(q_pos, k_pos, slopes, sqrt_d)  # [..., H, 1, Lk]
    own = FalconAlibiKeyRow(k_pos, q_pos, slopes, sqrt_d)  # [..., H, 1, Lq]: each query's own key value
    column = op.Unsqueeze(op.Squeeze(own, [-2]), [-1])  # [..., H, Lq, 1]
    return op.Sub(row, column)  # [..., H, Lq, Lk]


class FalconAlibiBias(AttentionBias, family=False):
    """Falcon's rounded ALiBi. Causal: the key row is the whole bias, up to the per-row
    constant softmax ignores."""

    name = "falcon_alibi"
    function = FalconAlibi
    key_row_function = FalconAlibiKeyRow

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__(num_heads, causal=True)
        slopes = bloom_style_slopes(num_heads).bfloat16().float()  # [H], as transformers rounds them
        self.register_buffer("slopes", slopes, persistent=False)
        self.register_buffer("sqrt_d", torch.tensor(math.sqrt(head_dim)), persistent=False)

    def function_inputs(self):
        return [self.slopes, self.sqrt_d], {}

    def _key_values(self, pos):
        """[..., L] -> [..., H, 1, L] float32: bf16(slope * bf16(pos)) / sqrt(d), as transformers rounds."""
        key_row = self.slopes.bfloat16().view(-1, 1, 1) * pos.unsqueeze(-2).unsqueeze(-3).bfloat16()
        return key_row.float() / self.sqrt_d

    def from_positions(self, q_pos, k_pos):
        """[..., Lq] x [..., Lk] -> [..., H, Lq, Lk] float32: each key's value minus the query's own
        (softmax-equivalent to transformers' key row; see FalconAlibi)."""
        return self._key_values(k_pos) - self._key_values(q_pos).transpose(-1, -2)


class FalconAttention(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = H, D // H
        self.new_arch, self.multi_query = config.new_decoder_architecture, config.multi_query
        self.num_kv_heads = config.num_kv_heads if (self.new_arch or not self.multi_query) else 1
        if self.new_arch:
            out = (2 * config.num_kv_heads + H) * self.head_dim
        else:
            out = D + 2 * self.head_dim if self.multi_query else 3 * D
        self.query_key_value = nn.Linear(D, out, bias=config.bias)
        self.dense = nn.Linear(D, D, bias=config.bias)
        self.alibi = bias

    def split(self, fused):
        """fused [B, L, out] -> q [B, H, L, d], k, v [B, Hkv, L, d]: the layout's own key/value
        heads (1 multi-query, num_kv_heads grouped), repeated over their query heads only inside
        attention, so the KV cache holds Hkv heads as transformers' does."""
        B, L, _ = fused.shape
        H, d = self.num_heads, self.head_dim
        if self.new_arch:
            qkv = fused.view(B, L, self.num_kv_heads, H // self.num_kv_heads + 2, d)
            q = qkv[:, :, :, :-2].flatten(2, 3)  # [B, L, H, d]
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [B, L, Hkv, d]
        elif self.multi_query:
            qkv = fused.view(B, L, H + 2, d)
            q, k, v = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]  # k, v [B, L, 1, d]
        else:
            qkv = fused.view(B, L, H, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        return (t.transpose(1, 2) for t in (q, k, v))

    def forward(self, x, attention_mask, past, settings):
        q, k, v = self.split(self.query_key_value(x))
        y, present = self_attention(q, k, v, attention_mask, past, self.alibi, settings, positions_from_mask=True)
        return self.dense(merge_heads(y)), present


class FalconMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.activations import get_activation

        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=config.bias)
        self.act = get_activation(config.activation)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconLayer(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_epsilon
        self.new_arch, self.parallel = config.new_decoder_architecture, config.parallel_attn
        lns = config.num_ln_in_parallel_attn or (2 if self.new_arch else None)
        self.two_norms = self.new_arch and lns == 2
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(D, eps=eps)
            self.ln_mlp = nn.LayerNorm(D, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(D, eps=eps)
            if not self.parallel:
                self.post_attention_layernorm = nn.LayerNorm(D, eps=eps)
        self.self_attention = FalconAttention(config, bias)
        self.mlp = FalconMLP(config)

    def forward(self, x, attention_mask, past, settings):
        h_attn = self.ln_attn(x) if self.two_norms else self.input_layernorm(x)
        attn, present = self.self_attention(h_attn, attention_mask, past, settings)
        if self.two_norms:
            h_mlp = self.ln_mlp(x)
        elif self.new_arch or self.parallel:
            h_mlp = h_attn
        else:
            x = x + attn
            h_mlp = self.post_attention_layernorm(x)
        out = self.mlp(h_mlp)
        if self.new_arch or self.parallel:
            out = out + attn
        return x + out, present


class FalconTransformer(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconLayer(config, bias) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class FalconLM(CausalLM):
    model_type = "falcon"
    bias_name = FalconAlibiBias.name
    sizes = {"vocab": "vocab_size", "hidden": "hidden_size", "heads": "num_attention_heads",
             "layers": "num_hidden_layers"}
    embedding_key = "transformer.word_embeddings.weight"
    layer_key = "transformer.h.{}."

    def __init__(self, config):
        H = config.num_attention_heads
        d = config.hidden_size // H
        kv = config.num_kv_heads if (config.new_decoder_architecture or not config.multi_query) else 1
        super().__init__(config, Shape(H, d, config.num_hidden_layers, config.vocab_size, kv))
        self.transformer = FalconTransformer(config, FalconAlibiBias(H, d))
        self.add_head(config)

    @classmethod
    def check_config(cls, config, where) -> str | None:
        if not config.alibi:
            return (f"{where}: this Falcon uses rotary positions (alibi=false); only Falcon with alibi=true "
                    "has a positional attention bias to export")
        return None

    def shipped_config(self, config: dict) -> dict:
        """The cache holds the layout's own key/value heads (1 multi-query, num_kv_heads grouped),
        as the config says. One key changes: transformers.js reads `multi_query: true` as
        gpt_bigcode's fused `key_value` cache names, so the copy says multi_query false with
        num_kv_heads = the cache's heads, which Optimum and transformers read as the same count."""
        if not config.get("multi_query"):
            return config
        return {**config, "multi_query": False, "num_kv_heads": self.num_kv_heads}

    @classmethod
    def tiny_transformers_model(cls, tf, vocab, hidden, heads, layers, max_len, **config):
        return tf.FalconForCausalLM(tf.FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                                    num_attention_heads=heads, alibi=True, **config))

    def transformers_bias_magnitude(self, length: int) -> float:
        """transformers' SDPA path puts slope * absolute key position / sqrt(d) into its float
        mask: the same magnitude as our file's key row (build_alibi_tensor, FalconModel.forward)."""
        return self.file_bias_magnitude(length)

    def file_bias_magnitude(self, length: int) -> float:
        """The file's key row is absolute (bf16 rounding is not shift-invariant): scores carry up
        to max slope * (L - 1) / sqrt(d), 724 at 4096 tokens for the tiny test model."""
        alibi = self.transformer.h[0].self_attention.alibi
        return float(alibi.slopes.max()) * (length - 1) / float(alibi.sqrt_d)

    def run(self, input_ids, attention_mask, past, settings):
        t = self.transformer
        x = t.word_embeddings(input_ids)  # [B, L, D]
        return self.decode(x, t.h, t.ln_f, t.word_embeddings, attention_mask, past, settings)

"""MPT (MptForCausalLM) on our biased attention, names and layout as transformers'
modeling_mpt: bias-free LayerNorms and linears, Wqkv chunked q|k|v, optional clip_qkv and
softmax_scale, exact GELU, tied head.

transformers builds MPT's ALiBi as a [H, 1, max_seq_len] table of slope * (j - max_seq_len + 1),
so neither it nor an export of it runs past max_seq_len. Here the bias comes from the
positions of the input (our alibi family with MPT's slopes): up to max_seq_len the two are
the same function under the causal mask; past it this file keeps going. MPT's bias ignores
the attention mask (positions are raw indices); with left padding that changes nothing,
since ALiBi depends on i - j only.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.nn import functional as F

from ...biases import create_bias
from ..blocks import merge_heads, scale_queries, self_attention, split_heads
from ..imported import CausalLM, Shape


TRANSFORMERS_ALIBI_BIAS_MAX = 8  # what transformers' MPT passes, whatever the config holds


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's slopes, float32 [H]: 2^-(k * alibi_bias_max / n) over n = the next power of two,
    then (when n > H) the odd-indexed ones followed by the even-indexed, first H kept."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1, dtype=torch.int64).float() * (alibi_bias_max / n))
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class MptAttention(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        D, H = config.hidden_size, config.n_heads
        self.num_heads = H
        scale = config.attn_config.softmax_scale  # 0 is a scale (uniform attention), as in transformers
        self.softmax_scale = 1 / math.sqrt(D / H) if scale is None else scale
        self.clip_qkv = config.attn_config.clip_qkv
        self.Wqkv = nn.Linear(D, 3 * D, bias=False)
        self.out_proj = nn.Linear(D, D, bias=False)
        self.alibi = bias

    def forward(self, x, attention_mask, past, settings):
        qkv = self.Wqkv(x)  # [B, L, 3D]
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (split_heads(t, self.num_heads) for t in qkv.chunk(3, dim=2))  # [B, H, L, d] each
        q = scale_queries(q, self.softmax_scale)
        y, present = self_attention(q, k, v, attention_mask, past, self.alibi, settings)
        return self.out_proj(merge_heads(y)), present


class MptMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.down_proj = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class MptBlock(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_epsilon
        self.norm_1 = nn.LayerNorm(D, eps=eps, bias=False)
        self.attn = MptAttention(config, bias)
        self.norm_2 = nn.LayerNorm(D, eps=eps, bias=False)
        self.ffn = MptMLP(config)

    def forward(self, x, attention_mask, past, settings):
        attn, present = self.attn(self.norm_1(x), attention_mask, past, settings)
        x = x + attn
        return x + self.ffn(self.norm_2(x)), present


class MptTransformer(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MptBlock(config, bias) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, bias=False)


class MptLM(CausalLM):
    model_type = "mpt"
    bias_name = "alibi"
    positions_from_mask = False  # MPT's ALiBi counts key indices, padding included (its layers say so too)

    @classmethod
    def check_config(cls, config, where) -> str | None:
        """An MPT without ALiBi (attn_config.alibi false: learned absolute positions instead) is
        not this model: exporting it with ALiBi would compute something else."""
        if getattr(config.attn_config, "alibi", True) is not True:
            return (f"{where}: config attn_config.alibi is {config.attn_config.alibi!r}: an MPT without ALiBi is not "
                    "a positional-bias model this tool exports")
        return None
    sizes = {"vocab": "vocab_size", "hidden": "d_model", "heads": "n_heads", "layers": "n_layers"}
    embedding_key = "transformer.wte.weight"
    layer_key = "transformer.blocks.{}."

    def __init__(self, config):
        H = config.n_heads
        super().__init__(config, Shape(H, config.hidden_size // H, config.n_layers, config.vocab_size))
        bias = create_bias("alibi", H, causal=True)
        bias.slopes.copy_(mpt_slopes(H, config.attn_config.alibi_bias_max))
        self.transformer = MptTransformer(config, bias)
        self.add_head(config)

    @classmethod
    def tiny_transformers_model(cls, tf, vocab, hidden, heads, layers, max_len, **config):
        # max_seq_len covers the lengths, so transformers can be the reference
        return tf.MptForCausalLM(tf.MptConfig(vocab_size=vocab, d_model=hidden, n_layers=layers, n_heads=heads,
                                              max_seq_len=max_len, **config))

    def export_note(self) -> str:
        note = (f"positions come from the input: this file runs past max_seq_len ({self.config.max_seq_len}), "
                "where transformers' MPT stops")
        bias_max = self.config.attn_config.alibi_bias_max
        if bias_max != TRANSFORMERS_ALIBI_BIAS_MAX:
            note += (f"; the ALiBi slopes follow the config's alibi_bias_max ({bias_max:g}), as MosaicML's training code "
                     f"does: transformers' MPT ignores it (always {TRANSFORMERS_ALIBI_BIAS_MAX}), so its logits differ "
                     "from this file's (validate --model judges against transformers made to follow the config)")
        return note

    def as_trained(self, reference):
        """transformers' MptForCausalLM builds its ALiBi table with alibi_bias_max=8 whatever the
        config says; the weights were trained with the config's (MosaicML's llm-foundry)."""
        from transformers.models.mpt import modeling_mpt

        bias_max = self.config.attn_config.alibi_bias_max
        if bias_max != TRANSFORMERS_ALIBI_BIAS_MAX:
            reference.transformer.build_mpt_alibi_tensor = functools.partial(modeling_mpt.build_mpt_alibi_tensor,
                                                                             alibi_bias_max=bias_max)
        return reference

    def max_length(self) -> int:
        return self.config.max_seq_len

    def transformers_table_bytes(self) -> float:
        """transformers' MPT builds its ALiBi for max_seq_len positions at every forward: an int32
        arange and a float32 [H, max_seq_len] table (4.4 TB at max_seq_len 2^40)."""
        return 4.0 * (self.num_heads + 1) * self.config.max_seq_len

    def transformers_bias_magnitude(self, length: int) -> float:
        """transformers' table holds slope * (j - max_seq_len + 1), whatever the input length."""
        return float(self.transformer.blocks[0].attn.alibi.slopes.max()) * (max(length, self.config.max_seq_len) - 1)

    def run(self, input_ids, attention_mask, past, settings):
        t = self.transformer
        x = t.wte(input_ids)  # [B, L, D]
        return self.decode(x, t.blocks, t.norm_f, t.wte, attention_mask, past, settings)

"""BLOOM (BloomForCausalLM) on our biased attention: parameter names, LayerNorms, fused QKV
layout and tanh GELU as in transformers' modeling_bloom; its ALiBi (slope * key position, the
positions counted by cumsum(mask) - 1, softmax-equivalent to -slope * |p_i - p_j| under the
causal mask) is our alibi family with BLOOM's slopes on positions from the mask."""
from __future__ import annotations

import torch
from torch import nn

from ...biases import create_bias
from ..blocks import bloom_style_slopes, merge_heads, self_attention
from ..imported import CausalLM, Shape


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's tanh GELU, with its own constant (0.79788456, not sqrt(2/pi) to full precision)."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomAttention(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        D = config.hidden_size
        self.num_heads = config.n_head
        self.query_key_value = nn.Linear(D, 3 * D)
        self.dense = nn.Linear(D, D)
        self.alibi = bias  # shared by every layer (no weights)

    def forward(self, x, attention_mask, past, settings):
        B, L, _ = x.shape
        qkv = self.query_key_value(x).view(B, L, self.num_heads, 3, -1)  # per head: q, k, v interleaved
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # [B, H, L, d] each
        # positions from cumsum(mask) - 1, as transformers' BLOOM builds its ALiBi: a hole in the
        # mask (right-padded batches that go on decoding) must not count as a distance
        y, present = self_attention(q, k, v, attention_mask, past, self.alibi, settings, positions_from_mask=True)
        return self.dense(merge_heads(y)), present


class BloomMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(bloom_gelu(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.post_ln_residual = config.apply_residual_connection_post_layernorm
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = BloomAttention(config, bias)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config)

    def forward(self, x, attention_mask, past, settings):
        h = self.input_layernorm(x)
        attn, present = self.self_attention(h, attention_mask, past, settings)
        x = attn + (h if self.post_ln_residual else x)
        h = self.post_attention_layernorm(x)
        return self.mlp(h) + (h if self.post_ln_residual else x), present


class BloomTransformer(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = nn.Embedding(config.vocab_size, D)
        self.word_embeddings_layernorm = nn.LayerNorm(D, eps=eps)
        self.h = nn.ModuleList(BloomBlock(config, bias) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(D, eps=eps)


class BloomLM(CausalLM):
    model_type = "bloom"
    bias_name = "alibi"
    sizes = {"vocab": "vocab_size", "hidden": "hidden_size", "heads": "n_head", "layers": "n_layer"}
    embedding_key = "transformer.word_embeddings.weight"
    layer_key = "transformer.h.{}."

    def __init__(self, config):
        H = config.n_head
        super().__init__(config, Shape(H, config.hidden_size // H, config.n_layer, config.vocab_size))
        bias = create_bias("alibi", H, causal=True)
        bias.slopes.copy_(bloom_style_slopes(H))
        self.transformer = BloomTransformer(config, bias)
        self.add_head(config)

    @classmethod
    def tiny_transformers_model(cls, tf, vocab, hidden, heads, layers, max_len, **config):
        return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads,
                                                  **config))

    def transformers_bias_magnitude(self, length: int) -> float:
        """transformers adds slope * absolute key position (up to max slope * (L - 1))."""
        return float(self.transformer.h[0].self_attention.alibi.slopes.max()) * (length - 1)

    def run(self, input_ids, attention_mask, past, settings):
        t = self.transformer
        x = t.word_embeddings_layernorm(t.word_embeddings(input_ids))  # [B, L, D]
        return self.decode(x, t.h, t.ln_f, t.word_embeddings, attention_mask, past, settings)

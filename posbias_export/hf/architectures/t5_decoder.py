"""The T5 decoder (of T5ForConditionalGeneration) on our biased attention, with a KV cache:
causal self-attention with the decoder's own learned relative-position bias (the causal
buckets: only j <= i is distinguished), cross-attention to the encoder's output (no position
bias), the feed-forward of the encoder, RMS norms, and the head: the folder's lm_head when it
has one (T5 v1.1), else the shared embedding with the original T5's d_model^-0.5 rescale.

One file serves prefill and decode: input_ids [B, L], attention_mask [B, P + L],
encoder_hidden_states [B, Le, D], encoder_attention_mask [B, Le], past_key.N / past_value.N
[B, H, P, d] -> logits [B, L, V], present_key.N / present_value.N. That file recomputes the
cross-attention keys from encoder_hidden_states each step (a step costs Le * D^2 more).

The clients' file (Optimum's merged layout, `step_cross_cached`) also caches the cross-attention
keys and values: past_cross_key.N / past_cross_value.N [B, H, Le|0, d] and use_cache_branch [1]
in, present_cross_key.N / present_cross_value.N out. One If (torch.cond) picks: use_cache_branch
false (the first step, the cross caches empty) computes every layer's keys and values from
encoder_hidden_states; true passes the cached ones through.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ...biases import MASK_PENALTY, create_bias, floor_scores
from ...nn.attention import EAGER
from ..folder import FolderError
from ..blocks import RMSNorm, merge_heads, scale_queries, self_attention, split_heads
from ..imported import ImportedModel, Shape
from .t5 import T5FeedForward, T5Projections, normed_sublayer, t5_bias_params

BIAS_KEY = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def cross_keys_values(attn: T5Projections, encoder_states) -> tuple[torch.Tensor, torch.Tensor]:
    """encoder_states [B, Le, D] -> one layer's cross-attention k, v [B, H, Le, d] (contiguous: the
    cached ones a client feeds back are)."""
    return tuple(split_heads(proj(encoder_states), attn.num_heads).contiguous() for proj in (attn.k, attn.v))


def cross_attention(attn: T5Projections, x, k, v, encoder_mask):
    """x [B, L, D] attends to the encoder's k, v [B, H, Le, d] (mask [B, Le]); T5: no scale, no bias."""
    q = split_heads(attn.q(x), attn.num_heads)  # [B, H, L, d]
    scores = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))  # [B, H, L, Le]
    keep = encoder_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, Le]
    scores = scores + torch.where(keep, 0.0, MASK_PENALTY).to(scores.dtype)
    return attn.o(merge_heads(torch.softmax(floor_scores(scores), dim=-1).to(v.dtype) @ v))  # [B, L, D]


class T5DecoderSelfLayer(nn.Module):
    def __init__(self, config, bias):
        super().__init__()
        self.SelfAttention = T5Projections(config)
        self.SelfAttention.position_bias = bias  # the first block's, shared by all
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def forward(self, x, attention_mask, past, settings):
        attn, h = self.SelfAttention, self.layer_norm(x)
        q, k, v = (split_heads(proj(h), attn.num_heads) for proj in (attn.q, attn.k, attn.v))  # [B, H, L, d]
        y, present = self_attention(scale_queries(q, 1.0), k, v, attention_mask, past, attn.position_bias, settings)
        return x + attn.o(merge_heads(y)), present


class T5DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention, the feed-forward; the feed-forward is the model
    class's (`feed_forward(config)`): a variant swaps it there."""

    def __init__(self, config, bias, feed_forward=T5FeedForward):
        super().__init__()
        self.layer = nn.ModuleList([T5DecoderSelfLayer(config, bias),
                                    normed_sublayer(config, EncDecAttention=T5Projections(config)),
                                    normed_sublayer(config, DenseReluDense=feed_forward(config))])

    def forward(self, x, attention_mask, cross_kv, encoder_mask, past, settings):
        """cross_kv: this layer's cross-attention (k, v) (cross_keys_values)."""
        own, cross, ff = self.layer
        x, present = own(x, attention_mask, past, settings)
        x = x + cross_attention(cross.EncDecAttention, cross.layer_norm(x), *cross_kv, encoder_mask)
        return x + ff.DenseReluDense(ff.layer_norm(x)), present


class T5DecoderStack(nn.Module):
    def __init__(self, config, bias, feed_forward=T5FeedForward):
        super().__init__()
        self.block = nn.ModuleList(T5DecoderBlock(config, bias, feed_forward) for _ in range(config.num_decoder_layers))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5Decoder(ImportedModel, part="decoder"):
    """(input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, past) -> logits
    [B, L, V] and the presents."""

    model_type = "t5"
    bias_name = "t5"
    sizes = {"vocab": "vocab_size", "hidden": "d_model", "heads": "num_heads", "layers": "num_decoder_layers",
             "head_dim": "d_kv"}
    embedding_key = "shared.weight"
    layer_key = "decoder.block.{}."
    heads_divide_hidden = False
    arch = "decoder"
    role = "seq2seq-decoder-with-past"
    transformers_class = "T5ForConditionalGeneration"  # what validate compares the pair with
    default_quant_block, default_quant_head = 16, "int8"  # the pair's int4 policy (hf/architectures/t5.py)
    tied_keys = ("decoder.embed_tokens.weight", "encoder.embed_tokens.weight", "lm_head.weight")
    feed_forward: ClassVar[type[nn.Module]] = T5FeedForward  # a variant's other feed-forward goes here
    ignored_prefixes = ("encoder.",)

    def __init__(self, config, own_head: bool, rescale: bool):
        super().__init__(config, Shape(config.num_heads, config.d_kv, config.num_decoder_layers, config.vocab_size))
        self.bias = create_bias("t5", config.num_heads, causal=True, **t5_bias_params(config))
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.decoder = T5DecoderStack(config, self.bias, self.feed_forward)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False) if own_head else None
        self.rescale = config.d_model ** -0.5 if rescale else 1.0

    @classmethod
    def from_folder(cls, source) -> "T5Decoder":
        if not any(k.startswith("decoder.") for k in source.state):
            raise FolderError(f"{source.path} holds no T5 decoder (--part decoder needs a T5ForConditionalGeneration "
                              "folder)")
        raw = source.raw
        # original T5 ties the head to the embedding and rescales; v1.1 ships its own lm_head. transformers 5
        # writes the rescale as scale_decoder_outputs (and tie_word_embeddings always true): it decides then
        rescale = raw.get("scale_decoder_outputs", raw.get("tie_word_embeddings") is not False)
        return cls(source.config, own_head="lm_head.weight" in source.state and raw.get("tie_word_embeddings") is False,
                   rescale=bool(rescale))

    def weight_key(self, name: str) -> str:
        return BIAS_KEY if name == "bias.relative_attention_bias.weight" else name

    def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask,
                settings=EAGER) -> torch.Tensor:
        """Target [B, T] (+ its mask), the encoder's states [B, S, D] and mask -> logits [B, T, V]."""
        return self.run(input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, None, settings)[0]

    def step(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, past: list,
             settings=EAGER) -> tuple[torch.Tensor, list]:
        """The cache path: new target tokens, past one (k, v) self-attention pair per layer ->
        (logits, presents)."""
        return self.run(input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, past, settings)

    def step_cross_cached(self, input_ids, encoder_hidden_states, encoder_attention_mask, use_cache_branch, past: list,
                          past_cross: list, settings=EAGER) -> tuple[torch.Tensor, list, list]:
        """The clients' step (no mask of its own): use_cache_branch [1] bool; past_cross one
        (k, v) pair per layer, [B, H, 0, d] on the first step -> (logits, presents, the
        cross (k, v) pairs: computed on the first step, passed through after)."""
        def fresh(states, *cached):
            return tuple(t for block in self.decoder.block
                         for t in cross_keys_values(block.layer[1].EncDecAttention, states))

        def passed(states, *cached):
            return tuple(t.clone() for t in cached)

        flat = torch.cond(use_cache_branch.reshape(()), passed, fresh,
                          (encoder_hidden_states, *[t for kv in past_cross for t in kv]))
        torch._check(flat[0].shape[2] == encoder_hidden_states.shape[1])  # cached keys are the encoder's length
        cross = [(flat[2 * i], flat[2 * i + 1]) for i in range(len(self.decoder.block))]
        logits, presents = self.run(input_ids, None, encoder_hidden_states, encoder_attention_mask, past, settings,
                                    cross)
        return logits, presents, cross

    def run(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask, past, settings, cross=None):
        x = self.shared(input_ids)  # [B, L, D]
        presents = []
        for index, block in enumerate(self.decoder.block):
            kv = cross[index] if cross is not None else cross_keys_values(block.layer[1].EncDecAttention,
                                                                          encoder_hidden_states)
            x, present = block(x, attention_mask, kv, encoder_attention_mask, None if past is None else past[index],
                               settings)
            presents.append(present)
        x = self.decoder.final_layer_norm(x) * self.rescale
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.shared.weight)  # [B, L, V]
        return logits, presents

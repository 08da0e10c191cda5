"""The T5 encoder (T5EncoderModel, or the encoder of T5ForConditionalGeneration) on our
biased attention, names as transformers' modeling_t5: RMS LayerNorms, unscaled attention
(q k^T without 1/sqrt(d)), the relative-position bias learned in the first block and shared by
all, ReLU or gated-GELU feed-forward. The bias is our t5 family, bidirectional, whose buckets
equal transformers' bit for bit; blocked export gives the encoder memory linear in L."""
from __future__ import annotations

from typing import ClassVar

from torch import nn

from ...biases import create_bias
from ...nn.attention import EAGER
from ..blocks import RMSNorm, merge_heads, scale_queries, self_attention, split_heads
from ..imported import ImportedModel, Shape

BIAS_KEY = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def t5_bias_params(config) -> dict:
    """Our t5 family's hyper-parameters from a T5Config."""
    return {"num_buckets": config.relative_attention_num_buckets,
            "max_distance": config.relative_attention_max_distance}


class T5Projections(nn.Module):
    """q, k, v, o of a T5 attention (self or cross), named as transformers names them."""

    def __init__(self, config):
        super().__init__()
        inner = config.num_heads * config.d_kv
        self.num_heads = config.num_heads
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)


class T5SelfAttention(T5Projections):
    def __init__(self, config, bias):
        super().__init__(config)
        self.position_bias = bias  # the first block's, shared by all

    def forward(self, x, attention_mask, settings):
        q, k, v = (split_heads(proj(x), self.num_heads) for proj in (self.q, self.k, self.v))  # [B, H, L, d]
        y, _ = self_attention(scale_queries(q, 1.0), k, v, attention_mask, None, self.position_bias, settings)
        return self.o(merge_heads(y))


class T5FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gated = config.is_gated_act
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = ACT2FN[config.dense_act_fn]

    def forward(self, x):
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


def normed_sublayer(config, **child: nn.Module) -> nn.Module:
    """A T5 sublayer as transformers names its weights (layer.N.<Child>, layer.N.layer_norm): one
    named child and the RMS norm before it. The caller runs them (each block's forward)."""
    (name, module), = child.items()
    layer = nn.Module()
    setattr(layer, name, module)
    layer.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
    return layer


class T5Block(nn.Module):
    """Self-attention, then the feed-forward, each after its norm. The sub-layers are the model
    class's (`attention(config, bias)`, `feed_forward(config)`): a variant swaps one there."""

    def __init__(self, config, bias, attention=T5SelfAttention, feed_forward=T5FeedForward):
        super().__init__()
        self.layer = nn.ModuleList([normed_sublayer(config, SelfAttention=attention(config, bias)),
                                    normed_sublayer(config, DenseReluDense=feed_forward(config))])

    def forward(self, x, attention_mask, settings):
        attn, ff = self.layer
        x = x + attn.SelfAttention(attn.layer_norm(x), attention_mask, settings)
        return x + ff.DenseReluDense(ff.layer_norm(x))


class T5Stack(nn.Module):
    def __init__(self, config, bias, **sublayers):
        super().__init__()
        self.block = nn.ModuleList(T5Block(config, bias, **sublayers) for _ in range(config.num_layers))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class T5Encoder(ImportedModel):
    """input_ids [B, L], attention_mask [B, L] -> last_hidden_state [B, L, d_model]. A variant
    with another attention or feed-forward (same weight names) is a subclass that sets one of
    the two below (tests/test_t5_seams.py)."""

    attention: ClassVar[type[nn.Module]] = T5SelfAttention
    feed_forward: ClassVar[type[nn.Module]] = T5FeedForward

    model_type = "t5"
    bias_name = "t5"
    sizes = {"vocab": "vocab_size", "hidden": "d_model", "heads": "num_heads", "layers": "num_layers",
             "head_dim": "d_kv"}
    embedding_key = "shared.weight"
    layer_key = "encoder.block.{}."
    heads_divide_hidden = False  # T5's heads are d_kv wide whatever d_model is
    arch = "encoder"
    role = "encoder"
    causal = False
    # int4: the encoder-decoder pair's error is the sum of both files'; at block 32 t5-base's pair
    # failed the policy (KL 0.0329 / 0.0355 nats at 64 / 512 tokens, budget 0.0296), at block 16
    # with the decoder's head in 8 bits it passes (0.0261 / 0.0283): docs/quantized.md
    default_quant_block = 16
    transformers_class = "T5EncoderModel"
    optimum_task = "text2text-generation"
    tied_keys = ("encoder.embed_tokens.weight",)
    ignored_prefixes = ("decoder.", "lm_head.")  # a T5ForConditionalGeneration folder: its encoder

    def __init__(self, config):
        super().__init__(config, Shape(config.num_heads, config.d_kv, config.num_layers, config.vocab_size))
        self.bias = create_bias("t5", config.num_heads, causal=False, **t5_bias_params(config))
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, self.bias, attention=self.attention, feed_forward=self.feed_forward)

    @classmethod
    def tiny_transformers_model(cls, tf, vocab, hidden, heads, layers, max_len, encoder_decoder: bool = False, **config):
        """T5EncoderModel, or with encoder_decoder the whole T5ForConditionalGeneration."""
        model_class = tf.T5ForConditionalGeneration if encoder_decoder else tf.T5EncoderModel
        sizes = dict(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden, num_layers=layers,
                     num_heads=heads)
        return model_class(tf.T5Config(**{**sizes, **config}))

    def weight_key(self, name: str) -> str:
        return BIAS_KEY if name == "bias.relative_attention_bias.weight" else name

    def forward(self, input_ids, attention_mask=None, settings=EAGER):
        x = self.shared(input_ids)  # [B, L, D]
        for block in self.encoder.block:
            x = block(x, attention_mask, settings)
        return self.encoder.final_layer_norm(x)

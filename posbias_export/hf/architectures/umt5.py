"""UMT5 (UMT5EncoderModel: the text encoder of current video-generation pipelines, and
UMT5ForConditionalGeneration's encoder and decoder): T5's with one difference, every layer
learns its own relative-position table (transformers' UMT5 gives each attention
has_relative_attention_bias) where T5 shares the first block's. Each layer's bias is our t5 family
with that layer's table, so the blocked export stays linear in L."""
from __future__ import annotations

from ...biases import create_bias
from .t5 import T5Encoder, t5_bias_params
from .t5_decoder import T5Decoder

OWN_TABLE = "SelfAttention.position_bias.relative_attention_bias"  # our name of a layer's table


class UMT5Encoder(T5Encoder):
    model_type = "umt5"
    transformers_class = "UMT5EncoderModel"

    def __init__(self, config):
        super().__init__(config)
        del self.bias  # no shared table: each block's attention gets its own below
        for block in self.encoder.block:
            block.layer[0].SelfAttention.position_bias = create_bias("t5", config.num_heads, causal=False,
                                                                     **t5_bias_params(config))

    @classmethod
    def tiny_transformers_model(cls, tf, vocab, hidden, heads, layers, max_len, encoder_decoder: bool = False, **config):
        model_class = tf.UMT5ForConditionalGeneration if encoder_decoder else tf.UMT5EncoderModel
        sizes = dict(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden, num_layers=layers,
                     num_heads=heads, feed_forward_proj="gated-gelu")
        return model_class(tf.UMT5Config(**{**sizes, **config}))

    def weight_key(self, name: str) -> str:
        return name.replace(OWN_TABLE, "SelfAttention.relative_attention_bias")


class UMT5Decoder(T5Decoder, part="decoder"):
    """The decoder of UMT5ForConditionalGeneration: T5's, each layer's causal self-attention with
    its own table."""

    model_type = "umt5"
    transformers_class = "UMT5ForConditionalGeneration"

    def __init__(self, config, own_head: bool, rescale: bool):
        super().__init__(config, own_head, rescale)
        del self.bias
        for block in self.decoder.block:
            block.layer[0].SelfAttention.position_bias = create_bias("t5", config.num_heads, causal=True,
                                                                     **t5_bias_params(config))

    def weight_key(self, name: str) -> str:
        return name.replace(OWN_TABLE, "SelfAttention.relative_attention_bias")

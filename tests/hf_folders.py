"""Tiny random-weight transformers models saved as local folders (no download): the models
the hf tests import, with head counts that are not powers of two."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
MPT_MAX_SEQ_LEN = 64


def _configs(tf):
    return {
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6)),
        "mpt": lambda: tf.MptForCausalLM(tf.MptConfig(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6,
                                                      max_seq_len=MPT_MAX_SEQ_LEN)),
        # transformers' default Falcon layout: multi-query, parallel attention and MLP
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                                                               num_attention_heads=6, alibi=True)),
        # the grouped ("new decoder") layout with two LayerNorms, sequential classic layout
        "falcon_grouped": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_kv_heads=2, alibi=True,
            new_decoder_architecture=True, bias=True)),
        "falcon_sequential": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, alibi=True,
            multi_query=False, parallel_attn=False, bias=True)),
        "t5": lambda: tf.T5EncoderModel(tf.T5Config(vocab_size=VOCAB, d_model=48, d_kv=8, d_ff=96, num_layers=2,
                                                    num_heads=6, relative_attention_max_distance=20)),
        # T5 v1.1 (gated GELU), saved as the full encoder-decoder: its encoder is what we import
        "t5_gated": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=48, d_kv=8, d_ff=96, num_layers=2, num_heads=6, feed_forward_proj="gated-gelu",
            relative_attention_num_buckets=16, relative_attention_max_distance=20)),
    }


KINDS = ("bloom", "mpt", "falcon", "falcon_grouped", "falcon_sequential", "t5", "t5_gated")


def model_type(kind: str) -> str:
    return kind.split("_")[0]


def save_tiny_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """Random weights large enough (std 0.1 on top of the init) that tokens differ step to step."""
    import transformers as tf

    torch.manual_seed(seed)
    _perturb(_configs(tf)[kind](), 0.1).save_pretrained(folder)
    return folder


def save_initialized_t5(folder: Path, seed: int = 0) -> Path:
    """A T5 v1.1 encoder-decoder (gated GELU) with transformers' own initialization, unperturbed:
    weights at the scale a trained T5 keeps. The perturbed folders above are sharper than any
    trained model (T5 does not scale its attention scores, so std-0.1 noise makes attention
    near one-hot), which quantization noise then flips: int4's KL measured 0.05-0.15 nats there,
    0.014-0.019 at this initialization (d_model 48) and 0.002-0.008 at d_model 192."""
    import transformers as tf

    torch.manual_seed(seed)
    tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=96, d_kv=16, d_ff=192, num_layers=2, num_heads=6, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=16, relative_attention_max_distance=20)).save_pretrained(folder)
    return folder


def _perturb(model, std: float):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    return model


CLIENT_KINDS = ("bloom", "mpt", "falcon", "t5")
PAD, BOS, EOS = 0, 1, 2  # the tokenizer's special tokens, written into every client folder's config


def _client_configs(tf):
    """Untied heads: with a tied one, a tiny random model mostly repeats its last token, and
    equal tokens would then prove little."""
    ids = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    return {
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6, **ids)),
        "mpt": lambda: tf.MptForCausalLM(tf.MptConfig(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6,
                                                      max_seq_len=2048, **ids)),
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                                                               num_attention_heads=6, alibi=True, **ids)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=48, d_kv=8, d_ff=96, num_layers=2, num_heads=6, feed_forward_proj="gated-gelu",
            decoder_start_token_id=PAD, **ids)),
    }


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer of VOCAB tokens (<pad>, <s>, </s> first), trained here on a
    line of text: tokenizer.json and tokenizer_config.json, as a Hub folder has them."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["To be, or not to be, that is the question: whether 'tis nobler in the mind"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}))


def save_client_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random model whose greedy tokens vary (untied head, weights + 0.5 noise), with a
    tokenizer: what a serving client loads."""
    import transformers as tf

    torch.manual_seed(seed)
    model = _perturb(_client_configs(tf)[kind](), 0.5)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_tokenizer(folder)
    return folder

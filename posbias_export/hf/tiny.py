"""The one factory of tiny random-weight transformers folders (no download): the models the tests
import, the client checks ship and the benches time. Each architecture of the registry makes its
own model (ImportedModel.tiny_transformers_model); a variant names one of its layouts.
tests/test_every_architecture.py fails when an architecture has no variant here."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .imported import PARTS
from .models import architecture

PAD, BOS, EOS = 0, 1, 2  # a client folder's special tokens (its config and tokenizer)


@dataclass(frozen=True)
class Variant:
    model_type: str
    config: dict = field(default_factory=dict)  # config fields beyond the sizes


VARIANTS = {
    "bloom": Variant("bloom"),
    "mpt": Variant("mpt"),
    # transformers' default Falcon layout: multi-query, parallel attention and MLP
    "falcon": Variant("falcon"),
    # the grouped ("new decoder") layout with two LayerNorms
    "falcon_grouped": Variant("falcon", dict(num_kv_heads=2, new_decoder_architecture=True, bias=True)),
    # the sequential classic layout
    "falcon_sequential": Variant("falcon", dict(multi_query=False, parallel_attn=False, bias=True)),
    "t5": Variant("t5"),  # T5EncoderModel
    # T5 v1.1 (gated GELU), the whole encoder-decoder
    "t5_gated": Variant("t5", dict(feed_forward_proj="gated-gelu", encoder_decoder=True)),
    # UMT5 (every layer its own relative-position table): the encoder alone
    "umt5": Variant("umt5"),
    "umt5_seq2seq": Variant("umt5", dict(encoder_decoder=True)),
    # jina-embeddings-v2 (small / base / de / es / zh) and its code model (q/k norms, up-gated feed-forward)
    "jina_bert": Variant("jina_bert"),
    "jina_bert_code": Variant("jina_bert", dict(layout="code")),
}


@dataclass(frozen=True)
class Sizes:
    vocab: int = 300
    hidden: int = 48
    heads: int = 6  # not a power of two: ALiBi's interleaved slopes
    layers: int = 2
    max_len: int = 64  # MPT's max_seq_len: validate's rows past it say transformers stops there


TESTS = Sizes()


def tiny_model(name: str, sizes: Sizes = TESTS, noise: float = 0.1, seed: int = 0, **config):
    """A random transformers model of the variant, with std-`noise` Gaussian noise on top of its
    initialization (enough that tokens differ step to step); `config`: more config fields."""
    import transformers as tf

    variant = VARIANTS[name]
    torch.manual_seed(seed)
    model = architecture(variant.model_type).tiny_transformers_model(
        tf, sizes.vocab, sizes.hidden, sizes.heads, sizes.layers, sizes.max_len, **{**variant.config, **config})
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p))
    return model


def save_tiny_folder(name: str, folder: Path, sizes: Sizes = TESTS, noise: float = 0.1, seed: int = 0,
                     client: bool = False, **config) -> Path:
    """The model saved as a local folder. client: as a serving client loads it (special token
    ids in its config, its generation config, an untied head: with a tied one a tiny random
    model mostly repeats its last token, and equal tokens would then prove little)."""
    if client:
        config = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, **config)
        if (VARIANTS[name].model_type, "decoder") in PARTS:  # an encoder-decoder's decoder starts from a token
            config.setdefault("decoder_start_token_id", PAD)
    model = tiny_model(name, sizes, noise, seed, **config)
    model.save_pretrained(folder)
    if client:
        model.generation_config.save_pretrained(folder)
    return Path(folder)


def save_tokenizer(folder: Path, vocab: int = TESTS.vocab, max_length: int | None = None) -> None:
    """A byte-level BPE tokenizer of `vocab` tokens (<pad>, <s>, </s> first), trained here on a
    line of text: tokenizer.json and tokenizer_config.json, as a Hub folder has them (with
    model_max_length where given: what an embedding client truncates to)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["To be, or not to be, that is the question: whether 'tis nobler in the mind"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **({"model_max_length": max_length}
                                                                             if max_length else {})}))

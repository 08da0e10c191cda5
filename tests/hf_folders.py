"""The tests' tiny folders, made by the package's one factory (posbias_export/hf/tiny.py): the
models the hf tests import (head counts that are not powers of two), and the client folders."""
from __future__ import annotations

from pathlib import Path


from posbias_export.hf.models import architecture
from posbias_export.hf.tiny import BOS, EOS, PAD, TESTS, VARIANTS, Sizes, save_tiny_folder, save_tokenizer  # noqa: F401

VOCAB = TESTS.vocab
MPT_MAX_SEQ_LEN = TESTS.max_len
# the variants transformers implements (test_hf_models.py compares with it); JinaBERT's: test_jina_bert.py
KINDS = tuple(k for k, v in VARIANTS.items() if architecture(v.model_type).transformers_class)
# the test folders' T5s: a smaller feed-forward and bucket range than the sizes imply
_T5 = dict(d_ff=96, relative_attention_max_distance=20)
TEST_CONFIG = {"t5": _T5, "t5_gated": dict(_T5, relative_attention_num_buckets=16)}


def model_type(kind: str) -> str:
    return VARIANTS[kind].model_type


def save_tiny_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """Random weights large enough (std 0.1 on top of the init) that tokens differ step to step."""
    return save_tiny_folder(kind, folder, noise=0.1, seed=seed, **TEST_CONFIG.get(kind, {}))


def cached_exports(folder_of, root: Path):
    """(variant, kv_cache) -> an inlined blocked export of folder_of(variant) under `root`, made on
    first use (block 16: several blocks at short lengths)."""
    from posbias_export.hf.export import export_model

    made = {}

    def get(variant: str, kv_cache: bool = False) -> Path:
        if (variant, kv_cache) not in made:
            path = root / f"{variant}_{int(kv_cache)}.onnx"
            export_model(folder_of(variant), path, kv_cache=kv_cache, inline_functions=True, block=16, check_growth=False)
            made[variant, kv_cache] = path
        return made[variant, kv_cache]

    return get


def save_initialized_t5(folder: Path, seed: int = 0) -> Path:
    """A T5 v1.1 encoder-decoder (gated GELU) with transformers' own initialization, unperturbed:
    weights at the scale a trained T5 keeps. The perturbed folders above are sharper than any
    trained model (T5 does not scale its attention scores, so std-0.1 noise makes attention
    near one-hot), which quantization noise then flips: int4's KL measured 0.05-0.15 nats there,
    0.014-0.019 at this initialization (d_model 48) and 0.002-0.008 at d_model 192."""
    return save_tiny_folder("t5_gated", folder, Sizes(hidden=96), noise=0.0, seed=seed, d_ff=192,
                            relative_attention_num_buckets=16, relative_attention_max_distance=20)


CLIENT_KINDS = ("bloom", "mpt", "falcon", "t5")
# a client's T5 is the whole gated encoder-decoder
_CLIENT = {"t5": ("t5_gated", dict(d_ff=96))}
CLIENT_SIZES = Sizes(max_len=2048)  # 2048 positions where a config has a limit (MPT's max_seq_len)


def client_variant(kind: str) -> str:
    """The tiny variant a client folder of `kind` is made from."""
    return _CLIENT.get(kind, (kind, {}))[0]


def seq2seq(kind: str) -> bool:
    """Whether a client folder of `kind` is an encoder-decoder (two files, Optimum's seq2seq layout):
    its architecture has a registered decoder part and the variant is the whole model."""
    from role_matrix import role

    return role(VARIANTS[client_variant(kind)]) == "seq2seq"


def positions_from_mask(kind: str) -> bool:
    """Whether a client folder's model takes its positions from the mask (a hole in it is then
    invisible) rather than from the key indices (MPT)."""
    return architecture(VARIANTS[client_variant(kind)].model_type).positions_from_mask


def save_client_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random model whose greedy tokens vary (untied head, weights + 0.5 noise), with a
    tokenizer: what a serving client loads."""
    variant, config = _CLIENT.get(kind, (kind, {}))
    save_tiny_folder(variant, folder, CLIENT_SIZES, noise=0.5, seed=seed, client=True, **config)
    save_tokenizer(Path(folder))
    return folder



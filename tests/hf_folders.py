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


# a client folder's extra config per variant (a smaller feed-forward for the seq2seq pair)
CLIENT_CONFIG = {"t5_gated": dict(d_ff=96)}
# Seeds whose random weights give greedy tokens that vary (the client tests' precondition: equal
# tokens prove little when a model repeats one). At seed 0 both Falcon layouts with biases loop on
# 2-4 distinct tokens in 12 for some row of the prompts; at seed 2 every row has 4-7.
CLIENT_SEEDS = {"falcon_grouped": 2, "falcon_sequential": 2}
CLIENT_SIZES = Sizes(max_len=2048)  # 2048 positions where a config has a limit (MPT's max_seq_len)


def seq2seq(variant: str) -> bool:
    """Whether a variant's client folder is an encoder-decoder (two files, Optimum's seq2seq layout)."""
    from role_matrix import role

    return role(VARIANTS[variant]) == "seq2seq"


def positions_from_mask(variant: str) -> bool:
    """Whether a variant's model takes its positions from the mask (a hole in it is then
    invisible) rather than from the key indices (MPT)."""
    return architecture(VARIANTS[variant].model_type).positions_from_mask


def save_client_model(variant: str, folder: Path, seed: int | None = None) -> Path:
    """A tiny random model whose greedy tokens vary (untied head, weights + 0.5 noise), with a
    tokenizer: what a serving client loads."""
    seed = CLIENT_SEEDS.get(variant, 0) if seed is None else seed
    save_tiny_folder(variant, folder, CLIENT_SIZES, noise=0.5, seed=seed, client=True, **CLIENT_CONFIG.get(variant, {}))
    save_tokenizer(Path(folder))
    return folder



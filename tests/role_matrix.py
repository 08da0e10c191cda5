"""Which architecture tests a tiny variant gets, decided by its role alone: every entry of
posbias_export/hf/tiny.py VARIANTS is a causal LM, a seq2seq pair or an encoder, and gets that
role's tests (tests/test_by_role.py), so adding a variant there is all it takes
(test_by_role.py proves it with a throwaway variant).

Expected failures are data beside the variant (EXPECTED_FAILURES, with the reason; strict, so a
fixed cause is noticed). The tier rule keeps CI's time: the first variant of each role runs by
default, the others under `-m slow` (each architecture's own modules are compared with
transformers for every variant in test_hf_models.py's default run), and the tests in ALWAYS_SLOW
run only there.
"""
from __future__ import annotations

import pytest

from posbias_export.hf.imported import PARTS
from posbias_export.hf.models import architecture
from posbias_export.hf.tiny import VARIANTS, Variant

# The serving clients' tests (tests/test_clients.py) on the folder --out-dir writes: the text-generation
# clients take a causal LM or a seq2seq pair; an encoder's clients (the embedders') have their own file.
CLIENT_TESTS = {
    "causal": ("transformers_js", "web", "genai", "genai_inplace", "triton", "gpu_folder", "generate_text",
               "validate_shipped", "folder_contents"),
    "seq2seq": ("transformers_js", "triton", "gpu_folder", "generate_text", "folder_contents"),
    "encoder": (),
}
ROLE_TESTS = {
    "causal": ("every_runtime", "greedy", "at_4096", *CLIENT_TESTS["causal"]),
    "seq2seq": ("pair", "cross_cache", *CLIENT_TESTS["seq2seq"]),
    "encoder": ("every_runtime", "at_4096"),  # the embedding, judged on every runtime
}
ALWAYS_SLOW = {"at_4096"}
# (variant, test) -> why it fails today
EXPECTED_FAILURES: dict[tuple[str, str], str] = {
    ("umt5_seq2seq", "transformers_js"): "transformers.js has no umt5 model type ('Unsupported model type: umt5')",
}


def role(variant: Variant) -> str:
    """causal, seq2seq (an architecture with a decoder part, made whole) or encoder."""
    if (variant.model_type, "decoder") in PARTS and variant.config.get("encoder_decoder"):
        return "seq2seq"
    return "encoder" if architecture(variant.model_type).arch == "encoder" else "causal"


def seq2seq_class(variant: Variant) -> str:
    """transformers' encoder-decoder class for a seq2seq variant (its decoder part names it)."""
    return PARTS[variant.model_type, "decoder"].transformers_class


def variants_for(test: str, variants: dict[str, Variant] | None = None) -> list[str]:
    variants = VARIANTS if variants is None else variants
    return [name for name, v in variants.items() if test in ROLE_TESTS[role(v)]]


def default_tier(variants: dict[str, Variant] | None = None) -> set[str]:
    """The first variant of each role (VARIANTS' order)."""
    variants = VARIANTS if variants is None else variants
    first: dict[str, str] = {}
    for name, v in variants.items():
        first.setdefault(role(v), name)
    return set(first.values())


def cases(test: str) -> list:
    """pytest params (id: the variant) for every variant whose role has `test`: slow outside the
    default tier, strict xfail where EXPECTED_FAILURES names it."""
    unknown = {t for _, t in EXPECTED_FAILURES} - {t for tests in ROLE_TESTS.values() for t in tests}
    if unknown:
        raise ValueError(f"EXPECTED_FAILURES names tests no role has: {sorted(unknown)}")
    fast = default_tier()
    out = []
    for name in variants_for(test):
        marks = [] if name in fast and test not in ALWAYS_SLOW else [pytest.mark.slow]
        if (name, test) in EXPECTED_FAILURES:
            marks.append(pytest.mark.xfail(reason=EXPECTED_FAILURES[name, test], strict=True))
        out.append(pytest.param(name, id=name, marks=marks))
    return out

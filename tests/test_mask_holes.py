"""Attention masks with holes: right padding followed by decode steps (what onnxruntime-genai
makes of a right-padded batch once it generates), and holes in the middle.

Imported models: the file (blocked and plain, ONNX Runtime; the blocked one also on the ONNX
reference evaluator) and transformers itself both within the parity policy of our float64
reference at every real token; a cached decoder prefilled with a right-padded batch, then fed
one token at a time, gives transformers' logits of the whole sequence at each step. BLOOM and
Falcon count positions by cumsum(mask) - 1 (a hole is no distance), MPT and the T5 encoder by
index, as transformers does. Our own --attention-mask exports: holes are invisible, the real
tokens give what the model gives for them alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from onnx.reference import ReferenceEvaluator  # noqa: E402

import posbias_export as pbe  # noqa: E402
import tiers
from conftest import cli_model, lm_inputs, ort_run, ort_session  # noqa: E402
from hf_folders import VOCAB, save_tiny_model  # noqa: E402
from posbias_export.hf import load_model  # noqa: E402
from posbias_export.hf.export import export_model  # noqa: E402
from posbias_export.hf.validate import transformers_model, transformers_tolerance  # noqa: E402
from posbias_export.nn import AttentionSettings  # noqa: E402
from posbias_export.parity import FLOAT32, compare, torch_outputs  # noqa: E402

LENGTH, PROMPT, PAD = 40, 17, 6  # row 0: a 17-token prompt, 6 pads (its batch's right padding), then decoding


def hole_masks() -> np.ndarray:
    """[3, 40]: right padding then decode steps; holes in the middle; left padding plus a hole."""
    mask = np.ones((3, LENGTH), np.int64)
    mask[0, PROMPT:PROMPT + PAD] = 0
    mask[1, [3, 4, 11, 20, 21, 22, 30]] = 0
    mask[2, :5] = 0
    mask[2, 25:28] = 0
    return mask


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("holes")
    return {kind: save_tiny_model(kind, root / kind) for kind in ("bloom", "mpt", "falcon", "t5")}


def _judge_at_real_tokens(got, ref64, same32, mask, tol=FLOAT32):
    keep = mask.astype(bool)
    parity = compare(got[keep], ref64[keep], same32[keep], tol)
    assert parity.passed, str(parity)


HOLES = [(k, form) for k in ("bloom", "mpt", "falcon", "t5") for form in ("blocked", "plain")]


@pytest.mark.parametrize("kind,form", tiers.cases(HOLES, [f"{k}-{form}" for k, form in HOLES],
                                                  slow={"mpt-plain", "falcon-plain", "t5-plain"}))
def test_imported_file_and_transformers_agree_under_holes(folders, tmp_path, kind, form):
    folder = folders[kind]
    path = tmp_path / f"{kind}.onnx"
    export_model(folder, path, attention=form, block=16, check_growth=False)
    ids = np.random.default_rng(1).integers(0, VOCAB, (3, LENGTH)).astype(np.int64)
    mask = hole_masks()
    ours = load_model(folder)
    settings = AttentionSettings(form=form, block=16)
    args = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        ref64 = ours.double()(*args, settings=settings).numpy()
        same32 = ours.float()(*args, settings=settings).numpy()
        out = transformers_model(folder, kind)(input_ids=args[0], attention_mask=args[1])
        theirs = (out.last_hidden_state if ours.arch == "encoder" else out.logits).numpy()
    _judge_at_real_tokens(theirs, ref64, same32, mask, transformers_tolerance(ours, LENGTH))  # the model is theirs
    _judge_at_real_tokens(ort_run(ort_session(path), ids, mask), ref64, same32, mask)  # the file is the model
    if form == "blocked":
        got = ReferenceEvaluator(str(path)).run(None, {"input_ids": ids, "attention_mask": mask})[0]
        _judge_at_real_tokens(got, ref64, same32, mask)


@pytest.mark.parametrize("kind", tiers.cases(["bloom", "mpt", "falcon"], ["bloom", "mpt", "falcon"], slow={"mpt"}))
def test_cached_decoder_after_right_padding_gives_transformers_logits(folders, tmp_path, kind):
    """Prefill the padded prompt [B, 23] (row 0 right-padded), then one token per step with the
    mask growing by a 1: each step's logits are transformers' logits of the whole sequence under
    the whole mask at that position (float32 both sides, |logits| ~ 1-10)."""
    folder = folders[kind]
    path = tmp_path / f"{kind}_kv.onnx"
    export_model(folder, path, kv_cache=True, block=16, check_growth=False)
    session = ort_session(path)
    ids = np.random.default_rng(2).integers(0, VOCAB, (3, LENGTH)).astype(np.int64)
    mask = hole_masks()
    with torch.no_grad():
        out = transformers_model(folder, kind)(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    expected = out.logits.numpy()
    names = [i.name for i in session.get_inputs()]
    ours = load_model(folder)
    past = {n: np.zeros((3, ours.num_kv_heads, 0, ours.head_dim), np.float32) for n in names if n.startswith("past_")}
    start = PROMPT + PAD
    for stop in [start, *range(start + 1, LENGTH + 1)]:
        first = 0 if stop == start else stop - 1
        outputs = session.run(None, {"input_ids": ids[:, first:stop], "attention_mask": mask[:, :stop], **past})
        past = {n.replace("present_", "past_"): v for n, v in zip([o.name for o in session.get_outputs()][1:], outputs[1:])}
        keep = mask[:, first:stop].astype(bool)
        err = np.abs(outputs[0] - expected[:, first:stop])[keep].max()
        assert err < 1e-4, f"{kind}: positions {first}..{stop - 1} off by {err:.2e}"


# every family blocked (each block plan path); the plain form, where every family shares one
# masked attention, for a key-row and a table family in the default run, all with -m slow
OWN = [(b, form) for form in ("blocked", "plain") for b in pbe.BIASES]


@pytest.mark.parametrize("bias,form", tiers.cases(
    OWN, [f"{b}-{form}" for b, form in OWN], slow={f"{b}-plain" for b in pbe.BIASES if b not in ("alibi", "kerple_log")}))
def test_own_attention_mask_exports_see_no_holes(exports, bias, form):
    """Positions come from cumsum(mask) - 1: every row's real tokens give, through the file,
    what the model gives for those tokens alone (float64 reference, the parity policy)."""
    # the blocked files are test_parity_ort.py's padded-row files (16-row blocks: the Loop runs)
    extra = ("--attention-mask", "--block", "16") if form == "blocked" else ("--attention-mask", "--attention", "plain")
    session = ort_session(exports.cli(bias, "lm", True, extra))
    ids = lm_inputs(3, LENGTH, seed=3)
    mask = torch.from_numpy(hole_masks())
    out = ort_run(session, ids, mask)
    assert np.isfinite(out).all()
    model = cli_model(bias)
    for row in range(3):
        keep = mask[row].bool()
        alone = (ids[row:row + 1, keep],)
        parity = compare(out[row:row + 1, keep.numpy()], torch_outputs(model, alone, torch.float64),
                         torch_outputs(model, alone, torch.float32), FLOAT32)
        assert parity.passed, f"row {row}: {parity}"

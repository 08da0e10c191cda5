"""UMT5 (every layer its own relative-position table) from transformers' own folders: the encoder
alone is covered with every architecture (test_every_architecture.py, test_hf_models.py); here the
encoder-decoder folder shipped with --out-dir, its two files judged as a client runs them, and
greedy generation through our runner equal to transformers' generate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from posbias_export.hf.tiny import EOS, PAD, save_tiny_folder  # noqa: E402
from posbias_export.parity import load_runner  # noqa: E402
from posbias_export.validation import validate  # noqa: E402


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    from posbias_export.hf.ship import ship

    root = tmp_path_factory.mktemp("umt5")
    source = save_tiny_folder("umt5_seq2seq", root / "src", client=True, noise=0.5)
    ship(source, root / "out", check_growth=False)
    return source, root / "out"


def test_each_layer_has_its_own_table(shipped):
    from posbias_export.hf.models import load_model

    source, _ = shipped
    for part, stack in (("encoder", "encoder"), ("decoder", "decoder")):
        model = load_model(source, part)
        tables = [b.layer[0].SelfAttention.position_bias.relative_attention_bias.weight
                  for b in getattr(model, stack).block]
        assert len(tables) == 2 and not torch.equal(tables[0], tables[1])


def test_the_shipped_pair_passes_validate_against_transformers(shipped):
    """The encoder's states into the merged decoder on ONNX Runtime, left-padded sources,
    judged against the float64 module and beside transformers' UMT5ForConditionalGeneration."""
    source, out = shipped
    files = [out / "encoder_model.onnx", out / "decoder_model_merged.onnx"]
    result = validate(files, ["ort-cpu"], (1, 17, 80), batch=3, model_dir=source, order=False)
    bad = [(m.arch, c.runtime, c.case, c.verdict) for m in result.matrices for c in m.cells if not c.ok]
    assert result.ok, bad
    pair = result.matrices[-1]
    assert "umt5 encoder-decoder" in pair.arch and "transformers" in {c.runtime for c in pair.cells}


def test_greedy_generation_equals_transformers(shipped):
    import transformers as tf

    source, out = shipped
    gen = load_runner("ort/seq2seq.py")
    ids = np.random.default_rng(3).integers(3, 300, (1, 24)).astype(np.int64)
    mask = np.ones_like(ids)
    ours = gen.greedy_generate(str(out / "encoder_model.onnx"), str(out / "decoder_model_merged.onnx"), ids, mask, 12,
                               start_token=PAD, eos_ids=(EOS,))
    model = tf.UMT5ForConditionalGeneration.from_pretrained(str(source)).eval()
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                max_new_tokens=12, do_sample=False)[0, 1:].numpy()  # after the start token
    assert len(set(theirs.tolist())) > 2, theirs  # tokens that vary: equality proves something
    assert np.array_equal(ours[0], theirs), (ours[0], theirs)

"""The transformers baselines the benches time (peers/eager_runs.py) load each seq2seq folder
with its own classes: a UMT5 folder read by T5's classes would drop every layer's bias table
but the first and still run, timing (and, for the streamed encoder, judging against) another model."""
import numpy as np
import pytest

from posbias_export.hf import tiny
from posbias_export.peers import eager_runs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("variant, encoder, seq2seq", [
    ("umt5_seq2seq", "UMT5EncoderModel", "UMT5ForConditionalGeneration"),
    ("t5_gated", "T5EncoderModel", "T5ForConditionalGeneration"),
    ("umt5", "UMT5EncoderModel", None),
])
def test_baselines_use_the_folders_own_classes(tmp_path, variant, encoder, seq2seq):
    folder = tiny.save_tiny_folder(variant, tmp_path / variant)
    assert eager_runs.seq2seq_encoder_class(str(folder)).__name__ == encoder
    if seq2seq:
        got = eager_runs.seq2seq_greedy(str(folder), 16, 3, threads=1)
        assert len(got["decode_ms"]) == 2 and got["prefill_s"] > 0
        loaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder)
        assert type(loaded).__name__ == seq2seq


def test_streamed_encoder_equals_the_whole_umt5_encoder(tmp_path):
    """The block-by-block encoder (weights read per block) gives transformers' own encoder's states
    on a UMT5 folder, whose layers each have their own table (float32 rounding only: 1e-5)."""
    import torch

    folder = tiny.save_tiny_folder("umt5_seq2seq", tmp_path / "umt5")
    ids = np.arange(1, 41, dtype=np.int64)[None] % 290 + 3
    streamed = eager_runs.encoder_streamed(str(folder), ids, threads=1)
    whole = transformers.UMT5EncoderModel.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = whole(input_ids=torch.from_numpy(ids)).last_hidden_state[0].numpy()
    assert np.abs(streamed - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max())
    forward = eager_runs.encoder_forward(str(folder), 16, threads=1)
    assert forward["prefill_s"] > 0

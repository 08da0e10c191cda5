"""bench-serving's llama.cpp rows (peers/llama_cpp_runs.py): the GGUF its own converter makes from a
BLOOM folder decodes, through the loop our files are timed by, what transformers computes.
Needs llama-cpp-python and LLAMA_CPP_CONVERTER (the converter from its sdist): skipped otherwise."""
from __future__ import annotations

import numpy as np
import pytest

from posbias_export.peers import llama_cpp_runs

pytestmark = pytest.mark.skipif(llama_cpp_runs.missing() is not None, reason=str(llama_cpp_runs.missing()))


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_llama_cpp_steps_follow_transformers(tmp_path, family):
    """A prompt then one step, against transformers float32: llama.cpp keeps its cache in float16
    (keys and values rounded by up to 2^-11 of themselves), measured 5e-4 (BLOOM, logits up to
    4.5) and 1.1e-3 (MPT, up to 2.2); the bound is 2e-3. MPT goes through the converter under
    MosaicML's class name (transformers' port keeps its config keys and tensor names). The Q4_0
    file (llama.cpp's quantizer on the f32 file) runs too."""
    import torch
    import transformers as tf
    from hf_folders import save_tiny_model

    folder = save_tiny_model(family, tmp_path / family)
    ids = np.arange(5, 25)[None]
    model = tf.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
    with torch.no_grad():
        expected = model(torch.tensor(np.concatenate([ids, [[7]]], 1))).logits.numpy()[0, -2:]
    f32 = llama_cpp_runs.causal_gguf(folder, tmp_path / "m.gguf", "float32")
    step = llama_cpp_runs.causal_steps(str(f32), 64, threads=1)()
    got = [step(ids, np.ones_like(ids))[0, 0], step(np.array([[7]]), np.ones((1, 21)))[0, 0]]
    assert np.abs(np.stack(got) - expected).max() < 2e-3
    q4 = llama_cpp_runs.causal_gguf(folder, tmp_path / "q4.gguf", "int4")
    assert q4.stat().st_size < f32.stat().st_size / 2 and not (tmp_path / "q4.gguf.f32").exists()
    assert np.isfinite(llama_cpp_runs.causal_steps(str(q4), 64, threads=1)()(ids, None)).all()

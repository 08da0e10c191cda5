"""A quantized embedder is judged on its embeddings (parity/embedding.py): the mean of the valid
tokens' states, L2-normalised, by cosine to the float64 reference's, per row of the batch. The
judge is checked against PyTorch's own pooling and cosine, and on real files: a JinaBERT int8 /
int4 export passes on every runtime that runs it, and one whose weight scales were edited fails."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from posbias_export.parity.embedding import judge

pytest.importorskip("transformers")


def torch_cosines(actual, ref, mask):
    """Independent: masked mean pooling and cosine by PyTorch on [B, L, D]."""
    m = torch.from_numpy(mask).double()[..., None]
    pool = lambda x: (torch.from_numpy(x).double() * m).sum(1) / m.sum(1)
    return torch.nn.functional.cosine_similarity(pool(actual), pool(ref), dim=-1).numpy()


def test_the_judge_pools_each_row_over_its_valid_tokens_as_pytorch_does():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((3, 5, 8))
    actual = ref + 0.05 * rng.standard_normal(ref.shape)
    actual[2] += 1.5 * rng.standard_normal((5, 8))  # the third row moves far
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], bool)
    actual[~mask] = 1e6  # padding never counts
    want = torch_cosines(np.where(mask[..., None], actual, 0), ref, mask.astype(np.int64))
    got = judge(actual[mask], ref[mask], mask, "int8")
    assert got.cosine_min == pytest.approx(want.min(), abs=1e-12) and got.cosine_mean == pytest.approx(want.mean())
    assert want[:2].min() > 0.99 > want[2] and not got.passed  # one row off fails the file
    assert judge(actual[mask][:5], ref[mask][:5], mask[:1], "int8").passed  # the first row alone passes


def test_a_nan_fails_and_the_budget_is_the_schemes():
    ref = np.ones((4, 2))
    actual = ref.copy()
    actual[1, 0] = np.nan
    assert not judge(actual, ref, np.ones((1, 4), bool), "int4").passed
    assert judge(ref, ref, np.ones((1, 4), bool), "int4").budget_cosine == 0.97


@pytest.fixture(scope="module")
def jina(tmp_path_factory):
    from posbias_export.hf.tiny import save_tiny_folder

    return save_tiny_folder("jina_bert", tmp_path_factory.mktemp("jina") / "src")


@pytest.mark.parametrize("argv", [["--quantize", "int8"], ["--quantize", "int4", "--quant-block", "16"]])
def test_a_quantized_jina_embedder_passes_on_every_runtime_that_runs_it(jina, tmp_path, argv):
    from posbias_export.cli import main as cli_main
    from posbias_export.validation import validate

    path = tmp_path / "q.onnx"
    assert cli_main(["--model", str(jina), "--out", str(path), "--skip-growth-check", *argv]) == 0
    result = validate([path], None, (17, 300), batch=3, model_dir=jina, order=False)
    cells = result.matrices[0].cells
    assert result.ok and {c.runtime for c in cells} >= {"ort-cpu", "node"}, [(c.runtime, c.verdict) for c in cells]
    assert all(c.dtype.endswith("(embeddings)") and c.parity["cosine_min"] >= c.parity["budget_cosine"] for c in cells)


def test_an_int8_embedder_with_edited_scales_fails(jina, tmp_path):
    from posbias_export.cli import main as cli_main
    from posbias_export.validation import validate

    path = tmp_path / "q.onnx"
    assert cli_main(["--model", str(jina), "--out", str(path), "--skip-growth-check", "--quantize", "int8"]) == 0
    proto = onnx.load(str(path))
    scales = [t for t in proto.graph.initializer if t.name.endswith("_scale") and "embeddings" not in t.name][:3]
    assert len(scales) == 3
    for t in scales:  # three linear layers' weights, each 4x too large: a quantizer's scale bug
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 4, t.name))
    onnx.save(proto, str(tmp_path / "bad.onnx"))
    bad = validate([tmp_path / "bad.onnx"], ("ort-cpu",), (17,), batch=2, model_dir=jina, order=False).matrices[0]
    assert [c.verdict[:4] for c in bad.cells] == ["FAIL"], [(c.case, c.verdict, c.parity) for c in bad.cells]

"""--external-data: a file under protobuf's limit written as model.onnx + model.onnx.data, so
ONNX Runtime maps its tensors (and releases what it prepacks) instead of holding the parsed
file. The numbers must be the one-file export's, bit for bit: only where the bytes lie changes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from posbias_export.export.quantize.schemes import scheme as quant_scheme

pytest.importorskip("transformers")
from hf_folders import save_tiny_model  # noqa: E402
from posbias_export.hf.export import export_model  # noqa: E402


@pytest.fixture(scope="module")
def bloom(tmp_path_factory) -> Path:
    return save_tiny_model("bloom", tmp_path_factory.mktemp("bloom") / "bloom")


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past_"):  # an empty cache: the prompt is the whole sequence
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    return session.run(["logits"], feeds)[0]


@pytest.mark.parametrize("quantize", [None, "int4", "int8"])
def test_external_data_file_computes_the_one_file_exports_numbers(bloom, tmp_path, quantize):
    options = dict(kv_cache=True, target="ort", check_growth=False,
                   quantize=quant_scheme(quantize) if quantize else None)
    whole, split = tmp_path / "one" / "m.onnx", tmp_path / "two" / "m.onnx"
    for out, external in ((whole, False), (split, True)):
        out.parent.mkdir()
        export_model(bloom, out, external_data=external, **options)
    assert sorted(p.name for p in whole.parent.iterdir()) == ["m.onnx"]
    assert sorted(p.name for p in split.parent.iterdir()) == ["m.onnx", "m.onnx.data"]
    graph = onnx.load(str(split), load_external_data=False).graph
    moved = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    # the tied table lies in the data file, and nothing large stays inside (the tracer keeps
    # tensors under 32 KiB in the graph: at real size, norms and biases)
    assert "lm.transformer.word_embeddings.weight" in {t.name for t in moved} or quantize
    assert max(t.ByteSize() for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL) < 1 << 16
    ids = np.random.default_rng(0).integers(0, 200, (1, 37))
    np.testing.assert_array_equal(_logits(split, ids), _logits(whole, ids))
    if quantize == "int4":  # the tied table: the embedding reads the head's bytes under names of its own, stored once
        where = {t.name: tuple((e.key, e.value) for e in t.external_data) for t in moved}
        aliases = {name: name[: -len("_rows")] for name in where if name.endswith("_rows")}
        assert aliases and all(where[alias] == where[head] for alias, head in aliases.items())
        assert not any(t.name.endswith("_rows") for t in onnx.load(str(whole), load_external_data=False).graph.initializer)
        stored = sum(int(dict(w)["length"]) for w in set(where.values()))
        assert (split.parent / "m.onnx.data").stat().st_size < stored + 4096 * len(set(where.values()))
        assert whole.stat().st_size < stored + split.stat().st_size + 64 * len(where)
    elif quantize == "int8":  # its column gathers read the head's own tensors (tied.py says why)
        assert not any(t.name.endswith("_rows") for t in moved)


def test_out_dir_refuses_external_data(bloom, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "posbias_export", "--model", str(bloom), "--out-dir",
                           str(tmp_path / "serve"), "--external-data"], capture_output=True, text=True)
    assert done.returncode == 2 and "--external-data" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "serve").exists()

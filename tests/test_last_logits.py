"""A server's decoder session computes the last position's logits only (runtimes/common/last_logits.py):
the same numbers as the file's own last row, for a file with its tensors inside and one with them
in a .data file loaded from another folder; a graph without a head is left as it is."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from hf_folders import save_client_model
from posbias_export.hf.ship import ship

RUNTIMES = Path(__file__).resolve().parents[1] / "runtimes"
sys.path.insert(0, str(RUNTIMES))

from common.last_logits import last_position_graph  # noqa: E402
from common.loading import load_runner  # noqa: E402

PROMPT = np.array([[5, 17, 42, 8, 99, 23, 4, 61, 7, 250, 3]], np.int64)


@pytest.fixture(scope="module")
def decoder_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("last")
    ship(save_client_model("bloom", root / "bloom"), root / "out", check_growth=False)
    return root / "out" / "model.onnx"


def logits_both_ways(path: Path, prompt: np.ndarray, new: int = 3):
    """(full session's last rows, last-logits session's rows) for a prompt then `new` greedy steps."""
    generate = load_runner("ort/generate.py")
    full = generate.CachedDecoder(str(path), "cpu")
    last = generate.CachedDecoder(str(path), "cpu", last_logits=True)
    pairs, ids = [], prompt
    buffers = {d: d.shared_cache(1, 64) for d in (full, last)}
    for step in range(new + 1):
        mask = np.ones((1, prompt.shape[1] + step), np.int64)
        a = full.step_shared(ids, mask, buffers[full])
        b = last.step_shared(ids, mask, buffers[last])
        pairs.append((a[:, -1:], b))
        ids = np.argmax(a[:, -1:], axis=-1).astype(np.int64)
    return pairs


def test_the_last_rows_are_the_files_own(decoder_file):
    for full, last in logits_both_ways(decoder_file, PROMPT):
        assert last.shape == full.shape  # [1, 1, V]: one position, not the prompt's 11
        # float32 rounding only: the same matmul on one row instead of eleven (|logits| ~ 1-10)
        np.testing.assert_allclose(last, full, rtol=0, atol=1e-4)


def test_a_file_holding_its_weights_is_not_parsed_whole(decoder_file):
    """The edited graph carries no weight: each one names its bytes in the file itself (the rows
    above are computed from that), so no copy of the file is parsed and serialized again."""
    full = onnx.load(str(decoder_file))
    big = {t.name: t for t in full.graph.initializer if len(t.raw_data) > 4096}
    assert big  # the shipped tiny decoder holds its weights
    edited = {t.name: t for t in last_position_graph(str(decoder_file)).graph.initializer}
    data = decoder_file.read_bytes()
    for name, tensor in big.items():
        where = {e.key: e.value for e in edited[name].external_data}
        assert not edited[name].raw_data and where["location"] == decoder_file.name
        offset, length = int(where["offset"]), int(where["length"])
        assert data[offset:offset + length] == tensor.raw_data


def test_external_tensors_are_found_beside_the_file(decoder_file, tmp_path, monkeypatch):
    """A file whose tensors lie in a .data file, loaded from another working folder: the edited
    graph (handed to ONNX Runtime as bytes) still finds them."""
    elsewhere = tmp_path / "model"
    elsewhere.mkdir()
    proto = onnx.load(str(decoder_file))
    onnx.save_model(proto, str(elsewhere / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=0)
    monkeypatch.chdir(tmp_path)
    for full, last in logits_both_ways(elsewhere / "model.onnx", PROMPT, new=1):
        np.testing.assert_allclose(last, full, rtol=0, atol=1e-4)


def test_a_graph_without_a_head_is_left_alone(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "L", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "L", 4])])
    onnx.save_model(helper.make_model(graph), str(tmp_path / "relu.onnx"))
    assert last_position_graph(str(tmp_path / "relu.onnx")) is None

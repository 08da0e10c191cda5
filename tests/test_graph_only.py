"""A file's graph is read without its weights' bytes (runtimes/common/graph_only.py): the same
model as onnx's own parse, less each initializer's values, at a memory cost that does not grow with
the weights (a server's replica read jina-v2-base's 547 MB graph at 1082 MiB of RSS before)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from posbias_export.cli import main as cli_main
from posbias_export.runners import RUNTIMES_DIR, runtimes_common

graph_only = runtimes_common("graph_only")
HEADER = ("name", "data_type", "dims", "external_data", "data_location")


def _without_values(proto: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's parse with each top-level initializer cut to the fields graph_only keeps."""
    for tensor in proto.graph.initializer:
        header = onnx.TensorProto()
        for name in HEADER:
            if name in ("dims", "external_data"):
                getattr(header, name).extend(getattr(tensor, name))
            elif tensor.HasField(name):
                setattr(header, name, getattr(tensor, name))
        tensor.CopyFrom(header)
    return proto


@pytest.mark.parametrize("argv", [["--kv-cache", "--target", "ort"], ["--quantize", "int4"]], ids=["inplace", "int4"])
def test_the_graph_is_onnx_parse_less_the_values(tmp_path, argv):
    path = tmp_path / "model.onnx"
    assert cli_main(["--bias", "alibi", "--heads", "2", "--dim", "32", "--layers", "1", "--skip-growth-check",
                     "--out", str(path), *argv]) == 0
    full = onnx.load(str(path))
    assert sum(len(t.raw_data) for t in full.graph.initializer) > 10_000  # the file holds its weights
    got = graph_only.load_graph_only(path)
    assert got == _without_values(full)
    assert not any(t.raw_data for t in got.graph.initializer)


def test_external_tensors_keep_where_they_lie(tmp_path):
    table = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "input_ids"], ["y"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["L"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["L", 64])], [table])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    got = graph_only.load_graph_only(path)
    assert got == _without_values(onnx.load(str(path), load_external_data=False))
    assert [e.value for e in got.graph.initializer[0].external_data if e.key == "location"] == ["m.data"]
    assert runtimes_common("graph_facts").read_graph_facts(path).embedding_rows == 64


def test_reading_a_large_file_does_not_hold_its_weights(tmp_path):
    """A 256 MB table: onnx's parse holds the file's bytes and the parsed copy (>= 512 MB more
    peak RSS); the graph alone stays within 64 MB of the interpreter's own (the file's pages are
    never touched)."""
    table = numpy_helper.from_array(np.ones((65536, 1024), np.float32), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "input_ids"], ["y"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["L"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["L", 1024])], [table])
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph), str(path))
    del table, graph
    probe = (f"import resource, sys; sys.path.insert(0, {str(RUNTIMES_DIR)!r}); import onnx\n"
             "from common.graph_facts import read_graph_facts\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             f"facts = read_graph_facts({str(path)!r})\n"
             "print(facts.embedding_rows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)")
    rows, grown_kb = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                    check=True).stdout.split()
    assert int(rows) == 65536
    assert int(grown_kb) < 64 * 1024, f"peak RSS grew {int(grown_kb) // 1024} MiB reading a 256 MB file's graph"


def test_a_cut_file_is_refused(tmp_path):
    path = tmp_path / "model.onnx"
    assert cli_main(["--bias", "alibi", "--heads", "2", "--dim", "32", "--layers", "1", "--skip-growth-check",
                     "--out", str(path)]) == 0
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="cut short"):
        graph_only.load_graph_only(cut)
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        graph_only.load_graph_only(tmp_path / "empty.onnx")
    assert runtimes_common("graph_facts").read_graph_facts(cut) is None  # the runtime's own load reports it


@pytest.mark.parametrize("bias", ["alibi", "sandwich", "t5"])
def test_small_constants_keep_their_values_and_the_cuda_check_agrees(tmp_path, bias):
    """keep_bytes: the small initializers come whole (ONNX Runtime's CUDA placement reads their
    values), so host_reads finds from the light graph what it finds from onnx's whole parse."""
    reads = runtimes_common("host_reads")
    path = tmp_path / f"{bias}.onnx"
    assert cli_main(["--bias", bias, "--heads", "2", "--dim", "32", "--layers", "1", "--skip-growth-check",
                     "--out", str(path)]) == 0
    full = onnx.load(str(path))
    light = graph_only.load_graph_only(path, reads.SMALL_BYTES)
    small = [t for t in full.graph.initializer if int(np.prod(t.dims)) <= reads.SMALL_CONSTANT]
    assert small and all(t in light.graph.initializer for t in small)
    assert any(t.raw_data for t in full.graph.initializer if t not in light.graph.initializer)  # weights left out
    assert (reads.risky_host_reads(light), reads.unfused_loops(light)) == (reads.risky_host_reads(full),
                                                                           reads.unfused_loops(full))

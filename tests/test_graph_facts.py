"""What a file is comes from its graph, not from a label that a tool may strip or a person may edit
(runtimes/common/graph_facts.py): an in-place cache file whose target label is gone still runs with
its cache in one buffer, and a label claiming more token rows than the table holds cannot let an
out-of-table id through (int4's GatherBlockQuantized reads past its table unchecked)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from posbias_export.cli import main as cli_main
from posbias_export.parity import load_runner
from posbias_export.runners import runtimes_common

SMALL = ["--heads", "2", "--dim", "32", "--layers", "1", "--skip-growth-check"]


def relabelled(path, out, **labels):
    """The file with posbias.* labels replaced (None: removed)."""
    proto = onnx.load(str(path))
    kept = {p.key: p.value for p in proto.metadata_props}
    for key, value in labels.items():
        kept.pop(f"posbias.{key}", None)
        if value is not None:
            kept[f"posbias.{key}"] = value
    del proto.metadata_props[:]
    for key, value in kept.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(out))
    return out


@pytest.mark.parametrize("label", [None, "portable"], ids=["stripped", "forged"])
def test_an_inplace_file_without_its_target_label_still_writes_in_place(tmp_path, label):
    path = tmp_path / "kv.onnx"
    assert cli_main(["--bias", "alibi", "--kv-cache", "--target", "ort", "--out", str(path), *SMALL]) == 0
    bare = relabelled(path, tmp_path / "bare.onnx", target=label)
    runner = load_runner("ort/generate.py")
    decoders = [runner.CachedDecoder(str(p)) for p in (path, bare)]
    assert decoders[1].inplace  # bound to one buffer, as the labelled file
    assert runner.generate(decoders[1], [b"To be, or not", b"Hi"], 16) == runner.generate(decoders[0], [b"To be, or not", b"Hi"], 16)


def test_a_forged_vocabulary_label_does_not_widen_the_table(tmp_path, capsys):
    path = tmp_path / "q4.onnx"
    assert cli_main(["--bias", "alibi", "--kv-cache", "--quantize", "int4", "--out", str(path), *SMALL]) == 0
    forged = relabelled(path, tmp_path / "forged.onnx", vocab_size="100000")
    runner = load_runner("ort/generate.py")
    decoder = runner.CachedDecoder(str(forged))
    assert decoder.vocab == 256  # the byte model's table, whatever the label says
    with pytest.raises(runner.RunnerError, match="token id 300 is outside the vocabulary"):
        decoder.step(np.array([[5, 300]], np.int64), np.ones((1, 2), np.int64), decoder.empty_past(1))


def test_the_graph_facts_of_each_kind_of_file(tmp_path):
    facts = runtimes_common("graph_facts")
    for argv, rows, inplace in ((["--kv-cache"], 256, False), (["--kv-cache", "--target", "ort"], 256, True),
                                (["--quantize", "int8"], 256, False), (["--quantize", "int4"], 256, False)):
        path = tmp_path / f"{len(argv)}{argv[-1]}.onnx"
        assert cli_main(["--bias", "alibi", "--out", str(path), *SMALL, *argv]) == 0
        got = facts.read_graph_facts(path)
        assert (got.embedding_rows, got.inplace_cache) == (rows, inplace), argv
    assert facts.read_graph_facts(tmp_path / "missing.onnx") is None

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


def _prepacking_off(decoder) -> bool:
    options = decoder.session.get_session_options()
    try:
        return options.get_session_config_entry("session.disable_prepacking") == "1"
    except RuntimeError:  # never set: ONNX Runtime's default, prepacking on
        return False


def test_a_cpu_decoder_prepacks_only_quantized_weights(tmp_path):
    """generate's session holds float weights once (no prepacked copies: their steps cost the same)
    and keeps the packed copies integer matmuls need; --lean-memory / --prepack override it."""
    runner = load_runner("ort/generate.py")
    files = {}
    for name, argv in (("float", []), ("int8", ["--quantize", "int8"]), ("int4", ["--quantize", "int4"])):
        files[name] = tmp_path / f"{name}.onnx"
        assert cli_main(["--bias", "alibi", "--kv-cache", "--target", "ort", "--out", str(files[name]), *SMALL, *argv]) == 0
    chosen = {name: runner.CachedDecoder(str(path)) for name, path in files.items()}
    assert {name: (d.lean, _prepacking_off(d)) for name, d in chosen.items()} == {
        "float": (True, True), "int8": (False, False), "int4": (False, False)}
    packed = runner.CachedDecoder(str(files["float"]), lean=False)
    assert not _prepacking_off(packed) and _prepacking_off(runner.CachedDecoder(str(files["int4"]), lean=True))
    # the same numbers either way: the same float32 products, summed by a packed or an unpacked kernel
    # (K = 32 terms of this width: 1e-5 is some hundred roundings of float32's 6e-8)
    ids = np.random.default_rng(0).integers(0, 256, (1, 302))
    steps = [runner.stepper(d, 1, 320) for d in (chosen["float"], packed)]
    for length in (300, 301, 302):
        got, want = (step(ids[:, :length] if length == 300 else ids[:, length - 1:length], np.ones((1, length), np.int64))
                     for step in steps)
        np.testing.assert_allclose(got[:, -1], want[:, -1], rtol=0, atol=1e-5)


def test_generate_takes_one_prepacking_choice(tmp_path, capsys):
    runner = load_runner("ort/generate.py")
    with pytest.raises(SystemExit) as stop:
        runner.main([str(tmp_path / "m.onnx"), "--prompt", "x", "--lean-memory", "--prepack"])
    assert stop.value.code == 2 and "not allowed with" in capsys.readouterr().err

"""Export options as one value (export/options.py) and quantization schemes as classes
(export/quantize/schemes.py): bad values are one line, options that do nothing are refused, and the
command line, the API and a scheme's own flags describe the same export."""
from __future__ import annotations

import pytest

from posbias_export.cli import main as cli_main
from posbias_export.export.options import ExportOptions, options_from
from posbias_export.export.quantize.schemes import SCHEMES, Int4, Int8, checked_scheme, scheme


@pytest.mark.parametrize("fields, words", [
    ({"dtype": "float64"}, "dtype must be one of float32, float16"),
    ({"trace_len": 1}, "trace_len must be an integer >= 2"),
    ({"logits": "first"}, "logits must be one of all, last"),
    ({"quantize": "int4"}, "quantize must be a scheme"),
])
def test_bad_option_values_are_one_line(fields, words):
    with pytest.raises(ValueError, match=words):
        ExportOptions(**fields)


def test_options_or_keywords_not_both():
    assert options_from(None, {"kv_cache": True}).kv_cache
    with pytest.raises(ValueError, match="not both"):
        options_from(ExportOptions(), {"kv_cache": True})
    with pytest.raises(TypeError, match="unknown export option"):
        options_from(None, {"kv_cash": True})


def test_scheme_options_flags_and_metadata():
    """Each scheme holds only its own options; its flags parse back (through the command line's
    own builder) to an equal scheme; unknown names and foreign options are one line."""
    from posbias_export.commands.export import build_export_parser, export_options

    for chosen in (Int8(), Int8(per_channel=False), Int4(), Int4(block=16, symmetric=True, accuracy_level=0),
                   Int4(head="int8")):
        args = build_export_parser().parse_args(["--bias", "alibi", "--out", "x.onnx", *chosen.flags()])
        assert export_options(args).quantize == chosen
    from posbias_export.export import FileContract

    written = FileContract(**Int4(block=64).contract_fields(7)).to_props()  # what a quantized file records
    assert {k: written[f"posbias.{k}"] for k in ("quantized", "quantized_nodes", "quant_block", "quant_head",
                                                 "quant_symmetric", "quant_accuracy_level")} == {
        "quantized": "int4", "quantized_nodes": "7", "quant_block": "64", "quant_head": "int4", "quant_symmetric": "0",
        "quant_accuracy_level": "4"}
    assert Int4().resolved(16, "int8") == Int4(block=16, head="int8")  # an architecture's defaults
    assert Int4(block=64, head="float").resolved(16, "int8") == Int4(block=64, head="float")  # what was asked wins
    with pytest.raises(ValueError, match="quantized head must be one of int4, int8, float"):
        scheme("int4", head="int2")
    with pytest.raises(ValueError, match="quantize must be one of int8, int4, got 'int3'"):
        scheme("int3")
    with pytest.raises(ValueError, match="block do not apply to --quantize int8"):
        scheme("int8", block=16)
    with pytest.raises(ValueError, match="quantization block must be one of"):
        scheme("int4", block=48)
    assert set(SCHEMES) == {"int8", "int4"}


@pytest.mark.parametrize("argv, words", [
    (["--quant-block", "32"], "--quant-block need --quantize"),  # 32 is the default: still an option with no effect
    (["--quantize", "int8", "--quant-block", "64"], "--quant-block do not apply to --quantize int8"),
    (["--quantize", "int4", "--quant-per-tensor"], "--quant-per-tensor do not apply to --quantize int4"),
])
def test_quantize_flags_that_do_nothing_are_refused(tmp_path, capsys, argv, words):
    out = tmp_path / "m.onnx"
    assert cli_main(["--bias", "alibi", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and not out.exists()


def test_checked_scheme_reads_the_graph():
    """No quantized op and no label: float; a label must name a scheme the graph shows."""
    import onnx

    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMulNBits", ["a", "b"], ["c"], domain="com.microsoft")],
                                   "g", [], [])
    proto = onnx.helper.make_model(graph)
    assert checked_scheme(proto, None) == "int4" and checked_scheme(proto, "int4") == "int4"
    with pytest.raises(ValueError, match="its graph's quantized ops are int4's"):
        checked_scheme(proto, "int8")
    float_proto = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    assert checked_scheme(float_proto, None) is None


def test_a_t5_serving_folder_refuses_options_it_cannot_honour(tmp_path, capsys):
    """--logits last and --context-length shape a causal LM's folder (its generation file, its
    genai_config.json); a T5 folder has neither, so they are refused, not silently dropped."""
    pytest.importorskip("transformers")
    from hf_folders import save_initialized_t5

    folder = save_initialized_t5(tmp_path / "t5")
    capsys.readouterr()  # transformers' own progress bars while saving
    for argv, words in ((["--logits", "last"], "--logits last apply to a causal LM's folder"),
                        (["--context-length", "64"], "--context-length apply to a causal LM's folder")):
        out = tmp_path / "out"
        assert cli_main(["--model", str(folder), "--out-dir", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1 and not out.exists()


def test_an_int4_file_says_what_it_needs(tmp_path, capsys):
    """The summary names the contrib ops an int4 file needs (not "standard ops" alone), and its
    metadata records the opset the file has (the 4-bit quantizer raises it to 21)."""
    import onnx

    out = tmp_path / "q.onnx"
    assert cli_main(["--bias", "alibi", "--kv-cache", "--quantize", "int4", "--out", str(out), "--heads", "4",
                     "--dim", "64", "--layers", "1", "--skip-growth-check"]) == 0
    summary = capsys.readouterr().out
    assert "com.microsoft.GatherBlockQuantized, MatMulNBits (ONNX Runtime only)" in summary
    model = onnx.load(str(out))
    opset = next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))
    assert {p.key: p.value for p in model.metadata_props}["posbias.opset"] == str(opset) == "21"


def test_a_last_logits_folder_does_not_name_onnxruntime_genai(tmp_path):
    """genai reads each row's last real token of a right-padded batch; a --logits last file gives
    each row's last position: such a folder writes no genai_config.json, and says why."""
    pytest.importorskip("transformers")
    from posbias_export.hf.ship import ship
    from posbias_export.hf.tiny import save_tiny_folder

    source = save_tiny_folder("bloom", tmp_path / "bloom", client=True)
    report = ship(source, tmp_path / "last", check_growth=False, logits="last")
    assert not (tmp_path / "last" / "genai_config.json").exists()
    assert any("no genai_config.json" in n for n in report.notes)
    ship(source, tmp_path / "all", check_growth=False)
    assert (tmp_path / "all" / "genai_config.json").is_file()


@pytest.mark.parametrize("argv, line", [
    (["--quantize", "int4", "--inline-functions"],
     "standard ops + com.microsoft.GatherBlockQuantized, MatMulNBits (ONNX Runtime only)"),
    (["--inline-functions"], "standard domain only"),
    (["--kv-cache", "--target", "ort"], "standard ops + posbias local functions + com.microsoft.GroupQueryAttention"),
])
def test_the_summary_says_what_the_final_file_holds(tmp_path, capsys, argv, line):
    """The domains line is read from the file as written (before: an int4 --inline-functions file,
    which needs com.microsoft ops, was summed up as "standard domain only")."""
    import onnx

    out = tmp_path / "q.onnx"
    assert cli_main(["--bias", "alibi", "--out", str(out), "--heads", "2", "--dim", "32", "--layers", "1",
                     "--skip-growth-check", *argv]) == 0
    summary = capsys.readouterr().out
    assert line in summary, summary
    model = onnx.load(str(out))
    held = {n.domain for n in model.graph.node} | {n.domain for f in model.functions for n in f.node}
    assert ("com.microsoft" in held) == ("com.microsoft" in line)


def test_a_causal_lm_folder_holds_the_inplace_file_unless_asked_otherwise(tmp_path, capsys):
    """--out-dir's default for a causal LM: the in-place cache, which genai binds to one buffer
    (before: the Concat file, so genai copied its whole cache every step); --target portable
    still writes the portable file (OpenVINO, the reference evaluator)."""
    import json

    pytest.importorskip("transformers")
    from posbias_export.hf.tiny import save_tiny_folder
    from posbias_export.runners import runtimes_common

    source = save_tiny_folder("bloom", tmp_path / "bloom", client=True)
    facts = runtimes_common("graph_facts")
    for argv, inplace in (([], True), (["--target", "portable"], False)):
        out = tmp_path / f"out{len(argv)}"
        assert cli_main(["--model", str(source), "--out-dir", str(out), "--skip-growth-check", *argv]) == 0
        assert facts.read_graph_facts(out / "model.onnx").inplace_cache == inplace
        genai = json.loads((out / "genai_config.json").read_text())["search"]
        assert genai["past_present_share_buffer"] == inplace

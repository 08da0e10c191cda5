"""--quantize int4 / int8 on the streamed path (export/quantize/streamed.py, streamed_int8.py):
the file holds the nodes and tensors ONNX Runtime's whole-model quantizers (MatMulNBitsQuantizer,
quantize_dynamic) write from the float file, and its export peaks at a fraction of the
whole-model path's memory at real width."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import tiers
from posbias_export.cli import main as cli_main
from posbias_export.export.quantize import whole as quantize
from posbias_export.export.quantize.schemes import Int4, Int8

CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "alibi.safetensors"


def _nodes(graph: onnx.GraphProto) -> list:
    return [(n.op_type, n.domain, list(n.input), list(n.output), n.name,
             sorted(onnx.helper.printable_attribute(a) for a in n.attribute)) for n in graph.node]


def assert_same_model(streamed: onnx.ModelProto, whole: onnx.ModelProto) -> None:
    """The same nodes in the same order, the same tensors by name (int4 compared byte for byte as
    packed), the same opsets, IR version and functions. The initializers' order in the file is
    not compared: the streamed file writes its spilled tensors where `save` puts placeholders."""
    assert _nodes(streamed.graph) == _nodes(whole.graph)
    ours, theirs = ({t.name: t for t in m.graph.initializer} for m in (streamed, whole))
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        other = theirs[name]
        assert (tensor.data_type, list(tensor.dims)) == (other.data_type, list(other.dims)), name
        if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
            assert tensor.raw_data == other.raw_data, name
        else:
            assert np.array_equal(numpy_helper.to_array(tensor), numpy_helper.to_array(other)), name
    assert [(o.domain, o.version) for o in streamed.opset_import] == [(o.domain, o.version) for o in whole.opset_import]
    assert streamed.ir_version == whole.ir_version
    assert [f.SerializeToString() for f in streamed.functions] == [f.SerializeToString() for f in whole.functions]


CASES = {  # scheme, source, export flags, quantize flags
    "int4-checkpoint": ("int4", "ckpt", ["--kv-cache", "--logits", "last"], []),
    "int4-bloom": ("int4", "bloom", ["--kv-cache", "--logits", "last"], []),
    "int4-bloom-int8-head": ("int4", "bloom", ["--kv-cache", "--logits", "last"], ["--quant-head", "int8"]),
    "int4-bloom-symmetric-block16": ("int4", "bloom", [], ["--quant-symmetric", "--quant-block", "16"]),
    "int4-falcon": ("int4", "falcon", ["--kv-cache"], []),
    "int4-mpt": ("int4", "mpt", ["--kv-cache"], []),
    "int4-t5-decoder": ("int4", "t5_gated", ["--part", "decoder"], []),
    "int8-checkpoint": ("int8", "ckpt", ["--kv-cache", "--logits", "last"], []),
    "int8-bloom-in-place": ("int8", "bloom", ["--kv-cache", "--logits", "last", "--target", "ort"], []),
    "int8-bloom-per-tensor": ("int8", "bloom", [], ["--quant-per-tensor"]),
    "int8-falcon": ("int8", "falcon", ["--kv-cache"], []),
    "int8-mpt": ("int8", "mpt", ["--kv-cache"], []),
    "int8-t5-decoder": ("int8", "t5_gated", ["--part", "decoder"], []),
    "int8-t5-encoder": ("int8", "t5_gated", ["--part", "encoder"], []),
}
SLOW_CASES = {"int4-bloom", "int4-falcon", "int4-mpt", "int4-bloom-symmetric-block16", "int8-bloom-per-tensor",
              "int8-falcon", "int8-mpt", "int8-t5-encoder", "int4-t5-decoder", "int8-t5-decoder", "int8-checkpoint",
              "int4-bloom-int8-head"}


def _scheme_of(model: onnx.ModelProto, name: str):
    """The scheme with the options the file records (the architecture's defaults resolved)."""
    meta = {p.key.removeprefix("posbias."): p.value for p in model.metadata_props}
    if name == "int8":
        return Int8(per_channel=meta["quant_per_channel"] == "1")
    return Int4(block=int(meta["quant_block"]), head=meta["quant_head"], symmetric=meta["quant_symmetric"] == "1",
                accuracy_level=int(meta["quant_accuracy_level"]))


@pytest.mark.parametrize("case", tiers.cases(list(CASES), list(CASES), slow=SLOW_CASES))
def test_streamed_file_is_the_whole_model_quantizers_file(tmp_path, monkeypatch, case):
    """Every weight read in pieces of a few rows (odd counts included) and rounded in slabs of a
    few columns: the pieces must stack into exactly what the quantizer gives the whole tensor
    (int8: per channel, or one range over all the slabs for the table and --quant-per-tensor)."""
    import hf_folders
    import posbias_export.export.quantize.slabs as slabs
    import posbias_export.nn.lazy_weights as lazy

    monkeypatch.setattr(lazy, "ROWS_PER_READ", 300)  # a few rows per piece, odd counts among them
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 500)
    name, kind, flags, qflags = CASES[case]
    source = ["--checkpoint", str(CHECKPOINT)] if kind == "ckpt" else \
        ["--model", str(hf_folders.save_tiny_model(kind, tmp_path / kind))]
    base = [*source, *flags, "--skip-growth-check"]
    assert cli_main([*base, "--out", str(tmp_path / "float.onnx")]) == 0
    assert cli_main([*base, "--quantize", name, *qflags, "--out", str(tmp_path / f"{name}.onnx")]) == 0
    ours = onnx.load(str(tmp_path / f"{name}.onnx"))
    whole = quantize.quantize_file(tmp_path / "float.onnx", _scheme_of(ours, name))  # ONNX Runtime's, whole
    assert_same_model(ours, whole)
    assert quantize.quantized_node_count(ours) >= 3
    assert not list(tmp_path.glob("**/skeleton.onnx*")) and not list(tmp_path.glob("**/quantized.bin"))


@pytest.mark.parametrize("name,file_range", tiers.cases([("int4", (0.12, 0.16)), ("int8", (0.19, 0.24))], ["int4", "int8"],
                                                         slow={"int8"}))
def test_streamed_quantized_export_peaks_within_its_bound_at_real_width(tmp_path, name, file_range):
    """A BLOOM of real width (hidden 2048, vocabulary 50432, 2 layers: 0.8 GB of float32, the
    largest weight 0.4 GB) exported quantized in its own process: peak RSS <= 1.5x the file +
    1 GB (the whole-model quantizers held the float model several times over)."""
    import torch
    import transformers as tf

    from posbias_export.bench.harness import measured_python
    from posbias_export.bench.real_models import weight_bytes

    torch.manual_seed(0)
    tf.BloomForCausalLM(tf.BloomConfig(hidden_size=2048, n_layer=2, n_head=16, vocab_size=50432)).save_pretrained(
        tmp_path / "wide")
    out = tmp_path / "wide.onnx"
    _, peak_gb, _ = measured_python(["-m", "posbias_export", "--model", str(tmp_path / "wide"), "--kv-cache", "--logits",
                                     "last", "--quantize", name, "--out", str(out)])
    file_gb = weight_bytes(out) / 1e9
    # 204M weights (the tied table's 103M stored once, export/quantize/tied.py, and two layers'
    # 101M): int4 ~0.64 bytes a weight with block-32 scales and zero points; int8 a byte
    assert file_range[0] < file_gb < file_range[1], file_gb
    assert peak_gb <= 1.5 * file_gb + 1.0, (peak_gb, file_gb)

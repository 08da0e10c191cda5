"""--quantize int4 on the streamed path (export/quantize_streamed.py): the file holds the nodes and
tensors ONNX Runtime's whole-model MatMulNBitsQuantizer writes from the float file, and its export
peaks at a fraction of the whole-model path's memory at real width."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import tiers
from posbias_export.cli import main as cli_main
from posbias_export.export import quantize
from posbias_export.export.schemes import Int4

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


CASES = {  # source, export flags, quantize flags
    "checkpoint": ("ckpt", ["--kv-cache", "--logits", "last"], []),
    "bloom": ("bloom", ["--kv-cache", "--logits", "last"], []),
    "bloom-int8-head": ("bloom", ["--kv-cache", "--logits", "last"], ["--quant-head", "int8"]),
    "bloom-symmetric-block16": ("bloom", [], ["--quant-symmetric", "--quant-block", "16"]),
    "falcon": ("falcon", ["--kv-cache"], []),
    "mpt": ("mpt", ["--kv-cache"], []),
    "t5-decoder": ("t5_gated", ["--part", "decoder"], []),
}


@pytest.mark.parametrize("case", tiers.cases(list(CASES), list(CASES), slow={"bloom", "falcon", "mpt", "bloom-symmetric-block16"}))
def test_streamed_int4_is_the_whole_model_quantizers_file(tmp_path, monkeypatch, case):
    """Every weight read in pieces of a few rows (odd counts included) and rounded in slabs of a
    few columns: the pieces must stack into exactly what the quantizer gives the whole tensor."""
    import hf_folders
    import posbias_export.export.quantize_streamed as streamed
    import posbias_export.nn.lazy_weights as lazy

    monkeypatch.setattr(lazy, "ROWS_PER_READ", 300)  # a few rows per piece, odd counts among them
    monkeypatch.setattr(streamed, "SLAB_ELEMENTS", 500)
    kind, flags, qflags = CASES[case]
    source = ["--checkpoint", str(CHECKPOINT)] if kind == "ckpt" else \
        ["--model", str(hf_folders.save_tiny_model(kind, tmp_path / kind))]
    base = [*source, *flags, "--skip-growth-check"]
    assert cli_main([*base, "--out", str(tmp_path / "float.onnx")]) == 0
    assert cli_main([*base, "--quantize", "int4", *qflags, "--out", str(tmp_path / "int4.onnx")]) == 0
    ours = onnx.load(str(tmp_path / "int4.onnx"))
    meta = {p.key.removeprefix("posbias."): p.value for p in ours.metadata_props}
    spec = Int4(block=int(meta["quant_block"]), head=meta["quant_head"], symmetric=meta["quant_symmetric"] == "1",
                accuracy_level=int(meta["quant_accuracy_level"]))
    whole = quantize.quantize_file(tmp_path / "float.onnx", spec)  # ONNX Runtime's MatMulNBitsQuantizer, whole
    assert_same_model(ours, whole)
    assert quantize.quantized_node_count(ours) >= 3


def test_streamed_int4_peaks_within_its_bound_at_real_width(tmp_path):
    """A BLOOM of real width (hidden 2048, vocabulary 50432, 2 layers: 0.8 GB of float32, the
    largest weight 0.4 GB) exported to int4 in its own process: peak RSS <= 1.5x the file + 1 GB
    (the whole-model quantizer held the float model several times over)."""
    import torch
    import transformers as tf

    from posbias_export.bench.harness import measured_python
    from posbias_export.bench.real_models import weight_bytes

    torch.manual_seed(0)
    tf.BloomForCausalLM(tf.BloomConfig(hidden_size=2048, n_layer=2, n_head=16, vocab_size=50432)).save_pretrained(
        tmp_path / "wide")
    out = tmp_path / "wide.onnx"
    _, peak_gb, _ = measured_python(["-m", "posbias_export", "--model", str(tmp_path / "wide"), "--kv-cache", "--logits",
                                     "last", "--quantize", "int4", "--out", str(out)])
    file_gb = weight_bytes(out) / 1e9
    assert 0.15 < file_gb < 0.25  # int4 with scales and zero points: ~1/4 of the float32 bytes
    assert peak_gb <= 1.5 * file_gb + 1.0, (peak_gb, file_gb)

"""A tied table stored once in quantized files (export/quantize/tied.py): the embedding reads the
quantized head's rows. Checked against the file as it was before (the embedding quantized on its
own), against the head's tensors dequantized in numpy, and by the quantized policy."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from posbias_export.export.quantize import streamed
from posbias_export.export.quantize.schemes import scheme as quant_scheme
from posbias_export.runners import runtimes_common

pytest.importorskip("transformers")
from hf_folders import save_tiny_model  # noqa: E402
from posbias_export.hf.export import export_model  # noqa: E402

TABLE = "lm.transformer.word_embeddings.weight"  # BLOOM's, tied to its head
HEAD = "val_"  # the folded Transpose(table): the head's own weight, named by the export


@pytest.fixture(scope="module")
def bloom(tmp_path_factory) -> Path:
    return save_tiny_model("bloom", tmp_path_factory.mktemp("bloom") / "bloom")


def _export(folder: Path, out: Path, name: str, share: bool = True, **options) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if not share:  # the file as it was: the embedding quantized on its own
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(streamed, "share_tied_table", lambda proto, tied, aliases=False: False)
            export_model(folder, out, kv_cache=True, quantize=quant_scheme(name, **options), check_growth=False)
    else:
        export_model(folder, out, kv_cache=True, quantize=quant_scheme(name, **options), check_growth=False)
    return out


def _bytes(path: Path) -> int:
    """The bytes of the file's tensors (the graph's own few kilobytes of nodes left out)."""
    return sum(t.ByteSize() for t in onnx.load(str(path)).graph.initializer)


def _run(path: Path, ids: np.ndarray, outputs=("logits",)) -> list[np.ndarray]:
    """The file's outputs for `ids` (no past), `embedding` exposed as an output when asked."""
    proto = onnx.load(str(path))
    if "embedding" in outputs:
        proto.graph.output.append(onnx.helper.make_tensor_value_info("embedding", onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past"):
            feeds[i.name] = np.zeros([ids.shape[0] if n == 0 else (0 if isinstance(d, str) else d)
                                      for n, d in enumerate(i.shape)], np.float32)
    return session.run(list(outputs), feeds)


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


IDS = np.random.default_rng(0).integers(0, 300, (2, 37)).astype(np.int64)


def test_int4_file_holds_the_table_once_and_computes_what_it_did(tmp_path, bloom):
    """int4 (default head int4): no GatherBlockQuantized and no table of the embedding's own, a
    file smaller by the table's bytes, and logits bit for bit the file's before sharing (both round each block of a
    row the same way)."""
    shared = _export(bloom, tmp_path / "shared" / "m.onnx", "int4")
    before = _export(bloom, tmp_path / "before" / "m.onnx", "int4", share=False)
    ops = [n.op_type for n in onnx.load(str(shared)).graph.node]
    assert "GatherBlockQuantized" not in ops and "GatherBlockQuantized" in [n.op_type for n in onnx.load(str(before)).graph.node]
    assert not [name for name in _tensors(shared) if name.startswith(TABLE)]
    table = 300 * 48 // 2 + 300 * 2 * 4 + 300  # one copy's 4-bit values, float32 scales, 4-bit zero points
    assert _bytes(before) - _bytes(shared) >= table - 1024  # the rows' few constants: under 1 KB
    assert np.array_equal(_run(shared, IDS)[0], _run(before, IDS)[0])
    assert runtimes_common("graph_facts").read_graph_facts(shared).embedding_rows == 300  # the runners' id check


@pytest.mark.parametrize("options", [{"head": "int8"}, {"symmetric": True}], ids=["int8-head", "symmetric"])
def test_int4_embedding_is_the_heads_rows_dequantized(tmp_path, bloom, options):
    """An 8-bit head (the table shared in 8 bits) and a symmetric one (no zero points: the
    midpoint): the embedding equals the head's MatMulNBits tensors dequantized in numpy."""
    path = _export(bloom, tmp_path / "m.onnx", "int4", **options)
    tensors = _tensors(path)
    head = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits")
    bits = next(a.i for a in head.attribute if a.name == "bits")
    weight, scales = tensors[head.input[1]], tensors[head.input[2]]
    values = np.stack([weight & 15, weight >> 4], -1).reshape(*weight.shape[:2], -1) if bits == 4 else weight
    if len(head.input) > 3:
        zero = tensors[head.input[3]]
        zero = zero if bits == 8 else np.stack([zero & 15, zero >> 4], -1).reshape(zero.shape[0], -1)[:, :scales.shape[1]]
    else:
        zero = np.full(scales.shape, 2 ** (bits - 1))
    table = ((values.astype(np.float32) - zero[..., None].astype(np.float32)) * scales[..., None]).reshape(len(weight), -1)
    embedding = _run(path, IDS, ("embedding",))[0]
    assert not [name for name in tensors if name.startswith(TABLE)]
    assert np.array_equal(embedding, table[IDS][..., :48])


@pytest.mark.parametrize("options", [{}, {"per_channel": False}], ids=["per-channel", "per-tensor"])
def test_int8_embedding_is_the_heads_columns_dequantized(tmp_path, bloom, options):
    """int8: the embedding reads MatMulInteger's int8 weight [K, N] column by column, with that
    column's scale (7-bit per row, in place of the table's own per-tensor uint8 copy), or the
    weight's one scale (--quant-per-tensor)."""
    path = _export(bloom, tmp_path / "m.onnx", "int8", **options)
    before = _export(bloom, tmp_path / "before" / "m.onnx", "int8", share=False, **options)
    tensors = _tensors(path)
    head = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulInteger"
                and n.input[1].startswith(HEAD) and tensors[n.input[1]].shape == (48, 300))
    weight, zero = tensors[head.input[1]], tensors[head.input[3]]
    scale = tensors[head.input[1].removesuffix("_quantized") + "_scale"]
    table = ((weight.astype(np.float32) - zero.astype(np.float32)) * scale).T
    assert np.array_equal(_run(path, IDS, ("embedding",))[0], table[IDS])
    assert not [name for name in tensors if name.startswith(TABLE)]
    assert _bytes(before) - _bytes(path) >= 300 * 48
    assert runtimes_common("graph_facts").read_graph_facts(path).embedding_rows == 300  # [K, N]: gathered on N


def test_float_head_and_untied_models_share_nothing(tmp_path, bloom):
    """--quant-head float keeps the head's float table: the embedding keeps its own quantized
    one. Our checkpoints' heads are untied: nothing to share."""
    from posbias_export.export import checkpoint_metadata, export_onnx
    from posbias_export.nn import load_checkpoint

    path = _export(bloom, tmp_path / "m.onnx", "int4", head="float")
    assert "GatherBlockQuantized" in [n.op_type for n in onnx.load(str(path)).graph.node]
    ckpt = Path(__file__).resolve().parents[1] / "models" / "alibi.safetensors"
    own = tmp_path / "own.onnx"
    export_onnx(load_checkpoint(ckpt), own, check_growth=False, metadata=checkpoint_metadata(ckpt),
                quantize=quant_scheme("int4"))
    assert "GatherBlockQuantized" in [n.op_type for n in onnx.load(str(own)).graph.node]

"""Every bias exports through the CLI, in both archs, causal and bidirectional, and the file
passes the post-export checks (which export_onnx also enforces)."""
from __future__ import annotations

import json
import os

import onnx
import pytest
import torch

import posbias_export as pbe
import tiers
from posbias_export.export import checks
from posbias_export.export import FileContract
from posbias_export.export.checks import initializer_signature
from conftest import SMALL, TRACE_LEN

CASES = [(b, arch, causal) for b in pbe.BIASES for arch in ("lm", "block") for causal in (True, False)]
ids = [f"{b}-{arch}-{'causal' if c else 'bidir'}" for b, arch, c in CASES]


# by default every family's causal LM, and ALiBi's every form
@pytest.mark.parametrize("bias,arch,causal", tiers.cases(CASES, ids, slow={i for i in ids if not i.startswith("alibi")
                                                                            and not i.endswith("lm-causal")}))
def test_cli_export_passes_checks(exports, bias, arch, causal):
    path = exports.cli(bias, arch, causal)
    model = onnx.load(str(path))
    # what the signature asks for, read straight off the file: named batch and sequence axes,
    # the other dims fixed (vocabulary 256, or the model width)
    width = 256 if arch == "lm" else SMALL["dim"]
    expected = ({"input_ids": ["batch", "seq"]} if arch == "lm" else {"hidden_states": ["batch", "seq", width]})
    expected[("logits" if arch == "lm" else "output")] = ["batch", "seq", width]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.input, *model.graph.output]}
    assert dims == expected
    onnx.checker.check_model(model, full_check=True)
    posbias_nodes = [n for n in model.graph.node if n.domain == "posbias"]
    assert posbias_nodes and all(n.domain in ("", "ai.onnx", "posbias") for n in model.graph.node)
    assert {n.op_type for n in posbias_nodes} <= {f.name for f in model.functions}
    contract = FileContract.of(model)
    cfg = pbe.ModelConfig.from_dict(dict(contract.config))
    assert (cfg.bias, cfg.causal, contract.arch, contract.trace_len) == (bias, causal, arch, TRACE_LEN)


@pytest.mark.parametrize("bias", tiers.cases(list(pbe.BIASES), list(pbe.BIASES), slow={"window", "kerple_log"}))
def test_file_independent_of_trace_length(tmp_path, bias):
    """Traced at 8 and at 256: the same initializers (dtype and shape), and file sizes within a
    few bytes (the metadata records the trace length). A baked [L] table of float32 would add
    1 KB at 256; the check allows 16 bytes."""
    model = pbe.build_model(pbe.ModelConfig(bias=bias, **SMALL), seed=0)
    a = pbe.export_onnx(model, tmp_path / "a.onnx", trace_len=8, check_growth=False)
    b = pbe.export_onnx(model, tmp_path / "b.onnx", trace_len=256, check_growth=False)
    assert initializer_signature(onnx.load(tmp_path / "a.onnx")) == initializer_signature(onnx.load(tmp_path / "b.onnx"))
    assert abs(a.file_bytes - b.file_bytes) <= 16, (a.file_bytes, b.file_bytes)


class _SpecializesLength(torch.nn.Module):
    """A deliberately bad model: int() on the sequence length, which makes torch.export
    silently specialize the axis to the trace length (no error from the exporter)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.cfg, self.arch = inner, inner.cfg, "lm"

    def forward(self, input_ids, settings):
        table = torch.zeros(int(input_ids.shape[1]))  # [trace_len], baked
        return self.inner(input_ids, settings=settings) + table.sum()


def test_specialized_axis_is_caught_and_nothing_written(tmp_path):
    inner = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=0)
    existing = tmp_path / "keep.onnx"
    existing.write_bytes(b"precious")
    with pytest.raises(checks.ExportCheckError, match="exported static"):
        pbe.export_onnx(_SpecializesLength(inner), existing)
    assert existing.read_bytes() == b"precious"  # a failed export never clobbers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.onnx"]  # and leaves no temp file


class _BranchesOnData(_SpecializesLength):
    """A Python branch on a tensor's value: torch.export cannot trace it."""

    def forward(self, input_ids, settings):
        out = self.inner(input_ids, settings=settings)
        return out + 1 if out.sum() > 0 else out - 1


def test_a_failed_trace_names_its_cause_on_one_line(tmp_path, capfd):
    """torch.onnx.export wraps the cause in a page of generic text with colour codes and dumps
    the graph through torch's loggers: the error keeps the line naming the cause, nothing else
    reaches stderr, and nothing is written."""
    inner = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=0)
    with pytest.raises(checks.ExportCheckError) as caught:
        pbe.export_onnx(_BranchesOnData(inner), tmp_path / "m.onnx", check_growth=False)
    message = str(caught.value)
    assert message.startswith("torch.onnx.export failed: ") and "data-dependent" in message, message
    assert "\x1b[" not in message and "step 1/3" not in message and "\n" not in message
    assert capfd.readouterr().err == ""
    assert not list(tmp_path.iterdir())


def _model_with_initializer(length: int) -> onnx.ModelProto:
    table = onnx.helper.make_tensor("table", onnx.TensorProto.FLOAT, [length], [0.0] * length)
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["table"], ["y"])], "g", [],
                                   [onnx.helper.make_tensor_value_info("y", 1, [length])], [table])
    return onnx.helper.make_model(graph)


def test_growth_check_catches_trace_length_initializer():
    checks.check_no_trace_length_growth(_model_with_initializer(5), _model_with_initializer(5), 16, 33)
    with pytest.raises(checks.ExportCheckError, match="depend on the trace length"):
        checks.check_no_trace_length_growth(_model_with_initializer(16), _model_with_initializer(33), 16, 33)


def test_check_domains_rejects_custom_op():
    node = onnx.helper.make_node("FusedAlibi", ["x"], ["y"], domain="com.microsoft")
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", 1, [2])],
                                   [onnx.helper.make_tensor_value_info("y", 1, [2])])
    with pytest.raises(checks.ExportCheckError, match="com.microsoft.FusedAlibi"):
        checks.check_domains(onnx.helper.make_model(graph))


def test_check_symbolic_axes_rejects_static_axis():
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", 1, ["batch", 16])],
                                   [onnx.helper.make_tensor_value_info("y", 1, ["batch", 16])])
    with pytest.raises(checks.ExportCheckError, match="axis 1 of 'x' was exported static"):
        checks.check_symbolic_axes(onnx.helper.make_model(graph), {"x": (0, 1)})


def test_export_report_and_metadata(tmp_path):
    model = pbe.build_model(pbe.ModelConfig(bias="kerple_log", **SMALL), seed=0)
    report = pbe.export_onnx(model, tmp_path / "k.onnx", opset=23)
    assert report.inputs == {"input_ids": ["batch", "seq"]}
    assert "Attention" in report.op_types  # opset 23: SDPA becomes the ONNX Attention op
    contract = FileContract.of_path(tmp_path / "k.onnx")
    assert contract.opset == 23 and contract.dtype == "float32"


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="bfloat16"), "dtype must be one of"),
    (dict(opset=17), "opset must be one of"),
    (dict(trace_len=1), "trace_len"),
], ids=["dtype", "opset", "trace_len"])
def test_export_argument_errors(tmp_path, kwargs, message):
    model = pbe.build_model(pbe.ModelConfig(**SMALL), seed=0)
    with pytest.raises(ValueError, match=message):
        pbe.export_onnx(model, tmp_path / "m.onnx", **kwargs)
    assert not (tmp_path / "m.onnx").exists()


def test_refused_models(tmp_path):
    """A cache for a bidirectional model, and weights holding NaN, are refused before tracing."""
    bidirectional = pbe.build_model(pbe.ModelConfig(causal=False, **SMALL), seed=0)
    with pytest.raises(ValueError, match="KV cache is for causal decoding"):
        pbe.export_onnx(bidirectional, tmp_path / "m.onnx", kv_cache=True)
    broken = pbe.build_model(pbe.ModelConfig(**SMALL), seed=0)
    with torch.no_grad():
        broken.blocks[0].mlp.up.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="'blocks.0.mlp.up.weight' holds NaN"):
        pbe.export_onnx(broken, tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_large_model_goes_to_external_data_checked_by_path(tmp_path, monkeypatch):
    """Models past protobuf's 2 GB limit: the tensors go to model.onnx.data, the full checker
    runs on the written files (an in-memory check cannot serialize them), both files get the
    normal permissions, and the summary names the data file. The threshold is lowered here so
    a small model takes the same path (the real 2.4 GB case is a slow test)."""
    from posbias_export.export import files

    monkeypatch.setattr(files, "EXTERNAL_DATA_THRESHOLD", 0)
    checked = []
    monkeypatch.setattr(checks, "check_full", lambda model: checked.append(model) or onnx.checker.check_model(model, full_check=True))
    model = pbe.build_model(pbe.ModelConfig(**SMALL), seed=0)
    report = pbe.export_onnx(model, tmp_path / "m.onnx")
    assert checked and isinstance(checked[0], str), "the check must run on the written file, by path"
    data = tmp_path / "m.onnx.data"
    assert report.data_path == str(data) and data.stat().st_size == report.data_bytes > 0.9 * report.initializer_bytes
    assert "m.onnx.data" in report.summary()
    umask = os.umask(0)
    os.umask(umask)
    for f in (tmp_path / "m.onnx", data):
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask
    import onnxruntime as ort

    ids = torch.randint(0, 256, (2, 40))
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(ids), rtol=1e-4, atol=1e-4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]  # no temporary left


@pytest.mark.slow
def test_model_over_2gb_exports(tmp_path):
    """dim 4096, 32 heads, 3 layers: 2.4 GB of float32 weights (about 10 GB RSS while tracing)."""
    model = pbe.build_model(pbe.ModelConfig(dim=4096, num_heads=32, num_layers=3), seed=0)
    report = pbe.export_onnx(model, tmp_path / "big.onnx", check_growth=False)
    assert report.data_bytes > 2 ** 31 and (tmp_path / "big.onnx.data").stat().st_size == report.data_bytes
    onnx.checker.check_model(str(tmp_path / "big.onnx"), full_check=True)

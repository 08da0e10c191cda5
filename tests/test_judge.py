"""The one judge (parity/judge.py) and what validate trusts: a file is read and checked once per
run, its quantization scheme comes from its graph (a label only has to agree), and an imported
model's quantized files are judged on text sampled through the model's cache."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from posbias_export.parity.judge import Case, FloatPolicy, QuantizedPolicy, Reference, judge
from posbias_export.parity.reference import ParityInputError
from posbias_export.parity.runs import Matrix, RuntimeRun
from posbias_export.parity.tolerance import FLOAT32


def _labelled(source, target, **labels) -> str:
    proto = onnx.load(str(source))
    onnx.helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props},
                                        **{f"posbias.{k}": v for k, v in labels.items()}})
    onnx.save(proto, str(target))
    return str(target)


def test_judge_selects_real_tokens_and_the_last_position():
    """A reference with a keep mask judges only those positions; a [B, 1, V] output of a
    logits-last file is placed at the last column; a wrong shape is an error cell, not a crash."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((2, 5, 3))
    keep = np.ones((2, 5), bool)
    keep[1, :2] = False  # row 1 left-padded by two
    padded = full.copy()
    padded[1, :2] = 1e6  # padding rows are arbitrary in every implementation
    last = np.zeros((2, 5), bool)
    last[:, -1] = True
    cases = [Case("kept", {}, Reference(full[keep], {"float32": full[keep]}, keep)),
             Case("last", {}, Reference(full[last], {"float32": full[last]}, last, last=True))]
    run = RuntimeRun("fake", None, outputs=[padded, full[:, -1:]])
    wrong = RuntimeRun("wrong", None, outputs=[full[:, :4], full[:, :1, :2]])
    matrix = judge(Matrix("m", "alibi", "lm"), [run, wrong], cases, FloatPolicy("float32"))
    verdicts = {(c.runtime, c.case): c.verdict for c in matrix.cells}
    assert verdicts[("fake", "kept")] == "pass" and verdicts[("fake", "last")] == "pass"
    assert verdicts[("wrong", "kept")].startswith("error: output has shape [2, 4, 3]")
    assert verdicts[("wrong", "last")] == "error: output has shape [2, 1, 2], expected [2, 5, 3]"


def test_judge_fails_an_output_off_by_more_than_the_budget():
    """FLOAT32: |out - ref64| <= 4 * E32 + 1e-5 + 1e-5 |ref64|; 1e-3 off with E32 = 0 fails, a
    string output is a verdict as it is, and a quantized policy reports KL."""
    ref = np.linspace(-1, 1, 24).reshape(2, 3, 4)
    case = Case("c", {}, Reference(ref, {"float32": ref}))
    outputs = [ref + 1e-3]
    matrix = judge(Matrix("m", "alibi", "lm"), [RuntimeRun("off", None, outputs=outputs),
                                                 RuntimeRun("row", None, outputs=["not run: too long"])],
                   [case], FloatPolicy("float32"))
    assert [c.verdict for c in matrix.cells] == ["FAIL", "not run: too long"]
    assert FLOAT32.atol <= matrix.cells[0].parity["budget_abs"] <= FLOAT32.atol + FLOAT32.rtol  # E32 = 0, |ref| <= 1
    quantized = judge(Matrix("m", "alibi", "lm"), [RuntimeRun("q", None, outputs=[ref])], [case],
                      QuantizedPolicy("float32", "int4"))
    assert quantized.cells[0].verdict == "pass" and quantized.cells[0].dtype == "float32 int4"
    assert quantized.cells[0].parity["kl_mean"] == pytest.approx(0.0, abs=1e-12)


def test_forged_scheme_label_is_one_line(exports, tmp_path):
    """posbias.quantized=int3 (no such scheme) and a float file labelled int4 (which would be
    judged ~1000x more loosely) are refused in one line by the API and by the command line."""
    from posbias_export.validation import validate

    source = exports.cli("alibi")
    forged = _labelled(source, tmp_path / "int3.onnx", quantized="int3")
    with pytest.raises(ParityInputError, match="posbias.quantized is 'int3', not one of int8, int4"):
        validate([forged], ("ort-cpu",), (17,), batch=1, order=False)
    lying = _labelled(source, tmp_path / "lying.onnx", quantized="int4")
    with pytest.raises(ParityInputError, match="no quantized op"):
        validate([lying], ("ort-cpu",), (17,), batch=1, order=False)
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "validate", forged, "--runtimes", "ort-cpu",
                           "--lengths", "17"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "int3" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_reads_each_file_once(exports, monkeypatch):
    """Every in-process parse of the validated file during one validate run is counted: one
    (the runners, separate processes, read it on their own)."""
    import posbias_export.parity.reference as reference
    from posbias_export.validation import validate

    path = str(exports.cli("alibi"))
    loads = []
    real = onnx.load

    def counting(f, *args, **kwargs):
        loads.append(str(f))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", counting)
    monkeypatch.setattr(reference.onnx, "load", counting)
    result = validate([path], ("ort-cpu",), (1, 17), batch=2, order=False)
    assert result.ok
    assert loads.count(path) == 1, loads


def test_imported_quantized_file_is_judged_on_cached_samples(tmp_path, monkeypatch):
    """validate --model on a quantized BLOOM file samples its inputs through the model's KV cache
    (linear in the length; the whole-prefix sampler it replaced took 10.5 s at 512 tokens)."""
    pytest.importorskip("transformers")
    from hf_folders import save_tiny_model

    import posbias_export.parity.quantized as quantized
    from posbias_export.export.quantize.schemes import scheme
    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    folder = save_tiny_model("bloom", tmp_path / "bloom")
    path = tmp_path / "int8.onnx"
    export_model(folder, path, kv_cache=True, quantize=scheme("int8"), check_growth=False)
    calls = []
    real = quantized.sampled_ids_cached
    monkeypatch.setattr("posbias_export.hf.cases.sampled_ids_cached",
                        lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    result = validate([path], ("ort-cpu",), (17, 64), batch=2, model_dir=folder, order=False)
    assert result.ok, [(c.runtime, c.case, c.verdict) for m in result.matrices for c in m.cells if not c.ok]
    assert calls == [17, 64]


def test_float32_runtimes_get_one_ulp_of_an_absolute_key_row():
    """A file whose key row is absolute adds |bias| up to M to every score: float32 rounds each
    score by half an ulp of M, which PyTorch's floor does not show. The policy adds one ulp(M)
    to a float32 runtime's budget for that case, and only there."""
    ref = np.linspace(-1, 1, 24).reshape(2, 3, 4)
    cases = [Case("long", {}, Reference(ref, {"float32": ref})), Case("short", {}, Reference(ref, {"float32": ref}))]
    off = RuntimeRun("off", None, outputs=[ref + 5e-5, ref + 5e-5])  # the size measured at 4096 tokens
    plain = judge(Matrix("m", "falcon_alibi", "lm"), [off], cases, FloatPolicy("float32"))
    widened = judge(Matrix("m", "falcon_alibi", "lm"), [off], cases,
                    FloatPolicy("float32", extra_atol={"long": float(np.spacing(np.float32(724.0)))}))
    assert [c.verdict for c in plain.cells] == ["FAIL", "FAIL"]
    assert [c.verdict for c in widened.cells] == ["pass", "FAIL"]
    assert widened.cells[0].parity["budget_abs"] - plain.cells[0].parity["budget_abs"] == pytest.approx(2.0 ** -14)


def test_falcon_file_bias_magnitude_is_transformers_largest_alibi(tmp_path):
    """The magnitude is transformers' own largest Falcon ALiBi value (bf16(slope * position) /
    sqrt(d)), to the float32 ulp that decides the budget."""
    import torch
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    import hf_folders
    from posbias_export.hf.models import load_model

    hf_folders.save_tiny_model("falcon", tmp_path / "falcon")
    ours = load_model(tmp_path / "falcon")
    cfg = ours.config
    for length in (1024, 4096):
        alibi = build_alibi_tensor(torch.ones(1, length), cfg.num_attention_heads, torch.float32)  # [H, 1, L]
        theirs = float(alibi.abs().max()) / (cfg.hidden_size / cfg.num_attention_heads) ** 0.5
        assert np.spacing(np.float32(ours.file_bias_magnitude(length))) == np.spacing(np.float32(theirs))
        assert ours.file_bias_magnitude(length) == pytest.approx(theirs, rel=1e-2)

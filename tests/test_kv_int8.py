"""--kv-dtype int8 (export/quantize/kv_int8.py): an in-place file whose KV cache is int8 with one
calibrated scale per layer's keys and values. Judged by validate's int8 policy (perplexity within
1%, parity/quantized.py) on the trained ALiBi checkpoint, bound to one buffer and unbound; the
policy is load-bearing (scales made 50x too small saturate the cache and fail it); decode steps
through one int8 buffer follow the float file; refusals are one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import tiers

from test_inplace_cache import _ort_run

from posbias_export.cli import main as cli_main
from posbias_export.export.quantize.kv_int8 import has_int8_cache
from posbias_export.export import FileContract
from posbias_export.parity.quantized import judge

ort = pytest.importorskip("onnxruntime")
CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "alibi.safetensors"


def _export(tmp_path, kv_dtype: str, *extra) -> Path:
    path = tmp_path / f"alibi_{kv_dtype}{'_'.join(extra)}.onnx"
    argv = ["--checkpoint", str(CHECKPOINT), "--kv-cache", "--target", "ort", "--kv-dtype", kv_dtype,
            "--skip-growth-check", "--out", str(path), *extra]
    assert cli_main(argv) == 0
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_int8")
    return {kind: _export(tmp, kind) for kind in ("float", "int8")}


def test_the_file_keeps_an_int8_cache_a_quarter_of_float32s(files):
    model = onnx.load(str(files["int8"]))
    cache = [v for v in [*model.graph.input, *model.graph.output] if "past" in v.name or "present" in v.name]
    assert cache and all(v.type.tensor_type.elem_type == onnx.TensorProto.INT8 for v in cache)
    assert has_int8_cache(model) and not has_int8_cache(onnx.load(str(files["float"])))
    assert FileContract.of(model).kv_dtype == "int8"
    scales = [i for i in model.graph.initializer if i.name.startswith("kv_scale.")]
    assert len(scales) == len(cache) // 2  # one per present output: each layer's keys and values
    assert all(0 < onnx.numpy_helper.to_array(s)[0] < 1 for s in scales)


@pytest.mark.parametrize("lengths", tiers.cases(["1,17,256", "1024"], ["short", "1024"], slow={"1024"}))
def test_int8_cache_passes_the_int8_policy_on_the_trained_checkpoint(files, lengths):
    """validate judges it as a client runs it (ort-cpu-shared: prefill then steps through one
    bound int8 buffer) by the int8 policy; the issue's bar is 1024 tokens (slow tier)."""
    from posbias_export.validation import validate

    lengths = tuple(int(n) for n in lengths.split(","))
    result = validate([files["int8"]], ["ort-cpu", "ort-cpu-shared"], lengths, batch=2, order=False)
    cells = result.matrices[0].cells
    assert result.ok, [(c.runtime, c.case, c.verdict) for c in cells if not c.ok]
    assert {c.runtime for c in cells} == {"ort-cpu", "ort-cpu-shared"} and all(
        c.parity["scheme"] == "int8" and c.parity["kl_mean"] <= c.parity["budget_kl"] for c in cells)


def test_scales_too_small_saturate_the_cache_and_fail_the_policy(files, tmp_path):
    """Sabotage: every scale 50x too small (most keys and values clip at +-127 x scale): the
    same validate must fail, so the passing run above measured the cache, not nothing."""
    from posbias_export.validation import validate

    model = onnx.load(str(files["int8"]))
    for init in model.graph.initializer:
        if init.name.startswith("kv_scale."):
            init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) / 50, init.name))
    broken = tmp_path / "saturated.onnx"
    onnx.save(model, str(broken))
    result = validate([broken], ["ort-cpu"], (256,), batch=2, order=False)
    assert not result.ok


def _steps(vocab: int = 256):
    """A prompt [1, 40], then 6 one-token steps (GroupQueryAttention takes several new tokens
    after a cache at batch 1 only)."""
    rng = np.random.default_rng(5)
    steps = [(rng.integers(32, 127, (1, 40)), np.ones((1, 40), np.int64))]
    for t in range(6):
        steps.append((rng.integers(32, 127, (1, 1)), np.ones((1, 41 + t), np.int64)))
    return steps


def _run(path: Path, shared: bool) -> list[np.ndarray]:
    """Every step's logits, the cache fed back (unbound) or bound to one buffer per tensor
    (test_inplace_cache's loop: it also checks that only the written rows are non-zero)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return _ort_run(session, _steps(), shared)


def test_steps_through_one_int8_buffer_follow_the_float_file(files):
    """A prompt, then one-token steps: bound to one int8 buffer and unbound give the same logits
    (the same rounding, two ways of holding it), and every step's next-token distribution is
    within the int8 policy of the float in-place file's."""
    float_run = _run(files["float"], shared=False)
    bound, unbound = _run(files["int8"], shared=True), _run(files["int8"], shared=False)
    for index, (b, u, f) in enumerate(zip(bound, unbound, float_run)):
        np.testing.assert_allclose(b, u, atol=1e-5, err_msg=f"step {index}")
        verdict = judge(b, f, "int8")
        assert verdict.passed, (index, verdict)


@pytest.mark.parametrize("argv, words", [
    (["--bias", "alibi", "--kv-cache", "--kv-dtype", "int8"], "needs kv_cache and target ort"),
    (["--bias", "alibi", "--target", "ort", "--kv-cache", "--kv-dtype", "int4"], "invalid choice"),
])
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, argv, words):
    out = tmp_path / "m.onnx"
    assert cli_main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_out_dir_refuses_an_int8_cache(tmp_path, capsys):
    """Optimum and transformers.js make their own empty caches in the model's float dtype: a
    serving folder keeps a float cache."""
    folder = tmp_path / "src"
    folder.mkdir()
    assert cli_main(["--model", str(folder), "--out-dir", str(tmp_path / "out"), "--target", "ort",
                     "--kv-dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-dtype int8" in err[0], err


def test_imported_bloom_with_int4_weights_and_an_int8_cache(tmp_path):
    """The flags together on an imported folder: the cache calibrated through the folder's own
    file (tokens of its vocabulary), judged by the coarser scheme (int4) against the folder's
    model, unbound and bound."""
    pytest.importorskip("transformers")
    from hf_folders import save_tiny_model

    from posbias_export.export.quantize.schemes import checked_scheme, scheme
    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    folder = save_tiny_model("bloom", tmp_path / "bloom")
    path = tmp_path / "bloom.onnx"
    export_model(folder, path, kv_cache=True, target="ort", quantize=scheme("int4"), kv_dtype="int8", logits="last",
                 check_growth=False)
    model = onnx.load(str(path))
    assert has_int8_cache(model) and checked_scheme(model, "int4") == "int4"
    result = validate([path], ["ort-cpu", "ort-cpu-shared"], (1, 17, 40), batch=2, model_dir=folder, order=False)
    cells = [c for c in result.matrices[0].cells if c.runtime.startswith("ort-cpu")]
    assert result.ok and cells, [(c.runtime, c.case, c.verdict) for c in result.matrices[0].cells if not c.ok]
    assert all(c.parity["scheme"] == "int4" for c in cells if c.runtime in ("ort-cpu", "ort-cpu-shared"))

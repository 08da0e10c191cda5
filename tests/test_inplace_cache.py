"""The in-place KV cache (--kv-cache --target ort, export/targets/inplace_body.py): for every family, a
prompt then decode steps, left padding and a hole in the mask, run unbound (present fed back as
past, as the Concat file) and with each past and present bound to ONE buffer longer than needed
(as onnxruntime-genai's past_present_share_buffer does); each judged against the float64
PyTorch cache path under the float32 policy, and the Concat file beside it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import posbias_export as pbe
import tiers
from conftest import SMALL, TRACE_LEN, cli_model

from posbias_export.cli import main as cli_main
from posbias_export.parity.tolerance import FLOAT32, compare

ort = pytest.importorskip("onnxruntime")
CAPACITY = 48  # the shared buffer: longer than prompt + steps, as a client sizes it


def _export(tmp_path, bias: str, target: str, dtype: str = "float32", *extra: str):
    path = tmp_path / f"{bias}_{target}_{dtype}{''.join(extra)}.onnx"
    argv = ["--bias", bias, "--kv-cache", "--target", target, "--out", str(path), "--trace-len", str(TRACE_LEN),
            "--dtype", dtype,
            "--heads", str(SMALL["num_heads"]), "--dim", str(SMALL["dim"]), "--layers", str(SMALL["num_layers"]),
            "--skip-growth-check", *extra]
    assert cli_main(argv) == 0
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _sequence(vocab: int = 256):
    """A left-padded prompt [B=2, 9], then 4 one-token steps, the third with a hole in row 0."""
    rng = np.random.default_rng(7)
    mask = np.ones((2, 9), np.int64)
    mask[1, :3] = 0
    steps = [(rng.integers(0, vocab, (2, 9)), mask)]
    for t in range(4):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        if t == 2:
            mask[0, -1] = 0
        steps.append((rng.integers(0, vocab, (2, 1)), mask))
    return steps


def _torch_run(model, steps, dtype):
    model = model.to(dtype)
    past, out = model.empty_past(steps[0][0].shape[0], dtype), []
    with torch.no_grad():
        for ids, mask in steps:
            logits, past = model.step(torch.from_numpy(ids), torch.from_numpy(mask), past)
            out.append(logits.double().numpy())
    return out


def _ort_run(session, steps, shared: bool, capacity: int = CAPACITY):
    names = [i.name for i in session.get_inputs() if i.name.startswith("past_")]
    outputs = [o.name for o in session.get_outputs()]
    heads, dim = session.get_inputs()[2].shape[1], session.get_inputs()[2].shape[3]
    dtype = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}.get(session.get_inputs()[2].type, np.float32)
    batch = steps[0][0].shape[0]
    if shared:
        buffers = [ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, heads, capacity, dim), dtype)) for _ in names]
    else:
        past = [np.zeros((batch, heads, 0, dim), dtype) for _ in names]
    got = []
    for ids, mask in steps:
        if not shared:
            logits, *past = session.run(None, {"input_ids": ids, "attention_mask": mask, **dict(zip(names, past))})
            got.append(logits)
            continue
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        for name, buffer in zip(names, buffers):
            binding.bind_ortvalue_input(name, buffer)
        binding.bind_output(outputs[0], "cpu")
        for name, buffer in zip(outputs[1:], buffers):
            binding.bind_ortvalue_output(name, buffer)
        session.run_with_iobinding(binding)
        got.append(binding.copy_outputs_to_cpu()[0])
    if shared:  # only the rows written so far are non-zero: the kernel wrote in place, nothing more
        written = steps[-1][1].shape[1]
        assert all(buffer.shape() == [batch, heads, capacity, dim] for buffer in buffers)
        assert not np.abs(buffers[0].numpy()[:, :, written:]).any() and np.abs(buffers[0].numpy()[:, :, :written]).any()
    return got


@pytest.mark.parametrize("bias", tiers.cases(list(pbe.BIASES), list(pbe.BIASES), slow={"window", "kerple_log"}))
def test_inplace_file_equals_the_reference_bound_and_unbound(tmp_path, bias):
    inplace, concat = _export(tmp_path, bias, "ort"), _export(tmp_path, bias, "portable")
    steps = _sequence()
    model = cli_model(bias)
    ref64, ref32 = _torch_run(model, steps, torch.float64), _torch_run(model, steps, torch.float32)
    runs = {"in place, one buffer": _ort_run(inplace, steps, shared=True),
            "in place, unbound": _ort_run(inplace, steps, shared=False),
            "concat": _ort_run(concat, steps, shared=False)}
    for label, got in runs.items():
        for index, ((_, mask), out, r64, r32) in enumerate(zip(steps, got, ref64, ref32)):
            real = mask[:, -out.shape[1]:].astype(bool)  # padding rows are arbitrary in every implementation
            parity = compare(out[real], r64[real], r32[real], FLOAT32)
            assert parity.passed, (label, index, str(parity))


@pytest.mark.parametrize("bias", tiers.cases(["alibi", "t5", "window"], ["alibi", "t5", "window"], slow={"window"}))
def test_float16_inplace_file_equals_the_reference_bound_and_unbound(tmp_path, bias):
    """float16 (GroupQueryAttention's CPU kernel takes it; padded keys get float16's lowest, not
    float32's, which would cast to -inf): the left-padded batch with a hole, bound and unbound,
    under the float16 policy against PyTorch float16's own error."""
    from posbias_export.parity.tolerance import FLOAT16

    inplace = _export(tmp_path, bias, "ort", "float16")
    steps = _sequence()
    model = cli_model(bias)
    ref64, ref16 = _torch_run(model, steps, torch.float64), _torch_run(model, steps, torch.float16)
    for shared in (True, False):
        for index, ((_, mask), out, r64, r16) in enumerate(zip(steps, _ort_run(inplace, steps, shared), ref64, ref16)):
            real = mask[:, -out.shape[1]:].astype(bool)
            parity = compare(out[real].astype(np.float64), r64[real], r16[real], FLOAT16)
            assert parity.passed, (shared, index, str(parity))


def _long_sequence(length: int = 600, vocab: int = 256):
    """One row: a prompt of `length` tokens (far past the training length), then 3 steps."""
    rng = np.random.default_rng(11)
    steps = [(rng.integers(0, vocab, (1, length)), np.ones((1, length), np.int64))]
    for t in range(3):
        steps.append((rng.integers(0, vocab, (1, 1)), np.ones((1, length + t + 1), np.int64)))
    return steps


@pytest.mark.parametrize("bias", tiers.cases(["alibi", "t5", "kerple_log"], ["alibi", "t5", "kerple_log"],
                                             slow={"kerple_log"}))
def test_float16_cache_of_a_float32_file_stays_within_float16s_error(tmp_path, bias):
    """--kv-dtype float16 (float32 weights, attention in float16): the padded batch with a hole
    and a 600-token prompt, bound and unbound, under the float16 policy against float64 (PyTorch
    float16's own error bounds it: it rounds every weight and activation, this file only what
    attention reads), and within that budget of the float32-cache file too."""
    from posbias_export.parity.tolerance import FLOAT16

    half, whole = _export(tmp_path, bias, "ort", "float32", "--kv-dtype", "float16"), _export(tmp_path, bias, "ort")
    assert [i.type for i in half.get_inputs()][2] == "tensor(float16)"
    for steps in (_sequence(), _long_sequence()):
        # a model each: _torch_run casts the module it is given
        ref64, ref16 = _torch_run(cli_model(bias), steps, torch.float64), _torch_run(cli_model(bias), steps, torch.float16)
        capacity = steps[-1][1].shape[1] + 8
        float32_cache = _ort_run(whole, steps, shared=False)
        for shared in (True, False):
            got = _ort_run(half, steps, shared, capacity)
            for index, ((_, mask), out, r64, r16, f32) in enumerate(zip(steps, got, ref64, ref16, float32_cache)):
                real = mask[:, -out.shape[1]:].astype(bool)
                parity = compare(out[real].astype(np.float64), r64[real], r16[real], FLOAT16)
                assert parity.passed, (shared, index, str(parity))
                beside = compare(out[real].astype(np.float64), f32[real].astype(np.float64), r16[real], FLOAT16)
                assert beside.passed, (shared, index, "vs the float32 cache", str(beside))


@pytest.mark.parametrize("argv, words", [
    ([], "target ort writes a KV cache in place: it needs kv_cache"),
    (["--kv-cache", "--inline-functions"], "drop --inline-functions"),
])
def test_inplace_refusals_are_one_line(tmp_path, capsys, argv, words):
    out = tmp_path / "m.onnx"
    assert cli_main(["--bias", "alibi", "--target", "ort", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_validate_runs_an_inplace_file_where_it_can_and_says_why_not_elsewhere(tmp_path):
    """Default runtimes: ONNX Runtime in Python (also with the cache bound to one buffer), Node and
    the reference evaluator (its GroupQueryAttention takes a cache and a bias: contrib_ops.py);
    OpenVINO is left out with its reason."""
    from posbias_export.validation import validate

    path = tmp_path / "kv.onnx"
    assert cli_main(["--bias", "alibi", "--kv-cache", "--target", "ort", "--out", str(path), "--skip-growth-check",
                     "--heads", "4", "--dim", "64", "--layers", "2"]) == 0
    result = validate([path], None, (1, 40), batch=3, order=False)
    assert result.ok, [(c.runtime, c.case, c.verdict) for c in result.matrices[0].cells if not c.ok]
    assert {"ort-cpu-shared", "reference"} <= {c.runtime for c in result.matrices[0].cells}
    assert "GroupQueryAttention" in result.skipped["openvino"] and "reference" not in result.skipped


def test_generate_through_one_buffer_equals_the_concat_file(tmp_path):
    """runtimes/ort/generate.py on an in-place file: one buffer per cache tensor for the whole
    run; a padded batch, and one prompt longer than PREFILL_BLOCK (it enters the buffer in blocks)
    give the Concat file's greedy tokens."""
    from posbias_export.parity import load_runner

    runner = load_runner("ort/generate.py")
    inplace, concat = _export(tmp_path, "alibi", "ort"), _export(tmp_path, "alibi", "portable")
    paths = [tmp_path / "alibi_ort_float32.onnx", tmp_path / "alibi_portable_float32.onnx"]
    decoders = [runner.CachedDecoder(str(p)) for p in paths]
    assert decoders[0].inplace and not decoders[1].inplace
    long_prompt = bytes(np.random.default_rng(3).integers(32, 127, runner.PREFILL_BLOCK + 77).astype(np.uint8))
    for prompts in ([b"To be, or not", b"Hi"], [long_prompt]):
        tokens = [runner.generate(d, prompts, 24) for d in decoders]
        assert tokens[0] == tokens[1], prompts[0][:20]


@pytest.mark.parametrize("kind", tiers.cases(["bloom", "mpt", "falcon"], ["bloom", "mpt", "falcon"], slow={"mpt", "falcon"}))
def test_imported_inplace_file_equals_the_concat_file_and_the_folder(tmp_path, kind):
    """BLOOM (positions from the mask), MPT (from key indices), Falcon (one key/value head): the
    in-place file's steps, bound and unbound, equal the Concat file's within float32's error, and
    validate --model judges its prefill against the folder's model on ORT with and without the
    shared buffer."""
    pytest.importorskip("transformers")
    from hf_folders import save_tiny_model

    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    folder = save_tiny_model(kind, tmp_path / kind)
    sessions = {}
    for target in ("ort", "portable"):
        path = tmp_path / f"{kind}_{target}.onnx"
        export_model(folder, path, kv_cache=True, target=target, check_growth=False)
        sessions[target] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    steps = _sequence(vocab=200)
    concat = _ort_run(sessions["portable"], steps, shared=False)
    for shared in (True, False):
        for index, (got, want, (_, mask)) in enumerate(zip(_ort_run(sessions["ort"], steps, shared), concat, steps)):
            real = mask[:, -got.shape[1]:].astype(bool)
            assert np.abs(got[real] - want[real]).max() <= 1e-5 * max(1.0, np.abs(want[real]).max()), (shared, index)
    result = validate([tmp_path / f"{kind}_ort.onnx"], None, (1, 17, 40), batch=2, model_dir=folder, order=False)
    assert result.ok, [(c.runtime, c.case, c.verdict) for c in result.matrices[0].cells if not c.ok]
    assert {"ort-cpu", "ort-cpu-shared", "transformers"} <= {c.runtime for c in result.matrices[0].cells}


@pytest.mark.parametrize("target", ["portable", "ort"])
def test_generate_refuses_ids_past_the_embedding_of_an_int4_file(tmp_path, target):
    """An int4 file's GatherBlockQuantized reads past its table without a check: the runner
    checks every id against the model's vocabulary (its logits' width or recorded size) first,
    whichever way the cache is kept."""
    from posbias_export.parity import load_runner

    runner = load_runner("ort/generate.py")
    path = tmp_path / f"int4_{target}.onnx"
    assert cli_main(["--bias", "alibi", "--kv-cache", "--target", target, "--quantize", "int4", "--out", str(path),
                     "--heads", "4", "--dim", "64", "--layers", "1", "--skip-growth-check"]) == 0
    decoder = runner.CachedDecoder(str(path))
    assert decoder.vocab == 256
    for prompt, bad in (([5, 1900, 7], 1900), ([5, -1], -1)):
        with pytest.raises(runner.RunnerError, match=rf"token id {bad} is outside the vocabulary \[0, 256\)"):
            runner.generate(decoder, [prompt], 4)
    assert len(runner.generate(decoder, [[5, 255, 7]], 4)[0]) == 4


def test_the_shared_runtime_runs_a_prompt_as_prefill_then_steps(tmp_path, monkeypatch):
    """validate's ort-cpu-shared runs a prompt as a client does: its first tokens in one call,
    the last CLIENT_STEPS one call each into the same bound buffer, logits joined; the result
    equals one unbound call (a left-padded batch), and a Concat file is refused by the binding."""
    from posbias_export.runners import runtimes_common

    runner = runtimes_common("loading").load_runner("ort/run.py")
    session = _export(tmp_path, "alibi", "ort")
    rng = np.random.default_rng(3)
    mask = np.ones((2, 12), np.int64)
    mask[1, :4] = 0  # row 1 left-padded
    feeds = {"input_ids": rng.integers(0, 256, (2, 12)), "attention_mask": mask}
    for i in session.get_inputs():
        if i.name.startswith("past_"):
            feeds[i.name] = np.zeros((2, SMALL["num_heads"], 0, SMALL["dim"] // SMALL["num_heads"]), np.float32)
    calls = []
    bound = type(session).run_with_iobinding
    monkeypatch.setattr(type(session), "run_with_iobinding", lambda self, b, *a: calls.append(1) or bound(self, b, *a))
    shared = runner.run_shared(session, feeds)
    assert len(calls) == 1 + runner.CLIENT_STEPS
    plain = runner.run(session, feeds)
    keep = mask.astype(bool)
    assert np.abs(shared["logits"][keep] - plain["logits"][keep]).max() <= 1e-5  # float32 kernels, other blocking
    for name in (n for n in plain if n.startswith("present_")):
        assert shared[name].shape == plain[name].shape
    concat = _export(tmp_path, "alibi", "portable")
    with pytest.raises(runner.RunnerError, match="shared cache buffer"):
        runner.run_shared(concat, feeds)

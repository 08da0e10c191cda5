"""Every runtime, as a separate process through its runner in runtimes/, against PyTorch
float64, for every bias and length (ids: bias-runtime-length)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import posbias_export as pbe
import tiers
from posbias_export.parity import RUNTIMES_DIR, load_runner, run_matrix
from conftest import TRACE_LEN

RUNTIME_NAMES = ["ort-cpu", "openvino", "node", "reference"]
LENGTHS = [1, 17, 64 * TRACE_LEN]
SLOW_LENGTHS = [4096]


@pytest.fixture(scope="session")
def matrices(exports):
    """One runner process per (bias, runtime) for all lengths; each test reads one cell."""
    cache = {}

    def get(bias, lengths):
        key = (bias, lengths)
        if key not in cache:
            # the order protocol on every runtime once (alibi); test_order_protocol.py does the rest
            cache[key] = run_matrix(exports.cli(bias), tuple(RUNTIME_NAMES), lengths, batch=3, order=bias == "alibi")
        return cache[key]

    return get


def _cell(matrix, runtime, length):
    return next(c for c in matrix.cells if c.runtime == runtime and c.case == f"L={length} B=3")


def _params(lengths, marks=()):
    return [pytest.param(b, r, n, id=f"{b}-{r}-L{n}", marks=(*marks, *([tiers.SLOW] if tiers.extended(b) else [])))
            for b in pbe.BIASES for r in RUNTIME_NAMES for n in lengths]


@pytest.mark.parametrize("bias,runtime,length", _params(LENGTHS) + _params(SLOW_LENGTHS, (pytest.mark.slow,)))
def test_runtime_matches_pytorch(matrices, bias, runtime, length):
    lengths = tuple(LENGTHS) if length in LENGTHS else tuple(SLOW_LENGTHS)
    cell = _cell(matrices(bias, lengths), runtime, length)
    assert cell.verdict == "pass", f"{cell.verdict}: {cell.parity}"


def test_openvino_bf16_is_measured_separately(exports):
    """bf16 is OpenVINO's silent CPU default; measured, and judged against PyTorch bf16."""
    matrix = run_matrix(exports.cli("alibi"), ("openvino", "openvino-bf16"), (64,), batch=1, order=False)
    bf16_cell = matrix.cells[1]
    if "ignored the precision hint" in bf16_cell.verdict:  # a CPU without bf16 (e.g. AVX2-only): nothing to judge
        pytest.skip(f"no bf16 on this CPU: {bf16_cell.verdict}")
    f32, bf16 = (c.parity for c in matrix.cells)
    assert f32["max_abs"] < 1e-4 < bf16["max_abs"]  # bf16 really ran, f32 really is f32
    assert matrix.ok, [c.verdict for c in matrix.cells]


# --- runners on bad requests --------------------------------------------------------------
def runner(name, *args, env=None):
    script = {"ort": "ort/run.py", "openvino": "openvino/run.py", "reference": "reference/run.py", "node": "node/run.js"}[name]
    cmd = ["node" if name == "node" else sys.executable, str(RUNTIMES_DIR / script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _write_set(folder: Path, arrays: dict):
    from onnx import numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, a) in enumerate(arrays.items()):
        (folder / f"input_{i}.pb").write_bytes(numpy_helper.from_array(a, name).SerializeToString())


BAD_INPUTS = {
    "wrong-name": ({"tokens": np.zeros((2, 5), np.int64)}, "input names do not match"),
    "wrong-rank": ({"input_ids": np.zeros((2, 5, 1), np.int64)}, "expected rank 2"),
    "wrong-dtype": ({"input_ids": np.zeros((2, 5), np.float32)}, "expected dtype"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("name", ["ort", "openvino", "reference", "node"])
def test_runner_rejects_bad_inputs_before_running(exports, tmp_path, name, case):
    arrays, message = BAD_INPUTS[case]
    _write_set(tmp_path / "in", arrays)
    proc = runner(name, exports.cli("alibi"), tmp_path / "in", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["ort", "openvino", "reference", "node"])
def test_runner_rejects_corrupt_model(tmp_path, name):
    (tmp_path / "bad.onnx").write_bytes(b"\x08\x07garbage" * 50)
    _write_set(tmp_path / "in", {"input_ids": np.zeros((1, 3), np.int64)})
    proc = runner(name, tmp_path / "bad.onnx", tmp_path / "in", tmp_path / "out")
    assert proc.returncode == 2 and "cannot load model" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_runner_reads_and_writes_npz(exports, tmp_path):
    np.savez(tmp_path / "in.npz", input_ids=np.arange(10, dtype=np.int64).reshape(2, 5))
    proc = runner("ort", exports.cli("alibi"), tmp_path / "in.npz", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stderr
    with np.load(tmp_path / "out.npz") as out:
        assert out["logits"].shape == (2, 5, 256)


def test_cuda_request_without_cuda_provider_is_an_error(exports, tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has a CUDA provider; the GPU tests cover it")
    _write_set(tmp_path / "in", {"input_ids": np.zeros((1, 3), np.int64)})
    proc = runner("ort", exports.cli("alibi"), tmp_path / "in", tmp_path / "out", "--provider", "cuda")
    assert proc.returncode == 2
    assert "CUDA requested, but this onnxruntime build has no CUDAExecutionProvider" in proc.stderr
    assert not (tmp_path / "out").exists()  # never a silent CPU run


def _cuda_active() -> str | None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider here (CPU-only build or no GPU)"
    return None


@pytest.mark.skipif(_cuda_active() is not None, reason=str(_cuda_active()))
@pytest.mark.parametrize("bias", pbe.BIASES)
def test_ort_cuda_matches_pytorch(exports, bias):
    """ort-cuda runs float32 exactly (TF32 off) under the float32 policy; TF32 is its own row."""
    matrix = run_matrix(exports.cli(bias), ("ort-cuda", "ort-cuda-tf32"), (1, 17, 1024), batch=3)
    assert matrix.ok, [(c.runtime, c.case, c.verdict, c.parity) for c in matrix.cells]


def test_cuda_sessions_keep_tf32_off_unless_asked():
    ort_run = load_runner("ort/run.py")
    (name, options), cpu = ort_run.provider_list("cuda")
    assert (name, cpu, options["use_tf32"]) == ("CUDAExecutionProvider", "CPUExecutionProvider", "0")
    assert options["use_ep_level_unified_stream"] == "1"  # one stream (the order-dependent CUDA error's suspect)
    assert ort_run.provider_list("cuda", tf32=True)[0][1]["use_tf32"] == "1"
    assert ort_run.provider_list("cpu") == ["CPUExecutionProvider"]


def test_sessions_serve_changing_shapes_without_memory_patterns(exports):
    """Memory patterns are keyed by input dims (a Loop body's key is the same at every length):
    off in every runner session, and in the GPU bench worker, which takes the runner's options."""
    import onnxruntime as ort

    ort_run = load_runner("ort/run.py")
    opts = ort_run.session_options(ort, threads=1)
    assert opts.enable_mem_pattern is False and opts.intra_op_num_threads == 1
    session = ort_run.create_session(str(exports.cli("none")), "cpu")
    assert session.get_session_options().enable_mem_pattern is False


def test_cpu_sessions_free_each_tensor_without_planned_reuse(exports):
    """On CPU the runners turn the planner's buffer reuse off (a layer's feed-forward buffers were
    held through the next layers' attention: benchmarks/embedders.md); CUDA keeps it (unmeasured
    there). The outputs do not change."""
    import onnxruntime as ort

    ort_run = load_runner("ort/run.py")
    assert ort_run.session_options(ort).enable_mem_reuse is False
    assert ort_run.session_options(ort, provider="cuda").enable_mem_reuse is True
    path = str(exports.cli("alibi"))
    session = ort_run.create_session(path, "cpu")
    assert session.get_session_options().enable_mem_reuse is False
    feeds = {"input_ids": np.arange(40, dtype=np.int64).reshape(1, 40) % 50}
    planned = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, feeds)[0], planned.run(None, feeds)[0])


def test_tf32_policy_admits_tf32_rounding_and_float32_does_not():
    """Outputs whose matmul inputs were rounded to TF32's 10-bit mantissa (simulated here on the
    CPU): within the TF32 budget (relative to PyTorch float16's error), outside float32's."""
    from posbias_export.parity import FLOAT32, TF32, compare

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=gen, dtype=torch.float64), torch.randn(256, 64, generator=gen, dtype=torch.float64)
    ref64 = (a @ b).numpy()

    def rounded(t, bits):  # keep `bits` explicit mantissa bits, as TF32 (10) or float32 (23) do
        mantissa, exponent = np.frexp(t.numpy())
        return torch.from_numpy(np.ldexp(np.round(mantissa * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), exponent))

    tf32 = (rounded(a, 10) @ rounded(b, 10)).numpy()
    fp16 = (a.half().float() @ b.half().float()).double().numpy()
    fp32 = (a.float() @ b.float()).double().numpy()
    assert compare(tf32, ref64, fp16, TF32).passed
    assert not compare(tf32, ref64, fp32, FLOAT32).passed


def _validate(*args, env=None):
    return subprocess.run([sys.executable, "-m", "posbias_export", "validate", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900)


def test_validate_command_prints_matrix_and_exits_0(exports, tmp_path):
    proc = _validate(exports.cli("kerple_log"), "--lengths", "1,17,300", "--json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for runtime in RUNTIME_NAMES:
        assert runtime in proc.stdout
    assert "ALL PASS" in proc.stdout and "L=300 B=3" in proc.stdout
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    cells = report["models"][0]["cells"]
    order = [c for c in cells if c["case"].startswith("one session")]  # the order protocol: 2 per runtime
    assert report["ok"] and len(cells) - len(order) == 4 * 3 and len(order) == 4 * 2
    assert all(c["parity"]["bit_identical"] for c in order)


def test_validate_corrupt_model(tmp_path, exports):
    data = bytearray(Path(exports.cli("alibi")).read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64  # damage the middle
    (tmp_path / "broken.onnx").write_bytes(bytes(data[: len(data) // 2 + 64]))
    proc = _validate(tmp_path / "broken.onnx")
    assert proc.returncode == 2 and "is not a valid ONNX file" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_validate_bad_user_inputs(exports, tmp_path, case):
    arrays, message = BAD_INPUTS[case]
    np.savez(tmp_path / "in.npz", **arrays)
    proc = _validate(exports.cli("alibi"), "--inputs", tmp_path / "in.npz")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_validate_with_user_inputs(exports, tmp_path):
    np.savez(tmp_path / "in.npz", input_ids=np.arange(40, dtype=np.int64).reshape(2, 20))
    proc = _validate(exports.cli("t5"), "--inputs", tmp_path / "in.npz", "--runtimes", "ort-cpu,reference")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_validate_missing_runtime_is_a_failing_verdict(exports):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python only: no node
    proc = _validate(exports.cli("alibi"), "--runtimes", "ort-cpu,node", "--lengths", "5", env=env)
    assert proc.returncode == 1
    assert "unavailable: node is not on PATH" in proc.stdout


def test_validate_cuda_without_provider_is_a_failing_verdict(exports):
    if _cuda_active() is None:
        pytest.skip("CUDA provider present")
    proc = _validate(exports.cli("alibi"), "--runtimes", "ort-cuda", "--lengths", "5")
    assert proc.returncode == 1
    assert "error: CUDA requested" in proc.stdout


def test_cuda_sessions_launch_host_synchronously_only_for_files_that_read_stale_on_the_host(monkeypatch, exports):
    """ONNX Runtime CUDA reads index values computed on the GPU inside subgraphs before the GPU
    wrote them (benchmarks/gpu_cure.md): the runners set CUDA_LAUNCH_BLOCKING=1 only for a file
    with such a read (Sandwich's distance table, from the positions' values; the committed 0f33d6a
    file, exported before the cure) or with the portable blocked body (which still raced without
    one: benchmarks/gpu_cure_loops.md), keep a caller's own value, and leave the GPU-target blocked
    files and an in-place cache file (no control flow) asynchronous."""
    from posbias_export.runners import runtimes_common

    run = runtimes_common("loading").load_runner("ort/run.py")
    monkeypatch.setattr(run, "_cuda_async", [])
    inplace = exports.cli("alibi", extra=("--kv-cache", "--target", "ort"))
    gpu = exports.cli("alibi", extra=("--target", "cuda-ort"))  # blocked Loops, their scalars read from their own Shape
    portable = exports.cli("alibi")  # the portable blocked body: fenced
    sandwich = exports.cli("sandwich", extra=("--target", "cuda-ort"))
    old = Path(__file__).resolve().parents[1] / "posbias_export" / "gpu" / "data" / "alibi_attention_0f33d6a.onnx"
    assert not run.needs_host_sync(str(inplace)) and not run.needs_host_sync(str(gpu))
    assert run.needs_host_sync(str(portable)) and run.needs_host_sync(str(sandwich)) and run.needs_host_sync(str(old))
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    run.host_synchronous_cuda(str(inplace), str(gpu))
    assert "CUDA_LAUNCH_BLOCKING" not in os.environ
    monkeypatch.setattr(run, "_cuda_async", [])
    run.host_synchronous_cuda(str(sandwich))
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "0")
    run.host_synchronous_cuda(str(old))
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "0"


def test_validate_reference_on_a_missing_gpu_is_one_line(exports):
    import torch

    if torch.cuda.is_available():
        pytest.skip("PyTorch sees a CUDA GPU here")
    proc = _validate(exports.cli("alibi"), "--runtimes", "ort-cpu", "--lengths", "5", "--reference-device", "cuda")
    assert proc.returncode == 2 and "PyTorch sees no CUDA GPU" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_validate_unknown_runtime_is_usage_error(exports):
    proc = _validate(exports.cli("alibi"), "--runtimes", "tensorrt")
    assert proc.returncode == 2 and "unknown runtime" in proc.stderr


@pytest.mark.parametrize("bias", ["alibi", "window"])
def test_validate_judges_kv_cache_exports(exports, bias):
    """A --kv-cache file is judged on a step after a random cache (CACHE_LEN positions): the
    runtimes' logits against the float64 PyTorch cache path, on every runtime."""
    matrix = run_matrix(exports.cli(bias, extra=("--kv-cache",)), ("ort-cpu", "reference"), (1, 17), batch=2,
                        order=False)
    assert matrix.ok and len(matrix.cells) == 4, [(c.runtime, c.case, c.verdict) for c in matrix.cells]
    assert all(c.parity["max_abs"] > 0 for c in matrix.cells)  # a real comparison, not an empty one

"""Malformed inputs, fed the way a user would: to the command line and to the runners.

Every case must end with exit code 2, exactly one line on stderr that says what is wrong
(the expected words are part of the case), no traceback, and no file created or changed in
the folder that holds the inputs (an output path equal to an input included).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import save_file

import posbias_export as pbe
from conftest import SMALL
from posbias_export.cli import main as cli_main
from posbias_export.parity import RUNTIMES_DIR


def _npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def _pb_folder(path: Path, array: np.ndarray) -> Path:
    path.mkdir()
    (path / "input_0.pb").write_bytes(numpy_helper.from_array(array, "input_ids").SerializeToString())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The inputs every case draws from: models, checkpoints, tensors, broken files."""
    d = tmp_path_factory.mktemp("bad_inputs")
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=0)
    pbe.save_checkpoint(model, d / "ck.safetensors")
    pbe.save_checkpoint(pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=1), d / "other.safetensors")
    assert cli_main(["--checkpoint", str(d / "ck.safetensors"), "--out", str(d / "model.onnx")]) == 0
    assert cli_main(["--checkpoint", str(d / "ck.safetensors"), "--kv-cache", "--out", str(d / "kv.onnx")]) == 0
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    pbe.save_checkpoint(model, d / "nan.safetensors")
    save_file({"w": torch.zeros(2)}, str(d / "badjson.safetensors"), metadata={"posbias.config": "{not json"})
    (d / "random.bin").write_bytes(bytes(range(256)) * 8)
    (d / "random.onnx").write_bytes(bytes(range(256)) * 8)
    np.save(d / "ids.npy", np.zeros((1, 4), np.int64))
    _npz(d / "ids300.npz", input_ids=np.array([[1, 300]], np.int64))
    _npz(d / "neg.npz", input_ids=np.array([[-1, 3]], np.int64))
    _npz(d / "wrong_name.npz", tokens=np.zeros((1, 4), np.int64))
    _npz(d / "float_ids.npz", input_ids=np.zeros((1, 4), np.float32))
    _npz(d / "ok.npz", input_ids=np.zeros((1, 4), np.int64))
    _pb_folder(d / "pb300", np.array([[1, 300]], np.int64))
    _pb_folder(d / "pb_empty", np.zeros((1, 0), np.int64))
    (d / "corpus.txt").write_bytes(b"to be or not to be " * 200)
    (d / "a_folder").mkdir()
    return d


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


# (id, argv for python -m posbias_export, words the error line must contain); {d} is the folder
CLI_CASES = [
    ("unknown-bias", ["--bias", "alibx", "--out", "{d}/x.onnx"], "unknown bias 'alibx'"),
    ("zero-heads", ["--bias", "alibi", "--heads", "0", "--out", "{d}/x.onnx"], "expected a positive integer"),
    ("param-of-other-family", ["--bias", "alibi", "--bias-param", "window=5", "--out", "{d}/x.onnx"], "window"),
    ("param-below-minimum", ["--bias", "window", "--bias-param", "window=0", "--out", "{d}/x.onnx"], "window"),
    ("param-not-a-number", ["--bias", "window", "--bias-param", "window=abc", "--out", "{d}/x.onnx"], "window"),
    ("param-without-value", ["--bias", "window", "--bias-param", "window", "--out", "{d}/x.onnx"], "NAME=VALUE"),
    ("out-is-the-checkpoint", ["--checkpoint", "{d}/ck.safetensors", "--out", "{d}/ck.safetensors"], "also an input"),
    ("checkpoint-random-bytes", ["--checkpoint", "{d}/random.bin", "--out", "{d}/x.onnx"], "cannot read checkpoint"),
    ("checkpoint-broken-json", ["--checkpoint", "{d}/badjson.safetensors", "--out", "{d}/x.onnx"], "not valid JSON"),
    ("checkpoint-nan-weights", ["--checkpoint", "{d}/nan.safetensors", "--out", "{d}/x.onnx"], "NaN"),
    ("kv-cache-bidirectional", ["--bias", "alibi", "--kv-cache", "--bidirectional", "--out", "{d}/x.onnx"],
     "causal decoding"),
    ("out-in-missing-folder", ["--bias", "alibi", "--out", "{d}/no/x.onnx"], "does not exist"),
    ("out-is-a-folder", ["--bias", "alibi", "--out", "{d}/a_folder"], "it is a directory"),
    ("trace-len-1", ["--bias", "alibi", "--trace-len", "1", "--out", "{d}/x.onnx"], "trace_len"),
    ("dtype-float64", ["--bias", "alibi", "--dtype", "float64", "--out", "{d}/x.onnx"], "invalid choice"),
    ("validate-missing-model", ["validate", "{d}/none.onnx", "--runtimes", "ort-cpu"], "does not exist"),
    ("validate-random-bytes-model", ["validate", "{d}/random.onnx", "--runtimes", "ort-cpu"], "not a valid ONNX"),
    ("validate-npy-inputs", ["validate", "{d}/model.onnx", "--inputs", "{d}/ids.npy"], "not an .npz archive"),
    ("validate-random-inputs", ["validate", "{d}/model.onnx", "--inputs", "{d}/random.bin"], "not an .npz archive"),
    ("validate-id-300", ["validate", "{d}/model.onnx", "--inputs", "{d}/ids300.npz", "--runtimes", "ort-cpu"],
     "token id 300 is outside the vocabulary"),
    ("validate-id-negative", ["validate", "{d}/model.onnx", "--inputs", "{d}/neg.npz", "--runtimes", "ort-cpu"],
     "token id -1 is outside the vocabulary"),
    ("validate-wrong-input-name", ["validate", "{d}/model.onnx", "--inputs", "{d}/wrong_name.npz"], "input names"),
    ("validate-float-ids", ["validate", "{d}/model.onnx", "--inputs", "{d}/float_ids.npz"], "expected dtype int64"),
    ("validate-json-missing-folder", ["validate", "{d}/model.onnx", "--json", "{d}/no/r.json"], "does not exist"),
    ("validate-json-is-the-model", ["validate", "{d}/model.onnx", "--json", "{d}/model.onnx"], "also an input"),
    ("validate-unknown-runtime", ["validate", "{d}/model.onnx", "--runtimes", "tensorrt"], "unknown runtime"),
    ("validate-length-0", ["validate", "{d}/model.onnx", "--lengths", "0"], "positive integers"),
    ("validate-other-checkpoint", ["validate", "{d}/model.onnx", "--checkpoint", "{d}/other.safetensors",
                                   "--runtimes", "ort-cpu", "--lengths", "3"], "not the file this model was exported"),
    ("generate-temperature-nan", ["generate", "{d}/kv.onnx", "--prompt", "hi", "--temperature", "nan"], "finite"),
    ("generate-huge-count", ["generate", "{d}/kv.onnx", "--prompt", "hi", "--max-new-tokens", str(10 ** 18)],
     "exceeds --max-context"),
    ("generate-empty-prompt", ["generate", "{d}/kv.onnx", "--prompt", ""], "empty"),
    ("generate-no-cache-model", ["generate", "{d}/model.onnx", "--prompt", "hi"], "no KV cache inputs"),
    ("generate-output-missing-folder", ["generate", "{d}/kv.onnx", "--prompt", "hi", "--output", "{d}/no/o.bin"],
     "does not exist"),
    ("evaluate-too-long", ["evaluate", "{d}/model.onnx", "--corpus", "{d}/corpus.txt", "--lengths", "200000"],
     "longer than the corpus"),
    ("evaluate-missing-corpus", ["evaluate", "{d}/model.onnx", "--corpus", "{d}/none.txt"], "does not exist"),
    ("evaluate-json-is-the-corpus", ["evaluate", "{d}/model.onnx", "--corpus", "{d}/corpus.txt", "--json",
                                     "{d}/corpus.txt"], "also an input"),
]


@pytest.mark.parametrize("argv,words", [pytest.param(a, w, id=i) for i, a, w in CLI_CASES])
def test_cli_refuses_with_one_line(files, argv, words):
    before = _snapshot(files)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main([a.replace("{d}", str(files)) for a in argv])
        except SystemExit as exit_:  # the runner-backed generate exits through argparse
            code = exit_.code
    lines = [l for l in err.getvalue().splitlines() if l.strip()]
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and words in lines[0], err.getvalue()
    assert _snapshot(files) == before, "a refused command created or changed a file"


# (id, runner, model, inputs, words)
RUNNER_CASES = [
    ("ort-id-300", "ort/run.py", "model.onnx", "pb300", "token id 300"),
    ("ort-random-model", "ort/run.py", "random.onnx", "ok.npz", "cannot load model"),
    ("ort-npy-inputs", "ort/run.py", "model.onnx", "ids.npy", "inputs"),
    ("reference-negative-id", "reference/run.py", "model.onnx", "neg.npz", "token id -1"),
    ("reference-empty-input", "reference/run.py", "model.onnx", "pb_empty", "is empty"),
    ("openvino-id-300", "openvino/run.py", "model.onnx", "ids300.npz", "token id 300"),
    ("openvino-random-inputs", "openvino/run.py", "model.onnx", "random.bin", "inputs"),
    ("node-npz-inputs", "node/run.js", "model.onnx", "ok.npz", "not .npz"),
    ("node-empty-input", "node/run.js", "model.onnx", "pb_empty", "is empty"),
    ("node-id-300", "node/run.js", "model.onnx", "pb300", "token id 300"),
]


@pytest.mark.parametrize("script,model,inputs,words", [pytest.param(*c[1:], id=c[0]) for c in RUNNER_CASES])
def test_runners_refuse_with_one_line(files, script, model, inputs, words):
    if script.endswith(".js") and not (RUNTIMES_DIR / "node" / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip("onnxruntime-node is not installed (cd runtimes/node && npm install --ignore-scripts)")
    before = _snapshot(files)
    interpreter = "node" if script.endswith(".js") else sys.executable
    proc = subprocess.run([interpreter, str(RUNTIMES_DIR / script), str(files / model), str(files / inputs),
                           str(files / "no_outputs.npz" if inputs.endswith(".npz") else files / "no_outputs")],
                          capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert _snapshot(files) == before, "a refused run created or changed a file"


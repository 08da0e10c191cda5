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
import shutil
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
    # sizes that become tensors are bounded before anything is built (a 16 TB T5 offset table, 10^5 panels)
    ("show-bias-heads", ["show-bias", "alibi", "--heads", "100000", "--out", "{d}/b.png"], "--heads must be at most 128"),
    ("show-bias-t5-distance", ["show-bias", "t5", "--bias-param", "max_distance=1000000000000", "--out", "{d}/b.png"],
     "max_distance must be <= 1048576"),
    ("show-bias-sandwich-dim", ["show-bias", "sandwich", "--bias-param", "sin_dim=100000000", "--out", "{d}/b.png"],
     "sin_dim must be <= 8192"),
    ("t5-buckets-huge", ["--bias", "t5", "--bias-param", "num_buckets=1000000", "--bias-param", "max_distance=1048576",
                         "--out", "{d}/x.onnx"], "num_buckets must be <= 65536"),
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
    ("quantize-unknown", ["--bias", "alibi", "--quantize", "int3", "--out", "{d}/x.onnx"], "invalid choice"),
    ("quant-block-alone", ["--bias", "alibi", "--quant-block", "64", "--out", "{d}/x.onnx"], "need --quantize"),
    ("quant-block-odd", ["--bias", "alibi", "--quantize", "int4", "--quant-block", "48", "--out", "{d}/x.onnx"],
     "block must be one of"),
    ("quant-per-tensor-int4", ["--bias", "alibi", "--quantize", "int4", "--quant-per-tensor", "--out", "{d}/x.onnx"],
     "do not apply to --quantize int4"),
    ("quantize-float16", ["--bias", "alibi", "--quantize", "int8", "--dtype", "float16", "--out", "{d}/x.onnx"],
     "float32 weights"),
    ("quantize-block-arch", ["--bias", "alibi", "--quantize", "int8", "--arch", "block", "--out", "{d}/x.onnx"],
     "next-token predictions"),
    ("quantize-gpu-target", ["--bias", "alibi", "--quantize", "int4", "--target", "cuda", "--out", "{d}/x.onnx"],
     "portable and ort targets"),
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



# --- reliability, round 3: what a hostile user (or a full disk, or a kill) does ----------------
def _run(args: list, cwd=None, fsize: int | None = None, timeout: int = 300, **kwargs) -> subprocess.CompletedProcess:
    """A command as a deployment machine runs it; fsize: a file-size limit in the child, which
    makes every larger write fail as a full disk does (EFBIG; Python ignores SIGXFSZ, node too
    once it is ignored here, which the child inherits)."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit if fsize is not None else None, **kwargs)


def _one_line(proc: subprocess.CompletedProcess, words: str, code: int = 2) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == code, proc.stderr[-2000:]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def _no_temporaries(folder: Path) -> None:
    left = [p.name for p in folder.rglob("*") if "posbias-tmp" in p.name or ".tmp" in p.name]
    assert not left, f"temporaries left behind: {left}"


PY = sys.executable
CLI = [PY, "-m", "posbias_export"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny BLOOM folder with sharded weights (one shard in a subfolder), its --kv-cache
    export (imported: vocabulary 300, no tokenizer), and an MPT folder."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_folders import save_tiny_model
    from posbias_export.hf.export import export_model

    root = tmp_path_factory.mktemp("reliability_hf")
    bloom = save_tiny_model("bloom", root / "bloom")
    sharded = shutil.copytree(bloom, root / "sharded")
    (sharded / "sub").mkdir()
    (sharded / "model.safetensors").rename(sharded / "sub" / "model-1.safetensors")
    from safetensors import safe_open

    with safe_open(str(sharded / "sub" / "model-1.safetensors"), "pt") as f:
        keys = list(f.keys())
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "sub/model-1.safetensors"
                                                                                       for k in keys}}))
    export_model(bloom, root / "bloom_kv.onnx", kv_cache=True, check_growth=False)
    save_tiny_model("mpt", root / "mpt")
    return root


def test_outputs_never_overwrite_inputs(files, hf, tmp_path):
    """An output naming an input is refused before anything runs, whatever reads it: a shard
    the weight index points to (in a subfolder), a runner's inputs, generate's prompt file."""
    shard = hf / "sharded" / "sub" / "model-1.safetensors"
    before = shard.read_bytes()
    _one_line(_run([*CLI, "--model", hf / "sharded", "--out", shard]), "also an input")
    assert shard.read_bytes() == before
    inputs = _npz(tmp_path / "in.npz", input_ids=np.zeros((1, 4), np.int64))
    data = inputs.read_bytes()
    for script in ("ort/run.py", "reference/run.py", "openvino/run.py"):
        _one_line(_run([PY, RUNTIMES_DIR / script, files / "model.onnx", inputs, inputs]), "also an input")
    folder = _pb_folder(tmp_path / "pb", np.zeros((1, 4), np.int64))
    if (RUNTIMES_DIR / "node" / "node_modules" / "onnxruntime-node").is_dir():
        _one_line(_run(["node", RUNTIMES_DIR / "node/run.js", files / "model.onnx", folder, folder]), "also an input")
    assert inputs.read_bytes() == data and sorted(p.name for p in folder.iterdir()) == ["input_0.pb"]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("to be")
    _one_line(_run([*CLI, "generate", files / "kv.onnx", "--prompt-file", prompt, "--output", prompt]), "also an input")
    _one_line(_run([PY, RUNTIMES_DIR / "ort/generate.py", files / "kv.onnx", "--prompt", "x", "--output",
                    files / "kv.onnx"]), "also an input")
    assert prompt.read_text() == "to be"


def test_a_full_disk_changes_nothing(files, tmp_path):
    """Every writer: on a write that fails (a file-size limit stands for a full disk), one line,
    the file that was there is as it was, and no temporary is left."""
    existing = {name: tmp_path / name for name in ("o.bin", "r.json", "m.onnx", "out.npz", "e.json")}
    for path in existing.values():
        path.write_bytes(b"precious")
    inputs = _npz(tmp_path / "in.npz", input_ids=np.zeros((1, 4), np.int64))
    cases = [
        ([*CLI, "generate", files / "kv.onnx", "--prompt", "hi", "--max-new-tokens", "9", "--output", existing["o.bin"]], 8),
        ([*CLI, "validate", files / "model.onnx", "--runtimes", "ort-cpu", "--lengths", "3", "--json", existing["r.json"]],
         64),
        ([*CLI, "--bias", "alibi", "--heads", "2", "--dim", "16", "--layers", "1", "--skip-growth-check",
          "--out", existing["m.onnx"]], 4096),
        ([PY, RUNTIMES_DIR / "ort/run.py", files / "model.onnx", inputs, existing["out.npz"]], 64),
        ([*CLI, "evaluate", files / "model.onnx", "--corpus", files / "corpus.txt", "--lengths", "16", "--max-tokens",
          "64", "--json", existing["e.json"]], 16),
    ]
    for argv, limit in cases:
        proc = _run(argv, fsize=limit)
        assert proc.returncode != 0, (argv, proc.stdout[-500:])
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
    assert all(path.read_bytes() == b"precious" for path in existing.values())
    _no_temporaries(tmp_path)


def test_sigterm_during_an_export_leaves_nothing(tmp_path):
    """What timeout, systemd and container stops send: one line, exit 143, no model, no
    temporary; a temporary a killed (-9) run left is swept by the next write there."""
    import signal
    import time

    import os

    stale = tmp_path / ".m.onnx.99999999.abc.posbias-tmp"  # no process has that id: its run died
    stale.mkdir()
    (stale / "m.onnx").write_bytes(b"half")
    os.utime(stale, (time.time() - 60, time.time() - 60))  # killed a minute ago, not a writer still locking
    # a model large enough that its temporary lives ~2.6 s (dim 256, 4 layers: 1.4 s), so a busy
    # test worker still signals before the export is done
    proc = subprocess.Popen([*CLI, "--bias", "kerple_log", "--heads", "8", "--dim", "512", "--layers", "8",
                             "--out", str(tmp_path / "m.onnx")], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(".posbias-tmp" in p.name and p != stale for p in tmp_path.iterdir()):
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143 and err.strip().splitlines() == ["posbias-export: terminated"], err[-2000:]
    assert not (tmp_path / "m.onnx").exists() and not stale.exists()
    _no_temporaries(tmp_path)


def test_imported_models_are_not_fed_bytes(hf, tmp_path):
    """A model with its own vocabulary needs its tokenizer: generate refuses rather than feed
    UTF-8 bytes as token ids; the node runner refuses an id outside the recorded vocabulary."""
    _one_line(_run([*CLI, "generate", hf / "bloom_kv.onnx", "--prompt", "hello"]), "pass --tokenizer")
    if not (RUNTIMES_DIR / "node" / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip("onnxruntime-node is not installed")
    root = tmp_path / "sets"
    root.mkdir()
    from posbias_export.hf import load_model

    model = load_model(hf / "bloom")
    feeds = {"input_ids": np.array([[-1, 3]], np.int64), "attention_mask": np.ones((1, 2), np.int64)}
    for layer in range(model.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{layer}"] = np.zeros((1, model.num_kv_heads, 0, model.head_dim), np.float32)
    for k, (name, array) in enumerate(feeds.items()):
        (root / f"input_{k}.pb").write_bytes(numpy_helper.from_array(array, name).SerializeToString())
    _one_line(_run(["node", RUNTIMES_DIR / "node/run.js", hf / "bloom_kv.onnx", root, tmp_path / "out"]),
              "token id -1 is outside the vocabulary [0, 300)")


def test_seq2seq_runs_as_a_script_and_refuses_bad_input(hf, tmp_path):
    _one_line(_run([PY, RUNTIMES_DIR / "ort/seq2seq.py", hf / "bloom", "--prompt", "x"]), "encoder_model.onnx")
    _one_line(_run([PY, RUNTIMES_DIR / "ort/seq2seq.py", tmp_path / "none", "--prompt", "x"]), "is not a folder")


@pytest.mark.parametrize("change,words", [
    ({"n_head": "4"}, "n_head must be a positive integer"), ({"n_layer": 2.5}, "n_layer"), ({"vocab_size": 10 ** 12}, "does not describe"),
    ({"n_layer": 10 ** 7}, "the weights hold 2 layers"), ({"n_head": 5}, "not divisible"), ({"n_head": 0}, "positive"),
    ({"n_head": -6}, "positive"), ({"hidden_size": -48}, "positive"),
], ids=["heads-text", "layers-float", "vocab-1e12", "layers-1e7", "heads-not-dividing", "heads-0", "heads-negative",
        "hidden-negative"])
def test_folder_configs_are_checked_before_anything_is_built(hf, tmp_path, change, words):
    """transformers 5's own validation errors, and sizes checked against the weights' shapes
    read from their headers: refused in seconds, before any module is built or any memory the
    config asks for is allocated."""
    import time

    folder = shutil.copytree(hf / "bloom", tmp_path / "bloom")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    start = time.perf_counter()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["--model", str(folder), "--out", str(tmp_path / "x.onnx")])
    lines = [l for l in err.getvalue().splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0], err.getvalue()
    assert time.perf_counter() - start < 60  # not a timing target: "before allocating for 10^7 layers"
    assert not (tmp_path / "x.onnx").exists()


def test_mpt_attn_config_text_is_one_line(hf, tmp_path):
    folder = shutil.copytree(hf / "mpt", tmp_path / "mpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_config": "oops"}))
    _one_line(_run([*CLI, "--model", folder, "--out", tmp_path / "x.onnx"]), "attn_config")


@pytest.mark.parametrize("index,words", [
    ([1, 2], "not a JSON object"), ({}, "has no weight_map"), ({"weight_map": {"w": 5}}, "must name a shard file"),
    ({"weight_map": {"w": "../outside.safetensors"}}, "outside the folder"),
    ({"weight_map": {"w": "/etc/passwd"}}, "outside the folder"),
], ids=["list", "no-map", "integer-shard", "parent-folder", "absolute-path"])
def test_weight_indexes_are_checked_before_opening_anything(hf, tmp_path, index, words):
    folder = shutil.copytree(hf / "bloom", tmp_path / "bloom")
    (folder / "model.safetensors").rename(folder / "shard.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["--model", str(folder), "--out", str(tmp_path / "x.onnx")])
    lines = [l for l in err.getvalue().splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0], err.getvalue()


def test_pickles_that_are_not_state_dicts_are_one_line(hf, tmp_path):
    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo code ran",))

    for name, payload, words in (("list", [1, 2, 3], "holds a list"), ("evil", {"w": Evil()}, "could run code")):
        folder = shutil.copytree(hf / "bloom", tmp_path / name)
        (folder / "model.safetensors").unlink()
        torch.save(payload, folder / "pytorch_model.bin")
        proc = _run([*CLI, "--model", folder, "--out", tmp_path / "x.onnx"])
        _one_line(proc, words)
        assert "code ran" not in proc.stdout


def test_runner_scripts_refuse_with_one_line(files, tmp_path):
    """Deployment machines run the scripts: an output under a file, inputs named input_x.pb or
    test_data_set_x, a negative seed, Ctrl-C while generating."""
    import signal

    inputs = _npz(tmp_path / "in.npz", input_ids=np.zeros((1, 4), np.int64))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for script in ("ort/run.py", "reference/run.py", "openvino/run.py"):
        _one_line(_run([PY, RUNTIMES_DIR / script, files / "model.onnx", inputs, blocker / "out.npz"]), "is a file")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "input_x.pb").write_bytes(b"")
    _one_line(_run([PY, RUNTIMES_DIR / "ort/run.py", files / "model.onnx", odd, tmp_path / "o"]), "expected a number")
    sets = tmp_path / "sets"
    (sets / "test_data_set_x").mkdir(parents=True)
    _one_line(_run([PY, RUNTIMES_DIR / "ort/run.py", files / "model.onnx", sets, tmp_path / "o"]), "expected a number")
    _one_line(_run([PY, RUNTIMES_DIR / "ort/generate.py", files / "kv.onnx", "--prompt", "x", "--seed", "-1"]),
              "--seed must be >= 0")
    # 100000 tokens take well over 30 s uninterrupted (5000 took 1 s: a busy test worker could send
    # the signal after the child had finished); SIGINT as a terminal delivers it, even when the test
    # run itself was started in the background (which ignores SIGINT, and children inherit that)
    proc = subprocess.Popen([PY, str(RUNTIMES_DIR / "ort/generate.py"), str(files / "kv.onnx"), "--prompt", "x",
                             "--max-new-tokens", "100000", "--max-context", "200000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.stdout.read(3)  # generating
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and err.strip().splitlines() == ["generate: interrupted"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "in.npz", "odd", "sets"]


SIZE_CASES = [
    ("validate-length-1e6", ["validate", "{d}/model.onnx", "--lengths", "1000000"], "needs about"),
    ("validate-batch-1e9", ["validate", "{d}/model.onnx", "--lengths", "8", "--batch", "1000000000"], "needs about"),
    # past 2^20 a length is refused as a typo before any estimate (commands/options.py int_list)
    ("bench-length-1e9", ["bench", "--biases", "alibi", "--lengths", "1000000000", "--out-dir", "{d}/bench"],
     "expected integers up to 1048576"),
    ("bench-decode-1e9", ["bench-decode", "--biases", "alibi", "--contexts", "1000000000", "--out-dir", "{d}/bench"],
     "expected integers up to 1048576"),
    ("block-2^63", ["--bias", "alibi", "--block", str(2 ** 63), "--out", "{d}/x.onnx"], "at most 2^30"),
    ("resize-1e9", ["--checkpoint", str(Path(__file__).parents[1] / "models" / "learned.safetensors"),
                    "--resize-positions", "1000000000", "--out", "{d}/x.onnx"], "needs about"),
    ("train-lr-1e30", ["train", "--bias", "alibi", "--corpus", "{d}/corpus.txt", "--steps", "3", "--batch", "2",
                       "--train-len", "8", "--heads", "2", "--dim", "16", "--layers", "1", "--lr", "1e30",
                       "--out", "{d}/trained"], "diverged"),
]


@pytest.mark.parametrize("argv,words", [pytest.param(a, w, id=i) for i, a, w in SIZE_CASES])
def test_too_big_or_diverging_requests_are_refused(files, argv, words):
    """Estimated up front (memory), refused with the estimate, nothing written (a results file
    an all-failed bench would replace included); a training run that diverges saves nothing."""
    test_cli_refuses_with_one_line(files, argv, words)


def test_validate_judges_our_own_imported_kv_cache_file(hf):
    """An empty cache is a prefill: every runner accepts it (only the past axis may be 0)."""
    from posbias_export.hf.validate import run_hf_matrix

    matrix = run_hf_matrix(hf / "bloom_kv.onnx", hf / "bloom", ("ort-cpu", "reference"), (1, 9), batch=2)
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]


def test_imported_validate_lengths_are_estimated(hf):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["validate", str(hf / "bloom_kv.onnx"), "--model", str(hf / "bloom"), "--lengths", "1000000",
                         "--runtimes", "ort-cpu"])
    lines = [l for l in err.getvalue().splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "needs about" in lines[0], err.getvalue()


def test_one_line_errors_drop_terminal_colours():
    """torch's exporter colours its messages; a results cell or a command's one line gets plain text."""
    from posbias_export.errors import first_line

    err = RuntimeError("Failed to decompose the FX graph. \x1b[96mThis is step 2/3\x1b[0m of exporting\nmore")
    assert first_line(err) == "Failed to decompose the FX graph. This is step 2/3 of exporting"

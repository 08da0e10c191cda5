"""The --out-dir folder of a JinaBERT v2 embedder in the clients people embed with: transformers.js
(feature-extraction, Node), fastembed (a custom model from a local folder) and sentence-transformers
(its ONNX backend), each on texts of different lengths padded into one batch. Each client's
embedding is judged against the float64 module on the token ids that client's own tokenizer
made: mean over the mask, L2-normalised, cosine >= 0.9999 (the issue's bound) and no entry off by
more than 1e-4 (float32 runs measure ~1e-6 here)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from posbias_export.hf.models import load_model  # noqa: E402
from side_env import SIDE_ENV, side_python  # noqa: E402
from posbias_export.hf.tiny import save_tiny_folder, save_tokenizer  # noqa: E402

JS = Path(__file__).resolve().parents[1] / "posbias_export" / "clients" / "js"
TEXTS = ["To be, or not to be", "that is the question: whether tis nobler in the mind to suffer the slings",
         "To be"]


@pytest.fixture(scope="module", params=["jina_bert", "jina_bert_code"])
def shipped(request, tmp_path_factory):
    from posbias_export.hf.ship import ship

    root = tmp_path_factory.mktemp(request.param)
    source = save_tiny_folder(request.param, root / "src")
    save_tokenizer(source, max_length=8192)  # a published folder's tokenizer_config names its 8192 tokens
    ship(source, root / "out", check_growth=False)
    return source, root / "out"


def reference(source: Path, ids, mask) -> np.ndarray:
    """The float64 module's last_hidden_state, mean over the mask, L2-normalised: [B, D]."""
    model = load_model(source).double()
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        states = model(ids, mask).numpy()
    m = mask.numpy()[..., None]
    pooled = (states * m).sum(1) / m.sum(1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def check(got: np.ndarray, ref: np.ndarray) -> None:
    got = np.asarray(got, np.float64)
    cosine = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1)
    assert cosine.min() >= 0.9999 and np.abs(got - ref).max() < 1e-4, (cosine, np.abs(got - ref).max())


def test_the_folder_is_laid_out_for_the_embedding_clients(shipped):
    _, out = shipped
    assert (out / "onnx" / "model.onnx").is_file() and (out / "tokenizer.json").is_file()
    assert "auto_map" not in json.loads((out / "config.json").read_text())  # no code to fetch for an ONNX folder
    pooling = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and json.loads((out / "modules.json").read_text())[1]["path"] == "1_Pooling"
    notes = (out / "SERVING.md").read_text()  # the embedding clients' knob for subnormal floats, or why none is needed
    assert all(client in notes for client in ("fastembed", "sentence-transformers", "transformers.js", "Triton"))
    assert "onnxruntime-genai" not in notes


@pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir(),
                    reason="transformers.js not installed (cd posbias_export/clients/js && npm install --ignore-scripts)")
def test_transformers_js_feature_extraction(shipped):
    source, out = shipped
    proc = subprocess.run(["node", str(JS / "embed.mjs"), str(out.resolve()), json.dumps(TEXTS)], capture_output=True,
                          text=True, timeout=300, cwd=JS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len({sum(m) for m in got["mask"]}) == len(TEXTS)  # three lengths: a padded batch
    check(np.array(got["embeddings"]), reference(source, got["ids"], got["mask"]))


def test_fastembed_custom_model(shipped):
    fastembed = pytest.importorskip("fastembed", reason="fastembed not installed (pip install -e '.[test]')")
    from fastembed.common.model_description import ModelSource, PoolingType

    source, out = shipped
    name = f"posbias/{source.parent.name}"
    width = json.loads((out / "config.json").read_text())["hidden_size"]
    if name not in {d["model"] for d in fastembed.TextEmbedding.list_supported_models()}:
        fastembed.TextEmbedding.add_custom_model(model=name, pooling=PoolingType.MEAN, normalization=True,
                                                 sources=ModelSource(hf=name), dim=width, model_file="onnx/model.onnx")
    model = fastembed.TextEmbedding(model_name=name, specific_model_path=str(out), threads=2)
    got = np.stack(list(model.embed(TEXTS)))
    encoded = model.model.tokenizer.encode_batch(TEXTS)
    ids, mask = [e.ids for e in encoded], [e.attention_mask for e in encoded]
    check(got, reference(source, ids, mask))


ROOT = Path(__file__).resolve().parents[1]
EMBED = ROOT / "posbias_export" / "clients" / "optimum_env.sh"


def sentence_transformers(out: Path, file_name: str) -> dict:
    """sentence-transformers' ONNX backend on the folder, in its side environment (made once:
    side_env.py)."""
    side_python()
    proc = subprocess.run(["bash", str(EMBED), "embed", str(out), file_name, json.dumps(TEXTS)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OPTIMUM_VENV": str(SIDE_ENV)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len({sum(m) for m in got["mask"]}) == len(TEXTS)  # three lengths: a padded batch
    return got


def test_sentence_transformers_onnx_backend(shipped):
    source, out = shipped
    got = sentence_transformers(out, "onnx/model.onnx")
    check(np.array(got["embeddings"]), reference(source, got["ids"], got["mask"]))


@pytest.fixture(scope="module", params=["int8", "int4"])
def shipped_quantized(request, tmp_path_factory):
    """A quantized embedder's folder: its file under the name transformers.js loads it by."""
    from posbias_export.export.quantize.schemes import scheme
    from posbias_export.hf.ship import ship

    root = tmp_path_factory.mktemp(request.param)
    source = save_tiny_folder("jina_bert", root / "src")
    save_tokenizer(source, max_length=8192)
    ship(source, root / "out", check_growth=False, quantize=scheme(request.param))
    return source, root / "out", request.param


JS_DTYPES = {"int8": ("q8", "onnx/model_quantized.onnx"), "int4": ("q4", "onnx/model_q4.onnx")}


def check_quantized(got, ref, scheme_name: str) -> None:
    """The scheme's promise on embeddings (parity/embedding.py): every row's cosine to float64's."""
    from posbias_export.export.quantize.schemes import SCHEMES

    got = np.asarray(got, np.float64)
    cosine = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1)
    assert cosine.min() >= SCHEMES[scheme_name].policy.min_cosine, cosine


def test_a_quantized_folder_holds_no_quantized_weights_under_the_fp32_name(shipped_quantized):
    _, out, name = shipped_quantized
    assert sorted(p.name for p in (out / "onnx").glob("*.onnx")) == [Path(JS_DTYPES[name][1]).name]


@pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "@huggingface").is_dir(),
                    reason="transformers.js not installed (cd posbias_export/clients/js && npm install --ignore-scripts)")
def test_transformers_js_loads_the_quantized_file_by_its_dtype(shipped_quantized):
    source, out, name = shipped_quantized
    proc = subprocess.run(["node", str(JS / "embed.mjs"), str(out.resolve()), json.dumps(TEXTS), JS_DTYPES[name][0]],
                          capture_output=True, text=True, timeout=300, cwd=JS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    check_quantized(np.array(got["embeddings"]), reference(source, got["ids"], got["mask"]), name)


def test_fastembed_runs_the_quantized_file(shipped_quantized):
    fastembed = pytest.importorskip("fastembed", reason="fastembed not installed (pip install -e '.[test]')")
    from fastembed.common.model_description import ModelSource, PoolingType

    source, out, name = shipped_quantized
    model_name = f"posbias/jina-{name}"
    width = json.loads((out / "config.json").read_text())["hidden_size"]
    if model_name not in {d["model"] for d in fastembed.TextEmbedding.list_supported_models()}:
        fastembed.TextEmbedding.add_custom_model(model=model_name, pooling=PoolingType.MEAN, normalization=True,
                                                 sources=ModelSource(hf=model_name), dim=width,
                                                 model_file=JS_DTYPES[name][1])
    model = fastembed.TextEmbedding(model_name=model_name, specific_model_path=str(out), threads=2)
    got = np.stack(list(model.embed(TEXTS)))
    encoded = model.model.tokenizer.encode_batch(TEXTS)
    check_quantized(got, reference(source, [e.ids for e in encoded], [e.attention_mask for e in encoded]), name)


def test_sentence_transformers_runs_the_quantized_file(shipped_quantized):
    source, out, name = shipped_quantized
    got = sentence_transformers(out, JS_DTYPES[name][1])
    check_quantized(np.array(got["embeddings"]), reference(source, got["ids"], got["mask"]), name)

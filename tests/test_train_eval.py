"""Training (a few steps) and evaluation of a shipped checkpoint through ONNX Runtime."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import posbias_export as pbe
from posbias_export.nn import load_checkpoint
from posbias_export.study.evaluate import evaluate, mean_nll

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
SHIPPED = ["alibi", "kerple_log", "kerple_power", "sandwich", "t5", "window", "rope", "sinusoidal", "learned", "none"]
SCHEMES = [*SHIPPED, *(b for b in pbe.BIASES if b not in SHIPPED)]  # a family added later: its cell skips until trained


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus made here (the shared one is not part of the repository)."""
    rng = np.random.default_rng(0)
    words = [b"the", b"king", b"queen", b"speaks", b"of", b"love", b"and", b"death", b"to", b"thee"]
    text = b" ".join(words[i] for i in rng.integers(0, len(words), 6000)) + b"\n"
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_bytes(text)
    return path


def test_train_smoke_is_deterministic(tmp_path, corpus):
    def run(out):
        cmd = [sys.executable, "-m", "posbias_export", "train", "--bias", "kerple_log", "--corpus", str(corpus),
               "--train-len", "32", "--steps", "12", "--batch", "4", "--dim", "32", "--heads", "2", "--layers", "1",
               "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return load_checkpoint(out.with_suffix(".safetensors"))

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    card = (tmp_path / "a.md").read_text()
    for field in ("corpus_sha256", "steps", "seed", "final_loss", "command"):
        assert field in card


def test_train_learns(corpus):
    from posbias_export.study.train import train

    model, card = train(pbe.ModelConfig(bias="alibi", dim=32, num_heads=2, num_layers=1), corpus, train_len=32,
                        steps=80, batch=8, progress=False)
    assert card["final_loss"] < np.log(256) - 1.0  # far below a uniform byte distribution


def test_train_errors(tmp_path):
    cmd = [sys.executable, "-m", "posbias_export", "train", "--bias", "alibi", "--corpus", str(tmp_path / "nope.txt"),
           "--out", str(tmp_path / "m")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "corpus" in proc.stderr and "does not exist" in proc.stderr


def test_mean_nll_matches_cross_entropy():
    logits = np.random.default_rng(0).normal(size=(2, 5, 7)).astype(np.float32)
    windows = np.random.default_rng(1).integers(0, 7, (2, 5))
    total, count = mean_nll(logits, windows)
    ref = torch.nn.functional.cross_entropy(torch.from_numpy(logits[:, :-1]).double().reshape(-1, 7),
                                            torch.from_numpy(windows[:, 1:]).reshape(-1), reduction="sum")
    assert count == 8 and abs(total - ref.item()) < 1e-9


# One scheme in the default run (test_cli.py exports a checkpoint the same way); all ten with -m slow.
@pytest.mark.parametrize("scheme", [s if s == "alibi" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in SCHEMES])
def test_shipped_checkpoint_exports_with_no_other_flag(tmp_path, scheme):
    ckpt = MODELS / f"{scheme}.safetensors"
    if scheme not in SHIPPED and not ckpt.is_file():
        pytest.skip(f"no trained checkpoint for {scheme} in models/ (python -m posbias_export train)")
    assert ckpt.is_file() and (MODELS / f"{scheme}.md").is_file()
    assert ckpt.stat().st_size < 4_000_000
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m.onnx")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("scheme", ["alibi", "learned"])
def test_shipped_checkpoint_evaluates_on_ort_like_pytorch(tmp_path, corpus, scheme):
    model = load_checkpoint(MODELS / f"{scheme}.safetensors")
    pbe.export_onnx(model, tmp_path / "m.onnx", check_growth=False)
    results = evaluate(tmp_path / "m.onnx", corpus, (32, 64, 128), max_tokens=2048, reference=model)
    for r in results:
        if scheme == "learned" and r.length > model.cfg.max_positions:
            assert r.ort_ppl is None and "beyond the learned position table" in r.note
            continue
        assert np.isfinite(r.ort_ppl) and 1.0 < r.ort_ppl < 256
        assert r.rel_diff < 1e-4, r  # ORT perplexity equals PyTorch's


def test_evaluate_command(tmp_path, corpus):
    model = load_checkpoint(MODELS / "t5.safetensors")
    pbe.export_onnx(model, tmp_path / "m.onnx", check_growth=False, metadata={"checkpoint": str(MODELS / "t5.safetensors")})
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "evaluate", str(tmp_path / "m.onnx"), "--corpus",
                           str(corpus), "--lengths", "16,64", "--max-tokens", "1024", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["length"] for r in rows] == [16, 64] and all(r["rel_diff"] < 1e-4 for r in rows)


@pytest.mark.slow  # a smoke run of a benchmark command: its time goes to subprocesses timing things
def test_extrapolation_command_smoke(tmp_path, corpus):
    (tmp_path / "models").mkdir()
    for scheme in ("alibi", "learned"):
        (tmp_path / "models" / f"{scheme}.safetensors").write_bytes((MODELS / f"{scheme}.safetensors").read_bytes())
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "extrapolation", "--models", str(tmp_path / "models"),
                           "--corpus", str(corpus), "--lengths", "32,64", "--max-tokens", "512", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "extrapolation.md").read_text()
    assert "| alibi |" in table and "| learned | " in table and "learned (table 64 interpolated to 64)" in table
    assert (tmp_path / "extrapolation.png").stat().st_size > 1000

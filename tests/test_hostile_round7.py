"""Reliability round 7 (what the model-identity and folder-values tests do not cover): validate
judges the inputs it is given or refuses them, the benches and the profiler refuse a bad
argument in one line before any work, and validate's default runtimes pass the T5 folder that
--out-dir writes (the node runner takes the merged decoder's empty first-step cross cache)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_folders import save_client_model
from test_cli import assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    from posbias_export.hf.ship import ship

    root = tmp_path_factory.mktemp("round7")
    made = {}
    for kind in ("bloom", "t5_gated"):
        ship(save_client_model(kind, root / kind), root / f"{kind}_out", check_growth=False)
        made[kind] = root / f"{kind}_out"
        made[f"{kind}_source"] = root / kind
    return made


def test_validate_refuses_inputs_it_would_not_read(shipped, tmp_path):
    """A file exported from a Hugging Face folder is judged against transformers on generated
    lengths: --inputs used to be ignored (ALL PASS on wrong names, float ids, ids past the table)."""
    np.savez(tmp_path / "bad.npz", wrong_name=np.ones((1, 4), np.float32))
    proc = run_cli("validate", str(shipped["bloom"] / "model.onnx"), "--inputs", str(tmp_path / "bad.npz"),
                   "--runtimes", "ort-cpu")
    assert_one_line_error(proc, "was exported from a Hugging Face folder")


@pytest.mark.parametrize("argv,words", [
    (["bench-embed", "--forms", ""], "expected comma-separated names"),
    (["bench-embed", "--lengths", "1000000000"], "expected integers up to 1048576"),
    (["bench-serving", "--models", "bloom-560m", "--contexts", "10000000000", "--work", "W"], "up to 1048576"),
    (["bench-serving", "--models", "bloom-560m", "--contexts", "1e10", "--work", "W"], "comma-separated integers"),
    (["bench-quant", "--models", ""], "nothing to measure"),
    (["bench-models", "--models", "bloom", "--lengths", "0"], "expected positive integers"),
    (["bench-models", "--models", "jina_bert"], "jina_bert has no transformers implementation"),
    (["bench-clients", "--models", "jina_bert", "--no-optimum"], "jina_bert is an encoder (an embedder)"),
], ids=["forms-empty", "lengths-huge", "contexts-huge", "contexts-float", "quant-nothing", "lengths-zero",
        "models-embedder", "clients-embedder"])
def test_bench_arguments_are_refused_before_any_work(tmp_path, argv, words):
    proc = run_cli(*[a.replace("W", str(tmp_path / "w")) for a in argv], "--out-dir", str(tmp_path / "out"))
    assert_one_line_error(proc, words)
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


@pytest.mark.parametrize("extra,words", [
    (["--runs", "abc"], "expected an integer, got 'abc'"),
    (["--threads", "-2"], "expected an integer in [0, 1048576], got -2"),
    (["--runs", "0"], "got 0"),
    (["--source", "5"], "--source is for a seq2seq decoder"),
])
def test_the_profiler_says_one_line(shipped, extra, words):
    proc = subprocess.run([sys.executable, str(ROOT / "runtimes" / "ort" / "profile.py"),
                           str(shipped["bloom"] / "model.onnx"), *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_validate_passes_the_t5_folder_out_dir_writes(shipped):
    """encoder_model.onnx + decoder_model_merged.onnx on the default runtimes (node included where
    installed): no FAILURES. The node runner refused the merged decoder's empty cross cache."""
    out = shipped["t5_gated"]
    proc = run_cli("validate", str(out / "encoder_model.onnx"), str(out / "decoder_model_merged.onnx"),
                   "--model", str(shipped["t5_gated_source"]), "--lengths", "8,24")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "FAILURES" not in proc.stdout and "ALL PASS" in proc.stdout

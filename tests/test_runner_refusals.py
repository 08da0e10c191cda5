"""What the runners read, checked as input: generate never writes over a file it read (the
serving folder's tokenizer and configs included), prompts that are not UTF-8 text, token ids a
folder names, a foreign cached decoder, forged metadata, seq2seq's Python API on files that do
not belong together, validate's --inputs too big or not arrays, and an empty --runtimes."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hf_folders import save_client_model, save_tiny_model  # noqa: E402
from posbias_export.hf.ship import ship  # noqa: E402
from posbias_export.parity import RUNTIMES_DIR, load_runner  # noqa: E402

PY = sys.executable
CLI = [PY, "-m", "posbias_export"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A BLOOM serving folder (with its tokenizer) and a small cached file of our own."""
    import posbias_export as pbe
    from conftest import SMALL

    root = tmp_path_factory.mktemp("runner_refusals")
    ship(save_client_model("bloom", root / "bloom"), root / "bloom_out", check_growth=False)
    pbe.export_onnx(pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=0), root / "own.onnx", kv_cache=True,
                    check_growth=False)
    return root


@pytest.fixture(scope="module")
def seq2seq_files(tmp_path_factory):
    """A T5 serving folder, and a BLOOM file without a cache (an encoder's inputs and rank)."""
    from posbias_export.hf.export import export_model

    root = tmp_path_factory.mktemp("runner_refusals_t5")
    ship(save_client_model("t5_gated", root / "t5"), root / "t5_out", check_growth=False)
    export_model(save_tiny_model("bloom", root / "plain"), root / "plain.onnx", check_growth=False)
    return root


@dataclass
class Result:
    returncode: int
    stderr: str


def _run(argv: list) -> Result:
    """The command in this process (a subprocess costs seconds of imports): CLI argv start with
    CLI, a runner script's with its path. Bytes stand for what a shell passes that is not UTF-8
    (Python hands them on as lone surrogates)."""
    import contextlib
    import io

    args = [a.decode("utf-8", "surrogateescape") if isinstance(a, bytes) else str(a) for a in argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        if args[:3] == [str(a) for a in CLI]:
            from posbias_export.cli import main

            code = main(args[3:])
        else:
            code = load_runner(str(Path(args[1]).relative_to(RUNTIMES_DIR))).main(args[2:])
    return Result(code, err.getvalue())


def _one_line(proc: Result, words: str, code: int = 2) -> str:
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == code and len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "config.json"])
@pytest.mark.parametrize("via", ["cli", "runner"])
def test_generate_never_writes_over_what_it_read(served, tmp_path, name, via):
    folder = shutil.copytree(served / "bloom_out", tmp_path / "out")
    target = folder / name
    before = target.read_bytes()
    runner = [*CLI, "generate", folder] if via == "cli" else [PY, RUNTIMES_DIR / "ort/generate.py", folder / "model.onnx"]
    _one_line(_run([*runner, "--prompt", "To be", "--max-new-tokens", "3", "--output", target]), "also an input")
    assert target.read_bytes() == before


NOT_UTF8 = b"to \xff\xfe be"  # a shell passes these bytes as they are


def test_prompts_that_are_not_utf8_are_one_line(served):
    for argv in ([*CLI, "generate", served / "bloom_out"], [PY, RUNTIMES_DIR / "ort/generate.py", served / "own.onnx"]):
        line = _one_line(_run([*argv, "--prompt", NOT_UTF8, "--max-new-tokens", "2"]), "not valid UTF-8")
        assert "--prompt-file" in line


@pytest.mark.parametrize("change,words", [
    ({"eos_token_id": []}, "eos_token_id must be a token id"), ({"pad_token_id": 2 ** 70}, "pad_token_id must be"),
    ({"pad_token_id": 300}, "below the vocabulary size 300"), ("[" * 100_000, "nested too deeply"),
    ([1, 2], "not a JSON object"),
], ids=["eos-empty", "pad-past-int64", "pad-past-vocab", "deep", "list"])
def test_generate_checks_the_token_ids_a_folder_names(served, tmp_path, change, words):
    folder = shutil.copytree(served / "bloom_out", tmp_path / "out")
    file = folder / "generation_config.json"
    file.write_text(change if isinstance(change, str) else json.dumps(
        {**json.loads(file.read_text()), **change} if isinstance(change, dict) else change))
    _one_line(_run([*CLI, "generate", folder, "--prompt", "To be", "--max-new-tokens", "2"]), words)


def test_seq2seq_refuses_what_does_not_fit(seq2seq_files, tmp_path, monkeypatch):
    """One test, so one worker builds the T5 folder: a prompt that is not UTF-8; a start token
    that is not an id (text, past the vocabulary); and the Python API as the round-3 cases
    called it: a BLOOM file as the encoder, an encoder of another width, max_new_tokens=0 (an
    empty [B, 0]) and -1."""
    line = _one_line(_run([PY, RUNTIMES_DIR / "ort/seq2seq.py", seq2seq_files / "t5_out", "--prompt", NOT_UTF8]),
                     "not valid UTF-8")
    assert "--prompt-file" in line
    folder = shutil.copytree(seq2seq_files / "t5_out", tmp_path / "out")
    (folder / "generation_config.json").write_text(json.dumps({"decoder_start_token_id": "0"}))
    _one_line(_run([PY, RUNTIMES_DIR / "ort/seq2seq.py", folder, "--prompt", "To be"]), "decoder_start_token_id")
    (folder / "generation_config.json").write_text(json.dumps({"decoder_start_token_id": 300}))
    _one_line(_run([PY, RUNTIMES_DIR / "ort/seq2seq.py", folder, "--prompt", "To be"]), "not a token id")

    from posbias_export.hf.export import export_model

    seq2seq = load_runner("ort/seq2seq.py")
    decoder = str(seq2seq_files / "t5_out" / "decoder_model_merged.onnx")
    encoder = str(seq2seq_files / "t5_out" / "encoder_model.onnx")
    ids = np.array([[5, 6, 7]], np.int64)
    with pytest.raises(seq2seq.RunnerError, match="is not an encoder|do not belong together"):
        seq2seq.greedy_generate(str(seq2seq_files / "plain.onnx"), decoder, ids, np.ones_like(ids), 2)
    wide = tmp_path / "wide"
    import torch
    import transformers as tf

    torch.manual_seed(0)
    tf.T5EncoderModel(tf.T5Config(vocab_size=300, d_model=64, d_kv=8, d_ff=96, num_layers=1, num_heads=8)
                      ).save_pretrained(wide)
    export_model(wide, tmp_path / "wide.onnx", check_growth=False)
    with pytest.raises(seq2seq.RunnerError, match="do not belong together"):
        seq2seq.greedy_generate(str(tmp_path / "wide.onnx"), decoder, ids, np.ones_like(ids), 2)
    assert seq2seq.greedy_generate(encoder, decoder, ids, np.ones_like(ids), 0).shape == (1, 0)
    with pytest.raises(seq2seq.RunnerError, match="max_new_tokens"):
        seq2seq.greedy_generate(encoder, decoder, ids, np.ones_like(ids), -1)
    if "CUDAExecutionProvider" not in ort.get_available_providers():  # a missing GPU is one line, not a NameError
        monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")  # what the run would set, kept to this test
        with pytest.raises(seq2seq.RunnerError, match="CUDA"):
            seq2seq.greedy_generate(encoder, decoder, ids, np.ones_like(ids), 2, provider="cuda")


def test_a_foreign_cached_decoder_with_symbolic_heads_is_one_line(served, tmp_path):
    model = onnx.load(str(served / "bloom_out" / "model.onnx"))
    for value in model.graph.input:
        if value.name.startswith("past_key_values."):
            value.type.tensor_type.shape.dim[1].dim_param = "heads"
    onnx.save(model, str(tmp_path / "foreign.onnx"))
    shutil.copy(served / "bloom_out" / "tokenizer.json", tmp_path)
    _one_line(_run([*CLI, "generate", tmp_path / "foreign.onnx", "--prompt", "To be"]), "heads and head size fixed")


@pytest.mark.parametrize("forged,words", [
    ({"posbias.config": "{not json"}, "posbias.config is not a model config"),
    ({"posbias.config": "[" * 100_000}, "nested too deeply"),
    ({"posbias.config": "[1]"}, "not an object"),
    ({"posbias.trace_len": "-3"}, "posbias.trace_len"),
    ({"posbias.max_positions": "x"}, "posbias.max_positions"),
], ids=["not-json", "deep", "list", "trace-len", "max-positions"])
def test_forged_metadata_is_one_line(served, tmp_path, forged, words):
    model = onnx.load(str(served / "own.onnx"))
    props = {p.key: p.value for p in model.metadata_props}
    onnx.helper.set_model_props(model, {**props, **forged})
    onnx.save(model, str(tmp_path / "forged.onnx"))
    _one_line(_run([*CLI, "validate", tmp_path / "forged.onnx", "--runtimes", "ort-cpu", "--lengths", "3"]), words)


def test_validate_inputs_are_guarded(served, tmp_path):
    """A 10 KB archive of ten million tokens is refused before anything is read or run (today's
    main allocated until the machine ran out); a member that is not an array is one line."""
    big = tmp_path / "big.npz"
    np.savez_compressed(big, input_ids=np.zeros((1, 10_000_000), np.int64))
    assert big.stat().st_size < 200_000
    _one_line(_run([*CLI, "validate", served / "own.onnx", "--runtimes", "ort-cpu", "--inputs", big]), "memory")
    import zipfile

    odd = tmp_path / "odd.npz"
    with zipfile.ZipFile(odd, "w") as archive:
        archive.writestr("input_ids.npy", b"\x93NUMPY garbage")
    _one_line(_run([*CLI, "validate", served / "own.onnx", "--runtimes", "ort-cpu", "--inputs", odd]), "cannot read")


def test_an_empty_runtime_list_is_a_usage_error(served):
    _one_line(_run([*CLI, "validate", served / "own.onnx", "--runtimes", ""]), "expected comma-separated names")


def test_seq2seq_bounds_a_request_and_pairs_one_folder(seq2seq_files, tmp_path):
    """--max-new-tokens 100000000 is refused at once (it never stopped); an encoder and a decoder
    of two folders of the same width (each file records its folder's weights) are refused; a
    batch stops once every row has ended, as transformers' generate."""
    _one_line(_run([PY, RUNTIMES_DIR / "ort/seq2seq.py", seq2seq_files / "t5_out", "--prompt", "To be",
                    "--max-new-tokens", "100000000"]), "max_new_tokens is at most 8192")
    other = tmp_path / "other_out"
    ship(save_client_model("t5_gated", tmp_path / "other", seed=1), other, check_growth=False)
    seq2seq = load_runner("ort/seq2seq.py")
    ids = np.array([[5, 6, 7]], np.int64)
    encoder = str(seq2seq_files / "t5_out" / "encoder_model.onnx")
    with pytest.raises(seq2seq.RunnerError, match="exported from different weights"):
        seq2seq.greedy_generate(encoder, str(other / "decoder_model_merged.onnx"), ids, np.ones_like(ids), 2)
    decoder = str(seq2seq_files / "t5_out" / "decoder_model_merged.onnx")
    full = seq2seq.greedy_generate(encoder, decoder, ids, np.ones_like(ids), 40)
    first = seq2seq.greedy_generate(encoder, decoder, ids, np.ones_like(ids), 1)
    # the first token taken as the end token: the only row ends at step 1, so the run does
    stopped = seq2seq.greedy_generate(encoder, decoder, ids, np.ones_like(ids), 40, eos_ids=(int(first[0, 0]),))
    assert stopped.shape == (1, 1) and full.shape == (1, 40)

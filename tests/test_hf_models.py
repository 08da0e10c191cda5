"""Models people already have (BLOOM, MPT, Falcon with ALiBi, T5) read from local Hugging Face
folders: our implementation equals transformers (float32 and float64, T5's decoder too), validate
--model judges files we did not write (and catches the Falcon rounding that Optimum's file drops),
and bad folders get one line. Each variant's export on every runtime, its greedy tokens and its
seq2seq pair: tests/test_by_role.py, from its role."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_folders import KINDS, VOCAB, cached_exports, model_type, save_tiny_model  # noqa: E402
from posbias_export.hf import load_model  # noqa: E402
from posbias_export.peers.baselines import dynamo_export  # noqa: E402
from posbias_export.hf.architectures.falcon import round_to_bfloat16  # noqa: E402
from posbias_export.hf.validate import left_padded, run_hf_matrix, transformers_model  # noqa: E402
from posbias_export.nn import AttentionSettings  # noqa: E402
from posbias_export.parity import FLOAT32, compare  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny_model(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def exported(folders, tmp_path_factory):
    return cached_exports(folders.__getitem__, tmp_path_factory.mktemp("hf_onnx"))


def test_float32_rounding_to_bfloat16_matches_torch():
    """Falcon's ONNX bias rounds with Veltkamp's split; torch's bfloat16 cast is the reference
    (round to nearest even), on every integer position up to 2^20 and on products of slopes."""
    ints = torch.arange(0, 1 << 20, dtype=torch.float32)
    assert torch.equal(round_to_bfloat16(ints), ints.bfloat16().float())
    values = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 1e6
    assert torch.equal(round_to_bfloat16(values), values.bfloat16().float())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["plain", "blocked"])
def test_ours_equals_transformers(folders, kind, form):
    """float32, left-padded batch, real tokens: our PyTorch model against transformers', each
    judged against our float64 run by the FLOAT32 policy (transformers is float32-exact only)."""
    ours, theirs = load_model(folders[kind]), transformers_model(folders[kind], model_type(kind))
    length = min(150, ours.max_length() or 150)  # MPT stops at its max_seq_len
    ids, mask = left_padded(length, 3, VOCAB, seed=1)
    keep = mask.astype(bool)
    args = torch.from_numpy(ids), torch.from_numpy(mask)
    settings = AttentionSettings(form=form, block=16)
    with torch.no_grad():
        ref64 = ours.double()(*args, settings=settings).numpy()[keep]
        mine = ours.float()(*args, settings=settings).numpy()[keep]
        out = theirs(input_ids=args[0], attention_mask=args[1])
        hf = (out.last_hidden_state if ours.arch == "encoder" else out.logits).numpy()[keep]
    parity = compare(hf, ref64, mine, FLOAT32)
    assert parity.passed, parity
    assert np.abs(hf - mine).max() < 1e-4  # and directly, float32 against float32


# T5 computes every step in float64: agreement to float64 rounding. BLOOM builds its ALiBi in
# float32 whatever the dtype (slope * j; ours -slope * (i - j), the same up to a per-row
# constant), so at 120 tokens the bias carries float32 rounding of values up to 60 (ulp 4e-6):
# a bound of 1e-5 on the logits, ten times below what float32 arithmetic gives (see above).
@pytest.mark.parametrize("kind,atol", [("t5", 1e-10), ("bloom", 1e-5)])
def test_ours_equals_transformers_in_float64(folders, kind, atol):
    """Without padding transformers' float64 runs are clean."""
    ours, theirs = load_model(folders[kind]).double(), transformers_model(folders[kind], model_type(kind)).double()
    ids = torch.randint(0, VOCAB, (2, 120), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = theirs(input_ids=ids)
        hf = out.last_hidden_state if ours.arch == "encoder" else out.logits
        assert (ours(ids) - hf).abs().max().item() < atol


@pytest.mark.parametrize("form", ["plain", "blocked"])
def test_t5_decoder_equals_transformers_in_float64(folders, form):
    """Encoder and decoder of a T5 v1.1 encoder-decoder folder (gated GELU, tied head with
    rescale), left-padded source: the logits of transformers' T5ForConditionalGeneration."""
    folder = folders["t5_gated"]
    encoder, decoder = load_model(folder).double(), load_model(folder, "decoder").double()
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(str(folder)).double().eval()
    ids, mask = (torch.from_numpy(a) for a in left_padded(30, 2, VOCAB, seed=4))
    target = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    settings = AttentionSettings(form=form, block=8)
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        states = encoder(ids, mask, settings=settings)
        got = decoder(target, torch.ones_like(target), states, mask, settings=settings)
    assert (got - expected).abs().max().item() < 1e-10


def test_validate_judges_a_plain_dynamo_export(folders, tmp_path):
    path = dynamo_export(folders["bloom"], tmp_path / "bloom_dynamo.onnx", "bloom")
    matrix = run_hf_matrix(path, folders["bloom"], ("ort-cpu", "reference"), (17, 300), order=False)
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells]


def test_validate_catches_falcon_without_bfloat16_rounding(folders, tmp_path, monkeypatch):
    """An export that computes Falcon's ALiBi exactly (Optimum's) is another model: it fails,
    by more the longer the input (bfloat16's spacing grows with the position)."""
    import transformers.models.bloom.modeling_bloom as bloom
    import transformers.models.falcon.modeling_falcon as falcon

    with monkeypatch.context() as patch:  # what Optimum's patcher does: BLOOM's exact ALiBi in Falcon
        patch.setattr(falcon, "build_alibi_tensor", bloom.build_alibi_tensor)
        path = dynamo_export(folders["falcon"], tmp_path / "falcon_exact.onnx", "falcon")
    # the reference row below is transformers as shipped (the patch is undone)
    matrix = run_hf_matrix(path, folders["falcon"], ("ort-cpu",), (17, 600), order=False)
    verdicts = {(c.runtime, c.case): c for c in matrix.cells}
    short, long = verdicts["ort-cpu", "L=17 B=3"], verdicts["ort-cpu", "L=600 B=3"]
    assert long.verdict == "FAIL" and long.parity["max_abs"] > 100 * long.parity["budget_abs"]
    assert long.parity["max_abs"] > short.parity["max_abs"]
    assert verdicts["transformers", "L=600 B=3"].verdict == "pass"


@pytest.fixture(scope="module")
def bad_folders(folders, tmp_path_factory):
    """Folders a user might point --model at, each wrong in one way."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad_hf")
    bloom_config = json.loads((folders["bloom"] / "config.json").read_text())

    def folder(name, config=None, weights=None):
        path = root / name
        path.mkdir()
        if config is not None:
            (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if weights is not None:
            save_file(weights, str(path / "model.safetensors"))
        return path

    weights = load_file(str(folders["bloom"] / "model.safetensors"))
    folder("empty")
    folder("not_json", "{model_type: bloom")
    folder("gpt2", {"model_type": "gpt2", "n_layer": 2})
    folder("remote_code", {**bloom_config, "auto_map": {"AutoModel": "modeling_x.XModel"}})
    folder("falcon_rotary", {"model_type": "falcon", "alibi": False, "hidden_size": 48, "num_attention_heads": 6})
    folder("no_weights", bloom_config)
    folder("missing_weight", bloom_config, {k: v for k, v in weights.items() if "h.1.mlp.dense_4h_to_h.weight" not in k})
    folder("wrong_shape", {**bloom_config, "hidden_size": 96}, weights)
    folder("extra_layer", {**bloom_config, "n_layer": 1}, weights)
    corrupt = folder("corrupt", bloom_config)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    shutil.copytree(folders["t5"], root / "t5")
    return root


# (id, argv; {d} is the bad folders' root), words the one error line must contain
FOLDER_CASES = [
    ("not-a-folder", ["--model", "{d}/none", "--out", "{d}/x.onnx"], "is not a folder"),
    ("no-config", ["--model", "{d}/empty", "--out", "{d}/x.onnx"], "has no config.json"),
    ("config-not-json", ["--model", "{d}/not_json", "--out", "{d}/x.onnx"], "not valid JSON"),
    ("unsupported-type", ["--model", "{d}/gpt2", "--out", "{d}/x.onnx"], "model_type 'gpt2' is not supported"),
    ("trust-remote-code", ["--model", "{d}/remote_code", "--out", "{d}/x.onnx"], "trust_remote_code"),
    ("falcon-rotary", ["--model", "{d}/falcon_rotary", "--out", "{d}/x.onnx"], "alibi=false"),
    ("no-weights", ["--model", "{d}/no_weights", "--out", "{d}/x.onnx"], "has no weights"),
    ("missing-weight", ["--model", "{d}/missing_weight", "--out", "{d}/x.onnx"], "dense_4h_to_h.weight is missing"),
    ("shape-mismatch", ["--model", "{d}/wrong_shape", "--out", "{d}/x.onnx"], "does not describe these weights"),
    ("weights-of-more-layers", ["--model", "{d}/extra_layer", "--out", "{d}/x.onnx"], "the weights hold 2 layers"),
    ("corrupt-weights", ["--model", "{d}/corrupt", "--out", "{d}/x.onnx"], "cannot read the weights"),
    ("model-with-bias-flag", ["--model", "{d}/t5", "--bias", "alibi", "--out", "{d}/x.onnx"], "drop --bias"),
    ("encoder-kv-cache", ["--model", "{d}/t5", "--kv-cache", "--out", "{d}/x.onnx"], "has none"),
    ("out-is-the-weights", ["--model", "{d}/t5", "--out", "{d}/t5/model.safetensors"], "also an input"),
]


@pytest.mark.parametrize("argv,words", [pytest.param(a, w, id=i) for i, a, w in FOLDER_CASES])
def test_bad_folders_get_one_line(bad_folders, argv, words):
    import contextlib
    import io

    from posbias_export.cli import main as cli_main

    before = sorted(str(p) for p in bad_folders.rglob("*"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main([a.replace("{d}", str(bad_folders)) for a in argv])
    lines = [line for line in err.getvalue().splitlines() if line.strip() and "Loading weights" not in line]
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and words in lines[0], err.getvalue()
    assert sorted(str(p) for p in bad_folders.rglob("*")) == before, "a refused command created a file"


def test_export_onnx_points_transformers_models_to_the_folder_path(folders):
    import posbias_export as pbe

    with pytest.raises(ValueError, match="save_pretrained"):
        pbe.export_onnx(transformers_model(folders["bloom"], "bloom"), "unused.onnx")


def test_docs_folder_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "python-api.md").read_text()
    block = re.search(r"## From a Hugging Face folder\n\n```python\n(.*?)```", page, re.S).group(1)
    save_tiny_model("bloom", tmp_path / "bloom-560m")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/python-api.md", "exec"), {})
    assert (tmp_path / "bloom.onnx").stat().st_size > 0


def test_validate_refuses_a_folder_with_other_weights(folders, exported, tmp_path):
    """Our file records the sha256 of the weights it was exported from."""
    import shutil

    from posbias_export.parity import ParityInputError

    other = tmp_path / "other"
    save_tiny_model("bloom", other, seed=1)
    shutil.copy(folders["bloom"] / "config.json", other / "config.json")
    with pytest.raises(ParityInputError, match="other weights"):
        run_hf_matrix(exported("bloom"), other, ("ort-cpu",), (5,))


@pytest.mark.slow  # a smoke run of a benchmark command: its time goes to subprocesses timing things
def test_bench_models_measures_each_exporter(tmp_path):
    """One small cell per exporter: ours and dynamo run and are compared with transformers;
    Optimum is either measured or says why not (not installed here, or no encoder file)."""
    from posbias_export.bench import models as bench

    cells = bench.run(("bloom",), (64,), repeats=1)
    by = {c.exporter: c for c in cells}
    for name in ("posbias", "dynamo"):
        assert by[name].median is not None and by[name].peak_rss > 0, by[name]
        assert by[name].error_vs_torch < 1e-4
    assert by["optimum"].median is not None or by["optimum"].skipped
    from posbias_export.environment import environment

    text = bench.markdown(cells, environment())
    assert "| 64 |" in text and "optimum" in text

"""Models people already have (BLOOM, MPT, Falcon with ALiBi, T5) read from local Hugging Face
folders: our implementation equals transformers, the export equals both on every runtime, a
cached decoder generates transformers' greedy tokens, and validate --model judges files we
did not write (and catches the Falcon rounding that Optimum's file drops)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiers  # noqa: E402
from hf_folders import KINDS, MPT_MAX_SEQ_LEN, VOCAB, model_type, save_tiny_model  # noqa: E402
from posbias_export.hf import load_model  # noqa: E402
from posbias_export.hf.baselines import dynamo_export  # noqa: E402
from posbias_export.hf.export import export_model  # noqa: E402
from posbias_export.hf.architectures.falcon import round_to_bfloat16  # noqa: E402
from posbias_export.hf.validate import left_padded, run_hf_matrix, transformers_model  # noqa: E402
from posbias_export.nn import AttentionSettings  # noqa: E402
from posbias_export.parity import FLOAT32, compare, load_runner  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_tiny_model(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def exported(folders, tmp_path_factory):
    """(kind, kv_cache) -> an inlined blocked export (block 16: several blocks at short lengths)."""
    root, made = tmp_path_factory.mktemp("hf_onnx"), {}

    def get(kind, kv_cache=False):
        if (kind, kv_cache) not in made:
            path = root / f"{kind}_{int(kv_cache)}.onnx"
            export_model(folders[kind], path, kv_cache=kv_cache, inline_functions=True, block=16, check_growth=False)
            made[kind, kv_cache] = path
        return made[kind, kv_cache]

    return get


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
    length = MPT_MAX_SEQ_LEN if kind == "mpt" else 150
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
    ours, theirs = load_model(folders[kind]).double(), transformers_model(folders[kind], kind).double()
    ids = torch.randint(0, VOCAB, (2, 120), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = theirs(input_ids=ids)
        hf = out.last_hidden_state if kind == "t5" else out.logits
        assert (ours(ids) - hf).abs().max().item() < atol


@pytest.mark.parametrize("kind", tiers.cases(["bloom", "mpt", "falcon", "falcon_grouped", "t5_gated"],
                                             ["bloom", "mpt", "falcon", "falcon_grouped", "t5_gated"], slow={"mpt", "falcon", "t5_gated"}))
def test_export_matches_on_every_runtime(folders, exported, kind):
    """The inlined blocked file on ORT, OpenVINO and the reference evaluator, left-padded, far
    beyond the trace length (16); MPT's 300 is past its max_seq_len (64): transformers cannot
    run it (its row says so) and the file is judged against our float64 reference."""
    lengths = (1, 17, 300)
    matrix = run_hf_matrix(exported(kind), folders[kind], ("ort-cpu", "openvino", "reference"), lengths,
                           order=kind == "bloom")  # the order protocol once for imported files
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]
    rows = {(c.runtime, c.case): c.verdict for c in matrix.cells}
    assert all(rows[r, f"L={n} B=3"] == "pass" for r in ("ort-cpu", "openvino", "reference") for n in lengths)
    if kind == "mpt":
        assert rows["transformers", "L=300 B=3"].startswith(f"not run: transformers' mpt stops at {MPT_MAX_SEQ_LEN} tokens")
    else:
        assert rows["transformers", "L=300 B=3"] == "pass"


@pytest.mark.parametrize("kind", tiers.cases(["bloom", "mpt", "falcon", "falcon_grouped", "falcon_sequential"],
                                             ["bloom", "mpt", "falcon", "falcon_grouped", "falcon_sequential"],
                                             slow={"falcon_grouped", "falcon_sequential"}))
def test_cached_decoder_generates_transformers_greedy_tokens(folders, exported, kind):
    """--kv-cache file, left-padded batch of two prompts, 10 greedy steps through the ORT
    runner's CachedDecoder: the same tokens as transformers' generate (Falcon's three layouts:
    multi-query and grouped files cache their own 1 / num_kv_heads key/value heads)."""
    decoder = load_runner("ort/generate.py").CachedDecoder(str(exported(kind, kv_cache=True)))
    ids, mask = left_padded(9, 2, VOCAB, seed=3)
    past, step_ids, step_mask, tokens, step_logits = decoder.empty_past(2), ids, mask, [], []
    for _ in range(10):
        logits, past = decoder.step(step_ids, step_mask, past)
        step_logits.append(logits[:, -1])
        step_ids = logits[:, -1].argmax(-1)[:, None]
        tokens.append(step_ids)
        step_mask = np.concatenate([step_mask, np.ones((2, 1), np.int64)], axis=1)
    theirs = transformers_model(folders[kind], model_type(kind))
    expected = theirs.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
    assert np.array_equal(np.concatenate(tokens, axis=1), expected.sequences[:, 9:].numpy())
    # every step's logits too (float32 both sides, |logits| ~ 1-10): the cache path, not just the argmax
    their_logits = torch.stack(expected.logits, 1).numpy()  # [B, 10, V]
    assert np.abs(np.stack(step_logits, 1) - their_logits).max() < 1e-4


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


def _pair_generates_transformers_tokens(folder, tmp_path, dtype, target, names="posbias"):
    """Export the encoder and the cached decoder (`names`: ours, or the clients' merged layout),
    generate greedily through runtimes/ort/seq2seq.py on a left-padded batch, and assert the
    tokens of transformers' generate. Returns (ids, mask)."""
    kwargs = dict(block=8, check_growth=False, dtype=dtype, target=target)
    export_model(folder, tmp_path / "encoder.onnx", **kwargs)
    export_model(folder, tmp_path / "decoder.onnx", part="decoder", names=names, **kwargs)
    ids, mask = left_padded(20, 2, VOCAB, seed=6)
    tokens = load_runner("ort/seq2seq.py").greedy_generate(
        str(tmp_path / "encoder.onnx"), str(tmp_path / "decoder.onnx"), ids, mask, max_new_tokens=12,
        start_token=0, min_new_tokens=12, eos_ids=(1,))
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(str(folder)).eval()
    expected = theirs.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False, decoder_start_token_id=0,
                               eos_token_id=1, pad_token_id=0)
    assert np.array_equal(tokens, expected[:, 1:].numpy())
    return ids, mask


@pytest.mark.parametrize("dtype,target", tiers.cases([("float32", "portable"), ("float16", "cuda-ort")],
                                                    ["float32-portable", "float16-cuda-ort"], slow={"float16-cuda-ort"}))
def test_t5_encoder_and_decoder_files_generate_transformers_tokens(folders, tmp_path, dtype, target):
    """The encoder file and the cached decoder file (ORT, runtimes/ort/seq2seq.py), greedy,
    a left-padded batch: the tokens of transformers' generate (float32); the float16 pair for
    the GPU target too, its encoder output feeding the decoder in float16."""
    _pair_generates_transformers_tokens(folders["t5_gated"], tmp_path, dtype, target)


@pytest.mark.parametrize("dtype,target", tiers.cases([("float32", "portable"), ("float16", "cuda-ort")],
                                                    ["float32-portable", "float16-cuda-ort"], slow={"float16-cuda-ort"}))
def test_clients_t5_decoder_caches_the_cross_attention(folders, tmp_path, dtype, target):
    """The clients' merged decoder (Optimum's layout: use_cache_branch, past_key_values.N.encoder.*):
    the first step computes every layer's cross-attention keys and values, later steps take them
    from the cache and never read encoder_hidden_states (zeros there change nothing), and greedy
    generation through it (runtimes/ort/seq2seq.py) gives transformers' tokens."""
    import onnxruntime as ort

    ids, mask = _pair_generates_transformers_tokens(folders["t5_gated"], tmp_path, dtype, target, "huggingface")
    decoder = ort.InferenceSession(str(tmp_path / "decoder.onnx"), providers=["CPUExecutionProvider"])
    encoder = ort.InferenceSession(str(tmp_path / "encoder.onnx"), providers=["CPUExecutionProvider"])
    states = encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    inputs = [i for i in decoder.get_inputs()]
    cache = [i for i in inputs if i.name.startswith("past_key_values.")]
    assert [i.name.split(".")[2] for i in cache[:4]] == ["decoder", "decoder", "encoder", "encoder"]  # Optimum's order
    dtype_np = states.dtype
    empty = {i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), dtype_np) for i in cache}
    start = np.zeros((2, 1), np.int64)
    first = dict(zip([o.name for o in decoder.get_outputs()], decoder.run(
        None, {"input_ids": start, "encoder_hidden_states": states, "encoder_attention_mask": mask,
               "use_cache_branch": np.array([False]), **empty})))
    assert first["present.0.encoder.key"].shape[2] == ids.shape[1]  # computed from the encoder's states
    past = {name.replace("present", "past_key_values"): value for name, value in first.items() if name != "logits"}
    step = first["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
    runs = [decoder.run(None, {"input_ids": step, "encoder_hidden_states": s, "encoder_attention_mask": mask,
                               "use_cache_branch": np.array([True]), **past})[0]
            for s in (states, np.zeros_like(states))]
    np.testing.assert_array_equal(runs[0], runs[1])  # the cached branch reads the cache, not the states


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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bloom", "mpt", "falcon", "t5"])
def test_export_matches_at_4096(folders, exported, kind):
    matrix = run_hf_matrix(exported(kind), folders[kind], ("ort-cpu", "openvino", "reference"), (4096,), batch=2)
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]


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

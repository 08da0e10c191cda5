"""The architecture tests every tiny variant gets from its role (tests/role_matrix.py): a causal LM's
export on every runtime, its cached decoder's greedy tokens and 4096 tokens; a seq2seq pair's
greedy tokens and its merged decoder's cross-attention cache; an encoder's embedding on every
runtime and at 4096 tokens. Each is judged against transformers (or, where none is installable,
our float64 module) on left-padded batches far beyond the trace length (16)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import role_matrix  # noqa: E402
import tiers  # noqa: E402
from hf_folders import VOCAB, cached_exports, save_tiny_model  # noqa: E402
from posbias_export.hf import load_model  # noqa: E402
from posbias_export.hf.export import export_model  # noqa: E402
from posbias_export.hf.tiny import VARIANTS  # noqa: E402
from posbias_export.hf.validate import left_padded, run_hf_matrix, transformers_model  # noqa: E402
from posbias_export.parity import load_runner  # noqa: E402

RUNTIMES = ("ort-cpu", "openvino", "reference")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """variant -> its tiny folder, made on first use."""
    root, made = tmp_path_factory.mktemp("by_role"), {}

    def get(variant):
        if variant not in made:
            made[variant] = save_tiny_model(variant, root / variant)
        return made[variant]

    return get


@pytest.fixture(scope="module")
def exported(folder, tmp_path_factory):
    return cached_exports(folder, tmp_path_factory.mktemp("by_role_onnx"))


def _judged_everywhere(matrix, lengths, batch):
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]
    rows = {(c.runtime, c.case): c.verdict for c in matrix.cells}
    assert all(rows[r, f"L={n} B={batch}"] == "pass" for r in RUNTIMES for n in lengths)
    return rows


@pytest.mark.parametrize("variant", role_matrix.cases("every_runtime"))
def test_file_matches_on_every_runtime(folder, exported, variant):
    """The inlined blocked file on ORT, OpenVINO and the reference evaluator, left-padded, far beyond
    the trace length; transformers' row beside it, or why it cannot run a length (MPT stops at its
    max_seq_len, 64: the file is then judged against our float64 reference alone)."""
    lengths = (1, 17, 300)
    ours = load_model(folder(variant), lazy=True)
    matrix = run_hf_matrix(exported(variant), folder(variant), RUNTIMES, lengths, order=variant == "bloom")
    rows = _judged_everywhere(matrix, lengths, 3)
    if not ours.transformers_class:
        assert "transformers" not in {runtime for runtime, _ in rows}
        return
    limit = ours.max_length()
    for n in lengths:
        expected = "pass" if limit is None or n <= limit else f"not run: transformers' {ours.model_type} stops at {limit}"
        assert rows["transformers", f"L={n} B=3"].startswith(expected)


@pytest.mark.parametrize("variant", role_matrix.cases("greedy"))
def test_cached_decoder_generates_transformers_greedy_tokens(folder, exported, variant):
    """--kv-cache file, left-padded batch of two prompts, 10 greedy steps through the ORT runner's
    CachedDecoder: transformers' generate's tokens and every step's logits (Falcon's multi-query and
    grouped files cache their own 1 / num_kv_heads key/value heads)."""
    decoder = load_runner("ort/generate.py").CachedDecoder(str(exported(variant, kv_cache=True)))
    ids, mask = left_padded(9, 2, VOCAB, seed=3)
    past, step_ids, step_mask, tokens, step_logits = decoder.empty_past(2), ids, mask, [], []
    for _ in range(10):
        logits, past = decoder.step(step_ids, step_mask, past)
        step_logits.append(logits[:, -1])
        step_ids = logits[:, -1].argmax(-1)[:, None]
        tokens.append(step_ids)
        step_mask = np.concatenate([step_mask, np.ones((2, 1), np.int64)], axis=1)
    theirs = transformers_model(folder(variant), VARIANTS[variant].model_type)
    expected = theirs.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
    assert np.array_equal(np.concatenate(tokens, axis=1), expected.sequences[:, 9:].numpy())
    # every step's logits too (float32 both sides, |logits| ~ 1-10): the cache path, not just the argmax
    their_logits = torch.stack(expected.logits, 1).numpy()  # [B, 10, V]
    assert np.abs(np.stack(step_logits, 1) - their_logits).max() < 1e-4


@pytest.mark.parametrize("variant", role_matrix.cases("at_4096"))
def test_file_matches_at_4096(folder, exported, variant):
    matrix = run_hf_matrix(exported(variant), folder(variant), RUNTIMES, (4096,), batch=2)
    _judged_everywhere(matrix, (4096,), 2)


def _pair_generates_transformers_tokens(variant, source, tmp_path, dtype, target, names="posbias"):
    """Export the encoder and the cached decoder (`names`: ours, or the clients' merged layout),
    generate greedily through runtimes/ort/seq2seq.py on a left-padded batch, and assert the
    tokens of transformers' generate. Returns (ids, mask)."""
    kwargs = dict(block=8, check_growth=False, dtype=dtype, target=target)
    export_model(source, tmp_path / "encoder.onnx", **kwargs)
    export_model(source, tmp_path / "decoder.onnx", part="decoder", names=names, **kwargs)
    ids, mask = left_padded(20, 2, VOCAB, seed=6)
    tokens = load_runner("ort/seq2seq.py").greedy_generate(
        str(tmp_path / "encoder.onnx"), str(tmp_path / "decoder.onnx"), ids, mask, max_new_tokens=12,
        start_token=0, min_new_tokens=12, eos_ids=(1,))
    cls = getattr(transformers, role_matrix.seq2seq_class(VARIANTS[variant]))
    theirs = cls.from_pretrained(str(source)).eval()
    expected = theirs.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False, decoder_start_token_id=0,
                               eos_token_id=1, pad_token_id=0)
    assert np.array_equal(tokens, expected[:, 1:].numpy())
    return ids, mask


PAIR_FORMS = tiers.cases([("float32", "portable"), ("float16", "cuda-ort")], ["float32-portable", "float16-cuda-ort"],
                         slow={"float16-cuda-ort"})


@pytest.mark.parametrize("dtype,target", PAIR_FORMS)
@pytest.mark.parametrize("variant", role_matrix.cases("pair"))
def test_pair_generates_transformers_tokens(folder, tmp_path, variant, dtype, target):
    """The encoder file and the cached decoder file (ORT, runtimes/ort/seq2seq.py), greedy, a
    left-padded batch: the tokens of transformers' generate (float32); the float16 pair for the GPU
    target too, its encoder output feeding the decoder in float16."""
    _pair_generates_transformers_tokens(variant, folder(variant), tmp_path, dtype, target)


@pytest.mark.parametrize("dtype,target", PAIR_FORMS)
@pytest.mark.parametrize("variant", role_matrix.cases("cross_cache"))
def test_clients_decoder_caches_the_cross_attention(folder, tmp_path, variant, dtype, target):
    """The clients' merged decoder (Optimum's layout: use_cache_branch, past_key_values.N.encoder.*):
    the first step computes every layer's cross-attention keys and values, later steps take them
    from the cache and never read encoder_hidden_states (zeros there change nothing), and greedy
    generation through it (runtimes/ort/seq2seq.py) gives transformers' tokens."""
    import onnxruntime as ort

    ids, mask = _pair_generates_transformers_tokens(variant, folder(variant), tmp_path, dtype, target, "huggingface")
    decoder = ort.InferenceSession(str(tmp_path / "decoder.onnx"), providers=["CPUExecutionProvider"])
    encoder = ort.InferenceSession(str(tmp_path / "encoder.onnx"), providers=["CPUExecutionProvider"])
    states = encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    cache = [i for i in decoder.get_inputs() if i.name.startswith("past_key_values.")]
    assert [i.name.split(".")[2] for i in cache[:4]] == ["decoder", "decoder", "encoder", "encoder"]  # Optimum's order
    empty = {i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), states.dtype) for i in cache}
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


# Variants added to VARIANTS by a plugin loaded before collection, as an edit to tiny.py would; the
# plugin also writes every collected id (before -m and -k deselect) to collected.txt.
THROWAWAY_PLUGIN = """
import pytest
from posbias_export.hf import tiny
tiny.VARIANTS["bloom_throwaway"] = tiny.Variant("bloom", dict(apply_residual_connection_post_layernorm=True))
tiny.VARIANTS["t5_throwaway"] = tiny.Variant("t5", dict(feed_forward_proj="gated-silu", encoder_decoder=True))

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    with open("collected.txt", "w") as f:
        f.write("\\n".join(item.nodeid for item in items))
"""


def test_a_variant_added_to_variants_alone_gets_its_roles_tests(tmp_path, monkeypatch):
    """Collected with two throwaway variants, a causal one and a seq2seq one: each has exactly its
    role's tests, the serving clients' among them (the slow tier included), and the causal variant's greedy test runs and passes
    against transformers; a declared expected failure is a strict xfail with its reason."""
    (tmp_path / "throwaway_plugin.py").write_text(textwrap.dedent(THROWAWAY_PLUGIN))
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(tests), os.environ.get("PYTHONPATH", "")])}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "throwaway_plugin", "-p", "no:cacheprovider", "-n", "0",
                          "-q", "-m", "slow or not slow", "-k", "greedy and bloom_throwaway", "--rootdir", str(tests.parent),
                          str(tests / "test_by_role.py"), str(tests / "test_clients.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0 and "1 passed" in ran.stdout, ran.stdout[-3000:] + ran.stderr[-2000:]
    ids = [line for line in (tmp_path / "collected.txt").read_text().splitlines() if "throwaway" in line]
    tests_of = {v: {line.split("::")[1].split("[")[0] for line in ids if v in line}
                for v in ("bloom_throwaway", "t5_throwaway")}
    clients = {"test_transformers_js_generates_transformers_tokens", "test_triton_config_parses_and_matches_the_file",
               "test_gpu_target_folder_is_gpu_ready", "test_our_generate_takes_and_prints_text",
               "test_the_folder_holds_what_each_client_looks_for"}  # the serving clients', every text-generation role
    decoder_clients = {"test_onnxruntime_web_generates_transformers_tokens", "test_onnxruntime_genai_generates_transformers_tokens",
                       "test_onnxruntime_genai_shares_the_buffer_of_an_inplace_folder",
                       "test_validate_judges_the_shipped_decoder"}  # a causal LM's clients alone
    assert tests_of["bloom_throwaway"] == {"test_file_matches_on_every_runtime", "test_file_matches_at_4096",
                                           "test_cached_decoder_generates_transformers_greedy_tokens",
                                           *clients, *decoder_clients}, ids
    assert tests_of["t5_throwaway"] == {"test_pair_generates_transformers_tokens",
                                        "test_clients_decoder_caches_the_cross_attention", *clients}, ids

    from posbias_export.hf import tiny
    monkeypatch.setitem(tiny.VARIANTS, "t5_throwaway", tiny.Variant("t5", dict(encoder_decoder=True)))
    monkeypatch.setitem(role_matrix.EXPECTED_FAILURES, ("t5_throwaway", "cross_cache"), "a reason")
    param = next(p for p in role_matrix.cases("cross_cache") if p.id == "t5_throwaway")
    xfail = next(m for m in param.marks if m.name == "xfail")
    assert xfail.kwargs == {"reason": "a reason", "strict": True} and any(m.name == "slow" for m in param.marks)

"""What a downloaded Hugging Face folder supplies, checked before the first export starts:
config values (finite, in range, token ids that are ids), its JSON (any depth, any type), the
files copied into a serving folder (never a link out of it), and what --out-dir writes from
them (genai_config.json's context, Triton's entry under triton/<name>/)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hf_folders import MPT_MAX_SEQ_LEN, save_tiny_model  # noqa: E402
from posbias_export.cli import main as cli_main  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder_values")
    save_tiny_model("bloom", root / "bloom")
    save_tiny_model("mpt", root / "mpt")
    return root


def _cli(argv: list[str]) -> tuple[int, list[str], str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli_main([str(a) for a in argv])
    return code, [l for l in err.getvalue().splitlines() if l.strip()], out.getvalue()


def _refused(argv: list, words: str) -> str:
    start = time.perf_counter()
    code, lines, _ = _cli(argv)
    assert code == 2 and len(lines) == 1 and words in lines[0], lines
    assert time.perf_counter() - start < 60  # refused before the export, not a timing target
    return lines[0]


def _copy(tiny: Path, tmp_path: Path, kind: str = "bloom") -> Path:
    return shutil.copytree(tiny / kind, tmp_path / kind)


def _edit(file: Path, **changes) -> None:
    data = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize("change,words", [
    ({"layer_norm_epsilon": float("nan")}, "not a finite number"),
    ({"layer_norm_epsilon": -1e-5}, "must be a number in (0, 1)"),
    ({"initializer_range": float("inf")}, "not a finite number"),
    ({"eos_token_id": []}, "non-empty list"),
    ({"pad_token_id": "0"}, "must be a token id"),
    ({"bos_token_id": 2 ** 70}, "must be a token id"),
    ({"pad_token_id": 300}, "below the vocabulary size 300"),
    ({"vocab_size": -300}, "vocab_size must be a positive integer"),
], ids=["eps-nan", "eps-negative", "inf", "eos-empty", "pad-text", "bos-past-int64", "pad-past-vocab", "vocab-negative"])
def test_config_values_are_refused_before_the_export(tiny, tmp_path, change, words):
    """One line (transformers' own warnings on such values silenced: ours says it), exit 2,
    nothing written; on today's main NaN and negative epsilons exported with "checks passed"
    into files ONNX Runtime will not load."""
    folder = _copy(tiny, tmp_path)
    _edit(folder / "config.json", **change)
    _refused(["--model", folder, "--out", tmp_path / "m.onnx"], words)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("kind,change,words", [
    ("jina_bert", {"intermediate_size": -5}, "intermediate_size must be a positive integer, got -5"),
    ("umt5", {"d_ff": -1}, "d_ff must be a positive integer, got -1"),
    ("umt5", {"dense_act_fn": "bogus"}, "dense_act_fn 'bogus' is not an activation transformers knows"),
    ("jina_bert", {"num_hidden_layers": 1.5}, "num_hidden_layers must be a positive integer, got 1.5"),
    ("umt5", {"num_heads": True}, "num_heads must be a positive integer, got True"),
], ids=["jina-intermediate-negative", "umt5-dff-negative", "umt5-act-bogus", "layers-fraction", "heads-bool"])
def test_hostile_sizes_and_activations_are_one_line(tmp_path, kind, change, words):
    """Sizes torch would build a layer from and activation names looked up in transformers' table:
    refused from config.json in one line (today's main ended each in a traceback)."""
    folder = save_tiny_model(kind, tmp_path / kind)
    _edit(folder / "config.json", **change)
    _refused(["--model", folder, "--out", tmp_path / "m.onnx"], words)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("content,words", [
    ("[1, 2]", "holds list, not a JSON object"), ("{\"eos_token_id\": []}", "non-empty list"),
    ("{\"decoder_start_token_id\": \"x\"}", "must be a token id"), ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
], ids=["list", "eos-empty", "start-text", "deep"])
def test_generation_config_is_checked_before_the_export(tiny, tmp_path, content, words):
    folder = _copy(tiny, tmp_path)
    (folder / "generation_config.json").write_text(content)
    _refused(["--model", folder, "--out-dir", tmp_path / "out"], words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_deeply_nested_json_is_one_line(tiny, tmp_path, name):
    folder = _copy(tiny, tmp_path)
    if name.endswith("index.json"):  # read when the weights are sharded
        (folder / "model.safetensors").rename(folder / "model-1.safetensors")
    (folder / name).write_text("{\"a\": " * 100_000 + "1" + "}" * 100_000)
    _refused(["--model", folder, "--out", tmp_path / "m.onnx"], "nested too deeply")


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.txt", "generation_config.json"])
def test_a_copied_file_that_links_out_of_the_folder_is_refused(tiny, tmp_path, name):
    """A secret beside the download, linked in under a name --out-dir copies: refused before
    anything is exported, and its bytes are nowhere in what was written."""
    secret = tmp_path / "secret.txt"
    secret.write_text('{"key": "do-not-ship-4d1f"}')
    folder = _copy(tiny, tmp_path)
    (folder / name).unlink(missing_ok=True)
    os.symlink(secret, folder / name)
    _refused(["--model", folder, "--out-dir", tmp_path / "out"], "outside")
    assert not (tmp_path / "out").exists()


def test_a_link_inside_the_folder_is_copied_as_its_file(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    (folder / "real_tokenizer.json").write_text("{}")
    os.symlink("real_tokenizer.json", folder / "tokenizer.json")
    code, lines, _ = _cli(["--model", folder, "--out-dir", tmp_path / "out", "--skip-growth-check"])
    assert code == 0, lines
    copied = tmp_path / "out" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == "{}"


@pytest.mark.parametrize("kind", ["dangling", "to-an-empty-folder"])
def test_an_out_dir_that_is_a_link_is_refused_at_once(tiny, tmp_path, kind):
    """Refused before the export, naming the path given (not an internal temporary)."""
    link = tmp_path / "out"
    target = tmp_path / ("missing" if kind == "dangling" else "empty")
    if kind != "dangling":
        target.mkdir()
    os.symlink(target, link)
    line = _refused(["--model", tiny / "bloom", "--out-dir", link], "symbolic link")
    assert str(link) in line and "posbias-tmp" not in line
    assert os.readlink(link) == str(target) and (kind == "dangling" or list(target.iterdir()) == [])


def test_genai_context_is_not_capped_by_the_position_limit(tiny, tmp_path):
    """MPT's max_seq_len (64 here) is where it was trained, not where the file stops: the
    context written is the default 8192, or --context-length; the summary says so."""
    code, lines, out = _cli(["--model", tiny / "mpt", "--out-dir", tmp_path / "a", "--skip-growth-check"])
    assert code == 0, lines
    genai = json.loads((tmp_path / "a" / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == genai["search"]["max_length"] == 8192
    assert f"position limit {MPT_MAX_SEQ_LEN} is not a cap" in out
    code, lines, out = _cli(["--model", tiny / "mpt", "--out-dir", tmp_path / "b", "--skip-growth-check",
                             "--context-length", "2000"])
    assert code == 0 and json.loads((tmp_path / "b" / "genai_config.json").read_text())["model"]["context_length"] == 2000
    _refused(["--model", tiny / "mpt", "--out", tmp_path / "c.onnx", "--context-length", "10"], "needs --out-dir")
    _refused(["--model", tiny / "mpt", "--out-dir", tmp_path / "d", "--context-length", "0"], "context-length")


def test_a_folder_reached_as_dotdot_gets_its_own_triton_entry(tiny, tmp_path, monkeypatch):
    """Today's main named Triton's entry after '..': config.pbtxt and 1/ landed at the top of
    the serving folder."""
    folder = _copy(tiny, tmp_path)
    (folder / "sub").mkdir()
    monkeypatch.chdir(folder / "sub")
    code, lines, _ = _cli(["--model", "..", "--out-dir", tmp_path / "out", "--skip-growth-check"])
    assert code == 0, lines
    assert (tmp_path / "out" / "triton" / "bloom" / "config.pbtxt").is_file()
    assert not (tmp_path / "out" / "config.pbtxt").exists() and not (tmp_path / "out" / "1").exists()
    assert 'name: "bloom"' in (tmp_path / "out" / "triton" / "bloom" / "config.pbtxt").read_text()


def test_the_export_loads_its_file_with_default_session_options(tiny, tmp_path, monkeypatch):
    """Behind the config checks, the export itself: a value ONNX Runtime refuses only when a
    session is made (a negative LayerNorm epsilon) fails the export's own checks, one line."""
    from posbias_export.export import ExportCheckError
    from posbias_export.hf import folder as hf_folder
    from posbias_export.hf.export import export_model

    monkeypatch.setattr(hf_folder, "check_config_values", lambda raw, file: None)  # as today's main: unchecked
    folder = _copy(tiny, tmp_path)
    _edit(folder / "config.json", layer_norm_epsilon=-1.0)
    with pytest.raises(ExportCheckError, match="does not load the file with default session options"):
        export_model(folder, tmp_path / "m.onnx", check_growth=False)
    assert not (tmp_path / "m.onnx").exists()


def test_mpt_alibi_bias_max_follows_the_config(tiny, tmp_path):
    """alibi_bias_max 16: the file's slopes follow the config (as MosaicML trained the weights),
    the summary says transformers does not, the file equals transformers' own ALiBi table built
    with the config's value, and differs from stock transformers (which always uses 8)."""
    import numpy as np
    import onnxruntime as ort
    import torch
    import transformers
    from transformers.models.mpt import modeling_mpt

    folder = _copy(tiny, tmp_path, "mpt")
    config = json.loads((folder / "config.json").read_text())
    config["attn_config"]["alibi_bias_max"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    code, lines, out = _cli(["--model", folder, "--out", tmp_path / "m.onnx", "--skip-growth-check"])
    assert code == 0, lines
    assert "alibi_bias_max (16)" in out and "always 8" in out
    ids = np.random.default_rng(0).integers(0, 300, (1, 40))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    stock = transformers.MptForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        theirs = stock(torch.from_numpy(ids)).logits.numpy()
        stock.transformer.build_mpt_alibi_tensor = lambda heads, length, device=None: \
            modeling_mpt.build_mpt_alibi_tensor(heads, length, alibi_bias_max=16, device=device)
        trained = stock(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - trained).max() < 1e-4  # float32 vs float32, 40 tokens: parity budget
    assert np.abs(ours - theirs).max() > 0.1  # stock transformers is not what the weights were trained with
    code, lines, out = _cli(["validate", tmp_path / "m.onnx", "--model", folder, "--runtimes", "ort-cpu",
                             "--lengths", "17"])
    assert code == 0, out[-2000:]


def test_written_files_carry_no_path_of_this_machine(tiny, tmp_path):
    """torch.onnx writes each node's stack trace (our source's and the virtual environment's
    absolute paths: 320 in a BLOOM file on today's main); every file we write drops them."""
    import onnx

    code, lines, _ = _cli(["--model", tiny / "bloom", "--out-dir", tmp_path / "out", "--skip-growth-check"])
    assert code == 0, lines
    code, lines, _ = _cli(["--bias", "kerple_log", "--heads", "2", "--dim", "16", "--layers", "1", "--kv-cache",
                           "--skip-growth-check", "--out", tmp_path / "own.onnx"])
    assert code == 0, lines
    here = [str(Path(__file__).resolve().parents[1]), sys.prefix]
    for path in (tmp_path / "out" / "model.onnx", tmp_path / "own.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
        values = [p.value for n in nodes for p in n.metadata_props]
        assert values, "the other node metadata (names, scopes) stays"
        leaks = [v for v in values if any(root in v for root in here)]
        assert not leaks, (path.name, leaks[:1])


def test_a_negative_vocabulary_is_one_line_on_stderr(tiny, tmp_path):
    """In a real process (transformers logs to the stderr it found at import): its warnings on
    the token ids such a config implies do not precede our line (round 3: two lines did)."""
    import subprocess

    folder = _copy(tiny, tmp_path)
    _edit(folder / "config.json", vocab_size=-300)
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "--model", str(folder), "--out",
                           str(tmp_path / "m.onnx")], capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "vocab_size must be a positive integer" in lines[0], proc.stderr


def test_a_hugging_face_cache_snapshot_ships(tiny, tmp_path):
    """The hub cache's layout: snapshots/<rev>/NAME are links to ../../blobs/<hash>. Those are
    the folder's own files (weights, index shards, tokenizer), not links out of it."""
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / "tok").write_text("{}")
    os.symlink("../../blobs/tok", snapshot / "tokenizer.json")
    for index, file in enumerate(sorted((tiny / "bloom").iterdir())):
        shutil.copy(file, blobs / f"hash{index}")
        os.symlink(f"../../blobs/hash{index}", snapshot / file.name)
    code, lines, _ = _cli(["--model", snapshot, "--out-dir", tmp_path / "out", "--skip-growth-check"])
    assert code == 0, lines
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"


def test_every_file_a_folder_supplies_is_its_own_and_parses(tmp_path):
    """One rule for a folder's files: the weights file and the copied tokenizer/config files must
    resolve inside the folder (a model.safetensors linked to another model's is refused, as an
    index's shards are) and a JSON file must parse (a truncated tokenizer.json is refused before
    any export, not copied into the serving folder for every client to fail on)."""
    import shutil

    from hf_folders import save_client_model

    from posbias_export.hf.folder import FolderError
    from posbias_export.hf.models import load_model
    from posbias_export.hf.ship import ship

    source = save_client_model("bloom", tmp_path / "bloom")
    elsewhere = shutil.copytree(source, tmp_path / "elsewhere")
    linked = shutil.copytree(source, tmp_path / "linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    with pytest.raises(FolderError, match="model.safetensors links to .*outside"):
        load_model(linked)
    truncated = shutil.copytree(source, tmp_path / "truncated")
    text = (truncated / "tokenizer.json").read_text()
    (truncated / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(FolderError, match="tokenizer.json is not valid JSON"):
        ship(truncated, tmp_path / "out", check_growth=False)
    assert not (tmp_path / "out").exists()


def test_an_mpt_without_alibi_is_refused(tmp_path):
    """attn_config.alibi false: MPT with learned absolute positions, not ALiBi; exporting it as
    ALiBi would compute another model. One line, naming the key."""
    import json

    from hf_folders import save_tiny_model

    from posbias_export.hf.folder import FolderError
    from posbias_export.hf.models import load_model

    folder = save_tiny_model("mpt", tmp_path / "mpt")
    config = json.loads((folder / "config.json").read_text())
    config["attn_config"]["alibi"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FolderError, match="attn_config.alibi is False"):
        load_model(folder)


def test_validate_reads_transformers_in_float32_whatever_the_config_says(tmp_path):
    """A folder of float32 weights whose config names bfloat16 (as published configs do):
    transformers' row is computed in float32, so a correct file passes (transformers 5 would
    load in the config's dtype and round every weight)."""
    import json

    from hf_folders import save_tiny_model

    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    folder = save_tiny_model("bloom", tmp_path / "bloom")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    export_model(folder, tmp_path / "b.onnx", check_growth=False)
    result = validate([tmp_path / "b.onnx"], ("ort-cpu",), (17,), batch=2, model_dir=folder, order=False)
    assert result.ok, [(c.runtime, c.verdict, c.parity) for c in result.matrices[0].cells if not c.ok]
    assert any(c.runtime == "transformers" for c in result.matrices[0].cells)


def test_a_tied_config_with_a_head_of_its_own_is_refused(tmp_path):
    """tie_word_embeddings true but a stored lm_head.weight that differs from the embedding: we
    would tie, transformers uses the stored head (logits far apart): one line instead. A stored
    head equal to the embedding is a tied model saved with its copy, and loads."""
    import json

    from hf_folders import save_tiny_model
    from safetensors.torch import load_file, save_file

    from posbias_export.hf.folder import FolderError
    from posbias_export.hf.models import load_model

    folder = save_tiny_model("bloom", tmp_path / "bloom")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(folder / "model.safetensors")
    embedding = state["transformer.word_embeddings.weight"]
    save_file({**state, "lm_head.weight": embedding.clone()}, folder / "model.safetensors")
    load_model(folder)  # the tied head's copy: fine
    save_file({**state, "lm_head.weight": embedding + 0.5}, folder / "model.safetensors")
    with pytest.raises(FolderError, match="lm_head.weight differs from transformer.word_embeddings.weight.*"
                                          "tie_word_embeddings to false"):
        load_model(folder)


@pytest.mark.parametrize("key,part", [("encoder.embed_tokens.weight", "encoder"),
                                      ("encoder.embed_tokens.weight", "decoder"),
                                      ("decoder.embed_tokens.weight", "decoder")])
def test_an_encoder_decoders_tables_that_are_not_copies_are_refused(tmp_path, key, part):
    """T5 holds one embedding table (shared) that encoder.embed_tokens and decoder.embed_tokens
    name too; transformers fills it from whichever key it reads last. A folder storing a copy
    loads (encoder and decoder part); one whose copy differs has no one model: refused in one line
    (before: the copy was skipped unchecked, every ONNX row passed against our own model)."""
    from hf_folders import save_client_model
    from safetensors.torch import load_file, save_file

    from posbias_export.hf.folder import FolderError
    from posbias_export.hf.models import load_model

    folder = save_client_model("t5_gated", tmp_path / "t5")  # the whole encoder-decoder, a head of its own
    state = load_file(folder / "model.safetensors")
    shared = state["shared.weight"]
    save_file({**state, key: shared.clone()}, folder / "model.safetensors")
    load_model(folder, part=part)  # a copy: fine
    save_file({**state, key: shared + 0.5}, folder / "model.safetensors")
    with pytest.raises(FolderError, match=f"{key} differs from shared.weight.*one embedding table"):
        load_model(folder, part=part)


@pytest.mark.parametrize("kind,key,value,path", [
    ("t5_gated", "d_ff", 10 ** 12, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"),
    ("falcon", "ffn_hidden_size", 10 ** 12, "transformer.h.0.mlp.dense_h_to_4h.weight"),
    ("bloom", "hidden_size", 6 * 10 ** 12, "transformer.word_embeddings.weight"),  # 6 heads divide it
])
def test_a_config_size_of_ten_to_the_twelve_allocates_nothing(tmp_path, kind, key, value, path):
    """A layer sized 10^12 by the config is built on the meta device, so nothing is allocated
    (today's main: nn.Linear allocated 192 TB and crashed), and its shape is refused against the
    weight the folder holds, in one line."""
    folder = save_tiny_model(kind, tmp_path / kind)
    _edit(folder / "config.json", **{key: value})
    out = tmp_path / "out"
    line = _refused(["--model", folder, "--out-dir", out], path)
    assert str(value) in line and not out.exists()


def test_validate_estimates_transformers_position_table_before_allocating(tmp_path):
    """An MPT config with max_seq_len 2^40: transformers' own forward would build a 4.4 TB ALiBi
    table (today's main: a RuntimeError traceback from validate). Its row is "not run" with the
    reason; the file itself is judged as usual."""
    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    folder = save_tiny_model("mpt", tmp_path / "mpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_seq_len": 2 ** 40}))
    export_model(folder, tmp_path / "m.onnx", check_growth=False)
    result = validate([tmp_path / "m.onnx"], ("ort-cpu",), (5,), batch=2, model_dir=folder, order=False)
    cells = {c.runtime: c for c in result.matrices[0].cells}
    assert cells["transformers"].verdict.startswith("not run: transformers' mpt builds a")
    assert "position table" in cells["transformers"].verdict
    assert cells["ort-cpu"].verdict == "pass"

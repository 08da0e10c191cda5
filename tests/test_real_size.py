"""Imported models as people bring them: at a real width (BLOOM-560m's hidden 1024 and vocabulary
of 250880, 2 layers: 1.1 GB of float32 weights), in float16, for the GPU targets, with the key/value
heads their layout has, and files that return only the last position's logits.

The export traces a skeleton whose large weights are fake tensors and streams the values from the
folder into the file (export/streamed.py), so its peak memory is bounded by the weights, measured
here in a subprocess (the kernel's own peak of that process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import tiers

transformers = pytest.importorskip("transformers")

from conftest import ort_session  # noqa: E402
from hf_folders import KINDS, VOCAB, save_tiny_model  # noqa: E402
from posbias_export.export import files  # noqa: E402
from posbias_export.hf.export import export_model  # noqa: E402
from posbias_export.hf.models import load_model  # noqa: E402
from posbias_export.hf.ship import ship  # noqa: E402
from posbias_export.hf.validate import run_hf_matrix  # noqa: E402
from posbias_export.parity.report import format_matrix  # noqa: E402

# What a Python process holding torch, onnx, onnxscript and transformers takes before any model
# (measured 0.40-0.45 GB on this machine): the part of an export's peak that is not the model.
FIXED_OVERHEAD_GB = 0.5
WIDE = dict(vocab_size=250880, hidden_size=1024, n_layer=2, n_head=16)  # BLOOM-560m's width, 2 of its 24 layers


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_size")
    return {kind: save_tiny_model(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def wide_bloom(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wide") / "bloom"
    torch.manual_seed(0)
    transformers.BloomForCausalLM(transformers.BloomConfig(**WIDE)).save_pretrained(folder)
    return folder


def peak_rss_gb(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """Run `python ARGS`; the peak resident memory of that process alone (GB), from wait4, read
    by a small wrapper process: a child forked from this test process would count this
    process's pages as its own until it execs."""
    wrapper = ("import json, os, subprocess, sys\n"
               "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)\n"
               "out, err = p.stdout.read(), p.stderr.read()\n"
               "_, status, usage = os.wait4(p.pid, 0)\n"
               "print(json.dumps({'kb': usage.ru_maxrss, 'rc': os.waitstatus_to_exitcode(status), 'out': out, 'err': err}))\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, *args], capture_output=True, text=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["kb"] / 1e6, subprocess.CompletedProcess(args, got["rc"], got["out"], got["err"])


def file_bytes(path: Path) -> int:
    data = Path(str(path) + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


# float32 by default (the streamed export at real width); float16's cast path at this width with -m slow
@pytest.mark.parametrize("dtype", tiers.cases(["float32", "float16"], ["float32", "float16"], slow={"float32", "float16"}))
def test_real_width_export_memory_is_bounded_by_the_weights(wide_bloom, tmp_path, dtype):
    """--model --kv-cache at BLOOM-560m's width: peak RSS <= 1.5 x the file's weight bytes + the
    interpreter's fixed overhead (the in-memory export took 6.0 GB for these 1.13 GB), every check
    still run (growth check included), and the file equals transformers under the parity policy."""
    path = tmp_path / "wide.onnx"
    peak, proc = peak_rss_gb(["-m", "posbias_export", "--model", str(wide_bloom), "--kv-cache", "--dtype", dtype,
                              "--out", str(path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no initializer grows with trace length" in proc.stdout and "onnx.checker full check" in proc.stdout
    weights = file_bytes(path) / 1e9
    assert weights > (1.0 if dtype == "float32" else 0.5)  # the weights really are in the file
    assert peak <= 1.5 * weights + FIXED_OVERHEAD_GB, f"peak {peak:.2f} GB for {weights:.2f} GB of weights"
    matrix = run_hf_matrix(path, wide_bloom, ("ort-cpu",), (17,), order=False)
    assert matrix.ok, format_matrix(matrix)


def test_external_and_inline_files_hold_the_same_model(folders, tmp_path, monkeypatch):
    """The two streamed layouts: one .onnx (the checked graph with its tensors moved in after a
    second `graph` field), and model + .data (tensors at 4096-byte aligned offsets). Both load in
    onnx and ONNX Runtime and give bit-identical logits; the single file's tensors equal the
    external ones."""
    inline = tmp_path / "inline.onnx"
    export_model(folders["bloom"], inline, check_growth=False)
    monkeypatch.setattr(files, "EXTERNAL_DATA_THRESHOLD", 0)
    external = tmp_path / "external.onnx"
    export_model(folders["bloom"], external, check_growth=False)
    assert not Path(str(inline) + ".data").exists() and Path(str(external) + ".data").is_file()
    proto = onnx.load(str(external), load_external_data=False)
    outside = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert outside and all(int({e.key: e.value for e in t.external_data}["offset"]) % 4096 == 0 for t in outside)
    a, b = onnx.load(str(inline)), onnx.load(str(external))
    tensors = {t.name: onnx.numpy_helper.to_array(t) for t in a.graph.initializer}
    assert all(np.array_equal(tensors[t.name], onnx.numpy_helper.to_array(t)) for t in b.graph.initializer)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    assert np.array_equal(ort_session(inline).run(None, feeds)[0], ort_session(external).run(None, feeds)[0])


def test_nan_in_a_streamed_weight_is_one_line_and_no_file(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folders["bloom"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(bad / "model.safetensors")
    state["transformer.word_embeddings.weight"][3, 5] = float("nan")  # a large tensor: streamed, not loaded
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "x.onnx"
    proc = subprocess.run([sys.executable, "-m", "posbias_export", "--model", str(bad), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "transformer.word_embeddings.weight" in proc.stderr and "NaN" in proc.stderr
    assert list(tmp_path.glob("x.onnx*")) == [] and not [p for p in tmp_path.iterdir() if "posbias-tmp" in p.name]


# float16 for every architecture; each GPU target for every architecture in one dtype or the other
CASES = [(k, "float16", "portable") for k in ("bloom", "mpt", "falcon", "t5")] + [
    ("bloom", "float16", "cuda-ort"), ("mpt", "float32", "cuda-ort"), ("falcon", "float16", "cuda-ort"),
    ("t5", "float16", "cuda-ort"), ("bloom", "float32", "cuda"), ("mpt", "float16", "cuda"),
    ("falcon", "float16", "cuda"), ("t5", "float32", "cuda")]


@pytest.mark.parametrize("kind,dtype,target", tiers.cases(CASES, ["-".join(c) for c in CASES], slow={
    "mpt-float16-portable", "falcon-float16-portable", "mpt-float32-cuda-ort", "t5-float16-cuda-ort", "mpt-float16-cuda",
    "falcon-float16-cuda"}))  # by default each target and dtype once, BLOOM, Falcon and T5 among them
def test_imported_float16_and_gpu_target_files_match_transformers(folders, tmp_path, kind, dtype, target):
    """--model with --dtype / --target: validate --model on ORT CPU (which runs the GPU targets'
    fused ops) at 1, 17 and 300 tokens, judged by the file's dtype policy (float16: against
    PyTorch float16's own error), with the order protocol; transformers' row agrees too."""
    path = tmp_path / "m.onnx"
    report = export_model(folders[kind], path, dtype=dtype, target=target, block=128, check_growth=False)
    assert report.dtype == dtype
    out = onnx.load(str(path), load_external_data=False).graph.output[0].type.tensor_type.elem_type
    assert out == (onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.FLOAT)
    matrix = run_hf_matrix(path, folders[kind], ("ort-cpu",), (1, 17, 300))
    assert matrix.ok, format_matrix(matrix)
    assert {c.dtype for c in matrix.cells if c.runtime == "ort-cpu"} == {dtype}


@pytest.mark.parametrize("kind,kv_heads", tiers.cases([("falcon", 1), ("falcon_grouped", 2), ("falcon_sequential", 6)],
                                                     ["falcon-1", "falcon_grouped-2", "falcon_sequential-6"],
                                                     slow={"falcon-1", "falcon_sequential-6"}))
def test_falcon_cache_holds_its_own_key_value_heads(folders, tmp_path, kind, kv_heads):
    """Multi-query (1) and grouped (num_kv_heads) Falcon files keep the layout's own key/value
    heads in past and present; the export summary says what a token costs in the cache; the
    serving folder's config and genai_config describe the same cache."""
    model = load_model(folders[kind], lazy=True)
    assert model.num_kv_heads == kv_heads
    report = export_model(folders[kind], tmp_path / "kv.onnx", kv_cache=True, check_growth=False)
    graph = onnx.load(str(tmp_path / "kv.onnx"), load_external_data=False).graph
    caches = [v for v in [*graph.input, *graph.output] if "past" in v.name or "present" in v.name]
    assert caches and all(v.type.tensor_type.shape.dim[1].dim_value == kv_heads for v in caches)
    per_token = 2 * model.num_layers * kv_heads * model.head_dim * 4
    assert any(f"KV cache: {per_token} bytes per token" in n for n in report.notes), report.notes
    out = tmp_path / "serve"
    ship(folders[kind], out, check_growth=False)
    config = json.loads((out / "config.json").read_text())
    assert not config.get("multi_query") and config.get("num_kv_heads", model.num_heads) == kv_heads
    assert transformers.FalconConfig(**config).num_kv_heads == kv_heads or config.get("new_decoder_architecture")
    genai = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert genai["num_key_value_heads"] == kv_heads


@pytest.mark.parametrize("kind", tiers.cases(["bloom", "falcon"], ["bloom", "falcon"], slow={"falcon"}))
def test_last_logits_file_generates_transformers_tokens(folders, tmp_path, kind):
    """logits="last": [B, 1, V] out of the cached decoder (no [B, L, V] for a long prompt); a
    left-padded batch decoded through the ORT runner gives transformers' greedy tokens, and its
    logits are those of the full file's last position."""
    from posbias_export.hf.validate import left_padded, transformers_model
    from posbias_export.parity import load_runner

    last, full = tmp_path / "last.onnx", tmp_path / "full.onnx"
    export_model(folders[kind], last, kv_cache=True, logits="last", check_growth=False)
    export_model(folders[kind], full, kv_cache=True, check_growth=False)
    runner = load_runner("ort/generate.py")
    decoder, whole = runner.CachedDecoder(str(last)), runner.CachedDecoder(str(full))
    ids, mask = left_padded(9, 2, VOCAB, seed=3)
    logits, _ = decoder.step(ids, mask, decoder.empty_past(2))
    reference, _ = whole.step(ids, mask, whole.empty_past(2))
    assert logits.shape == (2, 1, VOCAB)
    np.testing.assert_allclose(logits[:, 0], reference[:, -1], rtol=0, atol=1e-5)
    past, step_ids, step_mask, tokens = decoder.empty_past(2), ids, mask, []
    for _ in range(8):
        logits, past = decoder.step(step_ids, step_mask, past)
        step_ids = logits[:, -1].argmax(-1)[:, None]
        tokens.append(step_ids)
        step_mask = np.concatenate([step_mask, np.ones((2, 1), np.int64)], axis=1)
    expected = transformers_model(folders[kind], kind).generate(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=8, min_new_tokens=8,
        do_sample=False, pad_token_id=0)
    assert np.array_equal(np.concatenate(tokens, axis=1), expected[:, 9:].numpy())


def test_last_logits_refused_without_a_cache(folders, tmp_path):
    with pytest.raises(ValueError, match="generation files"):
        export_model(folders["bloom"], tmp_path / "x.onnx", logits="last", check_growth=False)
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("bias", tiers.cases(["alibi", "t5"], ["alibi", "t5"], slow={"t5"}))
def test_own_last_logits_file_passes_validate(tmp_path, bias):
    """Our own cached decoders with logits="last": [B, 1, V], judged by validate against the
    float64 cache path's last position (ORT CPU and the reference evaluator, order protocol)."""
    import posbias_export as pbe
    from posbias_export.parity.matrix import run_matrix

    path = tmp_path / "kv_last.onnx"
    pbe.export_onnx(pbe.build_model(pbe.ModelConfig(bias=bias, num_heads=4, dim=64, num_layers=2)), path,
                    kv_cache=True, logits="last", check_growth=False)
    out = onnx.load(str(path)).graph.output[0].type.tensor_type.shape.dim
    assert out[1].dim_value == 1 and out[2].dim_value == 256
    matrix = run_matrix(path, ("ort-cpu", "reference"), (1, 17, 300))
    assert matrix.ok, format_matrix(matrix)


@pytest.mark.parametrize("perm", [(1, 0), (0, 2, 1), (2, 0, 1), (1, 2, 0)])
def test_permuted_weights_stream_as_the_permuted_tensor(monkeypatch, perm):
    """A folded Transpose is written piece by piece (slabs of the output's first axis from row
    pieces of the source): the bytes equal torch's permute of the whole tensor, with pieces
    smaller than a row range so every slab is assembled from several reads."""
    from posbias_export.export import streamed
    from posbias_export.nn.lazy_weights import MemoryReader

    monkeypatch.setattr(streamed, "ROWS_PER_READ", 7)
    monkeypatch.setattr("posbias_export.nn.lazy_weights.ROWS_PER_READ", 7)
    source = torch.randn(5, 4, 3) if len(perm) == 3 else torch.randn(9, 6)
    ref = streamed.WeightRef(MemoryReader("w", source), torch.float32, perm)
    written = np.concatenate([c.reshape(-1) for c in ref.chunks()])
    assert ref.shape == tuple(source.permute(perm).shape)
    np.testing.assert_array_equal(written, source.permute(perm).contiguous().numpy().reshape(-1))

"""JinaBERT v2 (both layouts) from a folder that maps to custom code, never run: recognised by
config and tensor names, rebuilt by our module, judged against a second, dense implementation
written here from the published description (numpy, float64, the [H, L, L] bias built whole as
the embedding tools' files do), and its export validated on the runtimes with padded batches."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from posbias_export.hf.export import export_model  # noqa: E402
from posbias_export.hf.folder import FolderError  # noqa: E402
from posbias_export.hf.models import load_model  # noqa: E402
from posbias_export.hf.tiny import save_tiny_folder  # noqa: E402
from posbias_export.validation import validate  # noqa: E402

LAYOUTS = {"base": "jina_bert", "code": "jina_bert_code"}


def paper_slopes(n: int) -> np.ndarray:
    """The ALiBi paper's slopes: 2^(-8k/n) for a power of two, else the closest power's and every
    other one of twice that many."""
    def power_of_2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start ** (k + 1) for k in range(m)]
    if math.log2(n).is_integer():
        return np.array(power_of_2(n))
    p = 2 ** math.floor(math.log2(n))
    return np.array(power_of_2(p) + power_of_2(2 * p)[0::2][: n - p])


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))  # exact GELU, math.erf per element


def dense_reference(folder, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """last_hidden_state [B, L, D] in float64, the bias and mask as one dense [B, H, L, L] tensor."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    H, D, I, eps = cfg["num_attention_heads"], cfg["hidden_size"], cfg["intermediate_size"], cfg["layer_norm_eps"]
    code = any("up_gated_layer" in k for k in w)
    lin = lambda x, name, bias=True: x @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)  # noqa: E731
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][np.zeros_like(ids)]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    L = ids.shape[1]
    distance = np.abs(np.arange(L)[:, None] - np.arange(L)[None, :])
    bias = -paper_slopes(H)[:, None, None] * distance + np.where(mask[:, None, None, :] > 0, 0.0, -np.inf)
    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        q, k, v = (lin(x, p + f"attention.self.{t}") for t in ("query", "key", "value"))
        if code:
            q = layer_norm(q, w[p + "attention.self.layer_norm_q.weight"], w[p + "attention.self.layer_norm_q.bias"], eps)
            k = layer_norm(k, w[p + "attention.self.layer_norm_k.weight"], w[p + "attention.self.layer_norm_k.bias"], eps)
        split = lambda t: t.reshape(*t.shape[:2], H, -1).transpose(0, 2, 1, 3)  # noqa: E731
        scores = split(q) @ split(k).transpose(0, 1, 3, 2) / math.sqrt(D // H) + bias
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = (probs @ split(v)).transpose(0, 2, 1, 3).reshape(x.shape)
        a = layer_norm(lin(y, p + "attention.output.dense") + x, w[p + "attention.output.LayerNorm.weight"],
                       w[p + "attention.output.LayerNorm.bias"], eps)
        if code:
            h = layer_norm(x + a, w[p + "layer_norm_1.weight"], w[p + "layer_norm_1.bias"], eps)
            g = lin(h, p + "mlp.up_gated_layer", bias=False)
            x = layer_norm(h + lin(g[..., :I] * gelu(g[..., I:]), p + "mlp.down_layer"), w[p + "layer_norm_2.weight"],
                           w[p + "layer_norm_2.bias"], eps)
        else:
            g = lin(a, p + "mlp.gated_layers", bias=False)
            x = layer_norm(lin(gelu(g[..., :I]) * g[..., I:], p + "mlp.wo") + a, w[p + "mlp.layernorm.weight"],
                           w[p + "mlp.layernorm.bias"], eps)
    return x


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("jina")
    return {layout: save_tiny_folder(kind, root / kind) for layout, kind in LAYOUTS.items()}


def padded(length: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 300, (batch, length))
    mask = np.ones((batch, length), np.int64)
    for row in range(1, batch):  # right padding, as embedding clients pad
        mask[row, length - row * length // (2 * batch):] = 0
    return ids, mask


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("form", ["plain", "blocked"])
def test_our_module_equals_the_dense_description(folders, layout, form):
    """float64, a right-padded batch, valid tokens: our module (the reference validate uses)
    against the dense implementation above, to float64 rounding."""
    from posbias_export.nn import AttentionSettings

    ids, mask = padded(70, 3, seed=1)
    model = load_model(folders[layout]).double()
    assert model.layout == layout
    with torch.no_grad():
        ours = model(torch.from_numpy(ids), torch.from_numpy(mask), settings=AttentionSettings(form=form, block=16)).numpy()
    theirs = dense_reference(folders[layout], ids, mask)
    keep = mask.astype(bool)
    assert np.abs(ours[keep] - theirs[keep]).max() < 1e-10


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_export_passes_validate_on_every_runtime_with_padding(folders, tmp_path, layout):
    """input_ids, attention_mask, token_type_ids -> last_hidden_state, blocked (block 16: many
    blocks at 300 tokens), judged against the float64 module on ORT, OpenVINO, Node and the
    reference evaluator."""
    import onnx

    path = tmp_path / "jina.onnx"
    report = export_model(folders[layout], path, block=16, check_growth=False)
    assert any("custom code (auto_map) was not run" in n for n in report.notes)
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert graph.output[0].name == "last_hidden_state"
    # the checkpoint's one [2I, D] gated weight is two MatMul weights [D, I]: no [L, 2I] product
    widths = {tuple(t.dims) for t in graph.initializer if len(t.dims) == 2}
    hidden = json.loads((folders[layout] / "config.json").read_text())["hidden_size"]
    assert (hidden, 4 * hidden) in widths and (hidden, 8 * hidden) not in widths, widths
    result = validate([path], None, (1, 17, 300), batch=3, model_dir=folders[layout], order=layout == "base")
    cells = result.matrices[0].cells
    assert result.ok, [(c.runtime, c.case, c.verdict) for c in cells if not c.ok]
    assert "transformers" not in {c.runtime for c in cells}
    assert "our float64 implementation" in result.matrices[0].arch


def test_a_bert_prefix_loads_and_unknown_remote_code_is_still_refused(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_text((folders["base"] / "config.json").read_text())
    state = load_file(str(folders["base"] / "model.safetensors"))
    save_file({f"bert.{k}": v for k, v in state.items()}, str(prefixed / "model.safetensors"))
    a, b = load_model(folders["base"]), load_model(prefixed)
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
    # a BERT with ALiBi in its config but tensors of neither layout: custom code we do not know
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((folders["base"] / "config.json").read_text())
    save_file({k.replace("gated_layers", "fc1"): v for k, v in state.items()}, str(other / "model.safetensors"))
    with pytest.raises(FolderError, match="trust_remote_code"):
        load_model(other)


@pytest.mark.slow
def test_8192_tokens_within_policy(folders, tmp_path):
    """The length the models were trained for, a padded batch, on ONNX Runtime: within the
    float32 policy of the float64 module (measured 3.2e-06 max abs on the tiny base model; 2 min here)."""
    path = tmp_path / "jina.onnx"
    export_model(folders["base"], path, check_growth=False)
    result = validate([path], ["ort-cpu"], (8192,), batch=2, model_dir=folders["base"], order=False)
    assert result.ok, [(c.case, c.verdict, c.parity) for c in result.matrices[0].cells]


# llama.cpp (llama-cpp-python 0.3.36) stores the code layout's `up_gated_layer` whole and applies its
# fused GEGLU, GELU on the FIRST half; the published code models (and llama.cpp's own split of it
# when it was added, PR #7596) take GELU of the SECOND: cosine 0.73 here, 0.99999999 with the halves
# swapped. Strict, so a llama.cpp that fixes it fails this mark and the row can be added.
LLAMA_CODE_GATE = pytest.mark.xfail(strict=True, reason="llama.cpp applies GELU to the first half of up_gated_layer")


@pytest.mark.parametrize("layout", ["base", pytest.param("code", marks=LLAMA_CODE_GATE)])
def test_llama_cpp_computes_the_same_embedding_from_its_gguf(folders, tmp_path, layout):
    """bench-embed's llama.cpp row times the same model: the GGUF llama.cpp's own converter makes of
    our folder, run by llama-cpp-python, gives the description's mean-pooled embedding (cosine >=
    0.9999, the clients' bar; llama.cpp's GELU is the tanh form) for the ids the text names."""
    import shutil

    from posbias_export.peers import llama_cpp_runs

    reason = llama_cpp_runs.missing()
    if reason:
        pytest.skip(reason)
    import llama_cpp

    folder = shutil.copytree(folders[layout], tmp_path / "folder")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    llama_cpp_runs.write_wordpiece_vocab(folder, vocab)
    gguf = llama_cpp_runs.to_gguf(folder, tmp_path / "model.gguf")
    text = llama_cpp_runs.texts(40, 1)[0]
    llm = llama_cpp.Llama(model_path=str(gguf), embedding=True, n_ctx=64, n_batch=64, n_ubatch=64, flash_attn=True,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)
    ids = np.array([[101, *(llama_cpp_runs.FIRST_WORD + i % llama_cpp_runs.WORDS for i in range(38)), 102]])
    assert llm.tokenize(text.encode()) == ids[0].tolist()
    theirs = np.array(llm.embed(text, normalize=False))
    ours = dense_reference(folder, ids, np.ones_like(ids))[0].mean(0)
    assert theirs @ ours / np.linalg.norm(theirs) / np.linalg.norm(ours) >= 0.9999


def test_llama_cpp_serves_the_byte_level_folder_as_ours(tmp_path):
    """bench-serve's llama.cpp embedding rows: a JinaBERT folder with a byte-level BPE tokenizer (the
    served folder's) becomes a GGUF that, pooled as the served folder says, gives the served
    folder's embedding of the same text (cosine >= 0.9999: the same ids and the same mean pooling;
    llama.cpp's GELU is the tanh form)."""
    from posbias_export.hf.ship import ship
    from posbias_export.hf.tiny import Sizes, save_tokenizer
    from posbias_export.peers import llama_cpp_runs
    from posbias_export.serve.embedder import EmbedderEngine
    from posbias_export.serve.folder import ServedFolder

    reason = llama_cpp_runs.missing()
    if reason:
        pytest.skip(reason)
    import llama_cpp

    # a table of 304 rows: room for the converter's <unk> and <mask> after the tokenizer's 300
    folder = save_tiny_folder("jina_bert", tmp_path / "folder", Sizes(vocab=304))
    save_tokenizer(folder, max_length=64)
    served = tmp_path / "served"
    ship(folder, served, check_growth=False)
    gguf = llama_cpp_runs.bpe_embedder_gguf(folder, tmp_path / "model.gguf", served)
    llm = llama_cpp.Llama(model_path=str(gguf), embedding=True, n_ctx=64, n_batch=64, n_ubatch=64, verbose=False)
    text = "whether tis nobler in the mind to suffer the slings and arrows"
    theirs = np.array(llm.embed(text, normalize=False))
    engine = EmbedderEngine(ServedFolder.read(served))
    ours = engine.embed(engine.tokenize([text]))[0]
    assert theirs.shape == ours.shape
    assert theirs @ ours / np.linalg.norm(theirs) / np.linalg.norm(ours) >= 0.9999

"""--quantize int8 / int4: ONNX Runtime's quantizers on our LM files and imported ones, judged
by the quantized policy (parity/quantized.py) against the float model; sabotaged files fail it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import posbias_export as pbe
import tiers
from posbias_export.export import checkpoint_metadata, export_onnx
from posbias_export.export.quantize.schemes import scheme as quant_scheme
from posbias_export.export import FileContract
from posbias_export.nn import load_checkpoint
from posbias_export.parity import run_matrix
from posbias_export.parity.quantized import POLICIES, judge

MODELS = Path(__file__).resolve().parent.parent / "models"
FAMILY_CHECKPOINTS = [b for b in pbe.BIASES if (MODELS / f"{b}.safetensors").is_file()]
LENGTHS = (1, 17, 1024)  # 1024: 16x the checkpoints' training length (64)


def _export(family: str, scheme: str | None, path: Path, **spec) -> Path:
    ckpt = MODELS / f"{family}.safetensors"
    export_onnx(load_checkpoint(ckpt), path, check_growth=False, metadata=checkpoint_metadata(ckpt),
                quantize=quant_scheme(scheme, **spec) if scheme else None)
    return path


def _cells(matrix) -> list:
    return [c for c in matrix.cells if c.case.startswith("L=")]


# int4 of ALiBi by default (quantization touches the linear layers only, the same in every family;
# int8 is judged on the imported BLOOM below); every family and scheme with -m slow
CHECKPOINT_CASES = [(b, s) for b in pbe.BIASES for s in ("int8", "int4")]


@pytest.mark.parametrize("bias,scheme", tiers.cases(
    CHECKPOINT_CASES, [f"{b}-{s}" for b, s in CHECKPOINT_CASES],
    slow={f"{b}-{s}" for b, s in CHECKPOINT_CASES if (b, s) != ("alibi", "int4")}))
def test_quantized_checkpoint_passes_policy(tmp_path, bias, scheme):
    """Each family's trained checkpoint, quantized, passes the policy on ORT CPU at 1, 17 and
    16x the training length, in fresh sessions and in one session serving every length."""
    if bias not in FAMILY_CHECKPOINTS:
        pytest.skip(f"no trained checkpoint for {bias} in models/")
    path = _export(bias, scheme, tmp_path / "q.onnx")
    contract = FileContract.of_path(path)
    assert contract.quantized == scheme and contract.quantized_nodes >= 5
    matrix = run_matrix(path, ("ort-cpu",), LENGTHS, batch=2)
    assert matrix.ok, [(c.case, c.verdict, c.parity) for c in matrix.cells]
    decided = sum(c.parity["decided_positions"] for c in _cells(matrix))
    assert decided > 100  # trained: the top-1 criterion is exercised, not only KL


def test_int8_weights_are_seven_bit(tmp_path):
    """int8 weights stay in [-64, 64] (reduce_range): on CPUs without VNNI, ONNX Runtime's
    uint8 x int8 kernel saturates with full 8-bit weights (export/quantize/whole.py Int8.REDUCE_RANGE)."""
    import numpy as np

    path = _export("alibi", "int8", tmp_path / "q.onnx")
    proto = onnx.load(str(path))
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    fed = {n.input[1] for n in proto.graph.node if n.op_type == "MatMulInteger"}
    int8 = [weights[name] for name in fed if name in weights and weights[name].dtype == np.int8]
    assert len(int8) >= 5 and all(w.min() >= -64 and w.max() <= 64 for w in int8)
    assert max(int(np.abs(w).max()) for w in int8) >= 60  # the range is used, not collapsed
    assert FileContract.of(proto).option("quant_reduce_range") == "1"


def test_quantized_nodes_are_the_weights_and_the_tied_head(tmp_path):
    """int4: every linear layer and the embedding quantized (MatMulNBits / GatherBlockQuantized),
    no float MatMul with a weight left at the top level, nothing quantized inside the attention
    functions (the bias path stays float)."""
    path = _export("alibi", "int4", tmp_path / "q.onnx")
    proto = onnx.load(str(path))
    ops = [n.op_type for n in proto.graph.node]
    layers = load_checkpoint(MODELS / "alibi.safetensors").cfg.num_layers
    # per layer: q, k, v, out, up, down; plus the LM head
    assert ops.count("MatMulNBits") == 6 * layers + 1 and ops.count("GatherBlockQuantized") == 1
    inits = {t.name for t in proto.graph.initializer}
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    quantized_ops = {"MatMulNBits", "GatherBlockQuantized", "MatMulInteger", "DynamicQuantizeLinear"}
    assert not [n.op_type for f in proto.functions for n in f.node if n.op_type in quantized_ops]


@pytest.mark.parametrize("head", tiers.cases(["int8", "float"], ["int8", "float"], slow={"int8", "float"}))
def test_the_head_keeps_the_precision_asked_for(tmp_path, head):
    """--quant-head: the LM head alone as an 8-bit MatMulNBits, or left float; every other layer
    int4 (ONNX Runtime's quantizer quantizes every MatMul of its op types unless excluded: the
    others are named in nodes_to_exclude); the file passes the policy, closer to float than
    the all-int4 file."""
    path = _export("alibi", "int4", tmp_path / "q.onnx", head=head)
    proto = onnx.load(str(path))
    bits = {n.name: next((a.i for a in n.attribute if a.name == "bits"), None) for n in proto.graph.node
            if n.op_type == "MatMulNBits"}
    layers = load_checkpoint(MODELS / "alibi.safetensors").cfg.num_layers
    inits = {t.name for t in proto.graph.initializer}
    float_matmuls = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    if head == "int8":
        assert sorted(bits.values()) == [4] * (6 * layers) + [8] and not float_matmuls
    else:
        assert list(bits.values()) == [4] * (6 * layers) and len(float_matmuls) == 1
    assert FileContract.of(proto).option("quant_head") == head
    cell = lambda p: _cells(run_matrix(p, ("ort-cpu",), (1024,), batch=2, order=False))[0]
    mine, all_int4 = cell(path), cell(_export("alibi", "int4", tmp_path / "q4.onnx"))
    assert mine.verdict == "pass" and mine.parity["kl_mean"] < all_int4.parity["kl_mean"]


def test_quantized_perplexity_stays_within_the_promise(tmp_path):
    """Held-out perplexity of the trained ALiBi checkpoint on ORT: int8 within 1%, int4 within 3%
    of the float file, at the training length and 16x it (the corpus's last 10% lives in
    ../shared; the same windows are scored with the float file)."""
    corpus = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    if not corpus.is_file():
        pytest.skip(f"the corpus is not at {corpus}")
    from posbias_export.study.evaluate import evaluate

    ppl = {}
    for scheme in (None, "int8", "int4"):
        path = _export("alibi", scheme, tmp_path / f"{scheme}.onnx")
        ppl[scheme] = {r.length: r.ort_ppl for r in evaluate(path, corpus, (64, 1024), 4096, torch_check=False)}
    for scheme, budget in (("int8", 0.01), ("int4", 0.03)):
        for n in (64, 1024):
            assert ppl[scheme][n] / ppl[None][n] - 1 <= budget, (scheme, n, ppl)


def _scale_initializers(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in proto.graph.initializer if t.name.endswith("_scale") or t.name.endswith("_scales")]


@pytest.mark.parametrize("scheme", tiers.cases(["int8", "int4"], ["int8", "int4"], slow={"int8"}))
def test_a_scale_off_by_two_fails_the_policy(tmp_path, scheme):
    """Sabotage: every weight scale doubled (a quantizer bug of the kind the policy exists for)."""
    path = _export("alibi", scheme, tmp_path / "q.onnx")
    proto = onnx.load(str(path))
    scales = _scale_initializers(proto)
    assert scales
    for t in scales:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, t.name))
    onnx.save(proto, str(tmp_path / "bad.onnx"))
    matrix = run_matrix(tmp_path / "bad.onnx", ("ort-cpu",), (17, 1024), batch=2, order=False)
    assert not matrix.ok and all(c.verdict == "FAIL" for c in _cells(matrix))


def test_quantizing_the_bias_path_fails_the_policy(tmp_path):
    """Sabotage: the ALiBi bias tensor [heads, L, L] quantized the way quantize_dynamic treats an
    activation (DynamicQuantizeLinear: uint8, one scale from its range). At 17 tokens the range
    is a few units and the step tiny; at 1024 (16x the training length) the range is ~256 and
    the step ~1, which erases the recent-token differences: the policy must fail that case."""
    ckpt = MODELS / "alibi.safetensors"
    path = tmp_path / "q.onnx"
    export_onnx(load_checkpoint(ckpt), path, check_growth=False, metadata=checkpoint_metadata(ckpt),
                attention="plain", inline_functions=True, quantize=quant_scheme("int8"))
    proto = onnx.load(str(path))
    made = {o: n for n in proto.graph.node for o in n.output}
    wanted = np.array([2.0 ** (-8 * (h + 1) / 4) for h in range(4)], np.float32)  # ALiBi's slopes, 4 heads
    slopes = {t.name for t in proto.graph.initializer  # the slopes, or their reshape folded before quantizing
              if numpy_helper.to_array(t).size == 4 and np.allclose(numpy_helper.to_array(t).ravel(), wanted)}

    def from_slopes(name: str, depth: int = 0) -> bool:
        node = made.get(name)
        return node is not None and depth < 3 and any(i in slopes or from_slopes(i, depth + 1) for i in node.input)

    bias = [n for n in proto.graph.node if n.op_type == "Mul" and any(from_slopes(i) for i in n.input)]
    assert len(bias) == 1, [n.output for n in bias]
    name = bias[0].output[0]
    for node in proto.graph.node:
        node.input[:] = [f"{name}_dq" if i == name else i for i in node.input]
    at = list(proto.graph.node).index(bias[0]) + 1
    for k, node in enumerate([
            onnx.helper.make_node("DynamicQuantizeLinear", [name], [f"{name}_q", f"{name}_s", f"{name}_z"]),
            onnx.helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"])]):
        proto.graph.node.insert(at + k, node)
    onnx.save(proto, str(tmp_path / "bad.onnx"))
    verdicts = {c.case: c.verdict for c in _cells(run_matrix(tmp_path / "bad.onnx", ("ort-cpu",), (17, 1024), batch=2,
                                                              order=False))}
    assert verdicts == {"L=17 B=2": "pass", "L=1024 B=2": "FAIL"}, verdicts


def test_policy_measures_against_the_formula():
    """KL and top-1 by the definitions: identical logits pass with KL 0; logits shifted by a
    constant (softmax-invariant) pass; a swapped decided prediction fails top-1."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 50, 32))
    ref[..., 3] += 8  # every position decided on token 3
    assert judge(ref, ref, "int8").kl_mean == 0 and judge(ref, ref, "int8").passed
    assert judge(ref + 5.0, ref, "int4").passed
    swapped = ref.copy()
    swapped[..., [3, 4]] = swapped[..., [4, 3]]
    verdict = judge(swapped, ref, "int4")
    assert not verdict.passed and verdict.top1_decided == 0.0
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    noisy = ref + rng.normal(scale=0.05, size=ref.shape)
    q = np.exp(noisy - noisy.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    assert judge(noisy, ref, "int8").kl_mean == pytest.approx(float((p * np.log(p / q)).sum(-1).mean()), rel=1e-9)
    assert POLICIES["int8"].max_kl == pytest.approx(np.log(1.01))


# quantized imported files: BLOOM by default, every architecture with -m slow
IMPORTED = ["bloom", "mpt", "falcon", "falcon_grouped"]


@pytest.mark.parametrize("kind", tiers.cases(IMPORTED, IMPORTED, slow={"mpt", "falcon", "falcon_grouped"}))
def test_quantized_imported_model_passes_validate(tmp_path, kind):
    """Imported folders, --kv-cache --quantize int8 and int4: validate --model judges them by the
    policy against the folder's model (left-padded batches, real tokens), every length in one
    session too."""
    pytest.importorskip("transformers")
    from hf_folders import save_tiny_model
    from posbias_export.hf import load_model
    from posbias_export.hf.export import export_model
    from posbias_export.hf.validate import run_hf_matrix

    folder = save_tiny_model(kind, tmp_path / kind)
    limit = load_model(folder, lazy=True).max_length()  # MPT stops at its max_seq_len
    lengths = (1, 17, min(300, limit or 300))
    for scheme in ("int8", "int4"):
        out = tmp_path / f"{scheme}.onnx"
        export_model(folder, out, kv_cache=True, quantize=quant_scheme(scheme), check_growth=False)
        matrix = run_hf_matrix(out, folder, ("ort-cpu",), lengths, batch=2)
        assert matrix.ok, [(c.runtime, c.case, c.verdict, c.parity) for c in matrix.cells if not c.ok]
        assert any(c.dtype == f"float32 {scheme}" for c in matrix.cells)


def test_validate_defaults_skip_the_reference_evaluator_for_quantized_files(tmp_path):
    """The reference evaluator implements no quantized op: validate's default runtimes leave it out
    for a quantized file with a reason (named explicitly, it still runs and reports its error)."""
    from posbias_export.validation import validate

    path = _export("alibi", "int4", tmp_path / "q.onnx")
    result = validate([path], None, (17,), batch=2, order=False)
    assert "quantized op" in result.skipped["reference"]
    assert result.ok and not [c for c in result.matrices[0].cells if c.runtime == "reference"]
    named = validate([path], ("reference",), (17,), batch=2, order=False)
    assert not named.ok and named.matrices[0].cells[0].verdict.startswith("error")


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_folders import save_initialized_t5

    return save_initialized_t5(tmp_path_factory.mktemp("t5") / "t5")


@pytest.mark.parametrize("scheme", tiers.cases(["int8", "int4"], ["int8", "int4"], slow={"int8", "int4"}))
def test_quantized_t5_folder_passes_validate(tmp_path, t5_folder, scheme):
    """A T5 folder shipped with --quantize: both files quantized (the encoder's and decoder's
    linear layers, the embedding, the head), the relative-position bias left float; validate
    --model judges the decoder on the reference encoder's states, the encoder through the
    reference decoder, and the pair as a client runs it, each by the policy."""
    from posbias_export.hf.ship import ship
    from posbias_export.validation import validate

    out = tmp_path / "out"
    ship(t5_folder, out, quantize=quant_scheme(scheme), check_growth=False)
    files = [out / "encoder_model.onnx", out / "decoder_model_merged.onnx"]
    for path in files:
        proto = onnx.load(str(path))
        assert FileContract.of(proto).quantized == scheme
        inits = {t.name for t in proto.graph.initializer}
        assert not [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
        bias_tables = [t for t in proto.graph.initializer if "relative_attention_bias" in t.name]
        assert bias_tables and all(t.data_type == onnx.TensorProto.FLOAT for t in bias_tables)
    result = validate(files, ("ort-cpu",), (17, 300), batch=2, model_dir=t5_folder)  # 300: past 16x the trace length
    assert len(result.matrices) == 3 and "encoder file + decoder file" in result.matrices[2].arch
    assert result.ok, [(m.arch, c.runtime, c.case, c.verdict) for m in result.matrices for c in m.cells if not c.ok]
    judged = [c for m in result.matrices for c in m.cells if c.runtime == "ort-cpu" and c.case.startswith("L=")]
    assert all(c.dtype == f"float32 {scheme}" for c in judged)
    assert sum(c.parity["decided_positions"] for c in judged) > 20  # the top-1 criterion is exercised


@pytest.mark.slow  # the default run's sabotage cases: the ALiBi ones above and the float T5 decoder's below
def test_a_t5_decoder_scale_off_by_two_fails_the_policy(tmp_path, t5_folder):
    """Sabotage: the quantized decoder's weight scales doubled fail its matrix and the pair's; the
    encoder, untouched, still passes."""
    from posbias_export.hf.ship import ship
    from posbias_export.validation import validate

    out = tmp_path / "out"
    ship(t5_folder, out, quantize=quant_scheme("int4"), check_growth=False)
    proto = onnx.load(str(out / "decoder_model_merged.onnx"))
    for t in _scale_initializers(proto):
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, t.name))
    onnx.save(proto, str(out / "bad.onnx"))
    result = validate([out / "encoder_model.onnx", out / "bad.onnx"], ("ort-cpu",), (17, 300), batch=2,
                      model_dir=t5_folder, order=False)
    verdicts = {m.arch.split(": ")[1]: [c.verdict for c in m.cells if c.runtime == "ort-cpu"] for m in result.matrices}
    assert set(verdicts["encoder file (logits)"]) == {"pass"}
    assert all(v.startswith("FAIL") for v in verdicts["decoder file (logits)"] + verdicts["encoder file + decoder file "
                                                                                          "(logits)"]), verdicts


@pytest.mark.slow
def test_float_t5_decoder_is_judged_by_validate(tmp_path, t5_folder):
    """validate --model on a float T5 decoder file (once refused): the float policy against the
    float64 reference, transformers' T5ForConditionalGeneration as a row, every length in one
    session too; a decoder whose relative-position table is off fails it."""
    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    path = tmp_path / "decoder.onnx"
    export_model(t5_folder, path, part="decoder", check_growth=False)
    matrix = validate([path], ("ort-cpu",), (1, 300), batch=2, model_dir=t5_folder).matrices[0]
    assert matrix.ok and {c.runtime for c in matrix.cells} == {"transformers", "ort-cpu"}
    assert any(c.case.startswith("one session") for c in matrix.cells)
    proto = onnx.load(str(path))
    table = next(t for t in proto.graph.initializer if "relative_attention_bias" in t.name)
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table)[::-1].copy(), table.name))  # buckets reversed
    onnx.save(proto, str(tmp_path / "bad.onnx"))
    bad = validate([tmp_path / "bad.onnx"], ("ort-cpu",), (17,), batch=2, model_dir=t5_folder, order=False).matrices[0]
    assert [c.verdict[:4] for c in bad.cells if c.runtime == "ort-cpu"] == ["FAIL"]


def test_a_quantized_encoder_alone_is_judged_on_its_embeddings(tmp_path):
    """A T5EncoderModel folder (sentence-T5's shape): no prediction to judge, so validate judges
    the pooled embeddings (parity/embedding.py), not logits."""
    pytest.importorskip("transformers")
    from hf_folders import save_tiny_model
    from posbias_export.hf.export import export_model
    from posbias_export.validation import validate

    folder = save_tiny_model("t5", tmp_path / "t5")
    export_model(folder, tmp_path / "e.onnx", quantize=quant_scheme("int8"), check_growth=False)
    matrix = validate([tmp_path / "e.onnx"], ("ort-cpu",), (17,), batch=2, model_dir=folder, order=False).matrices[0]
    cells = [c for c in matrix.cells if c.runtime == "ort-cpu"]
    assert matrix.ok and [c.dtype for c in cells] == ["float32 int8 (embeddings)"]
    assert 0.99 <= cells[0].parity["cosine_min"] <= 1.0


def test_the_quantizers_temporaries_live_beside_the_output(tmp_path, monkeypatch):
    """quantize_dynamic copies the model into the system temp folder: a kill -9 left 0.8 GB there
    at BLOOM-560m. During quantization the temp folder is the export's own temporary (locked,
    swept), beside the output; after it, the system's again."""
    import tempfile

    from posbias_export.export.quantize import schemes

    seen = []
    real = schemes.Int8.quantize

    def spying(self, path, nodes, head=()):
        seen.append(tempfile.gettempdir())
        return real(self, path, nodes, head)

    monkeypatch.setattr(schemes.Int8, "quantize", spying)
    before = tempfile.gettempdir()
    _export("alibi", "int8", tmp_path / "q.onnx")
    assert seen and Path(seen[0]).resolve().parent == tmp_path.resolve()
    assert tempfile.gettempdir() == before


@pytest.mark.slow
def test_t5_int4_takes_its_architecture_defaults_unless_asked(tmp_path):
    """T5's int4 default is block 16 with the decoder's head in 8 bits (what makes t5-base's pair
    pass the policy, docs/quantized.md); flags given on the command line win."""
    import hf_folders

    from posbias_export.cli import main as cli_main

    source = hf_folders.save_tiny_model("t5_gated", tmp_path / "t5")

    def shipped(folder, *flags):
        assert cli_main(["--model", str(source), "--out-dir", str(folder), "--quantize", "int4", *flags]) == 0
        out = {}
        for name in ("encoder_model", "decoder_model_merged"):
            proto = onnx.load(str(folder / f"{name}.onnx"), load_external_data=False)
            bits = sorted(next((a.i for a in n.attribute if a.name == "bits"), 0) for n in proto.graph.node
                          if n.op_type == "MatMulNBits")
            contract = FileContract.of(proto)
            out[name] = (contract.option("quant_block"), contract.option("quant_head"), bits[-1])
        return out

    default = shipped(tmp_path / "default")
    assert default["encoder_model"][0] == "16" and default["encoder_model"][2] == 4
    assert default["decoder_model_merged"] == ("16", "int8", 8)
    asked = shipped(tmp_path / "asked", "--quant-block", "32", "--quant-head", "int4")
    assert asked["decoder_model_merged"] == ("32", "int4", 4)

"""Activations quantized with one scale per call (ONNX Runtime's quantize_dynamic as it writes its
graph, and so Optimum's int8 files: DynamicQuantizeLinear takes the range of its whole input) give
a row numbers that depend on what else the call holds: the other rows of a batch, the rest of a
prompt run at once. Our int8 files quantize each row on its own (export/quantize/per_row.py), so
any row beside others is as alone. For a file that still scales per
call, our runners keep rows apart and prompts whole, so a row equals its prompt run alone as every
client runs it. int4 (MatMulNBits quantizes each row's blocks) and float files batch as they are.

The reference here is `stepwise`: the file on a plain ONNX Runtime session, the prompt whole,
then one cached step per token (onnxruntime-genai, transformers.js and Optimum run it so)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from hf_folders import save_client_model, save_tiny_folder, save_tokenizer
from posbias_export.export.quantize import per_row
from posbias_export.export.quantize.schemes import scheme as quant_scheme
from posbias_export.hf.ship import ship
from posbias_export.serve.decoder import DecoderEngine, Request
from posbias_export.serve.embedder import EmbedderEngine
from posbias_export.serve.folder import ServedFolder
from posbias_export.serve.replica import Replica

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtimes"))

from common.graph_facts import read_graph_facts  # noqa: E402
from common.loading import load_runner  # noqa: E402

gen = load_runner("ort/generate.py")
NEW = 8
KINDS = ("float", "int8", "int4", "per call")


def ship_as(source: Path, out: Path, kind: str) -> Path:
    """--out-dir with float, int8, int4 weights, or "per call": int8 as quantize_dynamic writes it
    (our per-row rewrite left out: the graph Optimum's int8 files have)."""
    if kind != "per call":
        ship(source, out, check_growth=False, quantize=None if kind == "float" else quant_scheme(kind))
        return out
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(per_row, "activations_per_row", lambda proto, symmetric=(): 0)
        ship(source, out, check_growth=False, quantize=quant_scheme("int8"))
    return out


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """kind -> a BLOOM client folder written by --out-dir (the in-place cache)."""
    root = tmp_path_factory.mktemp("per_call")
    source = save_client_model("bloom", root / "bloom")
    return {kind: ship_as(source, root / kind.replace(" ", "_"), kind) for kind in KINDS}


def stepwise(model: Path, prompt: list[int], new: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the prompt's last logits, as the clients run a file (see the module)."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()
            if i.name.startswith("past_key_values.")}
    ids, total, tokens, first = np.array([prompt]), len(prompt), [], None
    for _ in range(new):
        got = dict(zip(outputs, session.run(None, {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64),
                                                   **past})))
        first = got["logits"][0, -1] if first is None else first
        tokens.append(int(got["logits"][0, -1].argmax()))
        past = {k.replace("present", "past_key_values"): v for k, v in got.items() if k.startswith("present.")}
        ids, total = np.array([[tokens[-1]]]), total + 1
    return tokens, first


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in (9, 40, 23)[:count]]


def test_the_graph_tells_which_files_scale_per_call(shipped):
    assert [read_graph_facts(shipped[k] / "model.onnx").scales_per_call for k in KINDS] == [False, False, False, True]


def prefills(model: Path, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, bool]:
    """The prompt's last logits through the in-place buffer: whole, and in PREFILL_BLOCK blocks."""
    decoder = gen.CachedDecoder(str(model))
    ids = np.array([prompt])
    apart = decoder.scales_per_call
    got = []
    for blocks in (False, True):
        decoder.scales_per_call = not blocks  # the runner's choice, forced each way
        got.append(gen.prefill_shared(decoder, ids, np.ones_like(ids), decoder.shared_cache(1, len(prompt) + 1))[0, -1])
    return got[0], got[1], apart


@pytest.mark.parametrize("kind", ["per call", "int8"])
def test_a_prompt_longer_than_a_prefill_block(shipped, kind):
    """Past PREFILL_BLOCK tokens an in-place file's prompt enters its buffer in blocks. Our int8
    file's blocks give the whole prompt's logits (rows quantized apart: float32 rounding); a file
    scaled per call is moved far by them, so its prompt goes in whole. Either way the greedy
    tokens are the clients'."""
    model = shipped[kind] / "model.onnx"
    prompt = np.random.default_rng(7).integers(3, 250, gen.PREFILL_BLOCK + 60).tolist()
    want_tokens, want_logits = stepwise(model, prompt, NEW)
    whole, blocked, apart = prefills(model, prompt)
    scale = np.abs(want_logits).max()
    assert np.abs(whole - want_logits).max() <= 1e-5 * scale  # the same call: float32 rounding
    moved = np.abs(blocked - want_logits).max() / scale
    assert apart == (kind == "per call")
    assert (moved > 1e-3) if apart else (moved <= 1e-5), moved  # what blocks do to a file scaled per call
    assert gen.generate(gen.CachedDecoder(str(model)), [prompt], NEW)[0] == want_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_each_row_of_a_batch_equals_its_prompt_alone(shipped, kind):
    """generate over several prompts: each row's tokens are the clients' for that prompt alone
    (a file scaled per call runs its rows apart; the others in one batch)."""
    decoder = gen.CachedDecoder(str(shipped[kind] / "model.onnx"))
    batch = prompts(3)
    together = gen.generate(decoder, batch, NEW)
    assert together == [stepwise(shipped[kind] / "model.onnx", p, NEW)[0] for p in batch]


def test_rows_in_one_call(shipped):
    """The same three prompts left-padded into ONE call: the first prompt's logits are its own to
    float32 rounding in our int8, int4 and float files, and far from them where the scale is the
    call's (why such a file's rows run apart)."""
    gaps = {}
    for kind in KINDS:
        decoder = gen.CachedDecoder(str(shipped[kind] / "model.onnx"))
        ids, mask = gen.left_pad(prompts(3))
        together, _ = decoder.step(ids, mask, decoder.empty_past(3))
        alone, _ = decoder.step(ids[:1, -9:], mask[:1, -9:], decoder.empty_past(1))
        gaps[kind] = float(np.abs(together[0, -1] - alone[0, -1]).max() / np.abs(alone[0, -1]).max())
    assert gaps["per call"] > 1e-3 and max(gaps[k] for k in ("int8", "int4", "float")) <= 1e-5, gaps


def quantize_dynamic_graph(weight: np.ndarray, weight_zero: np.ndarray, weight_scale: np.ndarray):
    """DynamicQuantizeLinear -> MatMulInteger -> Cast -> the scales' Mul, as quantize_dynamic writes
    one quantized MatMul (its names: the MatMulInteger is <MatMul's name>_quant)."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = weight.shape
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["y_int"], name="head_quant"),
             helper.make_node("Cast", ["y_int"], ["y_float"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["scales"]),
             helper.make_node("Mul", ["y_float", "scales"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                              [numpy_helper.from_array(a, name) for a, name in
                               ((weight, "w"), (weight_zero, "wz"), (weight_scale, "ws"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def numpy_rows(x: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's uint8 values less its zero point, and its scale: DynamicQuantizeLinear's formulas
    over the row (its range widened to hold 0, 255 steps), or about zero (max|x| / 127)."""
    if symmetric:
        scale = np.abs(x).max(-1, keepdims=True) / np.float32(127)
    else:
        low, high = np.minimum(x.min(-1, keepdims=True), 0), np.maximum(x.max(-1, keepdims=True), 0)
        scale = (high - low) / np.float32(255)
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    if symmetric:
        return np.clip(np.round(x / scale), -128, 127), scale
    zero = np.clip(np.round(-(low / scale)), 0, 255)
    return np.clip(np.round(x / scale) + zero, 0, 255) - zero, scale


@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-point-per-row", "head-about-zero"])
def test_the_row_quantizer_against_numpy(symmetric):
    """A quantize_dynamic MatMul rewritten per row gives numpy's per-row int8 product to float32
    rounding: (q - z) (W - w_zp) * scale * w_scale, each row its own scale and zero point (the
    head's about zero); a row of zeros gives zeros; a row's output is the one it gives alone."""
    rng = np.random.default_rng(3)
    weight = rng.integers(-64, 64, (16, 5)).astype(np.int8)
    weight_zero, weight_scale = np.zeros(5, np.int8), rng.uniform(0.01, 0.02, 5).astype(np.float32)
    proto = quantize_dynamic_graph(weight, weight_zero, weight_scale)
    assert per_row.activations_per_row(proto, ("head",) if symmetric else ()) == 1
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = (rng.standard_normal((5, 16)) * np.array([[1.0], [30.0], [0.01], [0.0], [1.0]])).astype(np.float32)
    x[4] = np.abs(x[4]) + 0.5  # one-sided: where a zero point per row pays
    got = session.run(None, {"x": x})[0]
    q, scale = numpy_rows(x, symmetric)
    want = (q @ (weight.astype(np.float64) - weight_zero)) * scale.astype(np.float64) * weight_scale
    assert np.allclose(got, want, rtol=1e-6, atol=0), np.abs(got - want).max()
    assert not got[3].any()
    for row in range(5):
        assert np.array_equal(session.run(None, {"x": x[row:row + 1]})[0][0], got[row])


@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-point-per-row", "head-about-zero"])
def test_openvino_runs_the_row_quantizer(symmetric):
    """OpenVINO's CPU plugin compiles the per-row graph (an empty optional input, the activations'
    zero point left out, was a node of dynamic rank it refused) and gives numpy's per-row product."""
    ov = pytest.importorskip("openvino")
    rng = np.random.default_rng(6)
    weight = rng.integers(-64, 64, (16, 5)).astype(np.int8)
    weight_zero, weight_scale = np.zeros(5, np.int8), rng.uniform(0.01, 0.02, 5).astype(np.float32)
    proto = quantize_dynamic_graph(weight, weight_zero, weight_scale)
    per_row.activations_per_row(proto, ("head",) if symmetric else ())
    assert all(name for node in proto.graph.node for name in node.input), "an empty optional input"
    core = ov.Core()
    compiled = core.compile_model(core.read_model(proto.SerializeToString(), b""), "CPU")
    x = (rng.standard_normal((4, 16)) * np.array([[1.0], [30.0], [0.01], [1.0]])).astype(np.float32)
    got = compiled({"x": x})[0]
    q, scale = numpy_rows(x, symmetric)
    want = (q @ (weight.astype(np.float64) - weight_zero)) * scale.astype(np.float64) * weight_scale
    # float32 scales and products: a few units of float32 rounding, far below one quantization step
    assert np.allclose(got, want, rtol=1e-5, atol=1e-7), np.abs(got - want).max()


def test_a_one_row_call_is_quantized_as_quantize_dynamic_does():
    """Where the zero point is per row, a one-row call (a decode step) gives DynamicQuantizeLinear's
    own product bit for bit: per row is per call there."""
    rng = np.random.default_rng(4)
    weight = rng.integers(-64, 64, (32, 7)).astype(np.int8)
    args = weight, rng.integers(-3, 3, 7).astype(np.int8), rng.uniform(0.01, 0.02, 7).astype(np.float32)
    ours, theirs = quantize_dynamic_graph(*args), quantize_dynamic_graph(*args)
    per_row.activations_per_row(ours)
    sessions = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]) for p in (ours, theirs)]
    for _ in range(5):
        x = (rng.standard_normal((1, 32)) * rng.uniform(0.1, 10)).astype(np.float32)
        a, b = (s.run(None, {"x": x})[0] for s in sessions)
        assert np.array_equal(a, b)


def test_serve_decodes_a_file_scaled_per_call_one_request_at_a_time(shipped):
    """The continuous batch of a file scaled per call has one slot; our int8 file's has the slots
    asked for. Each request's tokens are the clients' for its prompt alone."""
    for kind, slots in (("per call", 1), ("int8", 4)):
        engine = DecoderEngine(ServedFolder.read(shipped[kind]), slots=4)
        assert engine.slots == slots
        engine.start()
        try:
            requests = [engine.submit(Request(p, NEW)) for p in prompts(3)]
            for request, prompt in zip(requests, prompts(3)):
                got = []
                while (token := request.tokens.get(timeout=120)) is not None:
                    got.append(token)
                assert got == stepwise(shipped[kind] / "model.onnx", prompt, NEW)[0]
        finally:
            engine.stop()


def test_serve_embeds_inputs_scaled_per_call_one_at_a_time(tmp_path):
    """An embedder file scaled per call: each input runs alone; our int8 file and a float one batch
    by token budget. Each vector is the file's on that input alone."""
    source = save_tiny_folder("jina_bert", tmp_path / "jina")
    save_tokenizer(source, max_length=8192)
    rows = prompts(3)
    for kind, apart in (("per call", True), ("int8", False), ("float", False)):
        out = ship_as(source, tmp_path / kind.replace(" ", "_"), kind)
        assert EmbedderEngine(ServedFolder.read(out)).inputs_apart is apart
        replica = Replica(str(out))

        async def together():  # three requests arriving at once
            return await asyncio.gather(*(replica.embed([row]) for row in rows))

        got = asyncio.run(together())
        assert replica.batch_sizes == ([1, 1, 1] if apart else [3])
        for answer, row in zip(got, rows):
            alone = replica.engine.embed([row])[0]
            assert float(answer["vectors"][0] @ alone) >= 1 - 1e-6


def test_a_per_call_quantizer_inside_a_branch_is_seen():
    """A merged decoder (Optimum's int8 among them) holds its layers inside an If: the graph's
    facts look into its branches."""
    from onnx import TensorProto, helper

    from common.graph_facts import facts_of

    def branch(name):
        node = helper.make_node("DynamicQuantizeLinear", ["x"], [f"{name}_q", f"{name}_s", f"{name}_z"])
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(f"{name}_s", TensorProto.FLOAT, [])])

    merged = helper.make_node("If", ["use_cache_branch"], ["s"], then_branch=branch("with_cache"),
                              else_branch=branch("without"))
    graph = helper.make_graph([merged], "merged", [helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]),
                                                   helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    facts = facts_of(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert facts.scales_per_call and "If" in facts.op_types

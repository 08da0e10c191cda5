"""A file whose activations are quantized with one scale per call (int8 from ONNX Runtime's
quantize_dynamic: DynamicQuantizeLinear takes the range of its whole input) gives a row numbers
that depend on what else the call holds: the other rows of a batch, the rest of a prompt run at
once. Our runners then keep rows apart and prompts whole, so a row equals its prompt run alone
as every client runs it (one prompt, prefilled whole, then one token a step); int4 (MatMulNBits
quantizes each row's blocks) and float files keep batching.

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


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """scheme -> a BLOOM client folder written by --out-dir (the in-place cache), float, int8, int4."""
    root = tmp_path_factory.mktemp("per_call")
    source = save_client_model("bloom", root / "bloom")
    folders = {}
    for name in ("float", "int8", "int4"):
        folders[name] = root / name
        ship(source, folders[name], check_growth=False, quantize=None if name == "float" else quant_scheme(name))
    return folders


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
    assert [read_graph_facts(shipped[k] / "model.onnx").scales_per_call for k in ("float", "int8", "int4")] == \
        [False, True, False]


def test_an_int8_prompt_longer_than_a_prefill_block_goes_in_whole(shipped):
    """Past PREFILL_BLOCK tokens an in-place file's prompt enters its buffer in blocks; an int8
    file's goes in whole. In blocks its logits move far (each block's range scales it), whole they
    equal the clients' to float32 rounding, and so do the greedy tokens."""
    model = shipped["int8"] / "model.onnx"
    prompt = np.random.default_rng(7).integers(3, 250, gen.PREFILL_BLOCK + 60).tolist()
    want_tokens, want_logits = stepwise(model, prompt, NEW)
    decoder = gen.CachedDecoder(str(model))
    assert decoder.scales_per_call
    ids = np.array([prompt])
    whole = gen.prefill_shared(decoder, ids, np.ones_like(ids), decoder.shared_cache(1, len(prompt) + 1))[0, -1]
    decoder.scales_per_call = False  # as before: in blocks
    blocked = gen.prefill_shared(decoder, ids, np.ones_like(ids), decoder.shared_cache(1, len(prompt) + 1))[0, -1]
    scale = np.abs(want_logits).max()
    assert np.abs(whole - want_logits).max() <= 1e-5 * scale  # the same calls: float32 rounding
    assert np.abs(blocked - want_logits).max() > 1e-3 * scale  # what the blocks did (so the check can fail)
    decoder.scales_per_call = True
    assert gen.generate(decoder, [prompt], NEW)[0] == want_tokens


@pytest.mark.parametrize("kind", ["int8", "int4", "float"])
def test_each_row_of_a_batch_equals_its_prompt_alone(shipped, kind):
    """generate over several prompts: each row's tokens are the clients' for that prompt alone
    (an int8 file's rows run apart; the others in one batch)."""
    decoder = gen.CachedDecoder(str(shipped[kind] / "model.onnx"))
    batch = prompts(3)
    together = gen.generate(decoder, batch, NEW)
    assert together == [stepwise(shipped[kind] / "model.onnx", p, NEW)[0] for p in batch]


def test_int8_rows_in_one_call_would_differ(shipped):
    """Why the int8 rows run apart: the same three prompts left-padded into ONE call give the
    first prompt logits far from its own (int4 and float: float32 rounding)."""
    gaps = {}
    for kind in ("int8", "int4", "float"):
        decoder = gen.CachedDecoder(str(shipped[kind] / "model.onnx"))
        ids, mask = gen.left_pad(prompts(3))
        together, _ = decoder.step(ids, mask, decoder.empty_past(3))
        alone, _ = decoder.step(ids[:1, -9:], mask[:1, -9:], decoder.empty_past(1))
        gaps[kind] = float(np.abs(together[0, -1] - alone[0, -1]).max() / np.abs(alone[0, -1]).max())
    assert gaps["int8"] > 1e-3 and gaps["int4"] <= 1e-5 and gaps["float"] <= 1e-5, gaps


def test_serve_decodes_an_int8_folder_one_request_at_a_time(shipped):
    """The continuous batch of an int8 folder has one slot: each request's tokens are the
    clients' for its prompt alone, whatever else is waiting."""
    engine = DecoderEngine(ServedFolder.read(shipped["int8"]), slots=4)
    assert engine.slots == 1
    engine.start()
    try:
        requests = [engine.submit(Request(p, NEW)) for p in prompts(3)]
        for request, prompt in zip(requests, prompts(3)):
            got = []
            while (token := request.tokens.get(timeout=120)) is not None:
                got.append(token)
            assert got == stepwise(shipped["int8"] / "model.onnx", prompt, NEW)[0]
    finally:
        engine.stop()
    assert DecoderEngine(ServedFolder.read(shipped["int4"]), slots=4).slots == 4


def test_serve_embeds_int8_inputs_one_at_a_time(tmp_path):
    """An int8 embedder folder: each input runs alone (its vector the file's on that input alone);
    a float folder batches by token budget."""
    source = save_tiny_folder("jina_bert", tmp_path / "jina")
    save_tokenizer(source, max_length=8192)
    rows = prompts(3)
    for kind, apart in (("int8", True), ("float", False)):
        out = tmp_path / kind
        ship(source, out, check_growth=False, quantize=quant_scheme(kind) if kind != "float" else None)
        assert EmbedderEngine(ServedFolder.read(out)).inputs_apart is apart
        replica = Replica(str(out))

        async def together():  # three requests arriving at once: batched unless the file scales per call
            return await asyncio.gather(*(replica.embed([row]) for row in rows))

        got = asyncio.run(together())
        assert replica.batch_sizes == ([1, 1, 1] if apart else [3])
        for answer, row in zip(got, rows):
            alone = replica.engine.embed([row])[0]
            assert float(answer["vectors"][0] @ alone) >= 1 - 1e-6

"""Serving: the --kv-cache export generates on ONNX Runtime exactly what PyTorch generates."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import posbias_export as pbe
import tiers
from torch_generation import greedy_generate
from posbias_export.parity import load_runner
from posbias_export.parity import compare, torch_outputs
from conftest import cli_model

gen = load_runner("ort/generate.py")


def prompt(length: int, seed: int = 0) -> bytes:
    return bytes(np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tolist())


@pytest.fixture(scope="session")
def decoders(exports):
    cache = {}

    def get(bias):
        if bias not in cache:
            cache[bias] = gen.CachedDecoder(str(exports.cli(bias, extra=("--kv-cache",))))
        return cache[bias]

    return get


# 300 + 64 tokens = 364 > 8 x the trace length (128); the long prompt for a key-row family and
# the window (its decode steps read only their reach) by default, every family with -m slow
# (each prompt-1 case exports a file of its own: kerple_log's and sandwich's run with -m slow)
GREEDY = [(b, n) for b in pbe.BIASES for n in (1, 7, 300)]
GREEDY_SLOW = {f"{b}-prompt300" for b in pbe.BIASES if b not in ("alibi", "window")} | {"kerple_log-prompt1",
                                                                                        "sandwich-prompt1"}


@pytest.mark.parametrize("bias,length", tiers.cases(GREEDY, [f"{b}-prompt{n}" for b, n in GREEDY], slow=GREEDY_SLOW))
def test_greedy_tokens_equal_pytorch(decoders, bias, length):
    """64 new tokens; the 300-byte prompt takes the context to 364 > 8x the trace length."""
    p = prompt(length, seed=length)
    ours = gen.generate(decoders(bias), [p], 64)
    theirs = greedy_generate(cli_model(bias), [p], 64)
    assert ours == theirs


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_prefill_plus_decode_equals_full_forward(decoders, bias):
    """Prefill 80, then 20 single-token steps: past the window's 64 keys, so a window decode
    step reads only the cached keys within its reach (DirectWindowKeys)."""
    decoder = decoders(bias)
    tokens = np.frombuffer(prompt(100, seed=3), np.uint8).astype(np.int64)[None]  # [1, 100]
    past = decoder.empty_past(1)
    logits, past = decoder.step(tokens[:, :80], np.ones((1, 80), np.int64), past)
    chunks = [logits]
    for t in range(80, 100):  # 20 single-token decode steps
        logits, past = decoder.step(tokens[:, t:t + 1], np.ones((1, t + 1), np.int64), past)
        chunks.append(logits)
    cached = np.concatenate(chunks, axis=1)  # [1, 60, V]
    model = cli_model(bias)
    ids = torch.from_numpy(tokens)
    parity = compare(cached, torch_outputs(model, (ids,), torch.float64), torch_outputs(model, (ids,), torch.float32))
    assert parity.passed, str(parity)


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_left_padded_batch_equals_each_prompt_alone(decoders, bias):
    prompts = [prompt(5, 1), prompt(17, 2), prompt(40, 3)]
    batch = gen.generate(decoders(bias), prompts, 24)
    alone = [gen.generate(decoders(bias), [p], 24)[0] for p in prompts]
    assert batch == alone


def test_sampling_is_reproducible_with_a_seed(decoders):
    d = decoders("alibi")
    a = gen.generate(d, [b"hello"], 16, temperature=0.8, seed=5)
    b = gen.generate(d, [b"hello"], 16, temperature=0.8, seed=5)
    c = gen.generate(d, [b"hello"], 16, temperature=0.8, seed=6)
    assert a == b and a != c


@pytest.mark.parametrize("prompts,n,message", [
    ([b""], 4, "prompt 0 is empty"),
    ([], 4, "no prompt given"),
    ([b"ab"], -1, "max_new_tokens must be an integer >= 0"),
])
def test_bad_requests(decoders, prompts, n, message):
    with pytest.raises(gen.RunnerError, match=message):
        gen.generate(decoders("alibi"), prompts, n)


def test_context_limit(decoders):
    with pytest.raises(gen.RunnerError, match="exceeds --max-context"):
        gen.generate(decoders("alibi"), [b"abcdef"], 10, max_context=12)


def test_mismatched_past_shapes(decoders):
    d = decoders("t5")
    past = d.empty_past(1)
    past[3] = np.zeros((1, d.heads, 2, d.head_dim), np.float32)  # past_value.1 longer than the rest
    with pytest.raises(gen.RunnerError, match="past_value.1 has shape"):
        d.step(np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64), past)
    with pytest.raises(gen.RunnerError, match="attention_mask must be"):
        d.step(np.zeros((1, 1), np.int64), np.ones((1, 5), np.int64), d.empty_past(1))


def test_generate_command_with_non_utf8_prompt(exports, tmp_path):
    (tmp_path / "p.bin").write_bytes(b"\xff\xfe\x00abc")
    cmd = [sys.executable, "-m", "posbias_export", "generate", str(exports.cli("alibi", extra=("--kv-cache",))),
           "--prompt-file", str(tmp_path / "p.bin"), "--max-new-tokens", "8", "--output", str(tmp_path / "o.bin")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("\\xff\\xfe\x00abc")  # invalid bytes escaped, valid ones as they are
    expected = greedy_generate(cli_model("alibi"), [b"\xff\xfe\x00abc"], 8)[0]
    assert (tmp_path / "o.bin").read_bytes() == expected


def test_generate_command_errors_are_one_line(exports):
    cmd = [sys.executable, "-m", "posbias_export", "generate", str(exports.cli("alibi", extra=("--kv-cache",))),
           "--prompt", "", "--max-new-tokens", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == "generate: error: prompt 0 is empty: generation needs at least one token of context"


@pytest.mark.slow  # a smoke run of a benchmark command: its time goes to subprocesses timing things
def test_bench_decode_smoke(tmp_path):
    """The decode benchmark end to end at toy sizes (no timing thresholds: timings are noisy)."""
    cmd = [sys.executable, "-m", "posbias_export", "bench-decode", "--biases", "kerple_log", "--contexts", "20",
           "--steps", "2", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    import json

    data = json.loads((tmp_path / "decode.json").read_text())
    rows = data["rows"]
    assert rows[0]["bias"] == "kerple_log" and rows[0]["ort_ms_median"] > 0 and rows[0]["torch_ms_median"] > 0
    target = data["targets"][0]  # judged on the measured ratio, whatever it is
    assert target["met"] == (rows[0]["ort_over_torch"] <= 0.5) and target["target"].startswith("kerple_log context 20")
    md = (tmp_path / "decode.md").read_text()
    assert "| kerple_log | 20 |" in md and "## Targets" in md


def test_steps_come_one_at_a_time(decoders):
    """A streaming client gets the first byte without waiting for the rest: 10^6 requested tokens
    (within a raised --max-context) still yield at once, and equal the first greedy token."""
    steps = gen.generate_steps(decoders("alibi"), [b"To be"], 10 ** 6, max_context=2 * 10 ** 6)
    first = next(steps)
    steps.close()
    assert first.tolist() == list(gen.generate(decoders("alibi"), [b"To be"], 1)[0])


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_temperature_must_be_finite_and_not_negative(decoders, temperature):
    with pytest.raises(gen.RunnerError, match="finite number >= 0"):
        gen.generate(decoders("alibi"), [b"ab"], 2, temperature=temperature)


def test_default_context_bounds_a_huge_request(decoders):
    with pytest.raises(gen.RunnerError, match=f"exceeds --max-context \\({gen.DEFAULT_MAX_CONTEXT}\\)"):
        gen.generate(decoders("alibi"), [b"ab"], 10 ** 18)


def test_device_cache_path_equals_host_path(decoders):
    """generate keeps the cache as OrtValues bound from one step's outputs to the next step's
    inputs (IOBinding; on a GPU they stay on the device). Exercised here on ORT CPU: the same
    logits as feeding numpy arrays, through a prefill and three decode steps, padded batch."""
    d = decoders("sandwich")
    ids, mask = gen.left_pad([b"To be, or", b"not"])
    cache, past = d.empty_cache(2), d.empty_past(2)
    for step in range(4):
        on_device, cache = d.step_on_device(ids, mask, cache)
        on_host, past = d.step(ids, mask, past)
        np.testing.assert_array_equal(on_device, on_host)
        assert all(type(v).__name__ == "OrtValue" and v.shape()[2] == mask.shape[1] for v in cache)
        ids = on_host[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)

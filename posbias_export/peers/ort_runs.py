"""Our files on ONNX Runtime, run as they are served and timed as transformers eager is
(eager_runs.py): the decode steps `generate` takes, a T5 encoder forward, T5 greedy from a
serving folder, and where one decode step's time goes (runtimes/ort/profile.py). The benches' workers (bench/real_models.main_worker) call both sides.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .eager_runs import prompt_ids


def ort_steps(model_path: str, capacity: int, threads: int = 0, lean: bool | None = None, device: str = "cpu"):
    """make_step (eager_runs.timed_greedy) for our file on ONNX Runtime, the cache kept as
    `generate` keeps it (runtimes/ort/generate.py stepper: an in-place file's in one buffer
    written where it lies, another's as ONNX Runtime values between steps). lean None: as
    `generate` chooses (no prepacked copies on CPU for float weights)."""
    from ..parity.runtimes import load_runner

    runner = load_runner("ort/generate.py")
    decoder = runner.CachedDecoder(model_path, device, threads, lean=lean)

    def make_step():
        return runner.stepper(decoder, 1, capacity)
    make_step.ran_on = decoder.session.get_providers()[0]  # what ran it, as ONNX Runtime says
    return make_step


def encoder_forward(model_path: str, prompt: int, threads: int, save: str | None = None) -> dict:
    """The T5 encoder file on ORT CPU: one forward of `prompt` tokens (its states saved as .npy)."""
    from ..parity.runtimes import load_runner

    session = load_runner("ort/run.py").create_session(model_path, "cpu", threads)
    ids = prompt_ids(prompt, 32000)
    start = time.perf_counter()
    states = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    seconds = time.perf_counter() - start
    if save:
        np.save(save, states[0])
    return {"prefill_s": seconds}


def seq2seq_greedy(folder: str, prompt: int, new_tokens: int) -> dict:
    """A folder written with --out-dir (encoder_model.onnx, decoder_model_merged.onnx) on ORT
    CPU: the encoder over `prompt` tokens, then greedy decoder steps with the cache."""
    from ..parity.runtimes import load_runner

    config = json.loads((Path(folder) / "config.json").read_text())
    ids = prompt_ids(prompt, min(32000, config["vocab_size"]))
    timings: dict = {}
    tokens = load_runner("ort/seq2seq.py").greedy_generate(
        str(Path(folder) / "encoder_model.onnx"), str(Path(folder) / "decoder_model_merged.onnx"), ids,
        np.ones_like(ids), new_tokens, timings=timings)
    return {"prefill_s": timings["encoder_s"], "decode_ms": timings["steps_ms"][1:],  # the first step: no cache yet
            "tokens": tokens[0].tolist()}


def decode_step_profile(path: Path, threads: int, past: int, source: int | None = None) -> dict:
    """One decode step after `past` cached tokens (a T5 decoder's encoder `source` long), profiled
    by ONNX Runtime (runtimes/ort/profile.py): ms per operator type, the largest first."""
    import onnxruntime as ort

    from ..parity.runtimes import load_runner

    profiler = load_runner("ort/profile.py")
    inputs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()
    got = profiler.profile(path, profiler.decode_step_feeds(inputs, past, source), runs=4)
    return {"wall_ms": got["wall_us"] / 1e3, "ops": {o["op"]: o["us"] / 1e3 for o in got["ops"]}}

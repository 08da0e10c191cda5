#!/usr/bin/env python3
"""Byte-level text generation with an exported KV-cache decoder on ONNX Runtime.

    python runtimes/ort/generate.py model.onnx --prompt "To be" --max-new-tokens 64 [--provider cpu|cuda]
        [--temperature T --seed S] [--max-context N] [--output out.bin]

onnxruntime and numpy only. Greedy by default. Several prompts are left-padded into one
batch; positions come from the attention mask, so each row equals that prompt run alone.
"""
from __future__ import annotations

import argparse
import codecs
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.feeds import ONNX_TYPE_TO_NUMPY  # noqa: E402
from common.loading import load_runner  # noqa: E402
from common.runner_cli import OneLineParser  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402

create_session = load_runner("ort/run.py").create_session  # the sibling runner's session, checks included


class CachedDecoder:
    """A session over a --kv-cache export, with its cache layout read from the model."""

    def __init__(self, model_path: str, provider: str = "cpu", threads: int = 0, tf32: bool = False):
        self.session = create_session(model_path, provider, threads, tf32)
        self.device = "cuda" if provider == "cuda" else "cpu"  # where the cache lives between steps
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "attention_mask" not in inputs or "past_key.0" not in inputs:
            raise RunnerError(f"{model_path} has no KV cache inputs; export it with --kv-cache")
        self.layers = sum(1 for name in inputs if name.startswith("past_key."))
        first = inputs["past_key.0"]
        self.heads, self.head_dim = first.shape[1], first.shape[3]
        self.dtype = np.dtype(ONNX_TYPE_TO_NUMPY[first.type])
        meta = self.session.get_modelmeta().custom_metadata_map
        # A learned absolute position table (if any) bounds the context; biases do not.
        self.max_positions = int(meta["posbias.max_positions"]) if "posbias.max_positions" in meta else None
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.past_names = [f"past_{kind}.{i}" for i in range(self.layers) for kind in ("key", "value")]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        shape = (batch, self.heads, 0, self.head_dim)
        return [np.zeros(shape, self.dtype) for _ in range(2 * self.layers)]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[np.ndarray]):
        """input_ids [B, L], attention_mask [B, P+L], past: 2*layers arrays [B, H, P, d]
        -> (logits [B, L, V], presents [B, H, P+L, d])."""
        if input_ids.ndim != 2 or input_ids.dtype != np.int64:
            raise RunnerError(f"input_ids must be int64 [B, L], got {input_ids.dtype} {list(input_ids.shape)}")
        batch, new = input_ids.shape
        if len(past) != 2 * self.layers:
            raise RunnerError(f"expected {2 * self.layers} past tensors, got {len(past)}")
        expected = (batch, self.heads, past[0].shape[2] if past[0].ndim == 4 else -1, self.head_dim)
        for index, tensor in enumerate(past):
            if tensor.shape != expected or tensor.dtype != self.dtype:
                kind = "key" if index % 2 == 0 else "value"
                raise RunnerError(f"past_{kind}.{index // 2} has shape {list(tensor.shape)} {tensor.dtype}; "
                                  f"all past tensors must be {list(expected)} {self.dtype}")
        if attention_mask.shape != (batch, expected[2] + new):
            raise RunnerError(f"attention_mask must be [{batch}, past + new = {expected[2] + new}], "
                              f"got {list(attention_mask.shape)}")
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask.astype(np.int64)}
        for i in range(self.layers):
            feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = past[2 * i], past[2 * i + 1]
        try:
            outputs = self.session.run(None, feeds)
        except Exception as err:
            raise RunnerError(f"onnxruntime failed: {str(err).strip().splitlines()[0]}") from None
        return outputs[0], outputs[1:]


    def empty_cache(self, batch: int) -> list:
        """The prefill's empty cache, as OrtValues on the session's device."""
        import onnxruntime as ort

        return [ort.OrtValue.ortvalue_from_numpy(a, self.device, 0) for a in self.empty_past(batch)]

    def step_on_device(self, input_ids: np.ndarray, attention_mask: np.ndarray, cache: list):
        """One step with the cache kept where the session runs (IOBinding): the step's present
        tensors stay on the device and are bound as the next step's past; only input_ids,
        the mask (host -> device) and the logits (device -> host) cross.
        -> (logits [B, L, V] numpy, present OrtValues [B, H, P+L, d])."""
        past_len = cache[0].shape()[2]
        if attention_mask.shape != (input_ids.shape[0], past_len + input_ids.shape[1]):
            raise RunnerError(f"attention_mask must be [{input_ids.shape[0]}, past + new = "
                              f"{past_len + input_ids.shape[1]}], got {list(attention_mask.shape)}")
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, np.int64))
        for name, value in zip(self.past_names, cache):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(self.output_names[0], "cpu")  # logits: the host samples from them
        for name in self.output_names[1:]:
            binding.bind_output(name, self.device, 0)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as err:
            raise RunnerError(f"onnxruntime failed: {str(err).strip().splitlines()[0]}") from None
        outputs = binding.get_outputs()
        return outputs[0].numpy(), outputs[1:]


def left_pad(prompts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte prompts -> input_ids [B, Lmax] and attention_mask [B, Lmax], padding on the left."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = np.frombuffer(prompt, np.uint8)
        mask[row, width - len(prompt):] = 1
    return ids, mask


DEFAULT_MAX_CONTEXT = 8192  # prompt + new tokens; the KV cache grows with it (raise it with --max-context)


def check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise RunnerError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")


def check_request(prompts: list[bytes], max_new_tokens: int, max_context: int | None, max_positions: int | None) -> None:
    if not prompts:
        raise RunnerError("no prompt given")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (bytes, bytearray)) or len(prompt) == 0:
            raise RunnerError(f"prompt {index} is empty: generation needs at least one byte of context")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise RunnerError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    needed = max(len(p) for p in prompts) + max_new_tokens
    for limit, what in ((max_positions, "the model's position table"), (max_context, "--max-context")):
        if limit is not None and needed > limit:
            raise RunnerError(f"prompt + max_new_tokens = {needed} tokens exceeds {what} ({limit})")


def choose(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Next byte per row from logits [B, V]: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(-1).astype(np.int64)
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(len(p), p=p) for p in probs], np.int64)


def generate_steps(decoder: CachedDecoder, prompts: list[bytes], max_new_tokens: int, temperature: float = 0.0,
                   seed: int = 0, max_context: int | None = DEFAULT_MAX_CONTEXT):
    """Yields the next byte of every prompt, [B] int64, one step at a time (for streaming)."""
    check_request(prompts, max_new_tokens, max_context, decoder.max_positions)
    check_temperature(temperature)
    rng = np.random.default_rng(seed)
    ids, mask = left_pad(prompts)
    cache = decoder.empty_cache(len(prompts))
    for _ in range(max_new_tokens):
        logits, cache = decoder.step_on_device(ids, mask, cache)  # prefill at step 0, then one token at a time
        ids = choose(logits[:, -1], temperature, rng)[:, None]  # [B, 1]
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        yield ids[:, 0]


def generate(decoder: CachedDecoder, prompts: list[bytes], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, max_context: int | None = DEFAULT_MAX_CONTEXT) -> list[bytes]:
    """New bytes per prompt (the prompt itself not included)."""
    steps = list(generate_steps(decoder, prompts, max_new_tokens, temperature, seed, max_context))
    new_tokens = np.stack(steps, axis=1) if steps else np.zeros((len(prompts), 0), np.int64)  # [B, T]
    return [bytes(row.astype(np.uint8).tolist()) for row in new_tokens]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _check_output(path: str, model: str) -> None:
    """Before generating: the output can be written and is not the model."""
    target = Path(path)
    if not target.parent.is_dir():
        raise RunnerError(f"cannot write {path}: directory {target.parent} does not exist")
    if target.is_dir():
        raise RunnerError(f"cannot write {path}: it is a directory")
    if target.resolve() == Path(model).resolve():
        raise RunnerError(f"refusing to write {path}: it is the model")


def main(argv=None) -> int:
    p = OneLineParser(prog="generate", description=__doc__.splitlines()[0])
    p.add_argument("model", help="an export made with --kv-cache")
    p.add_argument("--prompt", action="append", help="text prompt (UTF-8); repeat for a batch")
    p.add_argument("--prompt-file", action="append", help="a file whose raw bytes are a prompt; repeatable")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="bytes to generate per prompt (default 64)")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cpu",
                   help="ONNX Runtime execution provider; the KV cache stays on its device between steps")
    p.add_argument("--tf32", action="store_true", help="cuda: allow TF32 matmuls (faster; off by default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--max-context", type=_positive, default=DEFAULT_MAX_CONTEXT,
                   help=f"refuse requests whose prompt + new tokens exceed this (default {DEFAULT_MAX_CONTEXT})")
    p.add_argument("--output", help="write the generated bytes of the first prompt here (raw)")
    args = p.parse_args(argv)
    try:
        check_temperature(args.temperature)
        if args.output:
            _check_output(args.output, args.model)
        prompts = [t.encode("utf-8") for t in args.prompt or []]
        for file in args.prompt_file or []:
            try:
                prompts.append(Path(file).read_bytes())
            except OSError as err:
                raise RunnerError(f"cannot read prompt file {file}: {err.strerror}") from None
        check_request(prompts, args.max_new_tokens, args.max_context, None)
        decoder = CachedDecoder(args.model, args.provider, tf32=args.tf32)
        steps = generate_steps(decoder, prompts, args.max_new_tokens, args.temperature, args.seed, args.max_context)
        outputs = _stream(prompts[0], steps) if len(prompts) == 1 else generate_rows(steps, len(prompts))
    except RunnerError as err:
        print(f"generate: error: {err}", file=sys.stderr)
        return 2
    if len(prompts) > 1:
        for prompt, out in zip(prompts, outputs):
            print(_text(prompt + out))
    if args.output:
        Path(args.output).write_bytes(outputs[0])
    return 0


def _text(data: bytes) -> str:
    # Generated bytes need not be valid UTF-8: shown with escapes, written raw with --output.
    return data.decode("utf-8", errors="backslashreplace")


def _stream(prompt: bytes, steps) -> list[bytes]:
    """One prompt: print it, then each byte as it comes (UTF-8 sequences completed first)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
    print(decoder.decode(prompt), end="", flush=True)
    out = bytearray()
    for token in steps:
        out.append(int(token[0]))
        print(decoder.decode(bytes([out[-1]])), end="", flush=True)
    print(decoder.decode(b"", final=True))
    return [bytes(out)]


def generate_rows(steps, rows: int) -> list[bytes]:
    out = [bytearray() for _ in range(rows)]
    for tokens in steps:
        for row, token in zip(out, tokens.tolist()):
            row.append(token)
    return [bytes(row) for row in out]


if __name__ == "__main__":
    sys.exit(main())

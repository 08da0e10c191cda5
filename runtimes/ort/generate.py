#!/usr/bin/env python3
"""Text generation with an exported KV-cache decoder on ONNX Runtime.

    python runtimes/ort/generate.py model.onnx --prompt "To be" --max-new-tokens 64 [--provider cpu|cuda]
        [--temperature T --seed S] [--max-context N] [--output out.bin] [--tokenizer tokenizer.json]

onnxruntime and numpy only (and the tokenizers package for a model from a Hugging Face folder,
whose tokenizer.json is found beside the file or in its folder). Greedy by default; a model
with an end-of-sequence token stops each row there. Several prompts are left-padded into one
batch; positions come from the attention mask, so each row equals that prompt run alone (a file
whose activations are quantized per call, int8's DynamicQuantizeLinear, runs each prompt in a batch
of its own: there a row's numbers depend on the rows beside it).
"""
from __future__ import annotations

import argparse
import codecs
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.atomic import Terminated, clashing_input, on_sigterm_raise, write_bytes  # noqa: E402
from common.cache import cache_layout  # noqa: E402
from common.feeds import ONNX_TYPE_TO_NUMPY  # noqa: E402
from common.graph_facts import inplace_cache, prepacking_pays, read_graph_facts, token_limit  # noqa: E402
from common.memory import check_allocation  # noqa: E402
from common.runner_cli import contract_of  # noqa: E402
from common.loading import load_runner  # noqa: E402
from common.runner_cli import OneLineParser  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402
from common.vocabulary import Vocabulary, utf8, vocabulary_for  # noqa: E402

create_session = load_runner("ort/run.py").create_session  # the sibling runner's session, checks included


class CachedDecoder:
    """A session over a --kv-cache export, with its cache layout read from the model."""

    def __init__(self, model_path: str, provider: str = "cpu", threads: int = 0, tf32: bool = False,
                 lean: bool | None = None, denormal_as_zero: bool = True, last_logits: bool = False):
        # last_logits: every step's logits are the last position's only, [B, 1, V] (a server's
        # decoder, which samples from nothing else; common/last_logits.py)
        # what the file is comes from its graph, read before the session exists: a file with its
        # tensors inside is parsed whole, and that copy is gone before ONNX Runtime holds the weights
        facts = read_graph_facts(model_path)
        # lean (no prepacked weight copies): None chooses by the file, on CPU (graph_facts.prepacking_pays)
        self.lean = lean if lean is not None else provider == "cpu" and not prepacking_pays(facts)
        self.session = create_session(model_path, provider, threads, tf32, self.lean, denormal_as_zero, last_logits)
        self.device = "cuda" if provider == "cuda" else "cpu"  # where the cache lives between steps
        inputs = {i.name: i for i in self.session.get_inputs()}
        try:
            layout = cache_layout(inputs, [o.name for o in self.session.get_outputs()])
        except ValueError as err:
            raise RunnerError(f"{model_path}: {err}") from None
        if "attention_mask" not in inputs or layout is None:
            raise RunnerError(f"{model_path} has no KV cache inputs; export it with --kv-cache")
        self.layers, self.past_names = layout.layers, list(layout.past)  # key 0, value 0, key 1, ...
        first = inputs[layout.past[0]]
        self.heads, self.head_dim = first.shape[1], first.shape[3]
        if len(first.shape) != 4 or not all(isinstance(d, int) for d in (self.heads, self.head_dim)):
            raise RunnerError(f"{model_path}: the cache input {first.name} is {first.shape}; this runner needs "
                              "[batch, heads, past, head size] with the heads and head size fixed in the file")
        if first.type not in ONNX_TYPE_TO_NUMPY:
            raise RunnerError(f"{model_path}: the cache input {first.name} is {first.type}, not a float tensor")
        self.dtype = np.dtype(ONNX_TYPE_TO_NUMPY[first.type])
        contract = contract_of(self.session.get_modelmeta().custom_metadata_map, model_path)
        self.contract = contract
        # A learned absolute position table (if any) bounds the context; biases do not.
        self.max_positions = contract.max_positions
        self.output_names = [self.session.get_outputs()[0].name, *layout.present]  # logits, then the cache in order
        # the rows of the embedding: an id past them is refused (an int4 file's GatherBlockQuantized
        # reads past the table unchecked; a tokenizer may know more tokens than the model has rows)
        logits_dim = self.session.get_outputs()[0].shape[-1]
        self.vocab = token_limit(facts, contract) or (logits_dim if isinstance(logits_dim, int) else None)
        # --target ort: the cache is written in place, so one buffer per tensor serves every step
        self.inplace = inplace_cache(facts, contract)
        # activations quantized with one scale per call (int8 from quantize_dynamic): a row's tokens
        # depend on what else the call holds, so prompts run whole and one at a time (as alone)
        self.scales_per_call = facts is not None and facts.scales_per_call

    def check_ids(self, input_ids: np.ndarray) -> None:
        """Token ids in [0, vocab): what an embedding row exists for."""
        if self.vocab is not None and input_ids.size and (input_ids.min() < 0 or input_ids.max() >= self.vocab):
            bad = int(input_ids.max() if input_ids.max() >= self.vocab else input_ids.min())
            raise RunnerError(f"token id {bad} is outside the vocabulary [0, {self.vocab})")

    def empty_past(self, batch: int) -> list[np.ndarray]:
        shape = (batch, self.heads, 0, self.head_dim)
        return [np.zeros(shape, self.dtype) for _ in range(2 * self.layers)]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[np.ndarray]):
        """input_ids [B, L], attention_mask [B, P+L], past: 2*layers arrays [B, H, P, d]
        -> (logits [B, L, V], presents [B, H, P+L, d])."""
        if input_ids.ndim != 2 or input_ids.dtype != np.int64:
            raise RunnerError(f"input_ids must be int64 [B, L], got {input_ids.dtype} {list(input_ids.shape)}")
        self.check_ids(input_ids)
        batch, new = input_ids.shape
        if len(past) != 2 * self.layers:
            raise RunnerError(f"expected {2 * self.layers} past tensors, got {len(past)}")
        expected = (batch, self.heads, past[0].shape[2] if past[0].ndim == 4 else -1, self.head_dim)
        for index, tensor in enumerate(past):
            if tensor.shape != expected or tensor.dtype != self.dtype:
                raise RunnerError(f"{self.past_names[index]} has shape {list(tensor.shape)} {tensor.dtype}; "
                                  f"all past tensors must be {list(expected)} {self.dtype}")
        if attention_mask.shape != (batch, expected[2] + new):
            raise RunnerError(f"attention_mask must be [{batch}, past + new = {expected[2] + new}], "
                              f"got {list(attention_mask.shape)}")
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask.astype(np.int64), **dict(zip(self.past_names, past))}
        try:
            outputs = self.session.run(self.output_names, feeds)
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
        self.check_ids(input_ids)
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


    def shared_cache(self, batch: int, capacity: int) -> list:
        """An in-place file's cache: one zeroed [B, H, capacity, d] OrtValue per tensor, on the
        session's device, bound as past AND present at every step (nothing is allocated after)."""
        import onnxruntime as ort

        shape = (batch, self.heads, capacity, self.head_dim)
        if self.device == "cpu":  # all of it at once, before the first step: asked first, refused in one line
            need = 2 * self.layers * batch * self.heads * capacity * self.head_dim * self.dtype.itemsize
            check_allocation(need, f"the in-place cache ({batch} rows of {capacity} tokens)",
                             "lower --max-new-tokens, the prompts' length or their number")
        try:
            return [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, self.device, 0)
                    for _ in range(2 * self.layers)]
        except (MemoryError, RuntimeError) as err:  # the device's allocator: std::bad_alloc, out of memory
            raise RunnerError(f"cannot allocate the in-place cache ({batch} rows of {capacity} tokens): "
                              f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None

    def step_shared(self, input_ids: np.ndarray, attention_mask: np.ndarray, buffers: list) -> np.ndarray:
        """One step of an in-place file into `buffers` (shared_cache): rows [T - L, T) of each
        buffer are written, T the mask's length. -> logits [B, L, V] numpy."""
        self.check_ids(input_ids)
        capacity = buffers[0].shape()[2]
        if attention_mask.shape[1] > capacity:
            raise RunnerError(f"the cache holds {capacity} tokens; this step needs {attention_mask.shape[1]}")
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, np.int64))
        for name, value in zip(self.past_names, buffers):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(self.output_names[0], "cpu")
        for name, value in zip(self.output_names[1:], buffers):
            binding.bind_ortvalue_output(name, value)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as err:
            raise RunnerError(f"onnxruntime failed: {str(err).strip().splitlines()[0]}") from None
        return binding.get_outputs()[0].numpy()


PREFILL_BLOCK = 256  # an in-place file's prompt enters the buffer this many rows at a time (batch 1)


def prefill_shared(decoder: CachedDecoder, ids: np.ndarray, mask: np.ndarray, buffers: list) -> np.ndarray:
    """The prompt into an in-place file's buffers -> the last position's logits [B, 1, V]. At
    batch 1 in blocks of PREFILL_BLOCK rows: the step's bias is [H, rows, T], not [H, T, T],
    so memory stays linear in the prompt. A batch goes in whole: GroupQueryAttention's CPU
    kernel takes several new rows after cached ones at batch 1 only. So does the prompt of a file
    whose activations are scaled per call: in blocks, each block's range would set its numbers,
    and they would differ from every client's, which runs a prompt whole."""
    block = PREFILL_BLOCK if ids.shape[0] == 1 and not decoder.scales_per_call else ids.shape[1]
    for start in range(0, ids.shape[1], block):
        stop = min(start + block, ids.shape[1])
        logits = decoder.step_shared(ids[:, start:stop], mask[:, :stop], buffers)
    return logits[:, -1:]


def stepper(decoder: CachedDecoder, batch: int, capacity: int):
    """step(ids [B, L], mask [B, T]) -> logits [B, L|1, V], the cache kept between calls: an
    in-place file's in one buffer per tensor of `capacity` tokens, written where it lies (no
    copy of the cache per step, nothing allocated after the first); any other file's as the
    OrtValues each step returns (step_on_device)."""
    if decoder.inplace:
        buffers = decoder.shared_cache(batch, capacity)

        def step(ids, mask):
            return prefill_shared(decoder, ids, mask, buffers) if ids.shape[1] > 1 else \
                decoder.step_shared(ids, mask, buffers)
        return step
    cache = [decoder.empty_cache(batch)]

    def step(ids, mask):
        logits, cache[0] = decoder.step_on_device(ids, mask, cache[0])
        return logits
    return step


def left_pad(prompts: list, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (bytes, or lists of token ids) -> input_ids [B, Lmax] and attention_mask
    [B, Lmax], padding on the left."""
    rows = [list(p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = tokens
        mask[row, width - len(tokens):] = 1
    return ids, mask


DEFAULT_MAX_CONTEXT = 8192  # prompt + new tokens; the KV cache grows with it (raise it with --max-context)


def check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise RunnerError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")


def check_request(prompts: list[bytes], max_new_tokens: int, max_context: int | None, max_positions: int | None) -> None:
    if not prompts:
        raise RunnerError("no prompt given")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise RunnerError(f"prompt {index} is empty: generation needs at least one token of context")
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


def generate_steps(decoder: CachedDecoder, prompts: list, max_new_tokens: int, temperature: float = 0.0,
                   seed: int = 0, max_context: int | None = DEFAULT_MAX_CONTEXT, eos_ids=(), pad_id: int = 0):
    """Yields the next token of every prompt (bytes or token id lists), [B] int64, one step at a
    time (for streaming). A row that produced any of eos_ids yields pad_id from then on, and the
    steps end once every row has (as transformers' generate). A file whose activations are scaled
    per call runs each prompt in a batch of its own, so each row still equals its prompt alone."""
    check_request(prompts, max_new_tokens, max_context, decoder.max_positions)
    check_temperature(temperature)
    if decoder.scales_per_call and len(prompts) > 1:
        yield from _rows_apart(decoder, prompts, max_new_tokens, temperature, seed, max_context, eos_ids, pad_id)
        return
    rng = np.random.default_rng(seed)
    ids, mask = left_pad(prompts, pad_id)
    step = stepper(decoder, len(prompts), ids.shape[1] + max_new_tokens)
    done = np.zeros(len(prompts), bool)
    for _ in range(max_new_tokens):
        logits = step(ids, mask)  # prefill at step 0, then one token at a time
        chosen = np.where(done, pad_id, choose(logits[:, -1], temperature, rng))  # [B]
        ids = chosen[:, None].astype(np.int64)  # [B, 1]
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        yield ids[:, 0]
        done |= np.isin(chosen, list(eos_ids))
        if done.all():
            return


def _rows_apart(decoder: CachedDecoder, prompts: list, max_new_tokens: int, temperature: float, seed: int,
               max_context, eos_ids, pad_id: int):
    """generate_steps' [B] tokens a step, each row run in a batch of its own (its own cache and
    sampler seed + row), a finished row giving pad_id until every row has finished."""
    rows = [generate_steps(decoder, [p], max_new_tokens, temperature, seed + k, max_context, eos_ids, pad_id)
            for k, p in enumerate(prompts)]
    done = [False] * len(rows)
    for _ in range(max_new_tokens):
        tokens = []
        for k, row in enumerate(rows):
            token = None if done[k] else next(row, None)
            done[k] = done[k] or token is None or int(token[0]) in eos_ids
            tokens.append(pad_id if token is None else int(token[0]))
        yield np.array(tokens, np.int64)
        if all(done):
            return


def generate(decoder: CachedDecoder, prompts: list, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, max_context: int | None = DEFAULT_MAX_CONTEXT, eos_ids=(), pad_id: int = 0) -> list:
    """New tokens per prompt (the prompt itself not included): bytes for byte prompts, else
    lists of token ids."""
    steps = list(generate_steps(decoder, prompts, max_new_tokens, temperature, seed, max_context, eos_ids, pad_id))
    new_tokens = np.stack(steps, axis=1) if steps else np.zeros((len(prompts), 0), np.int64)  # [B, T]
    if all(isinstance(p, (bytes, bytearray)) for p in prompts):
        return [bytes(row.astype(np.uint8).tolist()) for row in new_tokens]
    return [row.tolist() for row in new_tokens]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _check_output(path: str, inputs: list[str]) -> None:
    """Before generating: the output can be written and is none of the inputs (the model, a
    prompt file)."""
    target = Path(path)
    if not target.parent.is_dir():
        raise RunnerError(f"cannot write {path}: directory {target.parent} does not exist")
    if target.is_dir():
        raise RunnerError(f"cannot write {path}: it is a directory")
    clash = clashing_input([target], inputs)
    if clash:
        raise RunnerError(f"refusing to write {path}: it is also an input ({clash[1].name})")


def _parser() -> OneLineParser:
    p = OneLineParser(prog="generate", description=__doc__.splitlines()[0])
    p.add_argument("model", help="an export made with --kv-cache (or model.onnx of a folder written with --out-dir)")
    p.add_argument("--prompt", action="append", help="text prompt (UTF-8); repeat for a batch")
    p.add_argument("--prompt-file", action="append", help="a file whose raw bytes are a prompt; repeatable")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: the one beside the model or in its "
                   "folder; byte-level models need none)")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cpu",
                   help="ONNX Runtime execution provider; the KV cache stays on its device between steps")
    p.add_argument("--tf32", action="store_true", help="cuda: allow TF32 matmuls (faster; off by default)")
    packing = p.add_mutually_exclusive_group()
    packing.add_argument("--lean-memory", action="store_const", const=True, dest="lean", help="no prepacked copies "
                         "of the weights (they stay memory-mapped): less memory, a slower prefill; the default on CPU "
                         "for float weights, whose steps cost the same. On an int4 file it also changes the numbers: "
                         "without packed copies ONNX Runtime drops the int8-compute kernel of accuracy level 4 and "
                         "computes in float (logits move ~1%%, so greedy text may differ), and steps are far slower")
    packing.add_argument("--prepack", action="store_const", const=False, dest="lean",
                         help="prepacked weight copies for float weights too: a faster prefill, the weights held twice "
                         "while the session loads")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--max-context", type=_positive, default=DEFAULT_MAX_CONTEXT,
                   help=f"refuse requests whose prompt + new tokens exceed this (default {DEFAULT_MAX_CONTEXT})")
    p.add_argument("--output", help="write what the first prompt generated here (raw bytes; text for a tokenizer)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    on_sigterm_raise()
    try:
        check_temperature(args.temperature)
        if args.seed < 0:
            raise RunnerError(f"--seed must be >= 0, got {args.seed}")
        if args.output:  # before the model loads: the model, its weights, the prompt files, --tokenizer
            _check_output(args.output, [args.model, *(args.prompt_file or []),
                                        *([args.tokenizer] if args.tokenizer else [])])
        decoder = CachedDecoder(args.model, args.provider, tf32=args.tf32, lean=args.lean)
        vocab = vocabulary_for(args.model, decoder.contract, args.tokenizer)
        if args.output:  # and none of what the vocabulary read (tokenizer.json, config.json, generation_config.json)
            _check_output(args.output, [args.model, *(args.prompt_file or []), *vocab.files])
        prompts = [vocab.encode(t) if not vocab.is_bytes else utf8(t) for t in args.prompt or []]
        for file in args.prompt_file or []:
            try:
                data = Path(file).read_bytes()
            except OSError as err:
                raise RunnerError(f"cannot read prompt file {file}: {err.strerror}") from None
            prompts.append(data if vocab.is_bytes else vocab.encode_bytes(data))
        check_request(prompts, args.max_new_tokens, args.max_context, None)
        steps = generate_steps(decoder, prompts, args.max_new_tokens, args.temperature, args.seed, args.max_context,
                               vocab.eos_ids, vocab.pad_id)
        outputs = _stream(prompts[0], steps, vocab) if len(prompts) == 1 else generate_rows(steps, len(prompts))
        if len(prompts) > 1:
            for prompt, out in zip(prompts, outputs):
                print(vocab.decode(list(prompt) + vocab.until_eos(out)))
        if args.output:
            first = vocab.until_eos(outputs[0])
            write_bytes(args.output, bytes(first) if vocab.is_bytes else vocab.decode(first))
    except RunnerError as err:
        print(f"generate: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the output: a full disk, a read-only folder
        print(f"generate: error: {err if not err.filename else f'{err.filename}: {err.strerror}'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM: nothing half-written stays
        terminated = isinstance(stop, Terminated)
        print(f"\ngenerate: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    return 0


def _stream(prompt, steps, vocab: Vocabulary) -> list[list[int]]:
    """One prompt: print it, then the text as the tokens come (a byte-level model's UTF-8
    sequences completed first; a tokenizer's text decoded again as it grows)."""
    out: list[int] = []
    if vocab.is_bytes:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
        print(decoder.decode(bytes(prompt)), end="", flush=True)
        for token in steps:
            out.append(int(token[0]))
            print(decoder.decode(bytes([out[-1]])), end="", flush=True)
        print(decoder.decode(b"", final=True))
        return [out]
    shown = vocab.decode(prompt)
    print(shown, end="", flush=True)
    for token in steps:
        out.append(int(token[0]))
        text = vocab.decode(list(prompt) + vocab.until_eos(out))
        if text.startswith(shown):  # tokenizers may rewrite the tail once more tokens come: print only what holds
            print(text[len(shown):], end="", flush=True)
            shown = text
    print()
    return [out]


def generate_rows(steps, rows: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(rows)]
    for tokens in steps:
        for row, token in zip(out, tokens.tolist()):
            row.append(token)
    return out


if __name__ == "__main__":
    sys.exit(main())

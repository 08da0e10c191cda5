#!/usr/bin/env python3
"""Greedy encoder-decoder generation (T5) with two exported files on ONNX Runtime:

    python runtimes/ort/seq2seq.py OUT --prompt "translate: ..." [--max-new-tokens N] [--tokenizer PATH]
    python runtimes/ort/seq2seq.py encoder.onnx decoder.onnx --prompt ...

    encoder: input_ids, attention_mask [B, Le] -> last_hidden_state [B, Le, D]
    decoder: input_ids [B, L], (attention_mask [B, P+L],) encoder_hidden_states,
             encoder_attention_mask, the cache (past_key.N or past_key_values.N.decoder.key) -> logits, presents;
             the clients' merged file also caches the cross-attention keys (past_key_values.N.encoder.key,
             use_cache_branch): computed on the first step, fed back unchanged after

OUT is a folder written with --model DIR --out-dir OUT (encoder_model.onnx, decoder_model_merged.onnx,
tokenizer.json, config.json). onnxruntime, numpy and tokenizers only. The encoder runs once; each
step feeds the decoder one token and its cache; a row stops at the end-of-sequence token.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.atomic import Terminated, on_sigterm_raise  # noqa: E402
from common.cache import cache_layout, cross_cache_layout  # noqa: E402
from common.feeds import ONNX_TYPE_TO_NUMPY  # noqa: E402
from common.graph_facts import read_graph_facts, token_limit  # noqa: E402
from common.json_files import read_json_object, token_id  # noqa: E402
from common.loading import load_runner  # noqa: E402
from common.runner_cli import contract_of  # noqa: E402
from common.runner_cli import OneLineParser  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402
from common.vocabulary import TokenizerVocabulary  # noqa: E402

_ORT_RUN = load_runner("ort/run.py")
create_session, host_synchronous_cuda = _ORT_RUN.create_session, _ORT_RUN.host_synchronous_cuda


MAX_NEW_TOKENS = 8192  # a bound on a request: the cache grows with each token (generate's --max-context default)


def _check_request(input_ids, attention_mask, max_new_tokens, vocab: int | None) -> np.ndarray:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise RunnerError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise RunnerError(f"max_new_tokens is at most {MAX_NEW_TOKENS} (the decoder's cache grows with every token), "
                          f"got {max_new_tokens}")
    ids = np.asarray(input_ids)
    if ids.dtype != np.int64 or ids.ndim != 2 or np.asarray(attention_mask).shape != ids.shape:
        raise RunnerError(f"input_ids and attention_mask must be int64 [B, L] of one shape, got {ids.dtype} "
                          f"{list(ids.shape)} and {list(np.asarray(attention_mask).shape)}")
    if vocab and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise RunnerError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def _decoder_caches(decoder, decoder_path: str):
    """The decoder's self-attention cache layout, its cross-attention cache layout (None: the
    cross keys are recomputed every step) and the first past input."""
    names = {i.name: i for i in decoder.get_inputs()}
    try:
        layout = cache_layout(names, [o.name for o in decoder.get_outputs()])
        cross = cross_cache_layout(names, [o.name for o in decoder.get_outputs()])
    except ValueError as err:
        raise RunnerError(f"{decoder_path}: {err}") from None
    if "encoder_hidden_states" not in names or layout is None:
        raise RunnerError(f"{decoder_path} is not a cached T5 decoder (export it with --model DIR --part decoder)")
    first = names[layout.past[0]]
    if not all(isinstance(d, int) for d in (first.shape[1], first.shape[3])):
        raise RunnerError(f"{decoder_path}: its cache's heads and head size are symbolic ({first.shape}); "
                          "a cached T5 decoder written by --model DIR --part decoder names them")
    return layout, cross, first


def greedy_generate(encoder_path: str, decoder_path: str, input_ids: np.ndarray, attention_mask: np.ndarray,
                    max_new_tokens: int, start_token: int = 0, min_new_tokens: int = 0, eos_ids=(),
                    provider: str = "cpu", timings: dict | None = None) -> np.ndarray:
    """input_ids, attention_mask [B, Le] int64 -> generated tokens [B, n <= max_new_tokens] (greedy; it
    stops once every row has produced one of `eos_ids`, as transformers does, the ended rows repeating
    it; they are forbidden for the first `min_new_tokens` steps, as transformers does).
    timings: a dict to receive encoder_s and steps_ms (each decoder step's wall time)."""
    _check_request(input_ids, attention_mask, max_new_tokens, None)
    if provider == "cuda":  # before either session: the decoder's If decides for the process
        host_synchronous_cuda(encoder_path, decoder_path)
    encoder, decoder = create_session(encoder_path, provider), create_session(decoder_path, provider)
    vocab = token_limit(read_graph_facts(encoder_path), contract_of(encoder.get_modelmeta().custom_metadata_map, encoder_path))
    ids = _check_request(input_ids, attention_mask, max_new_tokens, vocab)
    layout, cross, first = _decoder_caches(decoder, decoder_path)
    _check_pair(encoder, {i.name: i for i in decoder.get_inputs()}["encoder_hidden_states"], encoder_path, decoder_path)
    _check_same_weights(encoder, decoder, encoder_path, decoder_path)  # after: a BLOOM "encoder" is named for what it is
    vocab_out = decoder.get_outputs()[0].shape[-1]
    if not isinstance(start_token, (int, np.integer)) or isinstance(start_token, bool) or start_token < 0 or (
            isinstance(vocab_out, int) and start_token >= vocab_out):
        raise RunnerError(f"the decoder start token {start_token!r} is not a token id of the decoder's vocabulary "
                          f"({vocab_out})")
    if max_new_tokens == 0:
        return np.zeros((ids.shape[0], 0), np.int64)
    timings = {} if timings is None else timings
    started = time.perf_counter()
    states = _run(encoder, None, {"input_ids": input_ids, "attention_mask": attention_mask}, encoder_path)[0]
    timings["encoder_s"], timings["steps_ms"] = time.perf_counter() - started, []
    steps = _Steps(decoder, decoder_path, layout, cross, first, states, attention_mask)
    return steps.greedy(max_new_tokens, start_token, min_new_tokens, tuple(eos_ids), timings["steps_ms"])


class _Steps:
    """The decoder's steps over its caches: the self-attention cache grows by one row a step; the
    cross-attention cache (the clients' merged file) is empty with use_cache_branch false on the
    first step, which computes it, then passed back unchanged with true."""

    def __init__(self, decoder, decoder_path, layout, cross, first, states, attention_mask):
        self.decoder, self.path, self.layout, self.cross = decoder, decoder_path, layout, cross
        self.states, self.attention_mask = states, attention_mask
        self.with_mask = "attention_mask" in {i.name for i in decoder.get_inputs()}
        batch, heads, head_dim = states.shape[0], first.shape[1], first.shape[3]
        dtype = np.dtype(ONNX_TYPE_TO_NUMPY[first.type])  # float16 for a float16 decoder
        self.past = [np.zeros((batch, heads, 0, head_dim), dtype) for _ in range(2 * layout.layers)]
        self.cross_past = [np.zeros((batch, heads, 0, head_dim), dtype) for _ in cross.past] if cross else []
        self.outputs = [decoder.get_outputs()[0].name, *layout.present]

    def logits(self, step: np.ndarray, index: int) -> np.ndarray:
        layout, cross, batch = self.layout, self.cross, step.shape[0]
        feeds = {"input_ids": step, "encoder_hidden_states": self.states, "encoder_attention_mask": self.attention_mask,
                 **dict(zip(layout.past, self.past))}
        if self.with_mask:  # the decoder's own mask (a file shipped for clients has none: all ones)
            feeds["attention_mask"] = np.ones((batch, index + 1), np.int64)
        if cross:
            feeds.update({"use_cache_branch": np.array([index > 0]), **dict(zip(cross.past, self.cross_past))})
        computes_cross = bool(cross) and index == 0
        logits, *past = _run(self.decoder, self.outputs + (list(cross.present) if computes_cross else []), feeds,
                             self.path)
        if computes_cross:
            past, self.cross_past = past[:len(layout.present)], past[len(layout.present):]
        self.past = past
        return logits

    def greedy(self, max_new_tokens, start_token, min_new_tokens, eos_ids: tuple, steps_ms: list) -> np.ndarray:
        batch = self.states.shape[0]
        step = np.full((batch, 1), start_token, np.int64)
        tokens, done, ended = [], np.zeros(batch, bool), np.zeros(batch, np.int64)
        for index in range(max_new_tokens):
            started = time.perf_counter()
            last = self.logits(step, index)[:, -1]
            steps_ms.append(1e3 * (time.perf_counter() - started))
            if eos_ids and index < min_new_tokens:
                last[:, list(eos_ids)] = -np.inf
            step = last.argmax(-1)[:, None].astype(np.int64)
            step[done, 0] = ended[done]  # a row that ended repeats its end token; all ended: stop (as transformers)
            ended = np.where(done, ended, step[:, 0])
            done |= np.isin(step[:, 0], list(eos_ids))
            tokens.append(step)
            if done.all():
                break
        return np.concatenate(tokens, axis=1)


def _check_same_weights(encoder, decoder, encoder_path: str, decoder_path: str) -> None:
    """Files we export record their folder's weights (posbias.weights_sha256): an encoder and a
    decoder of two different folders of the same width would run, and generate nonsense."""
    recorded = [contract_of(s.get_modelmeta().custom_metadata_map, path).weights_sha256
                for s, path in ((encoder, encoder_path), (decoder, decoder_path))]
    if all(recorded) and recorded[0] != recorded[1]:
        raise RunnerError(f"{encoder_path} and {decoder_path} were exported from different weights (their "
                          "posbias.weights_sha256 differ): give the encoder and decoder of one folder")


def _run(session, outputs, feeds: dict, path: str) -> list:
    try:
        return session.run(outputs, feeds)
    except Exception as err:  # noqa: BLE001 - ONNX Runtime's errors carry a C++ location and a log line
        raise RunnerError(f"{path}: ONNX Runtime failed: {str(err).strip().splitlines()[0][:300]}") from None


def _check_pair(encoder, states_input, encoder_path: str, decoder_path: str) -> None:
    """The encoder is a T5 encoder (input_ids, attention_mask -> [B, L, D]) whose width D is the
    one the decoder's encoder_hidden_states takes."""
    inputs = {i.name for i in encoder.get_inputs()}
    out = encoder.get_outputs()[0]
    if inputs != {"input_ids", "attention_mask"} or len(out.shape) != 3:
        raise RunnerError(f"{encoder_path} is not an encoder (input_ids, attention_mask -> hidden states [B, L, D]): "
                          f"it takes {', '.join(sorted(inputs))} and returns {out.name} {out.shape}")
    width, wanted = out.shape[-1], states_input.shape[-1]
    if isinstance(width, int) and isinstance(wanted, int) and width != wanted:
        raise RunnerError(f"{encoder_path} and {decoder_path} do not belong together: the encoder returns width "
                          f"{width}, the decoder takes encoder_hidden_states of width {wanted}")


def _files(model: str, decoder: str | None) -> tuple[Path, Path, Path]:
    """(encoder, decoder, the folder with tokenizer.json and config.json)."""
    first = Path(model)
    if decoder is not None:
        return first, Path(decoder), first.resolve().parent
    if not first.is_dir():
        raise RunnerError(f"{model} is not a folder: give the folder written with --out-dir, or ENCODER DECODER")
    pair = first / "encoder_model.onnx", first / "decoder_model_merged.onnx"
    missing = [p.name for p in pair if not p.is_file()]
    if missing:
        raise RunnerError(f"{model} has no {missing[0]} (a T5 folder written with --model DIR --out-dir OUT)")
    return pair[0], pair[1], first


def main(argv=None) -> int:
    p = OneLineParser(prog="seq2seq", description="greedy T5 generation from text with two ONNX files")
    p.add_argument("model", help="a folder written with --out-dir, or the encoder file")
    p.add_argument("decoder", nargs="?", help="the decoder file (when the first argument is the encoder)")
    p.add_argument("--prompt", action="append", required=True, help="source text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (>= 0; default 32)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the folder's)")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    on_sigterm_raise()
    try:
        if args.max_new_tokens < 0:  # 0, as for generate: the prompts read and checked, nothing generated
            raise RunnerError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
        encoder, decoder, folder = _files(args.model, args.decoder)
        tokenizer = Path(args.tokenizer) if args.tokenizer else folder / "tokenizer.json"
        if not tokenizer.is_file():
            raise RunnerError(f"tokenizer {tokenizer} does not exist (pass --tokenizer)")
        vocab = TokenizerVocabulary(tokenizer)
        start = decoder_start(folder)
        prompts = [vocab.encode(text) for text in args.prompt]
        if not all(prompts):
            raise RunnerError("a prompt encodes to no tokens")
        width = max(len(t) for t in prompts)
        ids = np.full((len(prompts), width), vocab.pad_id, np.int64)
        mask = np.zeros((len(prompts), width), np.int64)
        for row, tokens in enumerate(prompts):  # right padding, as T5 tokenizers pad
            ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
        tokens = greedy_generate(str(encoder), str(decoder), ids, mask, args.max_new_tokens, start,
                                 eos_ids=vocab.eos_ids, provider=args.provider)
    except RunnerError as err:
        print(f"seq2seq: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        print(f"seq2seq: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    for row in tokens.tolist():
        row = vocab.until_eos(row)
        print(vocab.decode(row[:-1] if row and row[-1] in vocab.eos_ids else row))
    return 0


def decoder_start(folder: Path) -> int:
    """The folder's decoder_start_token_id (generation_config.json first, as transformers reads
    it; 0, T5's pad, when neither file names one)."""
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if file.is_file():
            value = token_id(read_json_object(file).get("decoder_start_token_id"), file, "decoder_start_token_id", None)
            if value is not None:
                return value
    return 0


if __name__ == "__main__":
    sys.exit(main())

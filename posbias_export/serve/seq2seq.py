"""A T5 / UMT5 folder's engine: request-level batching with the cross cache.

The requests waiting when a batch starts (up to `slots`) run together: their prompts right-padded
into one encoder call (the encoder's mask hides the padding), then the merged decoder steps every
row at once, its cross-attention keys computed on the first step and fed back unchanged after
(runtimes/ort/seq2seq.py's steps). Each row streams its own tokens and leaves at its stop id, its
max_tokens or a cancel; the batch ends when every row has left, and the next one takes what
arrived meanwhile. A request's greedy tokens are the ones seq2seq.py gives for its prompt alone.
"""
from __future__ import annotations

import queue
import threading

import numpy as np

from ..runners import runtimes_common
from .decoder import DEFAULT_SLOTS, Request, choose_token
from .embedder import runner
from .folder import ServedFolder


class Seq2SeqEngine:
    """start() once, submit() from anywhere: the same interface as DecoderEngine."""

    def __init__(self, folder: ServedFolder, slots: int = DEFAULT_SLOTS, threads: int = 0):
        self.seq2seq = runner("ort/seq2seq.py")
        encoder_path, decoder_path = str(folder.files["encoder"]), str(folder.files["decoder"])
        self.encoder = self.seq2seq.create_session(encoder_path, "cpu", threads)
        self.decoder = self.seq2seq.create_session(decoder_path, "cpu", threads)
        self.decoder_path = decoder_path
        self.layout, self.cross, self.first = self.seq2seq._decoder_caches(self.decoder, decoder_path)
        settings = folder.settings
        self.pad = _int(settings.get("pad_token_id"), 0)
        self.start_token = _int(settings.get("decoder_start_token_id"), self.pad)
        # activations scaled per call (int8 from quantize_dynamic) in either file: a request's tokens would
        # depend on the prompts batched with it, so each runs alone (common/graph_facts.py)
        facts = [runtimes_common("graph_facts").read_graph_facts(p) for p in (encoder_path, decoder_path)]
        self.slots = 1 if any(f is not None and f.scales_per_call for f in facts) else slots
        self.capacity = folder.context
        self.waiting: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.steps = 0
        self.batch_sizes: list[int] = []

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="seq2seq", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.waiting.put(None)

    def submit(self, request: Request) -> Request:
        if len(request.prompt) > self.capacity or request.max_tokens > self.capacity:
            raise ValueError(f"the prompt ({len(request.prompt)} tokens) or max_tokens ({request.max_tokens}) "
                             f"exceeds the context of {self.capacity} tokens")
        self.waiting.put(request)
        return request

    def _loop(self) -> None:
        while not self.stopped.is_set():
            batch = [self.waiting.get()]
            while len(batch) < self.slots:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            batch = [r for r in batch if r is not None and not r.cancelled]
            if self.stopped.is_set():
                for request in batch:
                    _fail(request, "the server is shutting down")
                break
            if batch:
                try:
                    self._run(batch)
                except Exception as err:  # noqa: BLE001 - the batch's requests fail with the runtime's line
                    for request in batch:
                        if request.finish is None:
                            _fail(request, str(err).splitlines()[0] if str(err) else type(err).__name__)

    def _run(self, batch: list[Request]) -> None:
        width = max(len(r.prompt) for r in batch)
        ids = np.full((len(batch), width), self.pad, np.int64)
        mask = np.zeros_like(ids)
        for row, request in enumerate(batch):  # right padding: the encoder's mask hides it
            ids[row, :len(request.prompt)], mask[row, :len(request.prompt)] = request.prompt, 1
        states = self.seq2seq._run(self.encoder, None, {"input_ids": ids, "attention_mask": mask}, "the encoder")[0]
        steps = self.seq2seq._Steps(self.decoder, self.decoder_path, self.layout, self.cross, self.first, states, mask)
        step = np.full((len(batch), 1), self.start_token, np.int64)
        running = set(range(len(batch)))
        self.batch_sizes.append(len(batch))
        for index in range(max(r.max_tokens for r in batch)):
            logits = steps.logits(step, index)[:, -1]
            self.steps += 1
            for row in sorted(running):
                request = batch[row]
                token = choose_token(logits[row], request)
                step[row, 0] = token
                request.emit(token)
                if request.cancelled or token in request.stop_ids or len(request.made) >= request.max_tokens:
                    request.finish = "stop" if request.cancelled or token in request.stop_ids else "length"
                    request.emit(None)
                    running.discard(row)
            if not running:
                return


def _fail(request: Request, error: str) -> None:
    request.error, request.finish = error, "error"
    request.emit(None)


def _int(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default

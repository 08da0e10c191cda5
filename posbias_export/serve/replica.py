"""One model replica's work, apart from Ray: the folder's engine, the embedding inputs of
concurrent requests batched by token budget, completions streamed token by token. app.py wraps a
Replica in a Ray Serve deployment; tests drive it directly.
"""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from ..runners import runtimes_common
from .decoder import DEFAULT_SLOTS, DecoderEngine, Request
from .embedder import EmbedderEngine, default_budget, token_batches
from .folder import ServedFolder
from .seq2seq import Seq2SeqEngine

GATHER_S = 0.005  # how long the first waiting embedding input waits for others to batch with


class Replica:
    def __init__(self, folder: str, threads: int = 0, max_batch_tokens: int | None = None, slots: int = DEFAULT_SLOTS):
        self.folder = ServedFolder.read(folder)
        self.role = self.folder.role
        self.started = time.time()
        self.id = f"{os.getpid()}"
        if self.role == "embedder":
            self.engine = EmbedderEngine(self.folder, threads)
            hidden = self.engine.dimension if isinstance(self.engine.dimension, int) else 768
            self.budget = max_batch_tokens or default_budget(self.folder.context, hidden,
                                                             runtimes_common("memory").available_bytes())
            self.pending: list[tuple[list[int], asyncio.Future]] = []
            self.draining: asyncio.Task | None = None
            self.batch_sizes: list[int] = []
        else:  # a decoder batches continuously, a seq2seq folder by request
            engine = DecoderEngine if self.role == "decoder" else Seq2SeqEngine
            self.engine = engine(self.folder, slots=slots, threads=threads)
            self.engine.start()
        runtimes_common("memory").return_free_heap()

    # -- embeddings ------------------------------------------------------------------------------
    async def embed(self, rows: list[list[int]]) -> dict:
        """rows: token ids per input -> {"vectors": [N, D] float32, "queue_s", "batches", "rss"}."""
        loop = asyncio.get_running_loop()
        arrived = time.perf_counter()
        futures = [loop.create_future() for _ in rows]
        self.pending += list(zip(rows, futures))
        if self.draining is None or self.draining.done():
            self.draining = loop.create_task(self._drain())
        done = await asyncio.gather(*futures)  # (vector, when its batch started, the batch's size) per input
        return {"vectors": np.stack([v for v, _, _ in done]), "queue_s": min(s for _, s, _ in done) - arrived,
                "batch_sizes": [n for _, _, n in done], "rss": self.rss(), "replica": self.id}

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(GATHER_S)  # the inputs of requests arriving together batch together
        while self.pending:
            taken, self.pending = self.pending, []
            lengths = [len(r) for r, _ in taken]
            batches = [[k] for k in range(len(taken))] if self.engine.inputs_apart else token_batches(lengths, self.budget)
            for batch in batches:
                # a caller that left (its request cancelled: a client's timeout, a closed connection)
                # is not computed: under overload those are the retries' doubles
                batch = [i for i in batch if not taken[i][1].done()]
                if not batch:
                    continue
                started = time.perf_counter()
                try:
                    vectors = await loop.run_in_executor(None, self.engine.embed, [taken[i][0] for i in batch])
                except Exception as err:  # noqa: BLE001 - the batch's requests fail with the runtime's line
                    for i in batch:
                        taken[i][1].set_exception(RuntimeError(str(err).splitlines()[0] if str(err) else repr(err)))
                    continue
                self.batch_sizes.append(len(batch))
                for row, i in enumerate(batch):
                    if not taken[i][1].done():
                        taken[i][1].set_result((vectors[row], started, len(batch)))

    # -- completions -----------------------------------------------------------------------------
    async def complete(self, prompt: list[int], max_tokens: int, temperature: float, stop_ids: tuple[int, ...],
                       seed: int | None, top_p: float = 1.0):
        """Yields the new token ids as lists (each every token made since the last: one while the reader
        keeps up, more once it falls behind, so a busy ingress reads fewer messages), then
        {"finish": reason, "queue_s", "rss"} (or {"error": line})."""
        request = Request(list(prompt), max_tokens, temperature, tuple(stop_ids), seed, top_p, tokens=_LoopQueue())
        submitted = time.perf_counter()
        try:
            self.engine.submit(request)
        except ValueError as err:  # past what a slot holds: the caller's 400
            yield {"error": str(err), "status": 400}
            return
        first, ended, waiting = None, False, request.tokens.queue
        try:
            while not ended:
                token = await waiting.get()
                if token is None:
                    break
                first = first or time.perf_counter()
                tokens = [token]
                while not waiting.empty():  # a reader behind the decode gets what came meanwhile in one item
                    token = waiting.get_nowait()
                    ended = token is None
                    if ended:
                        break
                    tokens.append(token)
                yield tokens
        finally:  # the caller stopped reading (a stop string, a client gone): the row leaves at the next step
            request.cancelled = True
        if request.error:
            yield {"error": request.error}
        else:
            yield {"finish": request.finish, "queue_s": (first or time.perf_counter()) - submitted, "rss": self.rss(),
                   "replica": self.id}

    # -- health and stats ------------------------------------------------------------------------
    def rss(self) -> int:
        return runtimes_common("memory").rss_now()

    def healthy(self) -> bool:
        if self.role != "embedder":
            return self.engine.thread is not None and self.engine.thread.is_alive()
        return True

    def stop(self) -> None:
        if self.role != "embedder":
            self.engine.stop()


class _LoopQueue:
    """A request's tokens handed from the engine's thread to this event loop (no thread blocked per
    stream: the default executor has min(32, CPUs + 4) threads, fewer than the streams of a replica)."""

    def __init__(self):
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

    def put(self, token) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

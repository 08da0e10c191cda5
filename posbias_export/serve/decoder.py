"""A decoder folder's engine: continuous batching over the in-place cache.

The folder's model.onnx (written with --target ort, the --out-dir default) hands each step to ONNX
Runtime's GroupQueryAttention, which writes the step's keys and values where they lie in a buffer
bound as both past and present. A replica keeps ONE such batch of `slots` rows of `capacity` tokens
and one clock T shared by every row: each step feeds every row's next token at slot T and writes
column T of the attention mask (1 for a running request, 0 for an idle row). A request's positions
come from its own row of the mask (cumsum - 1), so a row's idle slots before its prompt are holes,
not distances: its tokens are the same as if it ran alone.

    join     a new request's prompt runs batch-1 (in blocks, memory linear in the prompt) straight
             into a free row, at slots [0, P); its keys and values move within that row to
             [T - P, T) (T moved up to P first if it is below), and its first token, from the
             prompt's last logits, is fed at the next step with everyone else's
    step     every running row advances one token; a row that meets max_tokens or a stop id
             leaves, its row free for the next request, the others go on
    compact  when T reaches the capacity, every buffer moves left by the earliest slot any
             running row still uses; a row that starts at slot 0 there has filled the context

Greedy requests give the tokens `generate` gives for the same prompt (tests/test_serve.py).
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .embedder import runner
from .folder import ServedFolder

DEFAULT_SLOTS = 8


@dataclass
class Request:
    """One completion: its prompt, limits and the tokens it has made; `tokens` receives each new
    token id, then None when it ends (`finish` says why: "stop" or "length")."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_p: float = 1.0  # nucleus sampling: drawn among the fewest likeliest tokens holding this mass
    made: list[int] = field(default_factory=list)
    cancelled: bool = False  # set by the reader (a stop string matched, the client left): the row leaves
    finish: str | None = None
    error: str | None = None
    tokens: queue.Queue = field(default_factory=queue.Queue)  # anything with put(): the replica's is its event loop's

    def emit(self, token: int | None) -> None:
        if token is not None:
            self.made.append(token)
        self.tokens.put(token)


class DecoderEngine:
    """The batch, its clock and the loop that runs it (a thread: start() once, submit() from anywhere)."""

    def __init__(self, folder: ServedFolder, slots: int = DEFAULT_SLOTS, threads: int = 0, capacity: int | None = None):
        import onnxruntime as ort

        generate = runner("ort/generate.py")
        self.generate = generate
        # logits of the last position only: a prompt's head over every position is half its prefill.
        # Weights prepacked when steps run several rows: bloom-560m's 16-row step takes 0.42 s on the
        # packed copies, 0.83 s without (a 1-row step 0.14 vs 0.12 s), for a copy of the weights in memory
        self.decoder = generate.CachedDecoder(str(folder.files["model"]), "cpu", threads, last_logits=True,
                                              lean=None if slots == 1 else False)
        if self.decoder.scales_per_call:  # a row's tokens would depend on the other rows of each step
            slots = 1
        if not self.decoder.inplace:
            raise ValueError(f"{folder.files['model']} writes its cache by concatenation; serve batches decoders over the "
                             "in-place cache: write the folder with --out-dir (its default --target ort)")
        self.slots, self.capacity = slots, capacity or fitting_capacity(self.decoder, slots, folder.context)
        shape = (slots, self.decoder.heads, self.capacity, self.decoder.head_dim)
        # numpy owns the memory (so a join can copy rows in), ONNX Runtime reads and writes it in place
        self.arrays = [np.zeros(shape, self.decoder.dtype) for _ in range(2 * self.decoder.layers)]
        self.prefixes: dict[int, list] = {}  # rows -> OrtValues over the first rows of each buffer
        # each row alone as batch-1 OrtValues over the same memory (a prompt's prefill writes its row):
        # GroupQueryAttention's CPU kernel takes several new tokens after cached ones at batch 1 only
        self.row_values = [[ort.OrtValue.ortvalue_from_numpy(a[k:k + 1]) for a in self.arrays] for k in range(slots)]
        self.mask = np.zeros((slots, self.capacity), np.int64)
        self.clock = 0  # T: every row's next token goes to slot T
        self.rows: list[Request | None] = [None] * slots
        self.last = np.zeros(slots, np.int64)  # each running row's next input token
        self.waiting: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.steps = 0  # batch steps run (metrics)
        self.batch_sizes: list[int] = []  # running rows at each step (metrics)
        self.compactions = 0

    # -- the loop --------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="decoder", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.waiting.put(None)

    def submit(self, request: Request) -> Request:
        if len(request.prompt) + request.max_tokens > self.capacity:
            raise ValueError(f"the prompt ({len(request.prompt)} tokens) and max_tokens ({request.max_tokens}) "
                             f"exceed the context of {self.capacity} tokens")
        self.waiting.put(request)
        return request

    def _loop(self) -> None:
        pending: deque[Request] = deque()  # taken from `waiting`, not yet in a row (the loop's own)
        while not self.stopped.is_set():
            running = any(r is not None for r in self.rows)
            try:  # idle: wait for work; running: take what has arrived, without waiting
                arrived = self.waiting.get() if not (running or pending) else self.waiting.get_nowait()
                while arrived is not None:
                    pending.append(arrived)
                    arrived = self.waiting.get_nowait()
            except queue.Empty:
                pass
            if self.stopped.is_set():
                break
            while pending and None in self.rows:
                request = pending.popleft()
                if not request.cancelled:
                    self._join(self.rows.index(None), request)
            if any(r is not None for r in self.rows):
                self._step()
        for request in [*pending, *(r for r in self.rows if r is not None)]:
            self._fail(request, "the server is shutting down")

    def _fail(self, request: Request, error: str) -> None:
        request.error, request.finish = error, "error"
        request.emit(None)

    # -- joining ---------------------------------------------------------------------------------
    def _join(self, slot: int, request: Request) -> None:
        """The prompt into row `slot` (batch 1, slots [0, P)), moved to [T - P, T); its first token.
        No buffer of its own: a joining prompt's buffer as long as the context doubled the cache's
        memory with one slot (7.05 GB of RSS after a 4096-token bloom-560m prompt)."""
        ids = np.asarray([request.prompt], np.int64)
        length = ids.shape[1]
        try:
            logits = self.generate.prefill_shared(self.decoder, ids, np.ones_like(ids), self.row_values[slot])  # [1, 1, V]
        except Exception as err:  # noqa: BLE001 - the request fails, the batch goes on
            self._fail(request, str(err).splitlines()[0] if str(err) else type(err).__name__)
            return
        if self.clock < length:  # the other rows get holes up to the prompt's length
            self.mask[:, self.clock:length] = 0
            self.clock = length
        start = self.clock - length
        if start:  # where the row's clock is (the source copied first: the ranges may overlap)
            for array in self.arrays:
                array[slot, :, start:self.clock] = array[slot, :, :length].copy()
        self.mask[slot] = 0
        self.mask[slot, start:self.clock] = 1
        self.rows[slot] = request
        self._next(slot, logits[0, -1])

    def _next(self, slot: int, logits: np.ndarray) -> None:
        """Row `slot`'s next token from its logits; the request ends on a stop id or its limit."""
        request = self.rows[slot]
        token = choose_token(logits, request)
        request.emit(token)
        if token in request.stop_ids:
            self._leave(slot, "stop")
        elif len(request.made) >= request.max_tokens:
            self._leave(slot, "length")
        else:
            self.last[slot] = token

    def _leave(self, slot: int, reason: str) -> None:
        request = self.rows[slot]
        request.finish = reason
        request.emit(None)
        self.rows[slot] = None
        self.mask[slot] = 0

    # -- stepping --------------------------------------------------------------------------------
    def _step(self) -> None:
        for slot, request in enumerate(self.rows):
            if request is not None and request.cancelled:
                self._leave(slot, "stop")
        if self.clock + 1 > self.capacity:
            self._compact()
        running = [s for s, r in enumerate(self.rows) if r is not None]
        if not running:
            return
        rows = running[-1] + 1  # the step runs rows [0, rows) only: a join takes the lowest free slot
        ids = np.zeros((rows, 1), np.int64)
        ids[running, 0] = self.last[running]
        self.mask[:, self.clock] = 0
        self.mask[running, self.clock] = 1
        try:
            logits = self.decoder.step_shared(ids, self.mask[:rows, :self.clock + 1], self._prefix(rows))  # [rows, 1, V]
        except Exception as err:  # noqa: BLE001 - every running request fails with the runtime's line
            for slot in running:
                self._fail(self.rows[slot], str(err).splitlines()[0] if str(err) else type(err).__name__)
                self.rows[slot], self.mask[slot] = None, 0
            return
        self.clock += 1
        self.steps += 1
        self.batch_sizes.append(len(running))
        for slot in running:
            self._next(slot, logits[slot, -1])

    def _prefix(self, rows: int) -> list:
        """The buffers' first `rows` rows as OrtValues over the same memory (the slot axis is the
        outermost: a prefix is contiguous), so idle rows past the last running one cost nothing."""
        if rows not in self.prefixes:
            import onnxruntime as ort

            self.prefixes[rows] = [ort.OrtValue.ortvalue_from_numpy(a[:rows]) for a in self.arrays]
        return self.prefixes[rows]

    def _compact(self) -> None:
        """Move every buffer left by the earliest slot a running row uses; a row from slot 0 has
        filled the context and ends ("length"), and the others move."""
        running = [s for s, r in enumerate(self.rows) if r is not None]
        if not running:
            self.mask[:], self.clock = 0, 0
            return
        firsts = [int(np.argmax(self.mask[s, :self.clock])) for s in running]
        shift = min(firsts)
        if shift <= 0:
            for slot, first in zip(running, firsts):
                if first == 0:
                    self._leave(slot, "length")
            return self._compact()
        self.compactions += 1
        for array in self.arrays:
            array[:, :, :self.clock - shift] = array[:, :, shift:self.clock].copy()
        self.mask[:, :self.clock - shift] = self.mask[:, shift:self.clock]
        self.mask[:, self.clock - shift:] = 0
        self.clock -= shift


def fitting_capacity(decoder, slots: int, context: int) -> int:
    """Tokens a slot holds: the folder's context, capped so the buffers take at most half the
    memory free once the weights are loaded (bloom-560m's 8192-token context in 16 slots would
    be 26 GB: 2 x 24 layers x 1024 x 4 bytes a token a row). Half, not less: MPT-1B's 16 slots
    then hold ~900 tokens beside its 10.6 GB of weights and prepacked copies on a 24 GB machine
    (a quarter: ~460, under a 512-token prompt and its answer)."""
    from ..runners import runtimes_common

    per_token = 2 * decoder.layers * decoder.heads * decoder.head_dim * np.dtype(decoder.dtype).itemsize
    fit = runtimes_common("memory").available_bytes() // 2 // (slots * per_token)
    return int(max(64, min(context, fit)))


def choose_token(logits: np.ndarray, request: Request) -> int:
    """Greedy at temperature 0, else a token drawn from softmax(logits / temperature) by the
    request's own generator (its seed); with top_p < 1 from the nucleus only (Holtzman et al.
    2020): the likeliest tokens whose probabilities first sum to top_p, renormalised."""
    if request.temperature <= 0:
        return int(np.argmax(logits))
    if not hasattr(request, "_rng"):
        request._rng = np.random.default_rng(request.seed)
    z = logits.astype(np.float64) / request.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if request.top_p < 1:
        order = np.argsort(-p, kind="stable")
        kept = order[:int(np.searchsorted(np.cumsum(p[order]), request.top_p)) + 1]
        nucleus = np.zeros_like(p)
        nucleus[kept] = p[kept]
        p = nucleus / nucleus.sum()
    return int(request._rng.choice(len(p), p=p))

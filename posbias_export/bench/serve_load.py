"""benchmarks/serve.md: `serve` under bounded load on loopback, one run, side by side.

    embeddings   a jina-v2-base-shaped folder (published configuration, random weights): C concurrent
                 clients each sending one input of L token ids at a time; requests/s, p50/p99
                 latency, the peak resident memory of the whole server (its process tree: Ray, the
                 proxy, the replicas), sampled every 0.25 s
    completions  a BLOOM-560m-shaped folder: S concurrent streams, each a P-token prompt and N new
                 tokens (greedy, streamed); tokens/s overall and per stream, time to first token
                 p50/p99, peak resident memory

The peers (infinity-emb, llama-cpp-python's OpenAI server) are rows where they are installed;
elsewhere the row says what is missing. `python -m posbias_export bench-serve --work DIR`.
"""
from __future__ import annotations

import importlib.util
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..environment import describe, environment
from .harness import md_table, one_line, write_results

COMMAND = "python -m posbias_export bench-serve"
JINA_BASE = dict(vocab=30528, hidden=768, heads=12, layers=12, max_len=8192)  # jina-embeddings-v2-base-en
EMBED_LENGTHS, EMBED_CLIENTS = (512, 2048, 8192), (1, 8, 32)
STREAMS, PROMPT, NEW_TOKENS = (1, 4, 16), 512, 128
REQUESTS_PER_CLIENT = 2  # each embedding client sends this many requests (a cell's total: clients x this)
MAX_CELL_TOKENS = 65536  # an embedding cell sending more tokens than this is skipped (8192 x 8 clients: ~20 min on 2 cores)
CELL_BUDGET_S = 900  # a cell's requests stop being sent after this (the cell says how many it ran)
TARGETS = {"streams": 3.0, "embed_gb": 2.0}


@dataclass
class LoadCell:
    server: str
    route: str
    length: int  # an embedding input's tokens, or a completion's prompt
    clients: int
    requests: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)  # per request (embeddings) or time to first token
    tokens: int = 0  # completion tokens made
    peak_rss: int = 0
    note: str = ""

    def pct(self, q: float) -> float | None:
        return float(np.percentile(self.latencies, q)) if self.latencies else None

    @property
    def rate(self) -> float | None:  # requests/s (embeddings) or tokens/s (completions)
        done = self.tokens if self.route == "completions" else self.requests
        return done / self.wall_s if self.wall_s and done else None


def peers_missing() -> dict[str, str]:
    """Each peer server's row: why it did not run here."""
    return {
        "infinity-emb": "" if shutil.which("infinity_emb") else "not installed (pip install 'infinity-emb[all]')",
        "llama.cpp server": "" if importlib.util.find_spec("llama_cpp") else
        "not installed (pip install 'llama-cpp-python[server]' builds llama.cpp from source)",
    }


def _load(cell: LoadCell, one_request, total: int) -> None:
    """`cell.clients` threads sending `total` requests in all; one_request() -> (latency, tokens)."""
    lock, sent = threading.Lock(), [0]
    started = time.perf_counter()

    def client():
        while True:
            with lock:
                if sent[0] >= total or time.perf_counter() - started > CELL_BUDGET_S:
                    return
                sent[0] += 1
            latency, tokens = one_request()
            with lock:
                cell.latencies.append(latency)
                cell.tokens += tokens
                cell.requests += 1

    threads = [threading.Thread(target=client) for _ in range(cell.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cell.wall_s = time.perf_counter() - started
    if cell.requests < total:
        cell.note = f"{cell.requests} of {total} requests within {CELL_BUDGET_S} s"


def embed_cell(server, client, model: str, length: int, clients: int, vocab: int) -> LoadCell:
    cell = LoadCell("ours", "embeddings", length, clients)
    rng = np.random.default_rng(length)

    def one():
        ids = rng.integers(3, vocab, length).tolist()
        t = time.perf_counter()
        client.embeddings.create(model=model, input=[ids])
        return time.perf_counter() - t, 0

    server.sample_peak()
    _load(cell, one, clients * REQUESTS_PER_CLIENT)
    cell.peak_rss = server.stop_sampling()
    return cell


def completion_cell(server, client, model: str, name: str, streams: int, vocab: int, prompt: int,
                    new_tokens: int) -> LoadCell:
    cell = LoadCell("ours", "completions", prompt, streams, note=name)
    rng = np.random.default_rng(streams)

    def one():
        ids = rng.integers(3, vocab, prompt).tolist()
        t, first, made = time.perf_counter(), None, 0
        for event in client.completions.create(model=model, prompt=ids, max_tokens=new_tokens, temperature=0,
                                               stream=True):
            first = first or time.perf_counter() - t
            made = event.usage.completion_tokens if event.usage else made
        return first or time.perf_counter() - t, made

    server.sample_peak()
    _load(cell, one, streams)
    cell.peak_rss = server.stop_sampling()
    return cell


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(cells: list[LoadCell], env: dict, missing: dict[str, str]) -> str:
    embed = [c for c in cells if c.route == "embeddings"]
    comp = [c for c in cells if c.route == "completions"]
    lines = [f"<!-- generated by: {COMMAND} -->", "# serve under load: embeddings and completions on loopback", "",
             "`python -m posbias_export serve` on this machine (one replica, ONNX Runtime's default threads), driven "
             "by the `openai` client from threads of this process. Peak RSS: the server's whole process tree "
             "(Ray's processes, the HTTP proxy, the replica), sampled every 0.25 s during the cell.",
             describe(env), "", "## Embeddings (jina-v2-base-shaped, float32, token-id inputs)", ""]
    lines += md_table(["server", "tokens", "clients", "requests", "requests/s", "p50 s", "p99 s", "peak RSS GB", "note"],
                      [[c.server, c.length, c.clients, c.requests, _ms(c.rate), _ms(c.pct(50)), _ms(c.pct(99)),
                        f"{c.peak_rss / 1e9:.2f}", c.note] for c in embed])
    lines += ["", "## Completions (streamed, greedy)", ""]
    lines += md_table(["server", "model", "prompt", "streams", "tokens", "tokens/s", "per stream tokens/s",
                       "TTFT p50 s", "TTFT p99 s", "peak RSS GB"],
                      [[c.server, c.note, c.length, c.clients, c.tokens, _ms(c.rate),
                        _ms(c.rate / c.clients if c.rate else None), _ms(c.pct(50)), _ms(c.pct(99)),
                        f"{c.peak_rss / 1e9:.2f}"] for c in comp])
    lines += ["", "Peers:", ""] + [f"- {peer}: {why or 'ran (rows above)'}" for peer, why in missing.items()]
    lines += ["", "## Targets", ""] + md_table(["target", "measured", "verdict"], _verdicts(embed, comp, missing))
    return "\n".join(lines) + "\n"


def _verdicts(embed, comp, missing) -> list[list[str]]:
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    rows = []
    by_streams = {c.clients: c for c in comp if c.rate}
    if 1 in by_streams and 16 in by_streams:
        ratio = by_streams[16].rate / by_streams[1].rate
        rows.append([f"completions: 16 streams >= {TARGETS['streams']:.0f}x the tokens/s of 1", f"{ratio:.2f}x",
                     met(ratio >= TARGETS["streams"])])
    rows.append(["completions at 16 streams >= llama.cpp's server", "-", "not run: " + missing["llama.cpp server"]
                 if missing["llama.cpp server"] else "see rows"])
    long = [c for c in embed if c.length == 8192 and c.requests]
    if long:
        peak = max(c.peak_rss for c in long) / 1e9
        rows.append([f"embeddings at 8192 tokens: server RSS <= {TARGETS['embed_gb']:.0f} GB", f"{peak:.2f} GB",
                     met(peak <= TARGETS["embed_gb"])])
    rows.append(["embeddings at 512 tokens >= infinity-emb's requests/s", "-", "not run: " + missing["infinity-emb"]
                 if missing["infinity-emb"] else "see rows"])
    return rows


def make_folders(work: Path, progress) -> dict[str, Path]:
    """The served folders (random weights at published sizes), written once into `work`."""
    from ..hf.ship import ship
    from ..hf.tiny import Sizes, save_tiny_folder, save_tokenizer

    folders = {}
    jina, served = work / "jina-v2-base", work / "jina-v2-base-served"
    if not (served / "model.onnx").is_file():
        progress("writing the jina-v2-base folder and its --out-dir folder")
        save_tiny_folder("jina_bert", jina, Sizes(**JINA_BASE), noise=0.0)
        save_tokenizer(jina, max_length=8192)
        ship(jina, served, check_growth=False)
    folders["jina-v2-base"] = served
    served = work / "bloom-560m-served"
    if not (served / "model.onnx").is_file():
        from ..hf.published import published_folder

        bloom = published_folder("bloom-560m", work, progress=progress)
        progress("writing bloom-560m's --out-dir folder (the in-place cache)")
        if not (bloom / "tokenizer.json").is_file():
            save_tokenizer(bloom)  # token-id prompts: the tokenizer only has to be there
        ship(bloom, served, check_growth=False)
    folders["bloom-560m"] = served
    return folders


def run_and_write(work: Path, out_dir: Path, lengths, clients, streams, prompt: int, new_tokens: int,
                  progress, max_cell_tokens: int = MAX_CELL_TOKENS, only: str | None = None) -> list[Path]:
    """only: "embeddings" or "completions" measures that route and keeps the other's rows of the last run."""
    folders = make_folders(work, progress)
    env, cells = environment(bandwidth=True), []
    if only == "completions":  # the embeddings rows of the last run are kept
        cells += [LoadCell(**c) for c in _last_cells(out_dir) if c["route"] == "embeddings"]
    for length in (lengths if only != "completions" else ()):  # a fresh server per length: a cell's peak is not an earlier, larger batch's arena
        runnable = [c for c in clients if length * c * REQUESTS_PER_CLIENT <= max_cell_tokens]
        cells += [LoadCell("ours", "embeddings", length, c, note=f"skipped: more than {max_cell_tokens} tokens in "
                           "the cell (--max-cell-tokens)") for c in clients if c not in runnable]
        if runnable:
            cells += _served(work, folders["jina-v2-base"], "jina-v2-base", (), progress, [
                (f"embeddings: {length} tokens, {c} clients", LoadCell("ours", "embeddings", length, c),
                 lambda server, client, model, vocab, c=c: embed_cell(server, client, model, length, c, vocab))
                for c in runnable])
    if only == "embeddings":
        cells += [LoadCell(**c) for c in _last_cells(out_dir) if c["route"] == "completions"]
        streams = ()
    slots = ("--slots", str(max(streams, default=1)))  # every stream decodes at once
    cells += [] if not streams else _served(work, folders["bloom-560m"], "bloom-560m", slots, progress, [
        (f"completions: bloom-560m, {s} streams", LoadCell("ours", "completions", prompt, s, note="bloom-560m"),
         lambda server, client, model, vocab, s=s: completion_cell(server, client, model, "bloom-560m", s, vocab,
                                                                   prompt, new_tokens))
        for s in streams])
    missing = peers_missing()
    data = {"environment": env, "cells": [asdict(c) for c in cells], "peers": missing}
    return write_results(out_dir, "serve", data, render(cells, env, missing))


def _last_cells(out_dir: Path) -> list[dict]:
    import json

    path = Path(out_dir) / "serve.json"
    return json.loads(path.read_text()).get("cells", []) if path.is_file() else []


def _served(work: Path, folder: Path, name: str, options, progress, jobs) -> list[LoadCell]:
    """One server of `folder` for `jobs` (label, the cell if it fails, measure(server, client, model, vocab))."""
    import json

    import openai

    from ..serve.process import ServeProcess

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    progress(f"starting serve {folder.name}")
    server = ServeProcess(folder, *options, log=work / f"{name}-serve.log")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=3600)
    cells = []
    try:
        for label, empty, measure in jobs:
            progress(label)
            cells.append(_guarded(lambda: measure(server, client, folder.name, vocab), empty))
    finally:
        server.stop()
    return cells


def _guarded(measure, empty: LoadCell) -> LoadCell:
    try:
        return measure()
    except Exception as err:  # noqa: BLE001 - a failed cell is its row, the run goes on
        empty.note = f"failed: {one_line(str(err) or type(err).__name__)}"
        return empty

"""benchmarks/serve.md: `serve` under bounded load on loopback, one run, side by side.

    embeddings   a jina-v2-base-shaped folder (published configuration, random weights): C concurrent
                 clients each sending one input of L token ids at a time; requests/s, p50/p99
                 latency, the peak resident memory of the whole server (its process tree: Ray, the
                 proxy, the replicas), sampled every 0.25 s
    completions  a BLOOM-560m-shaped folder: S concurrent streams, each a P-token prompt and N new
                 tokens (greedy, streamed); tokens/s overall and per stream, time to first token
                 p50/p99, peak resident memory

Every server is sent the same texts (peers/servers.text_of_tokens: exactly the cell's tokens under
the folder's tokenizer; a new text per request, so no server reuses a cached prefix). The peers
(infinity-emb; llama-cpp-python's OpenAI server, for embeddings too; peers/servers.py) are rows where they are
installed; elsewhere the row says what is missing. `python -m posbias_export bench-serve --work DIR`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..environment import describe, environment
from ..serve.process import ServeProcess
from ..peers import servers as peers
from .harness import md_table, one_line, write_results

COMMAND = "python -m posbias_export bench-serve"
JINA_BASE = dict(vocab=30528, hidden=768, heads=12, layers=12, max_len=8192)  # jina-embeddings-v2-base-en
EMBED_LENGTHS, EMBED_CLIENTS = (512, 2048, 8192), (1, 8, 32)
STREAMS, PROMPT, NEW_TOKENS = (1, 4, 16), 512, 128
DECODERS = ("bloom-560m", "mpt-1b")  # published configurations (hf/published.py), random weights
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
    token_s: list[float] = field(default_factory=list)  # completions: a stream's seconds per token after its first
    tokens: int = 0  # completion tokens made
    peak_rss: int = 0
    peak_pss: int = 0  # peak_rss less the pages shared between the tree's processes (process.py)
    peak_cgroup: int | None = None  # the server's memory cgroup's peak, where one could be made (peers/cgroup.py)
    note: str = ""
    read_gbs: float | None = None  # the read bandwidth measured in the run that measured this cell

    def pct(self, q: float) -> float | None:
        return float(np.percentile(self.latencies, q)) if self.latencies else None

    @property
    def rate(self) -> float | None:  # requests/s (embeddings) or tokens/s (completions)
        done = self.tokens if self.route == "completions" else self.requests
        return done / self.wall_s if self.wall_s and done else None


def peers_missing() -> dict[str, str]:
    """Each peer server's row: why it did not run here ("" where it can)."""
    return {"infinity-emb": peers.infinity_missing(), "llama.cpp server": peers.llama_missing()}


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


def _texts(tokenizer: Path, length: int, count: int) -> list[str]:
    """`count` different texts of `length` tokens each (the same for every server of a cell)."""
    return [peers.text_of_tokens(tokenizer, length, seed=length * 1000 + k) for k in range(count)]


def embed_cell(server, client, model: str, label: str, length: int, clients: int, tokenizer: Path) -> LoadCell:
    cell = LoadCell(label, "embeddings", length, clients)
    texts = _texts(tokenizer, length, clients * REQUESTS_PER_CLIENT)

    def one():
        t = time.perf_counter()
        client.embeddings.create(model=model, input=[texts.pop()])
        return time.perf_counter() - t, 0

    server.sample_peak()
    _load(cell, one, len(texts))
    cell.peak_rss, cell.peak_pss, cell.peak_cgroup = server.stop_sampling()
    return cell


def completion_cell(server, client, model: str, label: str, name: str, streams: int, tokenizer: Path, prompt: int,
                    new_tokens: int) -> LoadCell:
    cell = LoadCell(label, "completions", prompt, streams, note=name)
    texts = _texts(tokenizer, prompt, streams)

    def one():
        text = texts.pop()
        t, first, made, chunks = time.perf_counter(), None, 0, 0
        for event in client.completions.create(model=model, prompt=text, max_tokens=new_tokens, temperature=0,
                                               stream=True):
            first = first or time.perf_counter() - t
            made = event.usage.completion_tokens if event.usage else made
            # a server without usage in its stream (llama.cpp's): a chunk a token, the closing one empty
            chunks += bool(event.choices and (event.choices[0].text or event.choices[0].finish_reason is None))
        made = made or chunks
        if first is not None and made > 1:
            cell.token_s.append((time.perf_counter() - t - first) / (made - 1))
        return first or time.perf_counter() - t, made

    server.sample_peak()
    _load(cell, one, streams)
    cell.peak_rss, cell.peak_pss, cell.peak_cgroup = server.stop_sampling()
    return cell


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(cells: list[LoadCell], env: dict, missing: dict[str, str], models: dict | None = None) -> str:
    embed = [c for c in cells if c.route == "embeddings"]
    comp = [c for c in cells if c.route == "completions"]
    lines = [f"<!-- generated by: {COMMAND} -->", "# serve under load: embeddings and completions on loopback", "",
             "`python -m posbias_export serve` on this machine (one replica, ONNX Runtime's default threads) and the "
             "peer servers on the same weights, one at a time, driven by the `openai` client from threads of this "
             "process with the same texts. Peak memory: the server's whole process tree (for ours: Ray's processes, "
             "the HTTP proxy, the replica). Peak RSS: the sum of each process's resident high-water mark over the "
             "cell (the kernel's, reset at its start: nothing samples the server while it works), an upper bound "
             "of the tree at any one moment. Peak PSS: that less the pages the tree's processes share (RSS - PSS "
             "at the cell's end), which RSS counts once in every process that maps them. Peak cgroup: the peak of "
             "the server's own memory cgroup (peers/cgroup.py, where this machine lets us make one), each page "
             "once, its page cache included: what a container's memory limit counts.",
             describe(env), "", "## Embeddings (jina-v2-base-shaped, float32, text inputs)", ""]
    lines += md_table(["server", "tokens", "clients", "requests", "requests/s", "p50 s", "p99 s", "peak RSS GB",
                       "peak PSS GB", "peak cgroup GB", "note"],
                      [[c.server, c.length, c.clients, c.requests, _ms(c.rate), _ms(c.pct(50)), _ms(c.pct(99)),
                        _gb(c.peak_rss), _gb(c.peak_pss), _gb(c.peak_cgroup), c.note] for c in embed])
    lines += ["", "## Completions (streamed, greedy)", ""]
    lines += md_table(["server", "model", "prompt", "streams", "tokens", "tokens/s", "per stream tokens/s",
                       "TTFT p50 s", "TTFT p99 s", "s/token after the first, p50", "peak RSS GB", "peak PSS GB",
                       "peak cgroup GB"],
                      [[c.server, c.note, c.length, c.clients, c.tokens, _ms(c.rate),
                        _ms(c.rate / c.clients if c.rate else None), _ms(c.pct(50)), _ms(c.pct(99)),
                        f"{np.median(c.token_s):.3f}" if c.token_s else "-", _gb(c.peak_rss), _gb(c.peak_pss),
                        _gb(c.peak_cgroup)]
                       for c in comp])
    lines += _floors(comp, env, models or {})
    ran = {c.server for c in cells if c.requests}  # rows kept from an earlier run count: they are above
    lines += ["", "Peers:", ""] + [f"- {peer}: {'ran (rows above)' if peer in ran else why or 'no rows'}"
                                   for peer, why in missing.items()]
    lines += ["", "## Targets", ""] + md_table(["target", "measured", "verdict"], _verdicts(embed, comp, missing))
    return "\n".join(lines) + "\n"


def _floors(comp: list[LoadCell], env: dict, models: dict) -> list[str]:
    """One stream's decode step beside its read floor: the weights and the cache at the stream's
    mean context, read once a token at the bandwidth measured in the run that measured the step
    (rows kept by --only come from an earlier run, on a machine that may have been busier)."""
    rows = []
    for c in comp:
        facts, gbs = models.get(c.note), c.read_gbs or env.get("read_gbs")
        if c.clients != 1 or not c.token_s or not facts or not gbs:
            continue
        context = c.length + c.tokens / max(c.requests, 1) / 2
        read = facts["weight_bytes"] + facts["cache_bytes_per_token"] * context
        floor = read / (gbs * 1e9)
        step = float(np.median(c.token_s))
        rows.append([c.server, c.note, c.length, f"{read / 1e9:.2f}", f"{gbs:.1f}", f"{floor:.3f}", f"{step:.3f}",
                     f"{step / floor:.2f}x"])
    if not rows:
        return []
    return ["", "One stream's step beside its read floor (weights + cache at the mean context, at the read bandwidth "
            "measured in the step's run):", ""] + \
        md_table(["server", "model", "prompt", "GB read a token", "GB/s", "floor s", "step s", "step / floor"], rows)


def model_facts(folder: Path) -> dict:
    """What a decoder folder's step reads: its file's bytes (graph and tensors) and the cache's
    bytes a token (keys and values, every layer, float32)."""
    import json

    config = json.loads((folder / "config.json").read_text())
    hidden = config.get("hidden_size") or config.get("n_embed") or config["d_model"]
    layers = config.get("n_layer") or config.get("num_hidden_layers") or config["n_layers"]
    weights = sum(f.stat().st_size for f in folder.glob("model.onnx*"))
    return {"weight_bytes": weights, "cache_bytes_per_token": 2 * layers * hidden * 4}


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}" if n else "-"


def _verdicts(embed, comp, missing) -> list[list[str]]:
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def rate(cells, server, clients, length=None, model=None):
        found = [c for c in cells if c.server == server and c.clients == clients and c.rate
                 and (length is None or c.length == length) and (model is None or c.note == model)]
        return found[0].rate if found else None

    rows = []
    for model in dict.fromkeys(c.note for c in comp if c.server == "ours"):
        prompt = next((c.length for c in comp if c.note == model and c.clients == 16), PROMPT)
        one, sixteen = rate(comp, "ours", 1, prompt, model), rate(comp, "ours", 16, prompt, model)
        if one and sixteen:
            rows.append([f"completions ({model}): 16 streams >= {TARGETS['streams']:.0f}x the tokens/s of 1",
                         f"{sixteen / one:.2f}x", met(sixteen / one >= TARGETS["streams"])])
        peer = rate(comp, "llama.cpp server", 16, prompt, model)
        rows.append([f"completions ({model}) at 16 streams >= llama.cpp's server",
                     f"{sixteen:.2f} vs {peer:.2f} tokens/s" if sixteen and peer else "-",
                     met(sixteen >= peer) if sixteen and peer else "not run: " + (missing["llama.cpp server"] or "no rows")])
    long = [c for c in embed if c.server == "ours" and c.length == 8192 and c.requests]
    if long:  # judged on the cgroup's peak where measured (each page once), else on the summed RSS
        peak, pss = max(c.peak_rss for c in long) / 1e9, max(c.peak_pss for c in long) / 1e9
        group = max(c.peak_cgroup or 0 for c in long) / 1e9
        rows.append([f"embeddings at 8192 tokens: server RSS <= {TARGETS['embed_gb']:.0f} GB",
                     (f"{group:.2f} GB in its cgroup (summed RSS {peak:.2f}, PSS {pss:.2f})" if group else
                      f"{peak:.2f} GB (PSS {pss:.2f} GB)"), met((group or peak) <= TARGETS["embed_gb"])])
    pairs = [(c.clients, c.rate, rate(embed, "infinity-emb", c.clients, 512)) for c in embed
             if c.server == "ours" and c.length == 512 and c.rate]
    pairs = [(n, ours, theirs) for n, ours, theirs in pairs if theirs]
    rows.append(["embeddings at 512 tokens >= infinity-emb's requests/s",
                 ", ".join(f"{n} clients {ours:.2f} vs {theirs:.2f}" for n, ours, theirs in pairs) or "-",
                 met(all(ours >= theirs for _, ours, theirs in pairs)) if pairs else
                 "not run: " + (missing["infinity-emb"] or "no rows")])
    return rows


def make_folders(work: Path, progress, decoders=DECODERS) -> dict[str, Path]:
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
    for name in decoders:
        served = work / f"{name}-served"
        if not (served / "model.onnx").is_file():
            from ..hf.published import published_folder

            source = published_folder(name, work, progress=progress)
            progress(f"writing {name}'s --out-dir folder (the in-place cache)")
            if not (source / "tokenizer.json").is_file():
                save_tokenizer(source)  # random texts of exact token counts: any byte-level tokenizer does
            ship(source, served, check_growth=False)
        folders[name] = served
    return folders


def run_and_write(work: Path, out_dir: Path, lengths, clients, streams, prompt: int, new_tokens: int,
                  progress, max_cell_tokens: int = MAX_CELL_TOKENS, only: str | None = None,
                  decoders=DECODERS) -> list[Path]:
    """only: "embeddings" or "completions" measures that route's cells asked for and keeps every
    other row of the last run (so `--only embeddings --lengths 512` re-measures those cells alone)."""
    folders = make_folders(work, progress, decoders if only != "embeddings" else ())
    env, cells, missing = environment(bandwidth=True), [], peers_missing()
    jina = folders["jina-v2-base"]
    embed_servers = {"ours": lambda: ServeProcess(jina, log=work / "jina-v2-base-serve.log")}
    if not missing["infinity-emb"]:
        embed_servers["infinity-emb"] = lambda: peers.infinity_server(jina, work, jina.name)
    if not missing["llama.cpp server"]:  # the GGUF of the folder the served one was shipped from
        embed_servers["llama.cpp server"] = lambda: peers.llama_embedding_server(
            work / "jina-v2-base", jina, work, progress, JINA_BASE["max_len"])
    for length in (lengths if only != "completions" else ()):  # a fresh server per length: a cell's peak is not an earlier, larger batch's arena
        runnable = [c for c in clients if length * c * REQUESTS_PER_CLIENT <= max_cell_tokens]
        for label, start in embed_servers.items():
            cells += [LoadCell(label, "embeddings", length, c, note=f"skipped: more than {max_cell_tokens} tokens in "
                               "the cell (--max-cell-tokens)") for c in clients if c not in runnable]
            warm = _warm_embeddings(jina, length)
            cells += _served(start, label, progress, warm, [
                (f"embeddings ({label}): {length} tokens, {c} clients", LoadCell(label, "embeddings", length, c),
                 lambda server, client, c=c, label=label: embed_cell(server, client, jina.name, label, length, c,
                                                                     jina / "tokenizer.json"))
                for c in runnable]) if runnable else []
    for name in (decoders if only != "embeddings" else ()):
        cells += _completion_cells(work, name, folders[name], streams, prompt, new_tokens, missing, progress)
    for cell in cells:
        cell.read_gbs = env.get("read_gbs")
    previous, models = last_run(out_dir) if only else ([], {})
    cells = merge_cells(previous, cells)
    models.update({c.note: model_facts(folders.get(c.note) or work / f"{c.note}-served") for c in cells
                   if c.route == "completions" and (folders.get(c.note) or work / f"{c.note}-served").is_dir()})
    data = {"environment": env, "cells": [asdict(c) for c in cells], "peers": missing, "models": models}
    return write_results(out_dir, "serve", data, render(cells, env, missing, models))


def _completion_cells(work: Path, name: str, served: Path, streams, prompt: int, new_tokens: int, missing: dict,
                      progress) -> list[LoadCell]:
    """One decoder's completion cells on our server and llama-cpp-python's (its GGUF of the same weights)."""
    slots = ("--slots", str(max(streams, default=1)))  # every stream decodes at once
    servers = {"ours": lambda: ServeProcess(served, *slots, log=work / f"{name}-serve.log")}
    if not missing["llama.cpp server"]:
        servers["llama.cpp server"] = lambda: peers.llama_server(work / name, work, served.name, progress,
                                                                  prompt + new_tokens + 16)
    cells = []
    for label, start in servers.items():
        cells += _served(start, label, progress, _warm_completions(served, prompt), [
            (f"completions ({label}): {name}, {s} streams", LoadCell(label, "completions", prompt, s, note=name),
             lambda server, client, s=s, label=label: completion_cell(server, client, served.name, label, name, s,
                                                                      served / "tokenizer.json", prompt, new_tokens))
            for s in streams])
    return cells


def merge_cells(previous: list[LoadCell], measured: list[LoadCell]) -> list[LoadCell]:
    """The last run's rows with each one measured again replaced in place; new ones after."""
    def key(c):  # a completion cell's note names its model
        return c.server, c.route, c.length, c.clients, c.note if c.route == "completions" else ""

    fresh = {key(c): c for c in measured}
    merged = [fresh.pop(key(c), c) for c in previous]
    return merged + [c for c in measured if key(c) in fresh]


def last_run(out_dir: Path) -> tuple[list[LoadCell], dict]:
    """The last run's cells (each with the read bandwidth of the run that measured it) and its
    models' facts (a kept row's floor needs them when its folder is no longer in the work folder)."""
    import json

    path = Path(out_dir) / "serve.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    gbs = data.get("environment", {}).get("read_gbs")
    return [LoadCell(**{**c, "read_gbs": c.get("read_gbs") or gbs}) for c in data.get("cells", [])], data.get("models", {})


def _warm_embeddings(folder: Path, length: int):
    text = peers.text_of_tokens(folder / "tokenizer.json", length, seed=7)
    return lambda client: client.embeddings.create(model=folder.name, input=[text])


def _warm_completions(folder: Path, prompt: int):
    text = peers.text_of_tokens(folder / "tokenizer.json", prompt, seed=7)
    return lambda client: client.completions.create(model=folder.name, prompt=text, max_tokens=4, temperature=0)


def _served(start, label: str, progress, warm, jobs) -> list[LoadCell]:
    """One server (start() -> a ServerProcess) for `jobs` (title, the cell if it fails, measure(server,
    client)), after one request of the cells' shape (warm(client)): cells time a server's steady
    state, not its first run of a shape. A server that does not start fails each cell with its line."""
    import openai

    progress(f"starting {label}")
    try:
        server = start()
    except Exception as err:  # noqa: BLE001 - its rows say why
        for _, empty, _ in jobs:
            empty.note = f"failed to start: {one_line(str(err) or type(err).__name__)}"
        return [empty for _, empty, _ in jobs]
    # infinity's routes sit at the root (/embeddings); ours and llama.cpp's under /v1
    base = server.url if label == "infinity-emb" else f"{server.url}/v1"
    client = openai.OpenAI(base_url=base, api_key="-", max_retries=0, timeout=3600)
    cells = []
    try:
        progress(f"warming {label} up (one request of the cells' shape)")
        failed = _guarded(lambda: (warm(client), None)[1], LoadCell(label, "", 0, 0))
        for title, empty, measure in jobs:
            progress(title)
            if failed is not None:
                empty.note = f"warm-up {failed.note}"
            cells.append(empty if failed is not None else _guarded(lambda: measure(server, client), empty))
    finally:
        server.stop()
    return cells


def _guarded(measure, empty: LoadCell) -> LoadCell:
    try:
        return measure()
    except Exception as err:  # noqa: BLE001 - a failed cell is its row, the run goes on
        empty.note = f"failed: {one_line(str(err) or type(err).__name__)}"
        return empty

"""Servers run as their users start them, each a child process, for bench-serve and the tests.

Any server command (`ServerProcess`): started on a free loopback port, up once its health path
answers 200, stopped by SIGTERM, and the memory of its whole process tree (for ours: the driver,
Ray's processes, the replicas) read from the kernel: resident bytes (RSS, each process's pages
counted in full) and proportional bytes (PSS: a page shared by n processes counted 1/n times, so
the tree's sum is what it holds) and, where the machine lets us make one, its own memory cgroup's
peak (cgroup.py: each page once, as a container's limit counts). Ours is serve/process.py's
ServeProcess; the peers, on the same weights:

    infinity-emb      `infinity_emb v2 --engine optimum` on the served folder's onnx/model.onnx (our
                      file: infinity cannot export JinaBERT itself). Found on PATH: it pins numpy<2
                      and an older optimum, so it lives in a virtual environment of its own.
    llama.cpp server  `python -m llama_cpp.server` (llama-cpp-python's OpenAI server) on a float32
                      GGUF of the same Hugging Face folder, made by llama.cpp's converter
                      (peers/llama_cpp_runs.causal_gguf; LLAMA_CPP_CONVERTER names it), with
                      --interrupt_requests False (its default cuts a stream short when the next
                      request arrives: 4 streams of 128 tokens gave 131 tokens in all); for the
                      embedder, --embedding with a physical batch as long as the context.

Both are sent text, as ours is in the same cells: `text_of_tokens` makes a text that the folder's
tokenizer (the one each server was given) turns into exactly the cell's number of tokens.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from .cgroup import MemoryCgroup

STARTUP_S = 300  # a loaded 2-core machine starts Ray, its proxy and a replica in 60-120 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_pids(root: int) -> set[int]:
    """`root` and every process below it (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return tree


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def tree_memory(root: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of `root` and every process below it now (0 for what is unreadable)."""
    rss = pss = 0
    for pid in tree_pids(root):
        try:
            rss += _status_kb(pid, "VmRSS")
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            pss += next((int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    return rss, pss


def reset_peaks(root: int) -> None:
    """Restart each process's resident high-water mark (VmHWM) from its size now."""
    for pid in tree_pids(root):
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            continue


def tree_peak_rss(root: int) -> int:
    """The sum of each process's resident high-water mark since reset_peaks: an upper bound of the
    tree's resident size at any one moment (its processes may peak at different times)."""
    total = 0
    for pid in tree_pids(root):
        try:
            total += _status_kb(pid, "VmHWM")
        except (OSError, ValueError, IndexError):
            continue
    return total


class ServerProcess:
    """A server command as a child process, up once `health` answers 200 on its port."""

    name = "server"

    def __init__(self, command: list[str], port: int, log: Path, health: str = "/health", cwd: Path | None = None,
                 env: dict | None = None, name: str | None = None):
        self.name = name or self.name
        self.port, self.log, self.url = port, log, f"http://127.0.0.1:{port}"
        self.cgroup = MemoryCgroup.make(f"posbias-serve-{os.getpid()}-{port}")
        self.process = subprocess.Popen(self.cgroup.wrap(command) if self.cgroup else command,
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=cwd,
                                        env={**os.environ, **(env or {})})
        self.peak = self.peak_pss = 0
        self.peak_cgroup: int | None = None
        deadline = time.time() + STARTUP_S
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.process.returncode}: {self.tail()}")
            if self.status(health) == 200:
                return
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"{self.name} was not up in {STARTUP_S} s: {self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def sample_peak(self) -> None:
        """From now until stop_sampling(): the tree's peak memory, from the kernel's per-process
        resident high-water marks, reset now and read at the end. Nothing samples in between: on
        2 cores reading the replica's memory map every 0.25 s slowed a 512-token embedding from
        1.4 to 2.0 s, and every 2 s still to 1.6 s (the reads hold the lock its allocations take)."""
        reset_peaks(self.process.pid)
        if self.cgroup:
            self.cgroup.reset()

    def stop_sampling(self) -> tuple[int, int, int | None]:
        """(peak RSS, peak PSS, the cgroup's peak or None) since sample_peak(). PSS has no
        high-water mark: it is estimated as the peak RSS less the pages the tree's processes share
        (RSS - PSS at the end, counted in each process that maps them)."""
        self.peak = tree_peak_rss(self.process.pid)
        rss, pss = tree_memory(self.process.pid)
        self.peak_pss = max(0, self.peak - (rss - pss))
        self.peak_cgroup = self.cgroup.peak() if self.cgroup else None
        return self.peak, self.peak_pss, self.peak_cgroup

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: RuntimeError)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError(f"{self.name} did not stop in {timeout} s after SIGTERM") from None
        finally:
            if self.cgroup:
                self.cgroup.remove()

INFINITY = "infinity_emb"
# what infinity reads beside the model (its sentence-transformers pooling included)
INFINITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "modules.json", "sentence_bert_config.json",
                  "special_tokens_map.json")


def infinity_missing() -> str:
    return "" if shutil.which(INFINITY) else "not installed (pip install 'infinity-emb[optimum,server]' in a venv of its own)"


def llama_missing() -> str:
    from .llama_cpp_runs import missing

    why = missing()
    return f"{why} (pip install 'llama-cpp-python[server]' builds llama.cpp from source)" if why else ""


def infinity_view(served: Path, work: Path) -> Path:
    """A folder infinity can load: it takes the last *.onnx it finds under its model folder (ours
    has three: model.onnx, onnx/model.onnx, the Triton copy) and hands optimum a name relative to
    it, so the view holds one linked model.onnx beside the folder's config and tokenizer files."""
    view = work / f"{served.name}-infinity"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for name in INFINITY_FILES:
        if (served / name).is_file():
            shutil.copy2(served / name, view / name)
    for folder in served.glob("1_Pooling"):
        shutil.copytree(folder, view / folder.name)
    (view / "model.onnx").symlink_to((served / "onnx" / "model.onnx").resolve())
    return view


def infinity_server(served: Path, work: Path, name: str) -> ServerProcess:
    """infinity-emb on the folder's file, CPU, its default batch size, no warm-up (its warm-up
    times a batch at the model's longest length: many minutes at 8192 tokens on 2 cores)."""
    view, port = infinity_view(served, work), free_port()
    return ServerProcess([shutil.which(INFINITY), "v2", "--model-id", ".", "--served-model-name", name,
                          "--engine", "optimum", "--device", "cpu", "--port", str(port), "--no-model-warmup"],
                         port, work / f"{name}-infinity.log", cwd=view, name="infinity-emb",
                         env={"HF_HOME": str(work / "hf-home"), "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
                              "INFINITY_ANONYMOUS_USAGE_STATS": "0"})


def llama_server(hf_folder: Path, work: Path, name: str, progress, context: int) -> ServerProcess:
    """llama-cpp-python's OpenAI server on the folder's float32 GGUF (converted once into `work`),
    with a context of `context` tokens (a prompt and its new tokens)."""
    from .llama_cpp_runs import causal_gguf

    gguf = work / f"{name}-f32.gguf"
    if not gguf.is_file():
        progress(f"converting {hf_folder.name} to GGUF (llama.cpp's converter, f32)")
        causal_gguf(hf_folder, gguf, "float32")
    # its default stops a stream when another request arrives: under concurrent load each request
    # then ends after a few tokens; off, they queue and finish
    return _llama_process(gguf, name, work, context, "--interrupt_requests", "False")


def llama_embedding_server(hf_folder: Path, served: Path, work: Path, progress, context: int) -> ServerProcess:
    """llama-cpp-python's OpenAI server with embeddings on the float32 GGUF of the JinaBERT folder
    `served` was shipped from (converted once into `work`, pooled as `served`), its context and
    physical batch both `context` tokens: llama.cpp embeds an input in one batch, so a server that
    takes the model's longest input is set so."""
    from .llama_cpp_runs import bpe_embedder_gguf

    name = served.name
    gguf = work / f"{name}-f32.gguf"
    if not gguf.is_file():
        progress(f"converting {hf_folder.name} to GGUF (llama.cpp's converter, f32)")
        bpe_embedder_gguf(hf_folder, gguf, served)
    return _llama_process(gguf, name, work, context, "--embedding", "True", "--n_batch", str(context),
                          "--n_ubatch", str(context))


def _llama_process(gguf: Path, name: str, work: Path, context: int, *options: str) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", name,
                          "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context),
                          "--n_threads", str(os.cpu_count() or 1), *options],
                         port, work / f"{name}-llama-server.log", health="/v1/models", name="llama.cpp server")


def text_of_tokens(tokenizer_json: Path, tokens: int, seed: int) -> str:
    """A text the tokenizer turns into exactly `tokens` ids (ValueError if no prefix of the random
    text does): random lowercase words, the longest prefix (in characters) with that many."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = [("".join(rng.choice(letters, rng.integers(2, 9)))) for _ in range(tokens * 2)]
    text = " ".join(words)

    def count(chars: int) -> int:
        return len(tokenizer.encode(text[:chars]).ids)

    low, high = 0, len(text)  # binary search on the prefix length: the count grows with it
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) <= tokens else (low, mid - 1)
    if count(low) != tokens:
        raise ValueError(f"no prefix of the text makes exactly {tokens} tokens")
    return text[:low]

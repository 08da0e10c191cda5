"""The servers bench-serve runs beside ours, on the same weights, each started as its users start it.

    infinity-emb      `infinity_emb v2 --engine optimum` on the served folder's onnx/model.onnx (our
                      file: infinity cannot export JinaBERT itself). Found on PATH: it pins numpy<2
                      and an older optimum, so it lives in a virtual environment of its own.
    llama.cpp server  `python -m llama_cpp.server` (llama-cpp-python's OpenAI server) on a float32
                      GGUF of the same Hugging Face folder, made by llama.cpp's converter
                      (peers/llama_cpp_runs.causal_gguf; LLAMA_CPP_CONVERTER names it), with
                      --interrupt_requests False (its default cuts a stream short when the next
                      request arrives: 4 streams of 128 tokens gave 131 tokens in all).

Both are sent text, as ours is in the same cells: `text_of_tokens` makes a text that the folder's
tokenizer (the one each server was given) turns into exactly the cell's number of tokens.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np

from ..serve.process import ServerProcess, free_port

INFINITY = "infinity_emb"
# what infinity reads beside the model (its sentence-transformers pooling included)
INFINITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "modules.json", "sentence_bert_config.json",
                  "special_tokens_map.json")


def infinity_missing() -> str:
    return "" if shutil.which(INFINITY) else "not installed (pip install 'infinity-emb[optimum,server]' in a venv of its own)"


def llama_missing() -> str:
    from ..peers.llama_cpp_runs import missing

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
    from ..peers.llama_cpp_runs import causal_gguf

    gguf = work / f"{name}-f32.gguf"
    if not gguf.is_file():
        progress(f"converting {hf_folder.name} to GGUF (llama.cpp's converter, f32)")
        causal_gguf(hf_folder, gguf, "float32")
    port = free_port()
    return ServerProcess([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", name,
                          "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context),
                          "--n_threads", str(os.cpu_count() or 1),
                          # its default stops a stream when another request arrives: under concurrent
                          # load each request then ends after a few tokens; off, they queue and finish
                          "--interrupt_requests", "False"],
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

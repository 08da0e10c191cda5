"""llama.cpp beside our files: the CPU engine people pick instead of ONNX Runtime. A model folder
becomes a GGUF through llama.cpp's own converter (convert_hf_to_gguf.py, which pip's
llama-cpp-python does not install: LLAMA_CPP_CONVERTER names it, e.g. the one in the
llama-cpp-python sdist under vendor/llama.cpp/), and llama-cpp-python runs it, timed as our
files are (eager_runs.py, ort_runs.py).

    python -m posbias_export.peers.llama_cpp_runs embed MODEL.gguf LENGTH BATCH RUNS  -> {"times": [s]}

A causal LM (bench-serving's llama.cpp rows) is converted at float32 (f32) or Q8_0 by the
converter, and to Q4_0 from the f32 file by llama.cpp's own quantizer (llama_model_quantize,
which llama-cpp-python binds); `causal_steps` makes its decode steps for eager_runs.timed_greedy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONVERTER_ENV = "LLAMA_CPP_CONVERTER"
# BERT's special ids, which llama.cpp's WordPiece vocabulary assumes ([CLS] 101, [SEP] 102)
BERT_SPECIAL = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}
FIRST_WORD, WORDS = 104, 96  # the words a run sends: w104 ... w199 (each one id)
# The converter names a WordPiece vocabulary's pre-tokenizer by hashing how its tokenizer splits a
# test string, and knows only the published tokenizers; ours is made here, so it is named as
# jina-embeddings-v2-base-en's (the ids a run sends do not depend on it: one word, one id).
_CONVERT = """import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import conversion.base as base
owner = next(c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c))
pre = sys.argv[2]  # read now: sys.argv is the converter's below
owner.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [str(script), *sys.argv[3:]]
runpy.run_path(str(script), run_name="__main__")
"""


def missing() -> str | None:
    """Why llama.cpp cannot be measured here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not importable (pip install llama-cpp-python)"
    script = os.environ.get(CONVERTER_ENV)
    if not script or not Path(script).is_file():
        return (f"{CONVERTER_ENV} does not name llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python sdist has "
                "it under vendor/llama.cpp/)")
    return None


def write_wordpiece_vocab(folder: Path, vocab: int) -> None:
    """vocab.txt and tokenizer_config.json for a random-weight BERT folder: BERT's special ids,
    every other id a word of its own (w<id>), so a text of n words is n ids plus [CLS] and [SEP]."""
    (folder / "vocab.txt").write_text("\n".join(BERT_SPECIAL.get(i, f"w{i}") for i in range(vocab)) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))


# a causal LM's pre-tokenizer as llama.cpp names it (the folder's tokenizer is one made here)
CAUSAL_PRE_TOKENIZERS = {"bloom": "bloom", "mpt": "mpt", "falcon": "falcon"}
# architectures the converter knows by another name: transformers' MPT port keeps MosaicML's
# config keys and tensor names, but the converter registers only the remote-code class name
CONVERTER_NAMES = {"MptForCausalLM": "MPTForCausalLM"}
# bench-serving's scheme -> the GGUF type of the same bit width (Q4_0: blocks of 32 with one
# float16 scale, as our int4's block 32; Q8_0 likewise)
GGUF_TYPES = {"float32": "f32", "int8": "q8_0", "int4": "q4_0"}


def to_gguf(folder: Path, out: Path, pre_tokenizer: str = "jina-v2-en", outtype: str = "f32") -> Path:
    """llama.cpp's converter on `folder` (float32 as our files are; a folder without a tokenizer gets
    write_wordpiece_vocab's); RuntimeError with its last line."""
    if not (folder / "tokenizer_config.json").is_file():
        write_wordpiece_vocab(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    return _convert(folder, out, pre_tokenizer, outtype)


def causal_gguf(folder: Path, out: Path, scheme: str) -> Path:
    """The GGUF of a causal LM folder at the scheme's bit width (GGUF_TYPES): a folder without a
    tokenizer gets a small byte-level BPE one (the converter pads the vocabulary to the model's
    with unused tokens; runs send ids, not text); q4_0 quantized from a temporary f32 file."""
    from ..hf.tiny import save_tokenizer

    config = json.loads((folder / "config.json").read_text())
    if not (folder / "tokenizer.json").is_file():
        save_tokenizer(folder, vocab=300)
    pre = CAUSAL_PRE_TOKENIZERS[config["model_type"]]
    kind = GGUF_TYPES[scheme]
    names = [CONVERTER_NAMES.get(a, a) for a in config.get("architectures") or []]
    if names != (config.get("architectures") or []):
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.folder-") as view:
            return causal_gguf(_renamed(folder, Path(view), names), out, scheme)
    if kind != "q4_0":
        return _convert(folder, out, pre, kind)
    whole = _convert(folder, out.with_name(out.name + ".f32"), pre, "f32")
    try:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        if llama_cpp.llama_model_quantize(str(whole).encode(), str(out).encode(), params) != 0 or not out.is_file():
            raise RuntimeError(f"llama.cpp's quantizer failed on {whole.name}")
    finally:
        whole.unlink(missing_ok=True)
    return out


def bpe_embedder_gguf(folder: Path, out: Path, served: Path) -> Path:
    """The float32 GGUF of a JinaBERT folder whose tokenizer is byte-level BPE (hf/tiny.save_tokenizer,
    as bench-serve's folder has): llama.cpp's converter takes a BPE JinaBERT as jina-v2-code's, whose
    tokenizer config names RobertaTokenizer, so a view of the folder says that; the same texts then
    make the same ids in llama.cpp as in the folder's tokenizer.json (RobertaTokenizer adds <unk> and
    <mask> after them: the embedding table needs two rows past the tokenizer's). The pooling is read from the
    served folder's sentence-transformers files (without them llama.cpp answers every token's vector)."""
    pooling = ("modules.json", "1_Pooling", "sentence_bert_config.json")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.folder-") as view:
        for item in [*folder.iterdir(), *(served / name for name in pooling if (served / name).exists())]:
            if item.name != "tokenizer_config.json" and not (Path(view) / item.name).exists():
                (Path(view) / item.name).symlink_to(item.resolve())
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (Path(view) / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "RobertaTokenizer"}))
        return _convert(Path(view), out, "jina-v2-code", "f32")


def _renamed(folder: Path, view: Path, architectures: list[str]) -> Path:
    """`view` made the folder with its config's architectures renamed: every other file linked."""
    for item in folder.iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item.resolve())
    config = json.loads((folder / "config.json").read_text())
    (view / "config.json").write_text(json.dumps({**config, "architectures": architectures}, indent=2))
    return view


def _convert(folder: Path, out: Path, pre_tokenizer: str, outtype: str) -> Path:
    done = subprocess.run([sys.executable, "-c", _CONVERT, os.environ[CONVERTER_ENV], pre_tokenizer, str(folder),
                           "--outfile", str(out), "--outtype", outtype], capture_output=True, text=True)
    if done.returncode or not out.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"llama.cpp's converter failed: {lines[-1] if lines else done.returncode}")
    return out


def texts(length: int, batch: int) -> list[str]:
    """The texts a run embeds: `batch` rows of `length` tokens with [CLS] and [SEP], rows after the
    first shorter down to half (runtimes/common/inputs.padded_batch's lengths)."""
    words = [f"w{FIRST_WORD + i % WORDS}" for i in range(length - 2)]
    return [" ".join(words[:length - row * length // (2 * batch) - 2]) for row in range(batch)]


def embed_forward(model: str, length: int, batch: int, threads: int = 2, runs: int = 2) -> dict:
    """llama.cpp's embedding of the texts: one context as long as the longest row, every row in one
    batch, flash attention on (llama.cpp's own default on a CPU that has it); the last run timed."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, embedding=True, n_ctx=length * batch, n_batch=length * batch,
                          n_ubatch=length * batch, n_threads=threads, n_threads_batch=threads, flash_attn=True,
                          n_seq_max=batch, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)
    rows = texts(length, batch)
    for _ in range(runs):
        start = time.perf_counter()
        llm.embed(rows if batch > 1 else rows[0], normalize=False)
    return {"times": [time.perf_counter() - start]}


def causal_steps(model: str, capacity: int, threads: int = 1):
    """make_step (eager_runs.timed_greedy) for a causal GGUF: a llama.cpp context of `capacity`
    tokens whose cache it keeps; step(ids [1, n], mask) -> the last position's logits [1, 1, V]
    (the mask is all ones in these runs: llama.cpp keeps its own positions)."""
    import llama_cpp
    import numpy as np

    def make_step():
        llm = llama_cpp.Llama(model_path=model, n_ctx=capacity, n_batch=512, n_ubatch=512, n_threads=threads,
                              n_threads_batch=threads, verbose=False)

        vocab = llm.n_vocab()

        def step(ids, mask):
            llm.eval([int(i) for i in ids[0]])  # logits of the batch's last token only, as a server asks
            last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return np.ctypeslib.as_array(last, shape=(vocab,)).copy()[None, None]
        return step
    make_step.ran_on = "llama.cpp CPU"
    return make_step


if __name__ == "__main__":
    _, _, model, length, batch, runs = sys.argv  # embed MODEL LENGTH BATCH RUNS
    print(json.dumps(embed_forward(model, int(length), int(batch), runs=int(runs))))

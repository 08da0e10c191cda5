"""transformers eager on a model folder, the baseline our files are timed against (bench-real,
bench-quant, bench-serving, the GPU decode lease): greedy decoding with its own cache, a
seq2seq folder's encoder forward and greedy decoding with its cache (the folder's own classes),
and our own module of an imported folder, where no installable implementation exists
(JinaBERT: bench-embed). One timed loop (`timed_greedy`) runs these and our
files alike, so both sides are measured the same way.
"""
from __future__ import annotations

import resource
import time

import numpy as np


def prompt_ids(length: int, vocab: int = 30000) -> np.ndarray:
    """The prompt every runner gets: random ids of a vocabulary's common range, seed 0."""
    return np.random.default_rng(0).integers(10, 30000, (1, length)).astype(np.int64) % vocab


def timed_greedy(make_step, ids: np.ndarray, new_tokens: int, warmup: bool = False) -> dict:
    """make_step() -> step(ids [1, n], mask [1, total]) -> logits [1, n | 1, V] (numpy or torch),
    its cache kept inside. A prefill of `ids`, then `new_tokens` greedy steps, each timed up to its
    token on the host (a GPU step is finished then), in wall time and in the calling thread's CPU
    time (`decode_cpu_ms`: with one thread, ONNX Runtime and llama.cpp both compute on the caller,
    so it is the step's work without the waits of a loaded machine). warmup: a fresh step's
    8-token prefill first."""
    if warmup:
        make_step()(ids[:, :8], np.ones_like(ids[:, :8]))
    step, mask = make_step(), np.ones_like(ids)
    start = time.perf_counter()
    token = int(step(ids, mask)[0, -1].argmax())
    prefill = time.perf_counter() - start
    prefill_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # GB, before any decode step
    tokens, times, cpu = [], [], []
    for _ in range(new_tokens):
        tokens.append(token)
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], 1)
        start, start_cpu = time.perf_counter(), time.thread_time()
        token = int(step(np.array([[token]], np.int64), mask)[0, -1].argmax())
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return {"prefill_s": prefill, "prefill_peak_gb": prefill_peak, "decode_ms": [1e3 * t for t in times],
            "decode_cpu_ms": [1e3 * t for t in cpu], "tokens": tokens}


def device_peak(device: str) -> dict:
    """{"device_peak_gb": what PyTorch allocated at most on the GPU} where it ran there, else {}."""
    import sys

    torch = sys.modules.get("torch")
    if device != "cuda" or torch is None or not torch.cuda.is_initialized():
        return {}
    return {"device_peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def _torch(threads: int | None):
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch


def _causal_lm(folder: str, device: str, dtype: str):
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()


def causal_lm_steps(folder: str, device: str = "cpu", dtype: str = "float32", threads: int | None = None):
    """make_step for timed_greedy: AutoModelForCausalLM with its cache (DynamicCache)."""
    torch = _torch(threads)
    model = _causal_lm(folder, device, dtype)

    def make_step():
        past = [None]

        @torch.no_grad()
        def step(ids, mask):
            out = model(input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device),
                        past_key_values=past[0], use_cache=True)
            past[0] = out.past_key_values
            return out.logits[:, -1:]
        return step
    return make_step


def generate_timed(folder: str, ids: np.ndarray, new_tokens: int, device: str = "cpu", dtype: str = "float32") -> dict:
    """`model.generate` (greedy, its cache), prefill included, after a short warm-up."""
    torch = _torch(None)
    model = _causal_lm(folder, device, dtype)
    x, kwargs = torch.from_numpy(ids).to(device), dict(do_sample=False, use_cache=True, pad_token_id=0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        model.generate(x[:, :8], max_new_tokens=4, min_new_tokens=4, **kwargs)
        sync()
        start = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync()
    return {"generate_s": time.perf_counter() - start, "tokens": [int(t) for t in out[0, ids.shape[1]:]]}


def encoder_forward(folder: str, length: int, threads: int) -> dict:
    """The folder's encoder (T5EncoderModel, UMT5EncoderModel, ...: its own class, as
    `seq2seq_encoder_class` picks it) over `length` tokens, one timed forward."""
    torch = _torch(threads)
    model = seq2seq_encoder_class(folder).from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.from_numpy(prompt_ids(length, min(32000, model.config.vocab_size)))
    with torch.no_grad():
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return {"prefill_s": time.perf_counter() - start}


def seq2seq_encoder_class(folder: str):
    """transformers' encoder-only class of a seq2seq folder's model type (UMT5EncoderModel for a
    umt5 folder: T5's would drop its per-layer bias tables), or of an encoder-only folder itself."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(folder)
    declared = (config.architectures or [""])[0]
    if declared.endswith("EncoderModel"):
        return getattr(tf, declared)
    return getattr(tf, declared.replace("ForConditionalGeneration", "EncoderModel"))


def seq2seq_greedy(folder: str, length: int, new_tokens: int, threads: int) -> dict:
    """The folder's encoder-decoder (AutoModelForSeq2SeqLM: T5, UMT5, ...): the encoder over
    `length` tokens, then greedy decoder steps with its cache (the first, without a cache yet,
    not kept: as our seq2seq runner's)."""
    import transformers as tf

    torch = _torch(threads)
    model = tf.AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.from_numpy(prompt_ids(length, min(32000, model.config.vocab_size)))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        start = time.perf_counter()
        states = model.get_encoder()(input_ids=ids, attention_mask=mask)
        prefill = time.perf_counter() - start
        token, past, times = torch.zeros(1, 1, dtype=torch.int64), None, []
        for _ in range(new_tokens):
            start = time.perf_counter()
            out = model(encoder_outputs=states, attention_mask=mask, decoder_input_ids=token, past_key_values=past,
                        use_cache=True)
            times.append(time.perf_counter() - start)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1)[:, None]
    return {"prefill_s": prefill, "decode_ms": [1e3 * t for t in times[1:]]}


def module_forward(folder: str, ids: np.ndarray, mask: np.ndarray, runs: int = 2, threads: int = 2) -> dict:
    """Our module of an imported folder (hf.models.load_model) in float32 with plain attention:
    `runs` forwards, the last one's seconds in `times`."""
    from ..nn import AttentionSettings
    from ..hf.models import load_model

    torch = _torch(threads)
    model = load_model(folder)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        for _ in range(runs):
            start = time.perf_counter()
            model(ids, mask, settings=AttentionSettings(form="plain"))
    return {"times": [time.perf_counter() - start]}


def encoder_streamed(folder: str, ids: np.ndarray, threads: int = 2) -> np.ndarray:
    """transformers' T5 / UMT5 encoder in float32 over `ids` [1, L] (unpadded) -> last_hidden_state [L, D], for a
    model larger than memory in float32 (UMT5-XXL's encoder: 23 GB): built on the meta device, each
    block's weights read from the shards just before it runs and dropped after, so one block and the
    token table are held at a time."""
    import json
    from pathlib import Path

    import transformers as tf
    from safetensors import safe_open

    torch = _torch(threads)
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.is_file() else
             {k: "model.safetensors" for k in safe_open(str(folder / "model.safetensors"), "pt").keys()})
    config = tf.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # the encoder alone, whether the folder holds it alone or with a decoder
        model = seq2seq_encoder_class(str(folder))(config).eval()

    def load(module, prefix: str) -> None:
        state = {}
        for key, file in where.items():
            if key.startswith(prefix):
                with safe_open(str(folder / file), "pt") as f:
                    state[key[len(prefix):]] = f.get_tensor(key).float()
        module.to_empty(device="cpu").load_state_dict(state, strict=True)

    load(model.shared, "shared.")
    model.encoder.embed_tokens = model.shared  # it held the meta table, now replaced
    load(model.encoder.final_layer_norm, "encoder.final_layer_norm.")
    for n, block in enumerate(model.encoder.block):
        block.register_forward_pre_hook(lambda module, _, n=n: load(module, f"encoder.block.{n}."))
        block.register_forward_hook(lambda module, *_: module.to("meta") and None)  # None: keep the output
    with torch.no_grad():
        ids = torch.from_numpy(ids)
        states = model(input_ids=ids).last_hidden_state  # no mask: every token counts (a mask would go to the meta device)
    return states[0].numpy()


def encoder_streamed_timed(folder: str, length: int, threads: int, save: str | None = None) -> dict:
    """encoder_streamed over the benches' prompt of `length` tokens, timed (its states saved as .npy)."""
    start = time.perf_counter()
    states = encoder_streamed(folder, prompt_ids(length, 32000), threads)
    if save:
        np.save(save, states)
    return {"prefill_s": time.perf_counter() - start}

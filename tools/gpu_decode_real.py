"""An imported BLOOM at its published size (random weights)
decoding on CUDA: our --kv-cache file on ONNX Runtime CUDA (the cache kept on the GPU between
steps) against PyTorch CUDA eager on the same weights (transformers' model, its cache, one step
at a time) and `transformers.generate` with its cache -> benchmarks/gpu_decode_real.md.

    python tools/gpu_decode_real.py run OUT [--name bloom-560m] [--device cuda]   # on the GPU machine
    python tools/gpu_decode_real.py write OUT                                   # here
    python tools/gpu_decode_real.py run OUT --small --device cpu                # the CPU rehearsal (tiny BLOOM)

Each of the three runs in its own process (its own CUDA context and memory). Tokens are greedy
from one random prompt; float16 runs may part ways after some steps (ties broken by rounding), so
the table gives how many leading tokens agree with transformers' eager run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path from a checkout


def prompt(length: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(10, vocab - 1, (1, length)).astype(np.int64)


def ort_worker(model: str, device: str, ids: np.ndarray, new: int) -> dict:
    from posbias_export.parity.runtimes import load_runner

    decoder = load_runner("ort/generate.py").CachedDecoder(model, device)
    mask = np.ones_like(ids)
    decoder.step_on_device(ids[:, :8], mask[:, :8], decoder.empty_cache(1))  # warm-up: kernels, arena
    start = time.perf_counter()
    logits, past = decoder.step_on_device(ids, mask, decoder.empty_cache(1))
    prefill = time.perf_counter() - start
    tokens, times = [], []
    token = logits[:, -1].argmax(-1)[:, None]
    for _ in range(new):
        tokens.append(int(token[0, 0]))
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], 1)
        start = time.perf_counter()
        logits, past = decoder.step_on_device(token, mask, past)  # logits come back to the host: a sync
        times.append(time.perf_counter() - start)
        token = logits[:, -1].argmax(-1)[:, None]
    return {"prefill_s": prefill, "decode_ms": [1e3 * t for t in times], "tokens": tokens,
            "provider": decoder.session.get_providers()[0]}


def load_model(folder: str, device: str, dtype: str):
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()


def eager_worker(folder: str, device: str, dtype: str, ids: np.ndarray, new: int) -> dict:
    import torch

    model = load_model(folder, device, dtype)
    x = torch.from_numpy(ids).to(device)
    with torch.no_grad():
        model(input_ids=x[:, :8], use_cache=True)  # warm-up
        start = time.perf_counter()
        out = model(input_ids=x, use_cache=True)
        token = out.logits[:, -1].argmax(-1)[:, None]
        int(token[0, 0])  # a sync
        prefill = time.perf_counter() - start
        past, mask, tokens, times = out.past_key_values, torch.ones_like(x), [], []
        for _ in range(new):
            tokens.append(int(token[0, 0]))
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype, device=device)], 1)
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1)[:, None]
            int(token[0, 0])
            times.append(time.perf_counter() - start)
    return {"prefill_s": prefill, "decode_ms": [1e3 * t for t in times], "tokens": tokens}


def generate_worker(folder: str, device: str, dtype: str, ids: np.ndarray, new: int) -> dict:
    import torch

    model = load_model(folder, device, dtype)
    x = torch.from_numpy(ids).to(device)
    kwargs = dict(do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        model.generate(x[:, :8], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"generate_s": seconds, "tokens": [int(t) for t in out[0, ids.shape[1]:]]}


def prepare(out: Path, name: str, device: str, small: bool) -> tuple[Path, Path, str]:
    """The folder (published configuration, random weights) and our --kv-cache file: CPU work,
    done in the background while the lease's first calls carry onnxruntime-gpu over."""
    from posbias_export.hf.published import write_folder

    work = out / "work"
    folder = work / ("bloom-tiny" if small else name)
    dtype = "float16" if device == "cuda" else "float32"
    if not folder.exists():
        if small:
            from posbias_export.hf.tiny import save_tiny_folder

            save_tiny_folder("bloom", folder)
        else:
            write_folder(name, folder, dtype=dtype)
    target = ["--dtype", "float16", "--target", "cuda-ort"] if device == "cuda" else []
    onnx_file = work / f"{folder.name}_kv.onnx"
    if not onnx_file.exists():
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "posbias_export", "--model", str(folder), "--kv-cache",
                        "--logits", "last", *target, "--out", str(onnx_file)], check=True)
        print(f"export {time.perf_counter() - started:.0f} s", flush=True)
    return folder, onnx_file, dtype


def run(out: Path, name: str, device: str, small: bool, prompt_len: int, new: int) -> None:
    from posbias_export.environment import gpu_environment

    folder, onnx_file, dtype = prepare(out, name, device, small)
    rows = {"name": folder.name, "device": device, "dtype": dtype, "prompt": prompt_len, "new_tokens": new,
            "machine": gpu_environment(), "file": onnx_file.name}
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    for kind in ("ort", "eager", "generate"):
        proc = subprocess.run([sys.executable, __file__, "worker", kind, str(onnx_file if kind == "ort" else folder),
                               device, dtype, str(prompt_len), str(new), str(vocab)],
                              capture_output=True, text=True, timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        rows[kind] = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        print(kind, json.dumps(rows[kind])[:300], flush=True)
    (out / "gpu_decode_real.json").write_text(json.dumps(rows, indent=1))


def write(out: Path, dest: Path) -> None:
    from posbias_export.environment import describe_gpu
    from posbias_export.parity.tokens import agreeing

    r = json.loads((out / "gpu_decode_real.json").read_text())
    eager = r["eager"]

    def per_token(run):
        return float(np.median(run["decode_ms"])) if run.get("decode_ms") else None

    lines = ["# An imported BLOOM decoding on the GPU: ONNX Runtime CUDA vs PyTorch CUDA eager and transformers.generate", "",
             f"Generated by `python tools/gpu_decode_real.py run OUT --name {r['name']} --device {r['device']}` on the GPU "
             f"machine, then `write`. {describe_gpu(r['machine'])} {r['name']} (published configuration, random "
             f"weights, {r['dtype']}); our file: `export --model DIR --kv-cache --logits last"
             f"{' --dtype float16 --target cuda-ort' if r['device'] == 'cuda' else ''}`; prompt {r['prompt']} tokens, "
             f"{r['new_tokens']} greedy tokens; ms per decode step (median), tokens/s = 1000 / that.", "",
             "| runner | prefill s | ms per token | tokens/s | vs eager | tokens equal to eager's (leading) |",
             "|---|---|---|---|---|---|"]
    base = per_token(eager)
    for label, key in (("ours, ONNX Runtime " + r["device"], "ort"), ("PyTorch eager, transformers' cache", "eager")):
        run = r[key]
        if "error" in run:
            lines.append(f"| {label} | error: {run['error'][:80]} | | | | |")
            continue
        ms = per_token(run)
        lines.append(f"| {label} | {run['prefill_s']:.3f} | {ms:.2f} | {1e3 / ms:.1f} | "
                     f"{(base / ms if base else float('nan')):.2f}x | {agreeing(run['tokens'], eager.get('tokens', []))} of {len(run['tokens'])} |")
    gen = r["generate"]
    if "error" in gen:
        lines.append(f"| transformers.generate | error: {gen['error'][:80]} | | | | |")
    else:
        rate = len(gen["tokens"]) / gen["generate_s"]
        lines.append(f"| transformers.generate (prefill included) | - | {1e3 / rate:.2f} | {rate:.1f} | - | "
                     f"{agreeing(gen['tokens'], eager.get('tokens', []))} of {len(gen['tokens'])} |")
    dest.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--prepare-only", action="store_true", help="the folder and the export, nothing timed")
    r.add_argument("--name", default="bloom-560m")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--small", action="store_true", help="a tiny BLOOM folder (the rehearsal)")
    r.add_argument("--prompt", type=int, default=512)
    r.add_argument("--new-tokens", type=int, default=64)
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "gpu_decode_real.md")
    k = sub.add_parser("worker")
    k.add_argument("kind", choices=("ort", "eager", "generate"))
    k.add_argument("path")
    k.add_argument("device")
    k.add_argument("dtype")
    k.add_argument("prompt", type=int)
    k.add_argument("new", type=int)
    k.add_argument("vocab", type=int)
    args = p.parse_args(argv)
    if args.part == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        if args.prepare_only:
            prepare(args.out, args.name, args.device, args.small)
        else:
            run(args.out, args.name, args.device, args.small, args.prompt, args.new_tokens)
    elif args.part == "write":
        write(args.out, args.dest)
    else:
        ids = prompt(args.prompt, args.vocab)
        fn = {"ort": lambda: ort_worker(args.path, args.device, ids, args.new),
              "eager": lambda: eager_worker(args.path, args.device, args.dtype, ids, args.new),
              "generate": lambda: generate_worker(args.path, args.device, args.dtype, ids, args.new)}[args.kind]
        print(json.dumps(fn()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A 7B float16 file on the GPU (the MPT-7B configuration exported to float16 here, 13.3 GB,
needs a GPU to run: ONNX Runtime CPU casts float16 to float32, ~53 GB). The folder cannot travel
(64 MiB a call), so the lease writes it on the GPU machine, tensor by tensor (hf/shards.py, the
same seeded bfloat16 shards as here), exports it (`--kv-cache --logits last --target ort --dtype
float16`: the in-place cache, GroupQueryAttention on CUDA), then decodes on ONNX Runtime CUDA at
each context (prefill, then greedy steps, the cache in one bound buffer) against the floor (the
file's bytes over the GPU's measured copy bandwidth) and transformers eager in float16 at the
contexts MPT's max_seq_len allows. Each stage in its own process; OUT/big.json is rewritten after
each, so a call cut at its limit keeps what finished.

    python -m posbias_export.gpu.big run OUT --work DIR [--provider cuda] [--contexts 512,4096] [--steps 16] [--tiny]
    python -m posbias_export.gpu.big write OUT        # here: benchmarks/gpu_big.md / .json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODEL = "mpt-7b"
WARM_STEPS = 3  # decode steps run before the timed ones (and their tokens compared too)
TINY = ("MptForCausalLM", "MptConfig", dict(vocab_size=1000, d_model=128, n_layers=2, n_heads=4, max_seq_len=2048,
                                            expansion_ratio=4))  # the rehearsal's stand-in: the same code paths


def run(out: Path, work: Path, provider: str, contexts: list[int], steps: int, tiny: bool) -> int:
    from posbias_export.bench.harness import ChildFailed, measured_python
    from posbias_export.bench.real_models import worker_run
    from posbias_export.hf.published import PUBLISHED
    from posbias_export.hf.shards import write_sharded

    out.mkdir(parents=True, exist_ok=True)
    result = {"model": "tiny MPT (rehearsal)" if tiny else MODEL, "provider": provider, "gpu": gpu_name(provider),
              "stages": {}}

    def stage(name: str, value) -> None:
        result["stages"][name] = value
        (out / "big.json").write_text(json.dumps(result, indent=1))
        print(f"[{time.strftime('%T')}] {name}: {json.dumps(value)[:300]}", flush=True)

    folder, path = work / MODEL, work / f"{MODEL}_float16_inplace.onnx"
    start = time.perf_counter()
    write_sharded(TINY if tiny else PUBLISHED[MODEL], folder, "bfloat16", seed=0)
    stage("folder", {"seconds": time.perf_counter() - start,
                     "gb": sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9})
    try:
        seconds, peak, _ = measured_python(["-m", "posbias_export", "--model", str(folder), "--kv-cache", "--logits",
                                            "last", "--target", "ort", "--dtype", "float16", "--out", str(path)])
    except ChildFailed as err:
        stage("export", {"error": err.reason[-300:]})
        return 1
    file_bytes = sum(p.stat().st_size for p in (path, Path(f"{path}.data")) if p.exists())
    stage("export", {"seconds": seconds, "peak_gb": peak, "file_gb": file_bytes / 1e9})
    bandwidth = read_bandwidth(provider)
    config = (TINY if tiny else PUBLISHED[MODEL])[2]
    device, dtype = ("cuda", "float16") if provider == "cuda" else ("cpu", "float32")
    stage("bandwidth", {"read_gbs": bandwidth, "file_gb": file_bytes / 1e9,
                        "floor_ms": {c: (file_bytes + cache_bytes(config, c)) / 1e9 / bandwidth * 1e3 for c in contexts}})
    for context in contexts:
        for who, args in (("ort", ["ort", path]), ("eager", ["transformers", folder])):
            if who == "eager" and context + steps + WARM_STEPS > (TINY if tiny else PUBLISHED[MODEL])[2]["max_seq_len"]:
                stage(f"{who} {context}", {"error": "past MPT's max_seq_len (2048): transformers refuses it"})
                continue
            try:  # bench-real's workers: prefill, then greedy steps, the first WARM_STEPS not timed
                got = worker_run(*args, context, steps + WARM_STEPS, 0, "--device", device, "--dtype", dtype,
                                 "--vocab", str(config["vocab_size"]), warm=WARM_STEPS)
            except ChildFailed as err:
                stage(f"{who} {context}", {"error": err.reason[-300:]})
                continue
            stage(f"{who} {context}", {**got, "host_peak_gb": got["peak_gb"], "decode_median_ms": got["decode_ms"]})
    return 0


def gpu_name(provider: str) -> str:
    if provider != "cuda":
        return "none (CPU rehearsal)"
    import torch

    return f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory >> 20} MiB)"


def read_bandwidth(provider: str) -> float:
    """GB/s the device READS (a sum over a buffer far larger than any cache): a decode step reads
    its weights and cache and writes little, so the floor divides by this, not by copy bandwidth."""
    if provider != "cuda":
        from posbias_export.environment import read_bandwidth_gbs

        return read_bandwidth_gbs()
    import torch

    a = torch.ones(1 << 30, device="cuda")  # 4 GiB of float32
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return a.numel() * 4 / best / 1e9


def cache_bytes(config: dict, context: int) -> int:
    """The float16 key and value rows a step reads at `context` tokens (MPT: every head has its own)."""
    return 2 * config["n_layers"] * config["d_model"] * 2 * context


def write(folder: Path, dest: Path = ROOT / "benchmarks") -> None:
    """benchmarks/gpu_big.md / .json from a lease's OUT/big.json."""
    got = json.loads((folder / "big.json").read_text())
    s = got["stages"]
    lines = ["<!-- generated by: python -m posbias_export.gpu.big write OUT (a lease's tools/gpu_lease.sh big) -->",
             f"# {got['model']} in float16 on the GPU ({got['provider']}: {got.get('gpu', 'GPU not recorded')})", "",
             "Written on the GPU machine tensor by tensor (hf/shards.py, seeded bfloat16 shards), exported there with "
             "`--kv-cache --logits last --target ort --dtype float16` (the in-place cache), decoded on ONNX Runtime at "
             "each context: prefill, then greedy steps (median of the steps after the first "
             f"{WARM_STEPS}), against the floor (the file's bytes plus the cache a step reads at that context, over the "
             "GPU's measured read bandwidth) and transformers eager in float16.", ""]
    if "folder" in s:
        lines.append(f"- folder: {s['folder']['gb']:.2f} GB written in {s['folder']['seconds']:.0f} s")
    if "export" in s:
        e = s["export"]
        lines.append(f"- export: failed: {e['error']}" if "error" in e else
                     f"- export: {e['seconds']:.0f} s, peak RSS {e['peak_gb']:.2f} GB, file {e['file_gb']:.2f} GB")
    if "bandwidth" in s:
        floors = ", ".join(f"{c} tokens {ms:.2f}" for c, ms in s["bandwidth"]["floor_ms"].items())
        lines.append(f"- read bandwidth {s['bandwidth']['read_gbs']:.0f} GB/s: floor (ms/token) {floors}")
    lines += ["", "| context | runtime | ran on | prefill s | decode ms/token | decode / floor | tokens equal eager |",
              "|---|---|---|---|---|---|---|"]
    floors = s.get("bandwidth", {}).get("floor_ms", {})
    for key, v in s.items():
        if not key.startswith(("ort ", "eager ")):
            continue
        who, context = key.split()
        if "error" in v:
            last = (v["error"].strip().splitlines() or ["?"])[-1].replace("|", "/")
            lines.append(f"| {context} | {who} | failed: {last} | | | | |")
            continue
        other = s.get(f"{'eager' if who == 'ort' else 'ort'} {context}", {})
        same = "-" if "tokens" not in other else f"{sum(a == b for a, b in zip(v['tokens'], other['tokens']))}/{len(v['tokens'])}"
        floor = floors.get(context)
        ratio = f"{v['decode_median_ms'] / floor:.2f}" if floor else "-"
        lines.append(f"| {context} | {who} | {v.get('ran_on', 'torch')} | {v['prefill_s']:.2f} | "
                     f"{v['decode_median_ms']:.2f} | {ratio} | {same} |")
    (dest / "gpu_big.md").write_text("\n".join(lines) + "\n")
    (dest / "gpu_big.json").write_text(json.dumps(got, indent=1) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m posbias_export.gpu.big")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    r.add_argument("--contexts", default="512,4096")
    r.add_argument("--steps", type=int, default=16)
    r.add_argument("--tiny", action="store_true", help="a tiny MPT in place of the 7B (the CPU rehearsal)")
    w = sub.add_parser("write")
    w.add_argument("out", type=Path)
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args(argv)
    if args.command == "write":
        write(args.out, args.dest)
        return 0
    return run(args.out, args.work, args.provider, [int(c) for c in args.contexts.split(",")], args.steps, args.tiny)


if __name__ == "__main__":
    sys.exit(main())

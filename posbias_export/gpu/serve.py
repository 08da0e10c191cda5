"""The lease's `serve` step: for each in-place cache file,
which provider ran each operator type on ONNX Runtime CUDA, and its decode ms/token with the
cache in one bound buffer against PyTorch eager on the GPU (the same weights, the file's dtype;
an int8 cache against PyTorch's float32 one), timed in alternating chunks in one process.
CUDA_LAUNCH_BLOCKING comes from the environment (the lease runs this once with 1, once with 0):
these files have no If or Loop, the control flow the race needs (benchmarks/gpu_race.md).

    python -m posbias_export.gpu.serve run OUT FILE... [--provider cuda] [--contexts 512,4096] [--steps 32]
    python -m posbias_export.gpu.serve write OUT...        # here: benchmarks/gpu_serving.md / .json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def placement(path: Path, decoder) -> dict[str, list[str]]:
    """{operator type: the providers that ran it} over one profiled 17-token prefill into a
    bound buffer (ONNX Runtime falls back to the CPU per node, silently)."""
    import onnxruntime as ort

    from runtimes.ort.run import provider_list, session_options

    with tempfile.TemporaryDirectory() as tmp:
        provider = "cuda" if decoder.device == "cuda" else "cpu"
        opts = session_options(ort, provider=provider)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(tmp) / "p")
        session = ort.InferenceSession(str(path), opts, providers=provider_list(provider))
        past = [np.zeros((1, decoder.heads, 0, decoder.head_dim), decoder.dtype) for _ in decoder.past_names]
        session.run(None, {"input_ids": np.full((1, 17), 7, np.int64), "attention_mask": np.ones((1, 17), np.int64),
                           **dict(zip(decoder.past_names, past))})
        events = json.loads(Path(session.end_profiling()).read_text())
    ran: dict[str, set] = defaultdict(set)
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "Node" and "op_name" in args and "provider" in args:
            ran[args["op_name"]].add(args["provider"].replace("ExecutionProvider", ""))
    return {op: sorted(p) for op, p in sorted(ran.items())}


def measure(path: Path, provider: str, contexts: list[int], steps: int) -> list[dict]:
    import torch

    from posbias_export.bench.decode import time_alternating
    from posbias_export.bench.harness import median
    from posbias_export.export import model_config
    from posbias_export.nn import build_model
    from posbias_export.parity import load_runner

    gen = load_runner("ort/generate.py")
    decoder = gen.CachedDecoder(str(path), provider=provider)
    contract = decoder.contract
    device = "cuda" if provider == "cuda" else "cpu"
    torch_dtype = torch.float16 if contract.dtype == "float16" else torch.float32
    model = build_model(model_config(contract), seed=contract.seed or 0).to(device, torch_dtype).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row0 = {"file": path.name, "dtype": contract.dtype, "kv_dtype": contract.kv_dtype,
            "provider": provider, "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "unset"),
            "placement": placement(path, decoder)}
    rows = []
    for context in contexts:
        capacity = context + 4 * steps + 64  # every timed and settling step fits
        ids = np.random.default_rng(context).integers(0, 256, (1, context)).astype(np.int64)
        buffers = decoder.shared_cache(1, capacity)
        ort_last = gen.prefill_shared(decoder, ids, np.ones((1, context), np.int64), buffers)
        state = {"len": context}

        def ort_step():
            decoder.step_shared(np.array([[7]], np.int64), np.ones((1, state["len"] + 1), np.int64), buffers)
            state["len"] += 1

        with torch.no_grad():
            t_ids = torch.from_numpy(ids).to(device)
            t_logits, t_past = model.step(t_ids, torch.ones_like(t_ids),
                                          [(k.to(device, torch_dtype), v.to(device, torch_dtype)) for k, v in model.empty_past(1)])
        t_state = {"past": t_past, "len": context}

        @torch.no_grad()
        def torch_step():
            logits, t_state["past"] = model.step(torch.tensor([[7]], device=device),
                                                 torch.ones(1, t_state["len"] + 1, dtype=torch.int64, device=device),
                                                 t_state["past"])
            logits.cpu()  # as ORT's step: the logits reach the host
            sync()
            t_state["len"] += 1

        # the same weights: the prompt's last logits of both runtimes, before any timing
        agree = float(np.abs(ort_last[0, -1].astype(np.float64) - t_logits[0, -1].double().cpu().numpy()).max())
        ort_times, torch_times = time_alternating(ort_step, torch_step, steps)
        rows.append({**row0, "context": context, "steps": steps, "prefill_logits_max_abs_vs_torch": agree,
                     "ort_ms_median": median(ort_times) * 1e3, "torch_ms_median": median(torch_times) * 1e3,
                     "ort_over_torch": median(ort_times) / median(torch_times)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "placement"}), flush=True)
    return rows


def run(out: Path, files: list[Path], provider: str, contexts: list[int], steps: int) -> int:
    from posbias_export.environment import gpu_environment

    out.mkdir(parents=True, exist_ok=True)
    (out / "machine.json").write_text(json.dumps(gpu_environment()))
    label = os.environ.get("CUDA_LAUNCH_BLOCKING", "unset")
    code = 0
    for path in files:
        try:
            rows = measure(path, provider, contexts, steps)
        except Exception as err:  # noqa: BLE001 - one file's failure is a row, the others still run
            rows, code = [{"file": path.name, "provider": provider, "launch_blocking": label,
                           "error": str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__}], 1
            print(json.dumps(rows[0]), flush=True)
        with open(out / f"serve_blocking{label}.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return code


def write(folders: list[Path], dest: Path = ROOT / "benchmarks") -> None:
    """gpu_serving.md / .json from every run's rows; what a person wrote below the prose mark stays."""
    from posbias_export.bench.harness import PROSE_MARK, kept_prose
    from posbias_export.environment import describe_gpu

    rows = [json.loads(line) for f in folders for p in sorted(f.glob("serve_*.jsonl")) for line in p.read_text().splitlines()]
    machine = next((json.loads((f / "machine.json").read_text()) for f in folders if (f / "machine.json").exists()), None)
    prose = kept_prose(dest / "gpu_serving.md")
    lines = ["# Serving on the GPU: in-place cache files on ONNX Runtime CUDA", "",
             "Generated by `tools/gpu_lease.sh serve` (`python -m posbias_export.gpu.serve run`), then `python -m posbias_export.gpu.serve "
             "write`. " + (describe_gpu(machine) + " " if machine else "") + "The default decoder (alibi, 2 layers, 4 heads, "
             "width 128) exported `--kv-cache --target ort`; decode after a prompt of `context` tokens prefilled into one "
             "bound buffer, median ms per one-token step (logits back on the host), ONNX Runtime and PyTorch eager on the "
             "GPU timed in alternating chunks in one process, each with the CUDA_LAUNCH_BLOCKING shown. PyTorch runs the "
             "file's dtype (float32 for an int8 cache). `agree`: max |ORT - PyTorch| of the prompt's last logits.", "",
             "| file | CUDA_LAUNCH_BLOCKING | context | ORT ms/token | PyTorch ms/token | ORT / PyTorch | agree | "
             "GroupQueryAttention ran on |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['file']} | {r['launch_blocking']} | - | error: {r['error']} | | | | |")
            continue
        gqa = ", ".join(r["placement"].get("GroupQueryAttention", ["-"]))
        lines.append(f"| {r['file']} | {r['launch_blocking']} | {r['context']} | {r['ort_ms_median']:.3f} | "
                     f"{r['torch_ms_median']:.3f} | {r['ort_over_torch']:.2f} | {r['prefill_logits_max_abs_vs_torch']:.1e} | "
                     f"{gqa} |")
    on_cpu = {r["file"]: sorted(op for op, p in r["placement"].items() if "CPU" in p)
              for r in rows if r.get("provider") == "cuda" and "placement" in r}
    lines += ["", "Operators the CUDA session left to its CPU provider (a 17-token prefill, ONNX Runtime's profiler):", ""]
    lines += [f"- {f}: {', '.join(ops) or 'none'}" for f, ops in on_cpu.items()] or ["- no CUDA rows"]
    if prose:
        lines += ["", PROSE_MARK, "", prose]
    (dest / "gpu_serving.md").write_text("\n".join(lines) + "\n")
    (dest / "gpu_serving.json").write_text(json.dumps(rows, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("files", type=Path, nargs="+")
    r.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    r.add_argument("--contexts", default="512,4096")
    r.add_argument("--steps", type=int, default=32)
    w = sub.add_parser("write")
    w.add_argument("out", type=Path, nargs="+")
    w.add_argument("--dest", type=Path, default=ROOT / "benchmarks")
    args = p.parse_args(argv)
    if args.part == "run":
        return run(args.out, args.files, args.provider, [int(c) for c in args.contexts.split(",")], args.steps)
    write(args.out, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

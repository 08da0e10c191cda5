"""The lease's `embed` steps: jina-embeddings-v2-base's configuration (random weights) in float16 on
the GPU at long inputs, side by side in one call, each form in its own process:

- ours: the file `--model DIR --dtype float16 --target cuda-ort` on ONNX Runtime CUDA (the runner's
  session, launches as it chooses them: asynchronous for a cured file), one session serving every cell;
- sdpa: our module in float16 with PyTorch's fused attention and the [H, L, L] ALiBi bias as its mask
  (what a dense export computes), the bias built once per input and shared by the layers;
- flex: our module with compiled FlexAttention, ALiBi as score_mod (the slope times |i - j|
  computed in the kernel, no bias tensor) and the padding as a block mask;
- ref64 and eager16: our module in float64 and float16 (blocked form, memory linear in L): the
  reference and PyTorch float16's own error, which the float16 policy scales (parity/tolerance.py).

Cells: 8192 and 32768 tokens (batch 1), then 32 right-padded texts of at most 128 tokens. Each
form's cells run in increasing size, so the GPU memory read after a cell (ONNX Runtime: the
process's, from nvidia-smi; PyTorch: its peak allocation) is that cell's. Times: the median of 3
forwards after one warm-up, the GPU synchronised.

    python -m posbias_export.gpu.embed build WORK [--tiny]          # the folder and our file (CPU work)
    python -m posbias_export.gpu.embed run WORK OUT [--tiny] [--provider cuda]
    python -m posbias_export.gpu.embed write OUT                    # here: benchmarks/gpu_embedders.md / .json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "runtimes"))

CELLS = ((32, 128), (1, 8192), (1, 32768))  # (batch, length), increasing tokens
TINY_CELLS = ((4, 32), (1, 256), (1, 512))
FORMS = ("ref64", "eager16", "ours", "sdpa", "flex")
TIMED = ("ours", "sdpa", "flex")
TINY = dict(vocab=1000, hidden=64, heads=4, layers=2, max_len=8192)


def build(work: Path, tiny: bool) -> None:
    """The published-size folder (random weights, drawn as the model draws them) and our float16
    GPU file of it; `work/built` marks the end (the run step waits for it)."""
    from posbias_export.bench.embedders import BASE
    from posbias_export.hf.export import export_model
    from posbias_export.hf.tiny import Sizes, save_tiny_folder

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    save_tiny_folder("jina_bert", work / "folder", Sizes(**(TINY if tiny else BASE)), noise=0.0)
    t1 = time.perf_counter()
    export_model(work / "folder", work / "ours.onnx", dtype="float16", target="cuda-ort", check_growth=False)
    (work / "built").write_text(json.dumps({"folder_s": t1 - t0, "export_s": time.perf_counter() - t1}))


def _case(batch: int, length: int, vocab: int):
    from common.inputs import padded_batch

    return padded_batch(length, batch, vocab)


def _gpu_used() -> int | None:
    """The GPU's used memory (nvidia-smi): one form runs at a time, so what it adds is that form's
    (a container's process ids need not match the driver's)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def _timed(step, sync, runs: int = 3) -> tuple[object, list[float]]:
    out = step()  # warm-up (and, for flex, the compile)
    sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - start)
    return out, times


def _ort_cells(work: Path, cells, provider: str, vocab: int):
    from ort.run import create_session

    base = _gpu_used()
    session = create_session(str(work / "ours.onnx"), provider)
    names = [i.name for i in session.get_inputs()]
    for batch, length in cells:
        case = _case(batch, length, vocab)
        feeds = {"input_ids": case.ids, "attention_mask": case.mask, "token_type_ids": np.zeros_like(case.ids)}
        out, times = _timed(lambda: session.run(None, {n: feeds[n] for n in names})[0], lambda: None)
        used = _gpu_used()
        yield batch, length, case, np.asarray(out, np.float32), times, None if used is None else used - base, \
            {"ran_on": session.get_providers()[0], "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "unset")}


def _patched_attention(form: str, slopes):
    """attention_heads for the module's layers: SDPA with the [H, L, L] bias as its mask, or
    compiled FlexAttention with ALiBi as score_mod (bidirectional: -m_h |i - j|)."""
    import torch
    from torch.nn import functional as F

    cache = {}

    def sdpa(q, k, v, q_pos, k_pos, key_mask, bias, causal, settings):
        L = q.shape[2]
        key = (L, None if key_mask is None else key_mask.data_ptr())
        if key not in cache:  # once per input: every layer shares ALiBi's bias
            cache.clear()
            dist = (torch.arange(L, device=q.device)[:, None] - torch.arange(L, device=q.device)[None, :]).abs()
            mask = torch.empty(len(slopes), L, L, dtype=q.dtype, device=q.device)  # [H, L, L] in the model dtype
            for h, m in enumerate(slopes.tolist()):
                mask[h] = (-m * dist).to(q.dtype)
            del dist
            if key_mask is not None and not bool(key_mask.all()):
                mask = mask.unsqueeze(0).masked_fill(~key_mask.bool()[:, None, None, :], torch.finfo(q.dtype).min)
            cache[key] = mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=cache[key])

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    slopes_gpu = slopes.to("cuda", torch.float32) if torch.cuda.is_available() else slopes.float()

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes_gpu[h] * (q_idx - kv_idx).abs()

    def flex_heads(q, k, v, q_pos, k_pos, key_mask, bias, causal, settings):
        block_mask = None
        if key_mask is not None and not bool(key_mask.all()):
            keep = key_mask.bool()
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: keep[b, kv_idx], q.shape[0], None,
                                           q.shape[2], k.shape[2], device=q.device)
        return flex(q, k, v, score_mod=alibi, block_mask=block_mask)

    return {"sdpa": sdpa, "flex": flex_heads}[form]


def _torch_cells(work: Path, form: str, cells, device: str, vocab: int):
    import torch

    from posbias_export.hf import blocks
    from posbias_export.hf.models import load_model
    from posbias_export.nn import AttentionSettings

    dtype = {"ref64": torch.float64, "eager16": torch.float16}.get(form, torch.float16)
    model = load_model(str(work / "folder")).to(device, dtype).eval()
    settings = AttentionSettings(form="blocked")  # ref64, eager16: memory linear in L
    if form in ("sdpa", "flex"):
        blocks.attention_heads = _patched_attention(form, model.alibi.slopes.detach().to(device))
        settings = AttentionSettings(form="plain")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for batch, length in cells:
        case = _case(batch, length, vocab)
        ids, mask = (torch.from_numpy(x).to(device) for x in (case.ids, case.mask))
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            with torch.no_grad():
                out, times = _timed(lambda: model(ids, mask, settings=settings), sync, 3 if form in TIMED else 0)
        except torch.OutOfMemoryError as err:
            yield batch, length, case, None, [], None, {"error": f"out of GPU memory: {str(err).splitlines()[0][:160]}"}
            continue
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        yield batch, length, case, out.float().cpu().numpy(), times, peak, {"ran_on": device}


def form_worker(work: Path, form: str, provider: str, tiny: bool, out: Path) -> None:
    """One form's cells in this process: each cell's valid-token states saved, its row printed."""
    vocab = json.loads((work / "folder" / "config.json").read_text())["vocab_size"]
    cells = TINY_CELLS if tiny else CELLS
    device = "cuda" if provider == "cuda" else "cpu"
    rows = _ort_cells(work, cells, provider, vocab) if form == "ours" else _torch_cells(work, form, cells, device, vocab)
    for batch, length, case, states, times, gpu_bytes, extra in rows:
        if states is not None:
            np.save(out / f"{form}_{batch}x{length}.npy", states[case.mask.astype(bool)])  # [N, D] valid tokens
        print(json.dumps({"form": form, "batch": batch, "length": length, "times": times, "gpu_bytes": gpu_bytes,
                          **extra}), flush=True)


def _judge(out: Path, batch: int, length: int, form: str, case_mask) -> dict:
    from posbias_export.parity import FLOAT16, compare
    from posbias_export.parity.embedding import cosines, pooled

    got = out / f"{form}_{batch}x{length}.npy"
    ref, e16 = (out / f"{name}_{batch}x{length}.npy" for name in ("ref64", "eager16"))
    if not (got.exists() and ref.exists() and e16.exists()):
        return {}
    actual, ref64, torch16 = np.load(got).astype(np.float64), np.load(ref).astype(np.float64), np.load(e16)
    parity = compare(actual, ref64, torch16, FLOAT16)
    rows = np.nonzero(case_mask)[0]
    cos = cosines(pooled(actual, rows, batch), pooled(ref64, rows, batch))
    return {"max_abs": parity.max_abs, "budget_abs": parity.budget_abs, "passed": bool(parity.passed),
            "torch16_err": parity.torch32_err, "cosine_min": float(np.min(cos))}


def run(work: Path, out: Path, provider: str, tiny: bool, timeout: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(int(timeout)):  # the build runs beside the other steps
        if (work / "built").exists():
            break
        time.sleep(1)
    built = json.loads((work / "built").read_text())
    rows = []
    for form in FORMS:
        cmd = [sys.executable, "-m", "posbias_export.gpu.embed", "worker", str(work), form, str(out), "--provider", provider] + (["--tiny"] * tiny)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode and len(got) < len(TINY_CELLS if tiny else CELLS):
                got.append({"form": form, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]})
        except subprocess.TimeoutExpired:
            got = [{"form": form, "error": f"timed out after {timeout:.0f} s"}]
        rows += got
        print(json.dumps(got), flush=True)
    vocab = json.loads((work / "folder" / "config.json").read_text())["vocab_size"]
    for row in rows:
        if "length" in row and row["form"] in TIMED:
            row["parity"] = _judge(out, row["batch"], row["length"], row["form"],
                                   _case(row["batch"], row["length"], vocab).mask.astype(bool))
    (out / "gpu_embed.json").write_text(json.dumps({"provider": provider, "built": built, "rows": rows, "tiny": tiny,
                                                    "gpu": _gpu_name()}, indent=1))


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "no nvidia-smi"


def write(out: Path, dest: Path) -> None:
    from posbias_export.export.files import write_text_atomic

    data = json.loads((out / "gpu_embed.json").read_text())
    rows = [r for r in data["rows"] if r.get("form") in TIMED or r.get("error")]
    lines = ["# jina-embeddings-v2-base on the GPU, float16: our file against PyTorch SDPA and FlexAttention", "",
             "<!-- generated by: python -m posbias_export.gpu.embed write OUT (a lease's tools/gpu_lease.sh embed) -->", "",
             f"GPU: {data['gpu']} (provider {data['provider']}). "
             + ("A tiny configuration (the rehearsal)" if data.get("tiny") else
                "The published configuration (12 layers, 12 heads, hidden 768, GLU feed-forward, random weights)")
             + ", written and exported on the GPU machine "
             f"(folder {data['built']['folder_s']:.0f} s, export {data['built']['export_s']:.0f} s). Each form in its "
             "own process, its cells in increasing size; ms: the median of 3 forwards after a warm-up; GPU memory: "
             "ONNX Runtime's process (nvidia-smi), PyTorch's peak allocation. Parity: the valid tokens' states "
             "against our module in float64, budget from PyTorch float16's own error (the float16 policy); "
             "cosine: the mean-pooled embedding's.", "",
             "| tokens | form | ms / forward | GPU memory GB | max abs vs float64 | budget | embedding cosine (min) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error") and "length" not in r:
            lines.append(f"| - | {r['form']} | failed: {r['error']} | | | | | |")
            continue
        tokens = f"{r['length']}" if r["batch"] == 1 else f"{r['batch']} x {r['length']} (padded)"
        if r.get("error"):
            lines.append(f"| {tokens} | {r['form']} | {r['error']} | | | | | |")
            continue
        p = r.get("parity") or {}
        ms = f"{1e3 * statistics.median(r['times']):.1f}" if r["times"] else "-"
        gb = f"{r['gpu_bytes'] / 1e9:.2f}" if r.get("gpu_bytes") else "-"
        verdict = ("pass" if p.get("passed") else "FAIL") if p else "-"
        lines.append(f"| {tokens} | {r['form']} | {ms} | {gb} | {p.get('max_abs', float('nan')):.2e} | "
                     f"{p.get('budget_abs', float('nan')):.2e} | {p.get('cosine_min', float('nan')):.5f} | {verdict} |")
    write_text_atomic(dest, "\n".join(lines) + "\n")
    write_text_atomic(dest.with_suffix(".json"), json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    b = sub.add_parser("build")
    b.add_argument("work", type=Path)
    b.add_argument("--tiny", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("work", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    r.add_argument("--tiny", action="store_true")
    r.add_argument("--timeout", type=float, default=240)
    w = sub.add_parser("worker")
    w.add_argument("work", type=Path)
    w.add_argument("form", choices=FORMS)
    w.add_argument("out", type=Path)
    w.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    w.add_argument("--tiny", action="store_true")
    wr = sub.add_parser("write")
    wr.add_argument("out", type=Path)
    wr.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "gpu_embedders.md")
    args = p.parse_args(argv)
    if args.part == "build":
        build(args.work, args.tiny)
    elif args.part == "run":
        run(args.work, args.out, args.provider, args.tiny, args.timeout)
    elif args.part == "worker":
        form_worker(args.work, args.form, args.provider, args.tiny, args.out)
    else:
        write(args.out, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

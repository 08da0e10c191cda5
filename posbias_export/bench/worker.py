"""One benchmark configuration in its own process, so its peak RSS is its own.

Run by path (python posbias_export/bench/worker.py ...), not as a module: the ONNX runtimes
then never import torch or posbias_export, and their RSS is what a server would see. Prints
one JSON line: times (seconds per forward, after one warm-up), peak RSS and RSS before the
first run (after loading), in bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

PACKAGE = Path(__file__).resolve().parents[1]
# the runners: inside the package when installed from a wheel, beside it in a source checkout
RUNTIMES_DIR = PACKAGE / "runtimes" if (PACKAGE / "runtimes").is_dir() else PACKAGE.parent / "runtimes"
RUNNERS = ("ort", "openvino", "torch-eager", "torch-sdpa")
VARIANTS = ("causal", "bidirectional", "block")  # attention alone either way, or a whole transformer block
INPUT_NAMES = {"causal": ("query", "key", "value"), "bidirectional": ("query", "key", "value"),
               "block": ("hidden_states",)}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss_now() -> int:
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    # VmHWM belongs to this process image; getrusage's ru_maxrss survives exec and would
    # report the (larger) parent that spawned us.
    return _status_bytes("VmHWM")


def make_inputs(heads: int, head_dim: int, length: int, seed: int = 0, variant: str = "causal") -> list[np.ndarray]:
    """query, key, value [1, H, L, d] float32 (a block: hidden states [1, L, H*d]), the same in every worker."""
    rng = np.random.default_rng(seed)
    if variant == "block":
        return [rng.standard_normal((1, length, heads * head_dim), dtype=np.float32)]
    return [rng.standard_normal((1, heads, length, head_dim), dtype=np.float32) for _ in range(3)]


def ort_forward(model: str, inputs, variant: str):
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feeds = dict(zip(INPUT_NAMES[variant], inputs))
    return lambda: session.run(None, feeds)


def openvino_forward(model: str, inputs, variant: str):
    sys.path.insert(0, str(RUNTIMES_DIR))
    from common.loading import load_runner

    ov_run = load_runner("openvino/run.py")
    compiled = ov_run.compile_model(model, "f32")
    feeds = dict(zip(INPUT_NAMES[variant], inputs))
    return lambda: ov_run.run(compiled, feeds)


def torch_forward(runner: str, bias: str, inputs, variant: str, heads: int, head_dim: int):
    sys.path.insert(0, str(PACKAGE.parent))
    import torch
    from torch.nn import functional as F

    from posbias_export.nn import ModelConfig, build_model

    tensors = [torch.from_numpy(x) for x in inputs]
    causal = variant != "bidirectional"
    arch = "block" if variant == "block" else "attention"
    # torch-sdpa: the fused kernel without a bias, the practical limit here (a block: the same
    # block with bias "none", its attention through that kernel)
    cfg = ModelConfig(bias="none" if runner == "torch-sdpa" else bias, num_heads=heads, dim=heads * head_dim,
                      causal=causal, rope=False if runner == "torch-sdpa" else None)
    model = build_model(cfg, arch=arch).eval()
    if runner == "torch-sdpa" and arch == "attention":
        return lambda: F.scaled_dot_product_attention(*tensors, is_causal=causal)
    step = fused_block_forward if runner == "torch-sdpa" else (lambda m, *xs: m(*xs))  # eager: the plain form

    def forward():
        with torch.no_grad():
            return step(model, *tensors)

    return forward


def fused_block_forward(block, x):
    """posbias_export's Block with its attention through PyTorch's fused causal kernel and no
    bias: x [B, L, D] -> [B, L, D]."""
    from torch.nn import functional as F

    B, L, D = x.shape
    H = block.cfg.num_heads
    h = block.ln_attn(x)
    q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in block.attn.qkv(h).chunk(3, dim=-1))  # [B, H, L, hd]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=block.cfg.causal)  # [B, H, L, hd]
    x = x + block.attn.out(y.transpose(1, 2).reshape(B, L, D))
    return x + block.mlp(block.ln_mlp(x))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runner", choices=RUNNERS, required=True)
    p.add_argument("--model", help="ONNX file (ort, openvino)")
    p.add_argument("--bias", required=True, help="bias family of the torch-eager runner")
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", choices=VARIANTS, default="causal")
    args = p.parse_args(argv)
    inputs = make_inputs(args.heads, args.head_dim, args.length, variant=args.variant)
    if args.runner == "ort":
        forward = ort_forward(args.model, inputs, args.variant)
    elif args.runner == "openvino":
        forward = openvino_forward(args.model, inputs, args.variant)
    else:
        forward = torch_forward(args.runner, args.bias, inputs, args.variant, args.heads, args.head_dim)
    loaded_rss = rss_now()
    forward()  # warm-up: allocator pools, thread pools, lazy initialisation
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "peak_rss": peak_rss(), "loaded_rss": loaded_rss}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

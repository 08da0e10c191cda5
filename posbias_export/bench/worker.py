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


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss_now() -> int:
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    # VmHWM belongs to this process image; getrusage's ru_maxrss survives exec and would
    # report the (larger) parent that spawned us.
    return _status_bytes("VmHWM")


def make_inputs(heads: int, head_dim: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """query, key, value [1, H, L, d] float32, the same in every worker."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, heads, length, head_dim), dtype=np.float32) for _ in range(3)]


def ort_forward(model: str, inputs):
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feeds = dict(zip(("query", "key", "value"), inputs))
    return lambda: session.run(None, feeds)


def openvino_forward(model: str, inputs):
    sys.path.insert(0, str(RUNTIMES_DIR))
    from common.loading import load_runner

    ov_run = load_runner("openvino/run.py")
    compiled = ov_run.compile_model(model, "f32")
    feeds = dict(zip(("query", "key", "value"), inputs))
    return lambda: ov_run.run(compiled, feeds)


def torch_forward(runner: str, bias: str, inputs):
    sys.path.insert(0, str(PACKAGE.parent))
    import torch
    from torch.nn import functional as F

    from posbias_export.nn import ModelConfig, build_model

    q, k, v = (torch.from_numpy(x) for x in inputs)
    heads, head_dim = q.shape[1], q.shape[3]
    if runner == "torch-sdpa":  # the fused kernel, no bias: the practical limit here
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    core = build_model(ModelConfig(bias=bias, num_heads=heads, dim=heads * head_dim), arch="attention")

    def forward():
        with torch.no_grad():
            return core(q, k, v)  # the plain form: what the PyTorch model itself runs

    return forward


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runner", choices=RUNNERS, required=True)
    p.add_argument("--model", help="ONNX file (ort, openvino)")
    p.add_argument("--bias", required=True, help="bias family of the torch-eager runner")
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    inputs = make_inputs(args.heads, args.head_dim, args.length)
    if args.runner == "ort":
        forward = ort_forward(args.model, inputs)
    elif args.runner == "openvino":
        forward = openvino_forward(args.model, inputs)
    else:
        forward = torch_forward(args.runner, args.bias, inputs)
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

"""One benchmark configuration in its own process, so its peak memory is its own.

Run by path (python posbias_export/bench/worker.py ...), not as a module: the ONNX runtimes
then never import torch or posbias_export, and their RSS is what a server would see. Prints
one JSON line per length: times (seconds per forward, after one warm-up), peak RSS and RSS
before the first run (after loading), in bytes; or error (a length that fails, e.g. out of
memory, is a result). --provider cuda: ONNX Runtime CUDA with the runners' provider options,
inputs and output bound on the GPU (IOBinding: the timings are the graph, not PCIe copies),
and gpu_bytes (this process's GPU memory after the runs, minus what it held before the first
input; the arena keeps its peak, so lengths run in increasing order).
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
# attention alone either way, a whole transformer block, or a whole model (its inputs made by name)
VARIANTS = ("causal", "bidirectional", "block", "model")
INPUT_NAMES = {"causal": ("query", "key", "value"), "bidirectional": ("query", "key", "value"),
               "block": ("hidden_states",)}


def process_memory():
    """runtimes/common/memory.py: this process's RSS now, its peak, its GPU memory."""
    sys.path.insert(0, str(RUNTIMES_DIR))
    from common import memory

    return memory


def make_inputs(heads: int, head_dim: int, length: int, seed: int = 0, variant: str = "causal",
                dtype=np.float32) -> list[np.ndarray]:
    """query, key, value [1, H, L, d] (a block: hidden states [1, L, H*d]), the same in every worker."""
    rng = np.random.default_rng(seed)
    if variant == "block":
        return [rng.standard_normal((1, length, heads * head_dim), dtype=np.float32).astype(dtype)]
    return [rng.standard_normal((1, heads, length, head_dim), dtype=np.float32).astype(dtype) for _ in range(3)]


def model_feeds(session, length: int, vocab: int, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """A whole model's inputs for `batch` rows of `length` random tokens (inputs.padded_batch), each
    input made by its name's generator (runtimes/common/inputs.py; an empty cache: a prefill)."""
    sys.path.insert(0, str(RUNTIMES_DIR))
    from common.inputs import feeds_for, padded_batch

    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    declared = [(v.name, v.shape, dtypes.get(v.type, np.int64)) for v in session.get_inputs()]
    return feeds_for(declared, padded_batch(length, batch, vocab, seed))


def ort_runner(script: str = "run.py"):
    """runtimes/ort/<script> as a module: run.py (sessions as served) or profile.py (ORT's profiler)."""
    sys.path.insert(0, str(RUNTIMES_DIR))
    from common.loading import load_runner

    return load_runner(f"ort/{script}")


def served_providers(model: str, provider: str) -> list:
    """The runners' providers (what is timed is what is served), the CUDA arena growing by what
    is asked (kSameAsRequested) and not to the next power of two, so the memory column is what
    the graph needs (the default doubling reached 22 GB at 16384)."""
    runner = ort_runner()
    providers = runner.provider_list(provider)
    if provider == "cpu":
        return providers
    runner.host_synchronous_cuda(model)  # as served
    (name, cuda), cpu = providers
    return [(name, {**cuda, "arena_extend_strategy": "kSameAsRequested"}), cpu]


SESSIONS = ("defaults", "flag", "runners")


def ort_session(model: str, provider: str = "cpu", options: str = "defaults"):
    """options (CPU): "defaults", ONNX Runtime's own (what a tool's session gets); "flag", those
    with session.set_denormal_as_zero (subnormals read and written as zero: what the file would
    gain from a knob clients do not set); or "runners", our runners' session_options (the flag
    included). CUDA always runs with the runners'."""
    import onnxruntime as ort

    if provider == "cpu":
        opts = None
        if options == "runners":
            opts = ort_runner().session_options(ort)
        elif options == "flag":
            opts = ort.SessionOptions()
            ort_runner().set_denormal_as_zero(opts)
        return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    ort.set_default_logger_severity(3)  # a failing length is reported in its JSON row, once
    session = ort.InferenceSession(model, ort_runner().session_options(ort, provider=provider), providers=served_providers(model, provider))
    if session.get_providers()[0] != "CUDAExecutionProvider":  # ORT falls back to CPU silently
        raise RuntimeError(f"CUDA provider did not load (session runs on {session.get_providers()[0]})")
    return session


def ort_forward(session, feeds: dict):
    """CPU: session.run; CUDA: inputs and output bound on the GPU, synchronised after each run."""
    import onnxruntime as ort

    if session.get_providers()[0] != "CUDAExecutionProvider":
        return lambda: session.run(None, feeds)
    binding = session.io_binding()
    for name, x in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    binding.bind_output(session.get_outputs()[0].name, "cuda", 0)

    def forward():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    return forward


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


def timed(forward, repeats: int, warmup: bool = True) -> tuple[list[float], object]:
    """Seconds of each of `repeats` forwards after a warm-up, and the last forward's result."""
    if warmup:  # allocator pools, thread pools, lazy initialisation, kernel selection
        forward()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = forward()
        times.append(time.perf_counter() - start)
    return times, out


def one_length(args, session, length: int) -> dict:
    dtype = np.float16 if args.dtype == "float16" else np.float32
    if args.variant == "model":
        forward = ort_forward(session, model_feeds(session, length, args.vocab, args.batch))
    else:
        inputs = make_inputs(args.heads, args.head_dim, length, variant=args.variant, dtype=dtype)
        if args.runner == "ort":
            forward = ort_forward(session, dict(zip(INPUT_NAMES[args.variant], inputs)))
        elif args.runner == "openvino":
            forward = openvino_forward(args.model, inputs, args.variant)
        else:
            forward = torch_forward(args.runner, args.bias, inputs, args.variant, args.heads, args.head_dim)
    loaded_rss = process_memory().rss_now()
    times, out = timed(forward, args.repeats, not args.cold)
    if args.save:  # the first output of the last run, for an error column
        np.save(args.save, out[0].astype(np.float32))
    return {"length": length, "times": times, "peak_rss": process_memory().peak_rss(), "loaded_rss": loaded_rss}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runner", choices=RUNNERS, required=True)
    p.add_argument("--model", help="ONNX file (ort, openvino)")
    p.add_argument("--bias", default="alibi", help="bias family of the torch runners")
    p.add_argument("--length", type=int, action="append", required=True, help="repeat for several, increasing")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", choices=VARIANTS, default="causal")
    p.add_argument("--vocab", type=int, default=1000, help="model: the token ids' range")
    p.add_argument("--batch", type=int, default=1, help="model: rows, right-padded to lengths down to half")
    p.add_argument("--cold", action="store_true", help="no warm-up: time the first forward (what a one-off call sees)")
    p.add_argument("--save", help="where to save the first output of the last run (.npy)")
    p.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="ort: the execution provider")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="the inputs' dtype")
    p.add_argument("--session", choices=SESSIONS, default="defaults",
                   help="ort on CPU: ONNX Runtime's default session options, those with session.set_denormal_as_zero, "
                        "or our runners'")
    args = p.parse_args(argv)
    session = ort_session(args.model, args.provider, args.session) if args.runner == "ort" else None
    before = process_memory().process_gpu_bytes() if args.provider == "cuda" else None
    several = len(args.length) > 1 or args.variant == "model"  # a model that fails to run: its row says why
    for length in args.length:
        try:
            row = one_length(args, session, length)
        except Exception as err:  # noqa: BLE001 - with several lengths, one failing (out of memory) is a row
            if not several:
                raise
            row = {"length": length, "error": str(err).strip().splitlines()[0][:300] if str(err).strip()
                   else type(err).__name__}
        if before is not None and "times" in row:
            after = process_memory().process_gpu_bytes()
            row["gpu_bytes"] = None if after is None else after - before
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Run an ONNX model with ONNX Runtime on the CPU or CUDA execution provider.

    python runtimes/ort/run.py model.onnx inputs/ outputs/ [--provider cpu|cuda] [--threads N] [--tf32]
                               [--shared-cache]

Needs onnxruntime (or onnxruntime-gpu for cuda) and numpy. A CUDA request fails loudly when
the CUDA provider is not really active: ONNX Runtime silently falls back to CPU otherwise.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.atomic import stop_behind  # noqa: E402
from common.cache import cache_layout  # noqa: E402
from common.feeds import ONNX_TYPE_TO_NUMPY, InputSpec  # noqa: E402
from common.runner_cli import parse, run_all  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402
from common.host_reads import needs_host_sync  # noqa: E402
from common.last_logits import session_source  # noqa: E402
from common.memory import return_free_heap  # noqa: E402

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def provider_list(provider: str, tf32: bool = False) -> list:
    """What InferenceSession gets. CUDA runs float32 matmuls in TF32 by default (10-bit mantissa:
    errors ~1e-3 where float32 gives ~1e-6); we run it exactly unless TF32 is asked for. One
    stream for the whole provider (use_ep_level_unified_stream); the order-dependent CUDA error
    of older files is cured by host_synchronous_cuda, not by this (benchmarks/gpu_cure.md)."""
    if provider == "cpu":
        return [PROVIDERS["cpu"]]
    return [(PROVIDERS["cuda"], {"use_tf32": "1" if tf32 else "0", "use_ep_level_unified_stream": "1"}),
            PROVIDERS["cpu"]]


def set_denormal_as_zero(opts) -> None:
    """Subnormal floats read and written as zero on the session's threads (x86 FTZ/DAZ): an Intel
    core takes a slow assist on each one. Our files make none in their attention (biases/base.py:
    SCORE_FLOOR), so this changes nothing there; it is belt and braces for what we cannot floor (a
    model's own activations, a GPU file's whole-sequence ALiBi call run on a CPU). Clients set it
    through their session options (docs/cpu-kinds.md). ONNX Runtime also sets FTZ/DAZ on the
    thread that creates the session, for the rest of the process: numpy and PyTorch there then
    flush subnormals too (our runners are processes of their own: validate and the benches start
    them, `generate` is the whole program; runtimes/reference/subnormals.py counts in a fresh one)."""
    opts.add_session_config_entry("session.set_denormal_as_zero", "1")


def session_options(ort, threads: int = 0, lean: bool = False, provider: str = "cpu", denormal_as_zero: bool = True):
    """SessionOptions for a server that sees a new length at every call: subnormals as zero
    (set_denormal_as_zero), no memory patterns
    (ONNX Runtime keys them by the XOR of the input dims, and a Loop body's inputs key the same
    at every length; they only pay off for repeated shapes; benchmarks/session_options.md
    measures that turning them off costs nothing on CPU), and a quiet log (errors reach the
    user as our one line, not as red ERROR lines before the runtime raises). On CPU no planned
    memory reuse either: the planner hands a freed tensor's buffer to a later tensor of the
    same shape, so each layer's feed-forward buffers stay allocated through the next layers'
    attention (4 x 100 MB at 8192 tokens in jina-v2-base, traced by allocation); off, the
    arena recycles them, and that file's peak at 8192 tokens drops from 1.77 to 1.24 GB at no
    cost in time (prefill or decode steps: benchmarks/session_options.md). Not measured on CUDA,
    so left on there. lean: no
    prepacked copies of the weights (external tensors then stay memory-mapped and are read as
    they are used): a model loads in its own size, not twice it, and the prefill is slower
    (benchmarks/real_models.md). Turning the CPU arena off as well was measured and not kept:
    no lower peak at 4096 tokens, decode steps up to 2x slower."""
    opts = ort.SessionOptions()
    opts.enable_mem_pattern = False
    opts.enable_mem_reuse = provider != "cpu"
    opts.log_severity_level = 4
    if denormal_as_zero:  # off only to measure what a client's session without the flag does
        set_denormal_as_zero(opts)
    if lean:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if threads:
        opts.intra_op_num_threads = threads
    return opts


_cuda_async = []  # set once a CUDA session started this process without host-synchronous launches


def host_synchronous_cuda(*model_paths: str) -> None:
    """Host-synchronous CUDA launches (CUDA_LAUNCH_BLOCKING=1), unless the caller set the variable,
    for a file ONNX Runtime CUDA can run wrong without them: one with a subgraph (an If branch, a
    Loop body) that reads on the host a value ONNX Runtime computes on the GPU (host_reads.py
    replays its placement). ONNX Runtime 1.31.1 on an H200 gave such files wrong blocks (max
    error 1-5) and a Range of 10^18 bytes with asynchronous launches, order-dependently
    (benchmarks/gpu_cure.md). Our exports read nothing so (If branches hoisted, Loop bodies reading
    their scalars from their own Shape) but Sandwich's, whose distance table's length comes from the
    positions' values. The portable blocked body is fenced too: ALiBi's still raced without any
    such read (host_reads.unfused_loops). The GPU-target files (--target cuda / cuda-ort) and the
    in-place cache files run with ONNX Runtime's default asynchronous launches.
    CUDA reads the variable when the process creates its context: a risky file opened after an
    asynchronous session is warned about (set CUDA_LAUNCH_BLOCKING=1 before starting such a process)."""
    import os

    if "CUDA_LAUNCH_BLOCKING" in os.environ:
        return
    if not any(needs_host_sync(p) for p in model_paths):
        _cuda_async.append(True)
        return
    if _cuda_async:
        print("warning: this process started CUDA with asynchronous launches; "
              f"{Path(model_paths[0]).name} reads index values on the host inside If/Loop subgraphs, which ONNX "
              "Runtime CUDA can read stale so: set CUDA_LAUNCH_BLOCKING=1 before starting the process", file=sys.stderr)
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"


def create_session(model_path: str, provider: str = "cpu", threads: int = 0, tf32: bool = False, lean: bool = False,
                   denormal_as_zero: bool = True, last_logits: bool = False):
    """An InferenceSession on exactly the requested provider, or RunnerError naming the cause.
    last_logits: a decoder's graph edited to compute the last position's logits only (a server's
    sessions; common/last_logits.py), where the graph has a head to slice."""
    try:
        import onnxruntime as ort
    except ImportError as err:
        stop = stop_behind(err)  # Ctrl-C or SIGTERM while it loaded: a stop, not a missing package
        if stop is not None:
            raise stop from None
        raise RunnerError("onnxruntime is not installed") from None
    wanted = PROVIDERS[provider]
    if provider == "cuda":
        host_synchronous_cuda(model_path)
        if hasattr(ort, "preload_dlls"):
            try:
                ort.preload_dlls()
            except Exception:
                pass  # the provider check below reports what matters
        available = ort.get_available_providers()
        if wanted not in available:
            raise RunnerError(
                f"CUDA requested, but this onnxruntime build has no CUDAExecutionProvider "
                f"(available: {', '.join(available)}); install onnxruntime-gpu"
            )
    ort.set_default_logger_severity(4)  # load-time warnings too (see session_options)
    opts = session_options(ort, threads, lean, provider, denormal_as_zero)
    if tf32 and provider != "cuda":
        raise RunnerError("--tf32 applies to the cuda provider only")
    try:
        source = session_source(model_path, opts) if last_logits else None
        session = ort.InferenceSession(source or model_path, opts, providers=provider_list(provider, tf32))
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunnerError(f"cannot load model {model_path}: {first}") from None
    return_free_heap()  # the parsed file's pages, freed once the weights are copied out (memory.py)
    active = session.get_providers()
    if active[0] != wanted:
        raise RunnerError(
            f"{wanted} did not load (session runs on {active[0]}); check the CUDA and cuDNN libraries"
        )
    return session


def input_specs(session) -> list[InputSpec]:
    specs = []
    for i in session.get_inputs():
        if i.type not in ONNX_TYPE_TO_NUMPY:
            raise RunnerError(f"input {i.name!r} has unsupported type {i.type}")
        specs.append(InputSpec(i.name, np.dtype(ONNX_TYPE_TO_NUMPY[i.type]), tuple(i.shape)))
    return specs


def run(session, feeds):
    try:
        values = session.run(None, feeds)
    except Exception as err:
        raise RunnerError(f"onnxruntime failed: {str(err).strip().splitlines()[0]}") from None
    return {o.name: v for o, v in zip(session.get_outputs(), values)}


SHARED_SLACK = 3  # rows past a step's own in the shared buffer: a client's buffer is longer than the step
CLIENT_STEPS = 3  # a prompt into an empty cache: its last tokens are fed one at a time, as a client decodes


def run_shared(session, feeds):
    """The call as a client with ONE buffer per cache tensor runs it (onnxruntime-genai's
    past_present_share_buffer): each past copied into a [B, H, past + new + SHARED_SLACK, d]
    buffer, zeros after it, bound as the past input AND the present output; a file that writes
    its cache in place fills rows [past, past + new). A prompt into an empty cache runs as
    prefill then steps: its first tokens in one call, its last CLIENT_STEPS one call each into
    the same buffer, the outputs joined along the sequence (a --logits last file: the last
    call's). Returns the outputs, each present as the buffer's first past + new rows. A file
    whose present is not the buffer (a Concat file) fails here: ONNX Runtime refuses an output
    of another shape."""
    outputs = [o.name for o in session.get_outputs()]
    try:
        layout = cache_layout(feeds, outputs)
    except ValueError as err:
        raise RunnerError(str(err)) from None
    if layout is None:
        return run(session, feeds)
    total = feeds["attention_mask"].shape[1]
    device = "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"  # the cache stays on the GPU
    buffers = {name: _buffer(feeds[name], total, device) for name in layout.past}
    present_of = dict(zip(layout.present, layout.past))
    past, new = feeds[layout.past[0]].shape[2], feeds["input_ids"].shape[1]
    cuts = [0, new] if past or new <= CLIENT_STEPS else [0, *range(new - CLIENT_STEPS, new + 1)]
    calls = []
    for a, b in zip(cuts, cuts[1:]):
        step = {**feeds, "input_ids": feeds["input_ids"][:, a:b], "attention_mask": feeds["attention_mask"][:, :past + b]}
        calls.append(_bound_call(session, step, buffers, present_of, outputs))
    values = {}
    for name in outputs:
        if name in present_of:
            values[name] = buffers[present_of[name]].numpy()[:, :, :total].copy()
        elif calls[0][name].ndim > 1 and calls[0][name].shape[1] == cuts[1]:  # per position: join the calls
            values[name] = np.concatenate([c[name] for c in calls], axis=1)
        else:
            values[name] = calls[-1][name]
    return values


def _buffer(past: np.ndarray, total: int, device: str):
    import onnxruntime as ort

    buffer = np.zeros((*past.shape[:2], total + SHARED_SLACK, past.shape[3]), past.dtype)
    buffer[:, :, :past.shape[2]] = past
    return ort.OrtValue.ortvalue_from_numpy(buffer, device, 0)


def _bound_call(session, feeds, buffers, present_of, outputs) -> dict:
    """One call with every past and its present bound to the same buffer; the other outputs."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if name in buffers:
            binding.bind_ortvalue_input(name, buffers[name])
        else:
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
    for name in outputs:
        if name in present_of:
            binding.bind_ortvalue_output(name, buffers[present_of[name]])
        else:
            binding.bind_output(name, "cpu")
    try:
        session.run_with_iobinding(binding)
    except Exception as err:
        raise RunnerError(f"onnxruntime failed with a shared cache buffer: {str(err).strip().splitlines()[0]}") from None
    return dict(zip([n for n in outputs if n not in present_of], binding.copy_outputs_to_cpu()))


def main(argv=None) -> int:
    def options(p):
        p.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
        p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: runtime default)")
        p.add_argument("--tf32", action="store_true", help="cuda: allow TF32 matmuls (faster, ~1e-3 error)")
        p.add_argument("--shared-cache", action="store_true",
                       help="bind each past and its present to one buffer (an in-place --target ort file)")

    args = parse(__doc__.splitlines()[0], options, argv)
    return run_all(args, lambda path: create_session(path, args.provider, args.threads, args.tf32), input_specs,
                   run_shared if args.shared_cache else run,
                   f"ort-{args.provider}{'-tf32' if args.tf32 else ''}{'-shared' if args.shared_cache else ''}",
                   metadata_of=lambda session: session.get_modelmeta().custom_metadata_map)


if __name__ == "__main__":
    sys.exit(main())

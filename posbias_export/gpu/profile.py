"""What one exported attention file ran at each length, on ONNX Runtime CUDA, in its own process.

Run as a module (python -m posbias_export.gpu.profile model.onnx --lengths ... --dtype ...) after its timings
(posbias_export/bench/worker.py --provider cuda, the CPU bench's worker): one JSON line per
length with ONNX Runtime's profiler (ms per operator type, a fresh session) and, where PyTorch
with CUDA is importable, the CUDA kernels its profiler (CUPTI, process-wide) saw in the same
runs: the name of the attention kernel each cell ran (flash, memory-efficient, cuDNN, unfused).
--provider cpu runs the same steps on ORT CPU (the rehearsal before a GPU lease).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from pathlib import Path

import numpy as np

from posbias_export.bench.worker import make_inputs, ort_runner, served_providers

DTYPES = {"float16": np.float16, "float32": np.float32}


def feeds(length: int, heads: int, head_dim: int, dtype) -> dict[str, np.ndarray]:
    return dict(zip(("query", "key", "value"), make_inputs(heads, head_dim, length, dtype=dtype)))


class CudaKernels:
    """Context manager: the CUDA kernels launched in this process while it is open, by total
    device time (PyTorch's profiler over CUPTI sees ONNX Runtime's launches too). `names` stays
    None where PyTorch or CUDA is missing; `error` says why a trace failed."""

    def __init__(self):
        self.names, self.error, self._prof = None, None, None

    def __enter__(self):
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if torch.cuda.is_available():
                self._prof = profile(activities=[ProfilerActivity.CUDA])
                self._prof.__enter__()
        except Exception as err:  # noqa: BLE001 - the timings stand without kernel names
            self.error = str(err)[:200]
        return self

    def __exit__(self, *exc):
        if self._prof is None:
            return False
        self._prof.__exit__(*exc)
        try:
            totals = {}
            for e in self._prof.events():
                if str(getattr(e, "device_type", "")).endswith("CUDA"):
                    us = e.time_range.elapsed_us()  # a kernel's own span (device events carry it)
                    totals[e.name] = totals.get(e.name, 0.0) + us
            self.names = [{"kernel": k[:160], "us": round(v, 1)} for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:8]]
        except Exception as err:  # noqa: BLE001
            self.error = str(err)[:200]
        return False


def profile_length(model: str, provider: str, length: int, heads: int, head_dim: int, dtype) -> dict:
    """What one forward at this length ran: ORT's ops (ms per type) and, on CUDA, the kernels."""
    import onnxruntime as ort

    kernels = CudaKernels() if provider == "cuda" else contextlib.nullcontext()
    result = ort_runner("profile.py").profile(model, feeds(length, heads, head_dim, dtype), runs=1,
                                              providers=served_providers(model, provider),
                                              options=ort_runner().session_options(ort, provider=provider), during=kernels)
    row = {"length": length, "ort_ops_ms": {r["op"]: round(r["us"] / 1e3, 3) for r in result["ops"][:8]},
           "wall_ms": round(result["wall_us"] / 1e3, 3)}
    if provider == "cuda":
        row["cuda_kernels"] = kernels.names
        row["cuda_kernels_error"] = kernels.error
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__)
    p.add_argument("model")
    p.add_argument("--lengths", required=True, help="comma-separated")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    os.environ["ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO"] = "1"  # MHA / GQA print the kernel they pick
    for length in sorted(int(n) for n in args.lengths.split(",")):
        try:
            row = profile_length(args.model, args.provider, length, args.heads, args.head_dim, DTYPES[args.dtype])
        except Exception as err:  # noqa: BLE001 - a length that failed to run has no profile either
            row = {"length": length, "profile_error": str(err).strip()[:300]}
        print(json.dumps({"length": length, "profile": row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

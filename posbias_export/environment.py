"""The machine and library versions a results file was measured with (every results header
uses this): CPU model and the instruction sets that change the numbers (AVX-512, bf16); and its
memory bandwidth, the floor of a step that reads its weights."""
from __future__ import annotations

import os
import re
import platform
import time


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return {}
    fields = {}
    for line in info.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's vendor, model name, family and model numbers and the vector extensions that
    change the numbers, e.g. 'GenuineIntel Intel(R) Xeon(R) ... (family 6 model 207; avx2, avx512,
    bf16, amx)': the vendor decides what a subnormal float costs (Intel cores take a slow assist,
    AMD's barely), the extensions the kernels ONNX Runtime picks. The machine type where
    /proc/cpuinfo is missing."""
    info = _cpuinfo()
    if not info:
        return platform.processor() or platform.machine()
    name = info.get("model name", platform.machine())
    vendor = info.get("vendor_id", "")
    flags = set(info.get("flags", "").split())
    extras = [label for label, flag in (("avx2", "avx2"), ("avx512", "avx512f"), ("bf16", "avx512_bf16"),
                                        ("amx", "amx_tile")) if flag in flags]
    numbers = f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else ""
    inside = "; ".join(part for part in (numbers, ", ".join(extras)) if part)
    label = f"{vendor} {name}" if vendor and vendor not in name else name
    return f"{label} ({inside})" if inside else label


def cpu_vendor() -> str:
    """'intel', 'amd' or 'other': whether subnormal floats are slow here (Intel: a microcode
    assist per operand, 2-8x a softmax block's time; AMD: barely)."""
    vendor = _cpuinfo().get("vendor_id", "")
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, "other")


def environment(bandwidth: bool = True) -> dict:
    """The machine of a results file: CPU (cpu_model), its count, libraries, and the read bandwidth
    measured now (read_bandwidth_gbs; bandwidth=False skips the second it takes)."""
    import onnxruntime
    import torch

    try:
        import openvino

        ov_version = getattr(openvino, "__version__", None)  # a namespace package without OpenVINO has none
    except ImportError:
        ov_version = None
    return {"machine": platform.machine(), "processor": cpu_model(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "onnxruntime": onnxruntime.__version__, "openvino": ov_version,
            "read_gbs": round(read_bandwidth_gbs(), 1) if bandwidth else None}


def describe(env: dict | None = None) -> str:
    """One line for a results header."""
    env = env or environment()
    ov = f", openvino {env['openvino']}" if env.get("openvino") else ""
    read = f", read bandwidth {env['read_gbs']} GB/s (measured in this run)" if env.get("read_gbs") else ""
    return (f"Machine: {env['cpus']} CPUs ({env['processor']}){read}, Python {env['python']}, torch {env['torch']} "
            f"({env['torch_threads']} threads), onnxruntime {env['onnxruntime']}{ov}.")


def gpu_environment() -> dict:
    """environment() plus the GPU a CUDA run used (PyTorch's view, the driver from NVML) and
    onnxruntime's providers: the header of every GPU results file, read on that machine."""
    import datetime

    import onnxruntime
    import torch

    env = {**environment(), "providers": onnxruntime.get_available_providers(),
           "date": datetime.date.today().isoformat(), "gpu": None, "driver": None}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - the driver version is a nicety
            pass
    return env


def describe_gpu(env: dict) -> str:
    gpu = f"one {env['gpu']} (driver {env['driver']})" if env.get("gpu") else "no GPU (a CPU rehearsal)"
    return (f"Machine: {gpu}, {env['cpus']} CPU cores; onnxruntime {env['onnxruntime']} "
            f"({', '.join(p.replace('ExecutionProvider', '') for p in env.get('providers', []))}), "
            f"torch {env['torch']}; {env.get('date', '')}.")


LOCAL_PATH = re.compile(r"(?<![\w.])(/[\w.@+-]+)+/([\w.@+-]+)")  # an absolute path: its last part is kept


def without_local_paths(row: dict) -> dict:
    """A results row as it may be committed: every absolute path in its text (an error naming the
    temporary folder it read) cut to its last part, so no machine's paths are published."""
    return {k: LOCAL_PATH.sub(r"…/\2", v) if isinstance(v, str) else v for k, v in row.items()}


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth as a numpy copy moves it: the bytes read plus the bytes written, per second."""
    import numpy as np

    a = np.ones(megabytes * (1 << 20) // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best / 1e9


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Memory bandwidth as a read-only reduction moves it, every core reducing its own slice of a
    buffer far larger than the caches: what a decode step that reads its weights is bounded by.
    The fastest of two reductions: numpy's sum (pairwise, 14.6 GB/s on the 2-vCPU EPYC) is slower
    than the memory there, its max (19.1 GB/s) is not; a decode step read 17.4 GB/s, so a floor
    from the sum alone was one our steps beat."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(megabytes * (1 << 20) // 4, np.float32)
    parts = np.array_split(a, os.cpu_count() or 1)
    best = float("inf")
    with ThreadPoolExecutor(len(parts)) as pool:  # numpy's reductions release the GIL
        for reduce in (np.max, np.sum):
            for _ in range(repeats):
                start = time.perf_counter()
                list(pool.map(reduce, parts))
                best = min(best, time.perf_counter() - start)
    return a.nbytes / best / 1e9


def exporter_versions() -> dict[str, str]:
    """The exporters a comparison ran beside ours (Optimum's, transformers')."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "optimum", "optimum-onnx"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found

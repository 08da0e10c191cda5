"""The runtimes a model is validated on: each is a runner script in runtimes/ (torch-free, as a
deployment machine has it), run as its own process on ONNX backend-test tensors."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..runners import RUNTIMES_DIR, runtimes_common


@dataclass(frozen=True)
class Runtime:
    name: str
    command: tuple[str, ...]  # runner script relative to runtimes/, and fixed options; the interpreter is added
    interpreter: str  # "python" or "node"
    module: str | None = None  # a Python package it needs
    precision: str = "native"  # "bfloat16" / "tf32": judged against a PyTorch bfloat16 / float16 run


RUNTIMES = {
    r.name: r
    for r in (
        Runtime("ort-cpu", ("ort/run.py", "--provider", "cpu"), "python", "onnxruntime"),
        # the cache bound to one buffer as past and present (an in-place --target ort file, as genai runs it)
        Runtime("ort-cpu-shared", ("ort/run.py", "--provider", "cpu", "--shared-cache"), "python", "onnxruntime"),
        Runtime("ort-cuda", ("ort/run.py", "--provider", "cuda"), "python", "onnxruntime"),  # TF32 off: exact float32
        Runtime("ort-cuda-shared", ("ort/run.py", "--provider", "cuda", "--shared-cache"), "python", "onnxruntime"),
        Runtime("ort-cuda-tf32", ("ort/run.py", "--provider", "cuda", "--tf32"), "python", "onnxruntime", "tf32"),
        Runtime("openvino", ("openvino/run.py", "--precision", "f32"), "python", "openvino"),
        Runtime("openvino-bf16", ("openvino/run.py", "--precision", "bf16"), "python", "openvino", "bfloat16"),
        Runtime("node", ("node/run.js",), "node"),
        Runtime("reference", ("reference/run.py",), "python", "onnx"),
    )
}
DEFAULT_RUNTIMES = ("ort-cpu", "openvino", "node", "reference")


def load_runner(relative: str) -> ModuleType:
    """A runner script as a module, e.g. load_runner("ort/generate.py")."""
    return runtimes_common("loading").load_runner(relative)


def unavailable_reason(runtime: Runtime) -> str | None:
    script = RUNTIMES_DIR / runtime.command[0]
    if not script.is_file():
        return f"runner {script} not found (a broken install: reinstall posbias_export)"
    if runtime.interpreter == "node":
        if shutil.which("node") is None:
            return "node is not on PATH"
        if not (RUNTIMES_DIR / "node" / "node_modules" / "onnxruntime-node").is_dir():
            return f"onnxruntime-node is not installed (cd {RUNTIMES_DIR / 'node'} && npm install --ignore-scripts)"
    elif runtime.module and importlib.util.find_spec(runtime.module) is None:
        return f"python package {runtime.module!r} is not installed"
    return None


def run_runner(runtime: Runtime, model_path: Path, data_dir: Path, out_dir: Path, timeout: float,
               fresh: bool = False) -> str | None:
    """Run one runner process (fresh: a new session per data set); None on success, else its
    one-line error."""
    interpreter = sys.executable if runtime.interpreter == "python" else "node"
    cmd = [interpreter, str(RUNTIMES_DIR / runtime.command[0]), str(model_path), str(data_dir), str(out_dir),
           *runtime.command[1:], *(["--fresh-sessions"] if fresh else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.splitlines() if "error" in l.lower()] or proc.stderr.strip().splitlines() or ["no message"]
        return lines[-1].split("error: ", 1)[-1].strip()
    return None


def installed_defaults() -> tuple[tuple[str, ...], dict[str, str]]:
    """The default runtimes this machine can run, and why each of the others cannot."""
    missing = {name: reason for name in DEFAULT_RUNTIMES if (reason := unavailable_reason(RUNTIMES[name]))}
    return tuple(n for n in DEFAULT_RUNTIMES if n not in missing), missing

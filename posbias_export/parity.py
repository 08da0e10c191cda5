"""The parity matrix: rebuild the PyTorch reference from a model file's metadata, run every
requested runtime's runner (runtimes/) as a separate process on the same inputs, and compare.
Measures and judges here; printing and exit codes belong to the CLI."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .checkpoint import load_checkpoint
from .export import INPUT_NAMES, read_metadata
from .model import ModelConfig, build_model
from .validate import BFLOAT16, FLOAT16, FLOAT32, Parity, Tolerance, compare, torch_outputs

RUNTIMES_DIR = Path(__file__).resolve().parents[1] / "runtimes"


@dataclass(frozen=True)
class Runtime:
    name: str
    command: tuple[str, ...]  # relative script and fixed options; the interpreter is added
    interpreter: str  # "python" or "node"
    module: str | None = None  # a Python package it needs
    precision: str = "native"  # "bfloat16": judged against a PyTorch bfloat16 run


RUNTIMES = {
    r.name: r
    for r in (
        Runtime("ort-cpu", ("ort/run.py", "--provider", "cpu"), "python", "onnxruntime"),
        Runtime("ort-cuda", ("ort/run.py", "--provider", "cuda"), "python", "onnxruntime"),
        Runtime("openvino", ("openvino/run.py", "--precision", "f32"), "python", "openvino"),
        Runtime("openvino-bf16", ("openvino/run.py", "--precision", "bf16"), "python", "openvino", "bfloat16"),
        Runtime("node", ("node/run.js",), "node"),
        Runtime("reference", ("reference/run.py",), "python", "onnx"),
    )
}
DEFAULT_RUNTIMES = ("ort-cpu", "openvino", "node", "reference")


class ParityInputError(ValueError):
    pass


@dataclass
class Cell:
    runtime: str
    case: str  # e.g. "L=17 B=3" or the inputs file name
    dtype: str
    verdict: str  # "pass", "FAIL", "error: ...", "unavailable: ..."
    parity: dict | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"


@dataclass
class Matrix:
    model: str
    bias: str
    arch: str
    cells: list[Cell] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.cells) and all(c.ok for c in self.cells)

    def as_dict(self) -> dict:
        return {"model": self.model, "bias": self.bias, "arch": self.arch, "ok": self.ok,
                "cells": [asdict(c) for c in self.cells]}


def unavailable_reason(runtime: Runtime) -> str | None:
    script = RUNTIMES_DIR / runtime.command[0]
    if not script.is_file():
        return f"runner {script} not found (is this a source checkout?)"
    if runtime.interpreter == "node":
        if shutil.which("node") is None:
            return "node is not on PATH"
        if not (RUNTIMES_DIR / "node" / "node_modules" / "onnxruntime-node").is_dir():
            return "onnxruntime-node is not installed (cd runtimes/node && npm install --ignore-scripts)"
    elif runtime.module and importlib.util.find_spec(runtime.module) is None:
        return f"python package {runtime.module!r} is not installed"
    return None


def load_model_file(path: str | Path) -> tuple[onnx.ModelProto, dict]:
    path = Path(path)
    if not path.is_file():
        raise ParityInputError(f"model {path} does not exist")
    try:
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
    except Exception as err:
        raise ParityInputError(f"model {path} is not a valid ONNX file: {str(err).strip().splitlines()[0][:200]}") from None
    meta = read_metadata(proto)
    if "config" not in meta:
        raise ParityInputError(f"model {path} has no posbias metadata: export it with posbias_export")
    return proto, meta


def reference_model(meta: dict, checkpoint: str | None = None) -> torch.nn.Module:
    """The PyTorch model a file was exported from, rebuilt from its metadata."""
    cfg = ModelConfig.from_dict(json.loads(meta["config"]))
    arch = meta.get("arch", "lm")
    checkpoint = checkpoint or meta.get("checkpoint")
    if checkpoint:
        if not Path(checkpoint).is_file():
            raise ParityInputError(f"checkpoint {checkpoint} (needed for this model's weights) does not exist")
        model = load_checkpoint(checkpoint, cfg, arch)
    else:
        model = build_model(cfg, seed=int(meta.get("seed", 0)), arch=arch)
    for module in model.modules():
        if hasattr(module, "impl"):
            if int(meta.get("opset", 18)) >= 23:
                module.impl = "sdpa"
            # The file's own attention form: equal math on real tokens, and the same (arbitrary)
            # output on fully padded query rows; in blocks the float64 reference fits at 16k too.
            module.form = meta.get("attention", "plain")
            module.block = int(meta.get("attention_block", module.block))
    return model


def generated_inputs(meta: dict, length: int, batch: int, seed: int) -> dict[str, np.ndarray]:
    cfg = ModelConfig.from_dict(json.loads(meta["config"]))
    arch = meta.get("arch", "lm")
    gen = torch.Generator().manual_seed(seed)
    if arch == "lm":
        feeds = {"input_ids": torch.randint(0, cfg.vocab_size, (batch, length), generator=gen).numpy()}
    elif arch == "attention":
        dtype = np.float16 if meta.get("dtype") == "float16" else np.float32
        shape = (batch, cfg.num_heads, length, cfg.head_dim)
        return {name: torch.randn(shape, generator=gen).numpy().astype(dtype) for name in ("query", "key", "value")}
    else:
        dtype = np.float16 if meta.get("dtype") == "float16" else np.float32
        feeds = {"hidden_states": torch.randn(batch, length, cfg.dim, generator=gen).numpy().astype(dtype)}
    if meta.get("attention_mask") == "1":
        feeds["attention_mask"] = np.ones((batch, length), dtype=np.int64)
    return feeds


def check_user_inputs(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """The runners' own input check (runtimes/common/feeds.py), applied before PyTorch runs."""
    sys.path.insert(0, str(RUNTIMES_DIR))
    try:
        from common.feeds import InputSpec, check_feeds
        from common.tensor_io import RunnerError
    finally:
        sys.path.remove(str(RUNTIMES_DIR))
    specs = []
    for value in proto.graph.input:
        t = value.type.tensor_type
        dims = tuple(d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim)
        specs.append(InputSpec(value.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims))
    try:
        check_feeds(feeds, specs)
    except RunnerError as err:
        raise ParityInputError(str(err)) from None


def _torch_args(meta: dict, feeds: dict[str, np.ndarray]) -> tuple:
    arch = meta.get("arch", "lm")
    if arch == "attention":
        return tuple(torch.from_numpy(feeds[name]) for name in INPUT_NAMES[arch])
    first = torch.from_numpy(feeds[INPUT_NAMES[arch][0]])
    if "attention_mask" not in feeds:
        return (first,)
    mask = torch.from_numpy(feeds["attention_mask"])
    return (first, mask) if arch == "lm" else (first, None, mask)


def _run_runner(runtime: Runtime, model_path: Path, data_dir: Path, out_dir: Path, timeout: float) -> str | None:
    """Run one runner process; None on success, else its one-line error."""
    interpreter = sys.executable if runtime.interpreter == "python" else "node"
    cmd = [interpreter, str(RUNTIMES_DIR / runtime.command[0]), str(model_path), str(data_dir), str(out_dir),
           *runtime.command[1:]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.splitlines() if "error" in l.lower()] or proc.stderr.strip().splitlines() or ["no message"]
        return lines[-1].split("error: ", 1)[-1].strip()
    return None


def run_matrix(
    model_path: str | Path,
    runtimes: tuple[str, ...] = DEFAULT_RUNTIMES,
    lengths: tuple[int, ...] = (1, 17, 1024),
    batch: int = 3,
    checkpoint: str | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    timeout: float = 1800.0,
    progress=None,
) -> Matrix:
    """Measure every runtime on every case against float64 PyTorch. `inputs` (a user's own
    tensors) replaces the generated lengths. `progress(n)` is called as work completes."""
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ParityInputError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")
    model_path = Path(model_path)
    proto, meta = load_model_file(model_path)
    cfg = json.loads(meta["config"])
    matrix = Matrix(str(model_path), cfg["bias"], meta.get("arch", "lm"))
    dtype = meta.get("dtype", "float32")
    if inputs is not None:
        check_user_inputs(proto, inputs)
        cases = [("inputs", inputs)]
    else:
        cases = [(f"L={n} B={batch}", generated_inputs(meta, n, batch, seed=n)) for n in lengths]
    model = reference_model(meta, checkpoint)
    refs = []
    for _, feeds in cases:
        args = _torch_args(meta, feeds)
        ref64 = torch_outputs(model, args, torch.float64)
        same = torch_outputs(model, args, torch.float16 if dtype == "float16" else torch.float32)
        refs.append((ref64, same, args))
    with tempfile.TemporaryDirectory(prefix="posbias-parity-") as tmp:
        data_dir = Path(tmp) / "data"
        for index, (_, feeds) in enumerate(cases):
            set_dir = data_dir / f"test_data_set_{index}"
            set_dir.mkdir(parents=True)
            for k, (name, array) in enumerate(feeds.items()):
                (set_dir / f"input_{k}.pb").write_bytes(numpy_helper.from_array(array, name).SerializeToString())
        for name in runtimes:
            runtime = RUNTIMES[name]
            reason = unavailable_reason(runtime)
            error = None if reason else _run_runner(runtime, model_path, data_dir, Path(tmp) / name, timeout)
            for index, (case, _) in enumerate(cases):
                if reason:
                    matrix.cells.append(Cell(name, case, dtype, f"unavailable: {reason}"))
                    continue
                if error:
                    matrix.cells.append(Cell(name, case, dtype, f"error: {error}"))
                    continue
                out = numpy_helper.to_array(onnx.load_tensor(str(Path(tmp) / name / f"test_data_set_{index}" / "output_0.pb")))
                ref64, same, args = refs[index]
                tol = FLOAT16 if dtype == "float16" else FLOAT32
                if runtime.precision == "bfloat16":
                    same, tol = torch_outputs(model, args, torch.bfloat16), BFLOAT16
                parity = compare(out, ref64, same, tol)
                matrix.cells.append(Cell(name, case, dtype, "pass" if parity.passed else "FAIL", parity.as_dict()))
            if progress:
                progress(1)
    return matrix


def format_matrix(matrix: Matrix, markdown: bool = False) -> str:
    head = ["runtime", "case", "dtype", "max abs err", "max rel err", "budget at worst", "verdict"]
    rows = []
    for c in matrix.cells:
        p = c.parity or {}
        num = lambda k: f"{p[k]:.2e}" if k in p else "-"
        rows.append([c.runtime, c.case, c.dtype, num("max_abs"), num("max_rel"), num("budget_abs"), c.verdict])
    if markdown:
        lines = [f"### {matrix.bias} ({matrix.arch}): `{Path(matrix.model).name}`", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths[:-1])) + "  " + str(r[-1])
    title = f"{matrix.model}: {matrix.bias} {matrix.arch} -> {'ALL PASS' if matrix.ok else 'FAILURES'}"
    return "\n".join([title, fmt(head)] + [fmt(r) for r in rows])

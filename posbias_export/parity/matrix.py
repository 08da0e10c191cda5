"""The parity matrix: every requested runtime's runner on the same inputs, each output judged
against a float64 PyTorch run of the model the file was exported from (in the file's own
attention form). Measures and judges here; printing and exit codes belong to the CLI."""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..export import settings_from_metadata
from .reference import ParityInputError, generated_inputs, load_model_file, reference_model, torch_args, torch_outputs
from .runtimes import DEFAULT_RUNTIMES, RUNTIMES, run_runner, runtimes_common, unavailable_reason
from .tolerance import BFLOAT16, FLOAT16, FLOAT32, TF32, compare


NOT_RUN = "not run: "


@dataclass
class Cell:
    """One (runtime, case) verdict of the matrix."""

    runtime: str
    case: str  # e.g. "L=17 B=3" or the inputs file name
    dtype: str
    verdict: str  # "pass", "FAIL", "error: ...", "unavailable: ..."
    parity: dict | None = None

    @property
    def ok(self) -> bool:  # "not run: ..." is a case a reference row cannot do (transformers' MPT past max_seq_len)
        return self.verdict == "pass" or self.verdict.startswith(NOT_RUN)


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


def check_user_inputs(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """The runners' own input check (runtimes/common/feeds.py), applied before PyTorch runs."""
    feeds_module, tensor_io = runtimes_common("feeds"), runtimes_common("tensor_io")
    InputSpec, check_feeds, RunnerError = feeds_module.InputSpec, feeds_module.check_feeds, tensor_io.RunnerError
    specs = []
    for value in proto.graph.input:
        t = value.type.tensor_type
        dims = tuple(d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim)
        specs.append(InputSpec(value.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims))
    metadata = {p.key: p.value for p in proto.metadata_props}
    try:
        check_feeds(feeds, feeds_module.with_token_limit(specs, metadata))
    except RunnerError as err:
        raise ParityInputError(str(err)) from None


def runtime_outputs(runtimes, model_path: Path, cases: list[dict[str, np.ndarray]], timeout: float):
    """Run each runtime's runner once over every case (as ONNX test data sets); yields
    (name, runtime, problem, outputs): problem is "unavailable: ..." / "error: ..." or None, and
    outputs the first output of each case."""
    with tempfile.TemporaryDirectory(prefix="posbias-parity-") as tmp:
        data_dir = Path(tmp) / "data"
        for index, feeds in enumerate(cases):
            set_dir = data_dir / f"test_data_set_{index}"
            set_dir.mkdir(parents=True)
            for k, (name, array) in enumerate(feeds.items()):
                (set_dir / f"input_{k}.pb").write_bytes(numpy_helper.from_array(array, name).SerializeToString())
        for name in runtimes:
            runtime = RUNTIMES[name]
            reason = unavailable_reason(runtime)
            if reason:
                yield name, runtime, f"unavailable: {reason}", None
                continue
            error = run_runner(runtime, model_path, data_dir, Path(tmp) / name, timeout)
            if error:
                yield name, runtime, f"error: {error}", None
                continue
            outputs = [numpy_helper.to_array(onnx.load_tensor(str(Path(tmp) / name / f"test_data_set_{i}" / "output_0.pb")))
                       for i in range(len(cases))]
            yield name, runtime, None, outputs


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
    settings = settings_from_metadata(meta)
    refs = []
    for _, feeds in cases:
        args = torch_args(meta, feeds)
        ref64 = torch_outputs(model, args, torch.float64, settings)
        same = torch_outputs(model, args, torch.float16 if dtype == "float16" else torch.float32, settings)
        refs.append((ref64, same, args))
    for name, runtime, problem, outputs in runtime_outputs(runtimes, model_path, [f for _, f in cases], timeout):
        for index, (case, _) in enumerate(cases):
            if problem:
                matrix.cells.append(Cell(name, case, dtype, problem))
                continue
            ref64, same, args = refs[index]
            tol = FLOAT16 if dtype == "float16" else FLOAT32
            if runtime.precision == "bfloat16":
                same, tol = torch_outputs(model, args, torch.bfloat16, settings), BFLOAT16
            elif runtime.precision == "tf32" and dtype == "float32":  # a float16 file has no float32 matmul
                same, tol = torch_outputs(model, args, torch.float16, settings), TF32
            parity = compare(outputs[index], ref64, same, tol)
            matrix.cells.append(Cell(name, case, dtype, "pass" if parity.passed else "FAIL", parity.as_dict()))
        if progress:
            progress(1)
    return matrix

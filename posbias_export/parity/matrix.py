"""The parity matrix: every requested runtime's runner on the same inputs, each output judged
against a float64 PyTorch run of the model the file was exported from (in the file's own
attention form). Measures and judges here; printing and exit codes belong to the CLI."""
from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..export import settings_from_metadata
from ..nn import DEFAULT_BLOCK
from .reference import ParityInputError, generated_inputs, load_model_file, reference_model, torch_args, torch_outputs
from .runtimes import DEFAULT_RUNTIMES, RUNTIMES, run_runner, runtimes_common, unavailable_reason
from .quantized import judge as judge_quantized
from .quantized import sampled_ids_cached
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


@dataclass
class RuntimeRun:
    """One runtime's outputs over every case: `outputs` from a fresh session per case (what is
    judged against the reference), `shared` from ONE session that ran the cases in ascending and
    then descending size (what a server does), `order` the case indices in that order."""

    name: str
    runtime: object
    problem: str | None = None  # "unavailable: ..." / "error: ...": nothing ran
    outputs: list[np.ndarray] | None = None
    shared: list[np.ndarray] | None = None
    shared_problem: str | None = None
    order: list[int] = field(default_factory=list)

    def order_cells(self, dtype: str) -> list[Cell]:
        """The order protocol: the shared session's outputs must equal the fresh sessions' bit
        for bit, in each direction; a FAIL names the direction and the cases that differ."""
        if self.problem or not self.order:
            return []
        n = len(self.order) // 2
        cells = []
        for label, part in (("ascending", range(n)), ("descending", range(n, 2 * n))):
            case = f"one session, sizes {label}"
            if self.shared_problem:
                cells.append(Cell(self.name, case, dtype, self.shared_problem))
                continue
            differ = {}
            for k in part:
                fresh, shared = self.outputs[self.order[k]], self.shared[k]
                if fresh.shape != shared.shape or fresh.tobytes() != shared.tobytes():
                    diff = np.abs(fresh.astype(np.float64) - shared.astype(np.float64)).max() \
                        if fresh.shape == shared.shape else float("inf")
                    differ[f"case {self.order[k]}"] = float(diff)
            detail = {"bit_identical": not differ, "max_abs_diff": differ}
            cells.append(Cell(self.name, case, dtype, "pass" if not differ else
                              f"FAIL: {label} in one session differs from fresh sessions ({', '.join(differ)})", detail))
        return cells


def _write_sets(data_dir: Path, cases: list[dict[str, np.ndarray]]) -> None:
    for index, feeds in enumerate(cases):
        set_dir = data_dir / f"test_data_set_{index}"
        set_dir.mkdir(parents=True)
        for k, (name, array) in enumerate(feeds.items()):
            (set_dir / f"input_{k}.pb").write_bytes(numpy_helper.from_array(array, name).SerializeToString())


def _read_outputs(out_dir: Path, count: int) -> list[np.ndarray]:
    return [numpy_helper.to_array(onnx.load_tensor(str(out_dir / f"test_data_set_{i}" / "output_0.pb")))
            for i in range(count)]


def quantized_inputs(meta: dict, model: torch.nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A generated LM case made into what the quantized policy judges on: its tokens replaced by
    tokens the float model samples itself, and a cached decoder's step made a prefill (an
    empty cache: random cached keys are not the model's)."""
    batch, length = feeds["input_ids"].shape
    vocab = json.loads(meta["config"]).get("vocab_size", 256)
    lm = getattr(model, "lm", model)  # a --kv-cache file's reference wraps the DecoderLM
    ids = sampled_ids_cached(lm, batch, length, vocab, seed=length)
    out = {"input_ids": ids}
    if "attention_mask" in feeds:
        out["attention_mask"] = np.ones((batch, length), np.int64)
    for name, value in feeds.items():
        if name.startswith("past_"):
            out[name] = value[:, :, :0]
    return out


def runtime_outputs(runtimes, model_path: Path, cases: list[dict[str, np.ndarray]], timeout: float,
                    order: bool = True):
    """Run each runtime's runner over every case (as ONNX test data sets), a fresh session per
    case; with `order`, also one shared session over the cases in ascending then descending
    size. Yields a RuntimeRun per runtime (outputs: the first output of each case)."""
    sizes = [sum(a.size for a in feeds.values()) for feeds in cases]
    ascending = sorted(range(len(cases)), key=lambda i: sizes[i])
    sequence = ascending + ascending[::-1] if order else []
    with tempfile.TemporaryDirectory(prefix="posbias-parity-") as tmp:
        _write_sets(Path(tmp) / "data", cases)
        if order:
            _write_sets(Path(tmp) / "data_order", [cases[i] for i in sequence])
        for name in runtimes:
            runtime = RUNTIMES[name]
            reason = unavailable_reason(runtime)
            if reason:
                yield RuntimeRun(name, runtime, f"unavailable: {reason}")
                continue
            error = run_runner(runtime, model_path, Path(tmp) / "data", Path(tmp) / name, timeout, fresh=True)
            if error:
                yield RuntimeRun(name, runtime, f"error: {error}")
                continue
            run = RuntimeRun(name, runtime, outputs=_read_outputs(Path(tmp) / name, len(cases)), order=sequence)
            if order:
                shared_dir = Path(tmp) / f"{name}_order"
                error = run_runner(runtime, model_path, Path(tmp) / "data_order", shared_dir, timeout)
                if error:
                    run.shared_problem = f"error: {error}"
                else:
                    run.shared = _read_outputs(shared_dir, len(sequence))
            yield run


def run_matrix(
    model_path: str | Path,
    runtimes: tuple[str, ...] = DEFAULT_RUNTIMES,
    lengths: tuple[int, ...] = (1, 17, 1024),
    batch: int = 3,
    checkpoint: str | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    timeout: float = 1800.0,
    progress=None,
    order: bool = True,
) -> Matrix:
    """Measure every runtime on every case against float64 PyTorch. `inputs` (a user's own
    tensors) replaces the generated lengths. `order`: the order protocol (RuntimeRun.order_cells)
    as well. `progress(n)` is called as work completes."""
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ParityInputError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")
    model_path = Path(model_path)
    proto, meta = load_model_file(model_path)
    cfg = json.loads(meta["config"])
    matrix = Matrix(str(model_path), cfg["bias"], meta.get("arch", "lm"))
    dtype = meta.get("dtype", "float32")
    scheme = meta.get("quantized")  # weights quantized: judged by parity/quantized.py's policy
    if scheme:
        dtype = f"{dtype} {scheme}"
    if inputs is not None:
        check_user_inputs(proto, inputs)
        cases = [("inputs", inputs)]
    else:
        cases = [(f"L={n} B={batch}", generated_inputs(meta, n, batch, seed=n)) for n in lengths]
    model = reference_model(meta, checkpoint)
    if scheme and inputs is None:  # the policy's inputs: text the float model writes (parity/quantized.py)
        cases = [(case, quantized_inputs(meta, model, feeds)) for case, feeds in cases]
    settings = settings_from_metadata(meta)
    if matrix.arch == "attention" and settings.form == "blocked":
        # no padding in an attention file: every query blocking is the same math, and the GPU
        # targets' 4096-row blocks would make a float64 reference at 16k hold ~18 GB
        settings = dataclasses.replace(settings, block=min(settings.block, DEFAULT_BLOCK))
    refs = []
    for _, feeds in cases:
        args = torch_args(meta, feeds)
        ref64 = torch_outputs(model, args, torch.float64, settings)
        same = torch_outputs(model, args, torch.float16 if dtype == "float16" else torch.float32, settings)
        refs.append((ref64, same, args))
    for run in runtime_outputs(runtimes, model_path, [f for _, f in cases], timeout, order):
        name, runtime, outputs = run.name, run.runtime, run.outputs
        for index, (case, _) in enumerate(cases):
            if run.problem:
                matrix.cells.append(Cell(name, case, dtype, run.problem))
                continue
            ref64, same, args = refs[index]
            if scheme:
                verdict = judge_quantized(outputs[index], ref64, scheme)
                matrix.cells.append(Cell(name, case, dtype, "pass" if verdict.passed else "FAIL", verdict.as_dict()))
                continue
            tol = FLOAT16 if dtype == "float16" else FLOAT32
            if runtime.precision == "bfloat16":
                same, tol = torch_outputs(model, args, torch.bfloat16, settings), BFLOAT16
            elif runtime.precision == "tf32" and dtype == "float32":  # a float16 file has no float32 matmul
                same, tol = torch_outputs(model, args, torch.float16, settings), TF32
            parity = compare(outputs[index], ref64, same, tol)
            matrix.cells.append(Cell(name, case, dtype, "pass" if parity.passed else "FAIL", parity.as_dict()))
        matrix.cells += run.order_cells(dtype)
        if progress:
            progress(1)
    return matrix

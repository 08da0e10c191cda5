"""Running runtimes over cases: each runtime's runner process on the cases written as ONNX
backend-test data sets (a fresh session per case, and one shared session for the order
protocol), and the cells and matrix the judge (judge.py) fills from what they return."""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .runtimes import RUNTIMES, run_runner, unavailable_reason


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

    @property
    def precision(self) -> str:
        """The runtime's arithmetic ("native", "bfloat16", "tf32"): which floor the policy uses.
        A reference row (transformers) has no runtime and runs natively."""
        return self.runtime.precision if self.runtime is not None else "native"

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

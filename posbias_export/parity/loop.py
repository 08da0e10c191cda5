"""The one matrix loop. Whoever knows a kind of file builds a Plan (our own exports:
matrix.py; a Hugging Face model's file: hf/validate.py; a T5 encoder and decoder:
hf/validate_seq2seq.py): its cases with their float64 references, the reference rows
(transformers) with their policy, and the runtimes' policy. `measure` then runs every runtime
on every case, judges each output (judge.py) and returns the matrix."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .accuracy_level import level0_runs, note_disagreement
from .judge import Case, judge
from .runs import Matrix, RuntimeRun, runtime_outputs
from .reference import ParityInputError
from .runtimes import RUNTIMES


@dataclass
class Plan:
    matrix: Matrix  # its header (file, bias, architecture); measure() fills the cells
    cases: list[Case]
    policy: object  # the runtimes' (judge.py's FloatPolicy / QuantizedPolicy)
    path: Path | None = None  # the file the runners run on the cases' feeds
    scheme: str | None = None  # int4: the accuracy-level-0 row too (accuracy_level.py)
    reference_rows: list[tuple[RuntimeRun, object]] = field(default_factory=list)  # (row, its own policy)
    runs: Callable[..., Iterable[RuntimeRun]] | None = None  # (runtimes, timeout, order): how a pipeline runs
    order_label: str | None = None  # the dtype the order-protocol rows are labelled with


def check_runtimes(runtimes) -> None:
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ParityInputError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")


def file_runs(plan: Plan, runtimes, timeout: float, order: bool) -> list[RuntimeRun]:
    """Each runtime's runner on the file, and for an int4 file the same at accuracy level 0."""
    feeds = [c.feeds for c in plan.cases]
    runs = list(runtime_outputs(runtimes, plan.path, feeds, timeout, order))
    if plan.scheme == "int4":
        runs += level0_runs(runtimes, plan.path, feeds, timeout, order)
    return runs


def measure(plan: Plan, runtimes, timeout: float = 1800.0, order: bool = True, progress=None) -> Matrix:
    """Every reference row and every runtime on every case, judged; the level-0 rows annotated
    with how often their next token differs from the file's own."""
    for row, policy in plan.reference_rows:
        judge(plan.matrix, [row], plan.cases, policy)
    runs = list(plan.runs(runtimes, timeout, order) if plan.runs else file_runs(plan, runtimes, timeout, order))
    judge(plan.matrix, runs, plan.cases, plan.policy, order_label=plan.order_label, progress=progress)
    note_disagreement(plan.matrix, runs, plan.cases)
    return plan.matrix

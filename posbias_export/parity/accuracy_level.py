"""validate's accuracy-level check for int4 files (issue 48): MatMulNBits at accuracy level 4
quantizes its activations to int8 per block (1.8x faster decode on CPU, benchmarks/quantized.md),
which flips greedy tokens on models whose activations have outliers (ONNX Runtime #29849). When
a file has level-4 nodes, validate also runs a copy of it with every MatMulNBits at level 0
(float activations) on ONNX Runtime CPU, judged by the same policy as its own row, and says how
often the two pick a different next token: a user then knows whether to export with
`--quant-accuracy-level 0`.

The copy is the graph alone with the attribute changed, written beside the file under our
temporary naming (its external data is the original's, found by the same relative name), and
removed when the runs end (a killed run's is swept by the next write in that folder)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx

from .runs import RuntimeRun, runtime_outputs

LEVEL0_ROW = "ort-cpu, accuracy level 0"


def _nbits_nodes(proto: onnx.ModelProto):
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            yield node
    for function in proto.functions:
        for node in function.node:
            if node.op_type == "MatMulNBits":
                yield node


def _level(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)


def level4_nodes(path: Path) -> int:
    """How many MatMulNBits of the file compute at accuracy level 4 (read without its weights)."""
    return sum(_level(n) == 4 for n in _nbits_nodes(onnx.load(str(path), load_external_data=False)))


@contextlib.contextmanager
def level0_copy(path: Path):
    """The file with every MatMulNBits at accuracy level 0, written beside it under our
    temporary naming (its external data found by the same relative names); removed after, or
    swept by the next run after a kill."""
    import os
    import tempfile

    from ..runners import atomic

    proto = onnx.load(str(path), load_external_data=False)  # the weights stay where they are
    for node in _nbits_nodes(proto):
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 0
    atom = atomic()
    atom.sweep(path.parent)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=atom.temp_name(path), suffix=atom.MARK)
    copy = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())
        yield copy
    finally:
        copy.unlink(missing_ok=True)


def level0_runs(runtimes, path: Path, cases: list[dict], timeout: float, order: bool) -> list[RuntimeRun]:
    """ONNX Runtime CPU on the level-0 copy, as one more row, when the file has level-4 nodes and
    ort-cpu is among the runtimes; none otherwise."""
    if "ort-cpu" not in runtimes or not level4_nodes(path):
        return []
    try:
        with level0_copy(Path(path)) as copy:
            runs = list(runtime_outputs(("ort-cpu",), copy, cases, timeout, order))
    except OSError as err:  # a read-only folder: the check cannot run there, the file's own rows stand
        return [RuntimeRun(LEVEL0_ROW, None, f"not run: no copy beside the file ({err.strerror})")]
    for run in runs:
        run.name = LEVEL0_ROW
    return runs


def note_disagreement(matrix, runs: list[RuntimeRun], cases) -> None:
    """Each level-0 case cell gains the share of positions whose next token differs from the
    file's own ort-cpu run at level 4 (the judged positions of that case)."""
    level4 = next((r for r in runs if r.name == "ort-cpu" and r.outputs), None)
    level0 = next((r for r in runs if r.name == LEVEL0_ROW and r.outputs), None)
    if level4 is None or level0 is None:
        return
    for case, a, b in zip(cases, level4.outputs, level0.outputs):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape):
            continue
        keep = case.reference.keep
        differ = np.argmax(a, -1) != np.argmax(b, -1)  # [B, L]
        share = float(differ[keep].mean() if keep is not None and keep.shape == differ.shape else differ.mean())
        for cell in matrix.cells:
            if cell.runtime == LEVEL0_ROW and cell.case == case.name and cell.parity is not None:
                cell.parity["next_token_differs_from_level4"] = share

"""A runner's outputs are written all or none: a disk that fills at the second tensor leaves no
first one (and no folder the run made), in the Python runners and in the node runner alike."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from posbias_export.parity import RUNTIMES_DIR

SMALL, LARGE = 4, 200_000  # the two outputs' element counts: the file-size limit falls between them


def _two_outputs(path: Path) -> Path:
    """y0 = x (small); y1 = x tiled (large)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y0"]),
         helper.make_node("Tile", ["x", "reps"], ["y1"])],
        "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SMALL])],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT, [1, SMALL]),
         helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, None])],
        [numpy_helper.from_array(np.array([1, LARGE // SMALL], np.int64), "reps")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _limited(argv: list, limit: int) -> subprocess.CompletedProcess:
    import resource

    def child():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, preexec_fn=child)


@pytest.mark.parametrize("runner", ["ort/run.py", "node/run.js"])
def test_a_full_disk_at_the_second_tensor_leaves_no_first(tmp_path, runner):
    if runner.endswith(".js") and (shutil.which("node") is None
                                   or not (RUNTIMES_DIR / "node" / "node_modules" / "onnxruntime-node").is_dir()):
        pytest.skip("onnxruntime-node not installed (cd runtimes/node && npm install --ignore-scripts)")
    model = _two_outputs(tmp_path / "two.onnx")
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "input_0.pb").write_bytes(numpy_helper.from_array(np.ones((1, SMALL), np.float32), "x").SerializeToString())
    run = [sys.executable, RUNTIMES_DIR / runner] if runner.endswith(".py") else ["node", RUNTIMES_DIR / runner]
    out = tmp_path / "out"
    proc = _limited([*run, model, inputs, out], limit=64 * 1024)  # y0 fits, y1 (800 KB) does not
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "cannot write" in lines[0], proc.stderr[-2000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "two.onnx"]
    # and with room for both, both are written
    proc = subprocess.run([str(a) for a in [*run, model, inputs, out]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["output_0.pb", "output_1.pb"]

"""validate's order protocol: besides a fresh session per case, ONE session runs every case in
ascending then descending size (a server's life) and must reproduce the fresh outputs bit for bit;
a difference is a FAIL row naming the direction (the check that catches an order-dependent
runtime bug, such as the one benchmarks/gpu_parity.md recorded on ONNX Runtime CUDA)."""
from __future__ import annotations

import numpy as np
import pytest

import posbias_export as pbe
from posbias_export.parity import run_matrix
from posbias_export.parity.matrix import RuntimeRun


def _run(shared_changes=()):
    rng = np.random.default_rng(0)
    outputs = [rng.standard_normal((1, n, 4)).astype(np.float32) for n in (1, 17, 40)]
    order = [0, 1, 2, 2, 1, 0]  # ascending, then descending
    shared = [outputs[i].copy() for i in order]
    for k in shared_changes:
        shared[k].flat[0] = np.nextafter(shared[k].flat[0], np.float32(np.inf))  # one ulp
    return RuntimeRun("ort-cpu", None, outputs=outputs, shared=shared, order=order)


def test_identical_outputs_pass_both_directions():
    cells = _run().order_cells("float32")
    assert [c.case for c in cells] == ["one session, sizes ascending", "one session, sizes descending"]
    assert all(c.verdict == "pass" and c.parity["bit_identical"] for c in cells)


def test_one_ulp_in_the_descending_run_fails_and_names_it():
    ascending, descending = _run(shared_changes=[4]).order_cells("float32")  # k=4: case 1 in the descending run
    assert ascending.verdict == "pass"
    assert descending.verdict.startswith("FAIL: descending") and "case 1" in descending.verdict
    assert descending.parity["max_abs_diff"]["case 1"] > 0


def test_a_failed_shared_run_is_an_error_row():
    run = _run()
    run.shared, run.shared_problem = None, "error: onnxruntime failed: boom"
    assert [c.verdict for c in run.order_cells("float32")] == ["error: onnxruntime failed: boom"] * 2


@pytest.mark.parametrize("target", ["cuda-ort", "portable"])
def test_runtimes_pass_the_order_protocol(tmp_path, target):
    """ORT CPU, onnxruntime-node and the reference evaluator (with ONNX Runtime's
    MultiHeadAttention as a reference op) give the same bits in one session as in fresh ones,
    for a GPU-target file (whole path and blocked path both taken) and a portable one."""
    path = tmp_path / "lm.onnx"
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", num_heads=4, dim=64, num_layers=1, vocab_size=64))
    pbe.export_onnx(model, path, check_growth=False, target=target, block=16)
    matrix = run_matrix(path, ("ort-cpu", "node", "reference"), (1, 17, 40), batch=2)
    order_rows = [c for c in matrix.cells if c.case.startswith("one session")]
    assert len(order_rows) == 6, [c.verdict for c in matrix.cells]
    assert matrix.ok, [(c.runtime, c.case, c.verdict) for c in matrix.cells if not c.ok]


def test_skip_order_check_drops_the_rows(tmp_path):
    import json

    from posbias_export.cli import main as cli_main

    path = tmp_path / "lm.onnx"
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", num_heads=4, dim=64, num_layers=1, vocab_size=64))
    pbe.export_onnx(model, path, check_growth=False)
    for flag, rows in (([], 2), (["--skip-order-check"], 0)):
        report = tmp_path / f"r{rows}.json"
        argv = ["validate", str(path), "--runtimes", "ort-cpu", "--lengths", "1,5", "--json", str(report), *flag]
        assert cli_main(argv) == 0
        cells = json.loads(report.read_text())["models"][0]["cells"]
        assert sum(c["case"].startswith("one session") for c in cells) == rows

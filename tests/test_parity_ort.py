"""ONNX Runtime CPU vs PyTorch, judged against a float64 reference (validate.py's policy),
at lengths other than the trace length: 1, the trace length, 3x+1 and 64x, and 4096 (slow)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import posbias_export as pbe
import tiers
from posbias_export.parity import FLOAT16, FLOAT32, compare, torch_outputs
from conftest import SMALL, TRACE_LEN, lm_inputs, ort_run, ort_session, cli_model

LENGTHS = [1, TRACE_LEN, 3 * TRACE_LEN + 1, 64 * TRACE_LEN, pytest.param(4096, marks=pytest.mark.slow)]


def _judge(session, model, inputs, tol=FLOAT32, dtype=torch.float32):
    got = ort_run(session, *inputs)
    ref64 = torch_outputs(model, inputs, torch.float64)
    same_precision = torch_outputs(model, inputs, dtype)
    parity = compare(got, ref64, same_precision, tol)
    assert parity.passed, str(parity)
    return parity


@pytest.mark.parametrize("length", LENGTHS, ids=lambda n: f"L{n}")
@pytest.mark.parametrize("batch", [1, 3], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("bias", tiers.families())
def test_ort_cpu_lm_causal(exports, bias, batch, length):
    session = ort_session(exports.cli(bias, "lm", True))
    _judge(session, cli_model(bias), (lm_inputs(batch, length, seed=length),))


@pytest.mark.parametrize("length", [1, 3 * TRACE_LEN + 1, 64 * TRACE_LEN], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("bias", tiers.families())
def test_ort_cpu_lm_bidirectional(exports, bias, length):
    session = ort_session(exports.cli(bias, "lm", False))
    _judge(session, cli_model(bias, causal=False), (lm_inputs(3, length, seed=length),))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("length", [1, 3 * TRACE_LEN + 1, 64 * TRACE_LEN], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("bias", tiers.families())
def test_ort_cpu_block(exports, bias, length, causal):
    session = ort_session(exports.cli(bias, "block", causal))
    x = torch.randn(3, length, SMALL["dim"], generator=torch.Generator().manual_seed(length))
    _judge(session, cli_model(bias, "block", causal), (x,))


@pytest.mark.parametrize("bias,length", tiers.cases(
    [(b, n) for b in pbe.BIASES for n in (1, 3 * TRACE_LEN + 1, 64 * TRACE_LEN)],
    [f"{b}-L{n}" for b in pbe.BIASES for n in (1, 3 * TRACE_LEN + 1, 64 * TRACE_LEN)],
    slow={f"{b}-L{64 * TRACE_LEN}" for b in pbe.BIASES if b != "alibi"}))  # the long length: ALiBi's by default
def test_ort_cpu_opset23_attention_op(exports, bias, length):
    session = ort_session(exports.cli(bias, "lm", True, ("--opset", "23")))
    _judge(session, cli_model(bias), (lm_inputs(3, length, seed=length),))


# ALiBi in the default run; every bias with -m slow (each is ~10 s of fp64 reference).
@pytest.mark.parametrize("bias", [b if b == "alibi" else pytest.param(b, marks=pytest.mark.slow) for b in pbe.BIASES])
def test_ort_cpu_float16_at_2048(exports, bias):
    """fp16 export: within FLOAT16's data-derived budget of the float64 reference."""
    session = ort_session(exports.cli(bias, "lm", True, ("--dtype", "float16", "--attention-mask")))
    ids = lm_inputs(1, 2048, seed=7)
    mask = torch.ones_like(ids)
    _judge(session, cli_model(bias), (ids, mask), FLOAT16, torch.float16)


@pytest.mark.parametrize("bias,dtype", tiers.cases(
    [(b, d) for b in pbe.BIASES for d in ("float32", "float16")], [f"{b}-{d}" for b in pbe.BIASES for d in ("float32", "float16")],
    slow={f"{b}-float16" for b in pbe.BIASES if b != "alibi"}))
def test_padded_rows(exports, bias, dtype):
    """A batch with a fully padded row and a left-padded one: everything finite (a padded query
    sees no key: masks are finite, never -inf), and every row that holds tokens equals what the
    model computes for those tokens alone, within the parity budget."""
    # 16-row blocks: 40 tokens run the Loop (the files test_mask_holes.py uses too)
    extra = ("--attention-mask", "--block", "16") + (("--dtype", dtype) if dtype == "float16" else ())
    session = ort_session(exports.cli(bias, "lm", True, extra))
    ids = lm_inputs(3, 40)
    mask = torch.ones_like(ids)
    mask[1] = 0  # row 1 entirely padding
    mask[2, :25] = 0  # row 2 left-padded
    out = ort_run(session, ids, mask)
    assert np.isfinite(out).all()
    model = cli_model(bias)
    tol, same = (FLOAT16, torch.float16) if dtype == "float16" else (FLOAT32, torch.float32)
    for row, start in ((0, 0), (2, 25)):
        alone = (ids[row:row + 1, start:],)
        parity = compare(out[row:row + 1, start:], torch_outputs(model, alone, torch.float64),
                         torch_outputs(model, alone, same), tol)
        assert parity.passed, f"row {row}: {parity}"


def test_ort_matches_torch_with_left_padding(exports):
    """A padded row through ONNX equals the unpadded row: positions come from the mask."""
    session = ort_session(exports.cli("alibi", "lm", True, ("--attention-mask",)))
    ids = lm_inputs(1, 30)
    padded = torch.cat([torch.zeros(1, 10, dtype=torch.int64), ids], 1)
    mask = torch.cat([torch.zeros(1, 10), torch.ones(1, 30)], 1).to(torch.int64)
    alone = ort_run(session, ids, torch.ones_like(ids))
    np.testing.assert_allclose(ort_run(session, padded, mask)[:, 10:], alone, rtol=1e-5, atol=1e-5)

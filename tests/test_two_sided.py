"""Bidirectional ALiBi's two-sided fold (BlockKeysTwoSided + BlockAttendTwoSided): the body
ONNX Runtime runs, called directly with index positions and a key mask, against softmax with
-m|i - j| computed here in float64 (the paper's formula, not the package's code)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from posbias_export.biases import bias_class
from posbias_export.biases.onnx_domain import DOMAIN, VERSION
from posbias_export.export import functions
from posbias_export.export.targets.blocked_body import function_proto
from posbias_export.nn import block_plan
from conftest import ort_session

HEADS, HEAD_DIM, BLOCK, OPSET = 4, 16, 16, 18
# float32 scores of size ~|q.k| <= 10 plus a key row of at most m*Bq/2 = 4 (m <= 1/2): a few
# float32 ulps of 10 (1e-6) per score; the outputs (averages of unit normals) err less than 1e-5.
ATOL = 1e-5


def _two_sided_model(dtype=torch.float32) -> onnx.ModelProto:
    """One posbias.BlockedAttentionAlibiByDistance node over graph inputs, its functions attached."""
    bias = bias_class("alibi")(HEADS, causal=False)
    body = function_proto(bias, block_plan(bias, dtype=dtype, indices=True), BLOCK, dtype, OPSET)
    elem = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.FLOAT16
    slopes = helper.make_tensor("slopes", TensorProto.FLOAT, [HEADS], bias.slopes.tolist())
    node = helper.make_node(body.name, ["q", "k", "v", "q_pos", "k_pos", "keep", "slopes"], ["out"], domain=DOMAIN)
    graph = helper.make_graph(
        [node], "two_sided",
        [helper.make_tensor_value_info("q", elem, ["B", HEADS, "Lq", HEAD_DIM]),
         *[helper.make_tensor_value_info(n, elem, ["B", HEADS, "Lk", HEAD_DIM]) for n in ("k", "v")],
         helper.make_tensor_value_info("q_pos", TensorProto.INT64, ["Lq"]),
         helper.make_tensor_value_info("k_pos", TensorProto.INT64, ["Lk"]),
         helper.make_tensor_value_info("keep", TensorProto.BOOL, ["B", 1, 1, "Lk"])],
        [helper.make_tensor_value_info("out", elem, ["B", HEADS, "Lq", HEAD_DIM])],
        initializer=[slopes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, VERSION)])
    model.functions.extend(functions.function_protos({body.name}, OPSET, [body]))
    return model


def _alibi_reference(q, k, v, keep, slopes):
    """float64 softmax(q k^T / sqrt(d) - m_h |i - j| + mask) v, queries the last Lq keys."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    lq, lk = q.shape[2], k.shape[2]
    i = np.arange(lk - lq, lk)[:, None]
    j = np.arange(lk)[None, :]
    bias = -np.asarray(slopes, np.float64)[:, None, None] * np.abs(i - j)  # [H, Lq, Lk]
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + bias + np.where(keep, 0.0, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


def _inputs(q_len, k_len, padded, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, HEADS, q_len, HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((2, HEADS, k_len, HEAD_DIM), dtype=np.float32) for _ in range(2))
    keep = np.ones((2, 1, 1, k_len), dtype=bool)
    if padded:
        keep[1, ..., :9] = False  # left padding
        keep[0, ..., k_len // 2] = False  # and one key inside the first row (a hole on both sides of the diagonal)
    feeds = {"q": q, "k": k, "v": v, "q_pos": np.arange(k_len - q_len, k_len), "k_pos": np.arange(k_len), "keep": keep}
    return feeds


def test_the_loop_slices_no_table_and_folds_both_sides():
    model = _two_sided_model()
    body = next(f for f in model.functions if f.name == "BlockedAttentionAlibiByDistance")
    loop_ops = {n.op_type for n in functions.all_nodes(body.node) if n.op_type != "Loop"}
    assert {"BlockKeysTwoSided", "BlockAttendTwoSided", "AlibiKeyRow"} <= loop_ops
    assert not {"DistanceVectorPositions", "ExpandDistanceVector", "SliceByDistance", "MaskTable"} & loop_ops
    # float16: a row inside a float16 MatMul would cost the scores their precision, so the table stays
    half = next(f for f in _two_sided_model(torch.float16).functions if f.name == "BlockedAttentionAlibiByDistance")
    half_ops = {n.op_type for n in functions.all_nodes(half.node)}
    assert "SliceByDistance" in half_ops and "BlockAttendTwoSided" not in half_ops


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("q_len, k_len", [(53, 53), (40, 53), (16, 48), (17, 17), (1, 30)])
def test_two_sided_fold_equals_the_formula(tmp_path, q_len, k_len, padded):
    """Partial last blocks (53, 17), queries fewer than keys (the last Lq), whole blocks (48),
    one block (decode-like, the If's direct branch), with and without padding keys."""
    model = _two_sided_model()
    feeds = _inputs(q_len, k_len, padded, seed=q_len + k_len)
    slopes = bias_class("alibi")(HEADS).slopes.numpy()
    want = _alibi_reference(feeds["q"], feeds["k"], feeds["v"], feeds["keep"], slopes)
    onnx.save(model, tmp_path / "two_sided.onnx")
    got = ort_session(tmp_path / "two_sided.onnx").run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    if (q_len, k_len) == (40, 53):  # no ORT code: the ONNX reference evaluator, functions and inlined
        for form in (model, functions.inline(model)):
            np.testing.assert_allclose(ReferenceEvaluator(form).run(None, feeds)[0], want, rtol=0, atol=ATOL)

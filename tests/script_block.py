"""A second, independent route to the same graph semantics: the transformer block written
directly in ONNX Script (not traced from PyTorch), with weights copied from a PyTorch Block.

The model is three nodes: posbias.QueryKeyPositions -> posbias.<Bias family> ->
posbias.ScriptBlock, each a model-local function (or inlined on request).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxscript import FLOAT, INT64, script
from onnxscript import opset18 as op

from posbias_export.export import functions
from posbias_export.biases import FLOAT32_LOWEST
from posbias_export.biases.onnx_domain import DOMAIN, VERSION, posbias


@script(posbias, default_opset=op)
def QueryKeyPositions(x: FLOAT) -> tuple[INT64, INT64]:
    """Self-attention positions from hidden states [B, L, D]: q_pos = k_pos = 0..L-1.

    PyTorch: torch.arange(L), torch.arange(L)
    """
    length = op.Squeeze(op.Slice(op.Shape(x), [1], [2]), [0])  # scalar L
    pos = op.Range(op.Constant(value_int=0), length, op.Constant(value_int=1))  # [L]
    return pos, op.Identity(pos)


@script(posbias, default_opset=op)
def RotateHalf(x: FLOAT, pos: INT64, inv_freq: FLOAT) -> FLOAT:
    """RoPE in the half-split layout, [B, H, L, d] x [L] x [d/2] -> [B, H, L, d]. With
    inv_freq all zero the angles are 0 and x comes back exactly (cos 0 = 1, sin 0 = 0).

    PyTorch: x1, x2 = x.chunk(2, -1); cat([x1 cos - x2 sin, x2 cos + x1 sin], -1)
    """
    angle = op.Mul(op.Unsqueeze(op.Cast(pos, to=1), [-1]), inv_freq)  # [L, d/2]
    cos = op.Cos(angle)
    sin = op.Sin(angle)
    x1, x2 = op.Split(x, axis=-1, num_outputs=2)  # [B, H, L, d/2] each
    return op.Concat(op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin)), axis=-1)


@script(posbias, default_opset=op)
def ScriptBlock(
    x: FLOAT, bias: FLOAT, q_pos: INT64, k_pos: INT64,
    ln1_w: FLOAT, ln1_b: FLOAT, w_q: FLOAT, w_k: FLOAT, w_v: FLOAT, w_o: FLOAT,
    ln2_w: FLOAT, ln2_b: FLOAT, up_w: FLOAT, up_b: FLOAT, down_w: FLOAT, down_b: FLOAT, inv_freq: FLOAT,
    num_heads: int, causal: int, scale: float,
) -> FLOAT:
    """Pre-LN transformer block with an additive attention bias, [B, L, D] -> [B, L, D].
    Weights are pre-transposed ([in, out]). Scores, bias and softmax in float32.

    PyTorch: x + attn(ln1(x)); then + mlp(ln2(x)) -- see posbias_export.model.Block
    """
    h = op.LayerNormalization(x, ln1_w, ln1_b, axis=-1, epsilon=1e-5)  # [B, L, D]
    heads = op.Unsqueeze(op.Constant(value_int=num_heads), [0])  # [1]
    split_shape = op.Concat(op.Constant(value_ints=[0, 0]), heads, op.Constant(value_ints=[-1]), axis=0)
    q = op.Transpose(op.Reshape(op.MatMul(h, w_q), split_shape), perm=[0, 2, 1, 3])  # [B, H, L, hd]
    k = op.Transpose(op.Reshape(op.MatMul(h, w_k), split_shape), perm=[0, 2, 1, 3])  # [B, H, L, hd]
    v = op.Transpose(op.Reshape(op.MatMul(h, w_v), split_shape), perm=[0, 2, 1, 3])  # [B, H, L, hd]
    q = RotateHalf(q, q_pos, inv_freq)
    k = RotateHalf(k, k_pos, inv_freq)
    s = op.Constant(value_float=scale)
    scores = op.MatMul(op.Mul(q, s), op.Transpose(k, perm=[0, 1, 3, 2]))  # [B, H, Lq, Lk]
    scores = op.Add(scores, bias)
    is_causal = op.Constant(value_int=causal)
    behind = op.LessOrEqual(op.Unsqueeze(k_pos, [0]), op.Unsqueeze(q_pos, [1]))  # [Lq, Lk]
    allowed = op.Or(behind, op.Equal(is_causal, op.Constant(value_int=0)))
    low = op.Constant(value_float=FLOAT32_LOWEST)  # never -inf
    probs = op.Softmax(op.Where(allowed, scores, low), axis=-1)  # [B, H, Lq, Lk]
    y = op.Transpose(op.MatMul(probs, v), perm=[0, 2, 1, 3])  # [B, Lq, H, hd]
    y = op.Reshape(y, op.Constant(value_ints=[0, 0, -1]))  # [B, Lq, D]
    x = op.Add(x, op.MatMul(y, w_o))
    h2 = op.LayerNormalization(x, ln2_w, ln2_b, axis=-1, epsilon=1e-5)
    up = op.Add(op.MatMul(h2, up_w), up_b)  # [B, L, 4D]
    # exact (erf) GELU, as torch.nn.functional.gelu
    gelu = op.Mul(op.Mul(up, op.Constant(value_float=0.5)),
                  op.Add(op.Constant(value_float=1.0), op.Erf(op.Div(up, op.Constant(value_float=1.4142135623730951)))))
    return op.Add(x, op.Add(op.MatMul(gelu, down_w), down_b))


SCRIPT_FUNCTIONS = (QueryKeyPositions, RotateHalf, ScriptBlock)


def _weights(block) -> dict[str, np.ndarray]:
    """The PyTorch Block's parameters as float32 arrays, Linear weights transposed to [in, out]."""
    t = lambda p: p.detach().float().numpy()
    w_q, w_k, w_v = (t(w).T for w in block.attn.qkv.weight.chunk(3, dim=0))
    rope = block.attn.rope
    inv_freq = t(rope.inv_freq) if rope is not None else np.zeros(block.cfg.head_dim // 2, np.float32)
    return {
        "ln1_w": t(block.ln_attn.weight), "ln1_b": t(block.ln_attn.bias), "w_q": w_q, "w_k": w_k, "w_v": w_v,
        "w_o": t(block.attn.out.weight).T, "ln2_w": t(block.ln_mlp.weight), "ln2_b": t(block.ln_mlp.bias),
        "up_w": t(block.mlp.up.weight).T, "up_b": t(block.mlp.up.bias), "down_w": t(block.mlp.down.weight).T,
        "down_b": t(block.mlp.down.bias), "inv_freq": inv_freq,
    }


def script_block_model(block, inline: bool = False) -> onnx.ModelProto:
    """An ONNX model of `block` (a posbias_export Block, float32) authored in ONNX Script:
    input hidden_states [batch, seq, D] -> output [batch, seq, D]."""
    cfg = block.cfg
    bias = block.attn.bias
    weights = _weights(block)
    tensors, attrs = bias.function_inputs()
    bias_inputs = []
    for index, tensor in enumerate(tensors):
        array = tensor.detach().numpy()
        weights[f"bias_param_{index}"] = array.astype(np.float32) if array.dtype.kind == "f" else array
        bias_inputs.append(f"bias_param_{index}")
    nodes = [
        helper.make_node("QueryKeyPositions", ["hidden_states"], ["q_pos", "k_pos"], domain=DOMAIN),
        helper.make_node(bias.function_name, ["q_pos", "k_pos", *bias_inputs], ["bias"], domain=DOMAIN, **attrs),
        helper.make_node("ScriptBlock", ["hidden_states", "bias", "q_pos", "k_pos", *_weights(block)], ["output"],
                         domain=DOMAIN, num_heads=cfg.num_heads, causal=int(cfg.causal), scale=1.0 / math.sqrt(cfg.head_dim)),
    ]
    graph = helper.make_graph(
        nodes, f"script_block_{cfg.bias}",
        [helper.make_tensor_value_info("hidden_states", onnx.TensorProto.FLOAT, ["batch", "seq", cfg.dim])],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, ["batch", "seq", cfg.dim])],
        [numpy_helper.from_array(a, name) for name, a in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, VERSION)],
                              producer_name="posbias_export.script", ir_version=10)  # runtimes lag onnx's newest IR
    bias_protos = functions.function_protos({bias.function_name}, 18)
    model.functions.extend(bias_protos + [fn.to_function_proto() for fn in SCRIPT_FUNCTIONS])
    return functions.inline(model) if inline else model

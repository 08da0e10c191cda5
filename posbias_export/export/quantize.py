"""Weight-only quantization of a saved float LM file through ONNX Runtime's own quantizers.

    int8: `quantize_dynamic` (MatMulInteger + DynamicQuantizeLinear, standard ONNX ops: every
          runtime that runs the float file runs it; what Optimum's ORTQuantizer writes), with
          7-bit weights (reduce_range): see REDUCE_RANGE
    int4: `MatMulNBitsQuantizer` (com.microsoft.MatMulNBits / GatherBlockQuantized, ONNX
          Runtime's contrib ops: what onnxruntime-genai's builder writes with `-p int4`)

What is quantized: the linear layers' weights (top-level MatMul nodes whose right input is a
2-D initializer) and the token embedding (the Gather reading `input_ids`). Attention, the
positional bias, norms and the softmax stay in float: they live in model-local functions or
Loop/If bodies, or read no weight initializer, and are never in the list handed to the
quantizer. A tied LM head (MatMul on Transpose(embedding)) gets the transposed table as its
own initializer first, so the head, half the bytes at BLOOM-560m, is quantized too.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..errors import ExportCheckError

SCHEMES = ("int8", "int4")
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: 0 unset, 1 float32, 2 float16, 3 bfloat16, 4 int8 compute
# int8 weights in [-64, 64]: on x86 CPUs without VNNI (AVX2 alone, common in CPU servers) ONNX
# Runtime multiplies uint8 activations by int8 weights with VPMADDUBSW, which saturates its int16
# sums of pairs (255 * 127 * 2 > 32767); 7-bit weights cannot (255 * 64 * 2 < 32767). Measured on
# an AVX2-only EPYC, the ALiBi checkpoint at 1024 tokens: KL 0.0112 nats with 8-bit weights, over
# the policy's 0.00995, and 0.0005 with 7-bit ones (U8U8 weights: 0.0004, but a slower kernel on
# every CPU). The kernel and the file's format stay those of the default; VNNI CPUs lose a bit.
REDUCE_RANGE = True
WEIGHT_SHAPING = {"Transpose", "Split", "Reshape", "Squeeze", "Unsqueeze", "Slice", "Concat", "Cast"}


@dataclass(frozen=True)
class QuantizeSpec:
    """How to quantize: scheme, and for int4 the block size, symmetry and MatMulNBits'
    accuracy level; for int8 per-channel or per-tensor scales."""

    scheme: str
    block: int = 32
    symmetric: bool = False
    accuracy_level: int = 4  # int8 compute: 1.8x faster decode than 0 at BLOOM-560m, equal perplexity (quantized.md)
    per_channel: bool = True

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.block not in BLOCK_SIZES:
            raise ValueError(f"quantization block must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block!r}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy level must be one of {', '.join(map(str, ACCURACY_LEVELS))}, "
                             f"got {self.accuracy_level!r}")

    def metadata(self, quantized: int) -> dict[str, str]:
        meta = {"quantized": self.scheme, "quantized_nodes": str(quantized)}
        if self.scheme == "int4":
            meta.update(quant_block=str(self.block), quant_symmetric=str(int(self.symmetric)),
                        quant_accuracy_level=str(self.accuracy_level))
        else:
            meta.update(quant_per_channel=str(int(self.per_channel)), quant_reduce_range=str(int(REDUCE_RANGE)))
        return meta


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node of `graph` or of its subgraphs reads, and the graph's outputs."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                used |= _used_names(sub)
    return used


def fold_weight_shaping(proto: onnx.ModelProto) -> int:
    """Make every weight an initializer the quantizer can see: evaluate the Split / Transpose /
    Reshape ... nodes whose inputs are all constants (a fused qkv weight split three ways, a
    tied head's Transpose(embedding)) and drop what no node reads any more. (onnxscript's
    folder skips multi-output nodes such as Split.) Returns the number of nodes folded."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = proto.graph
    consts = {t.name: t for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            consts[node.output[0]] = onnx.helper.get_attribute_value(node.attribute[0]) \
                if node.attribute[0].name == "value" else None
            kept.append(node)
            continue
        inputs = [i for i in node.input if i]
        if node.op_type in WEIGHT_SHAPING and node.domain in ("", "ai.onnx") and inputs and all(
                consts.get(i) is not None for i in inputs):
            single = onnx.helper.make_model(
                onnx.helper.make_graph([node], "fold", [], [onnx.helper.make_tensor_value_info(o, 0, None)
                                                              for o in node.output]),
                opset_imports=[op for op in proto.opset_import if op.domain in ("", "ai.onnx")])
            feeds = {i: numpy_helper.to_array(consts[i]) for i in inputs}
            values = ReferenceEvaluator(single).run(None, feeds)
            for name, value in zip(node.output, values):
                tensor = numpy_helper.from_array(value, name)
                graph.initializer.append(tensor)
                consts[name] = tensor
            folded += 1
            continue
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    used = _used_names(graph)
    unused = [t for t in graph.initializer if t.name not in used]
    for t in unused:
        graph.initializer.remove(t)
    return folded


def weight_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes the quantizer may touch: top-level MatMul with a 2-D weight initializer (both
    sides at least 16: a linear layer, not a small constant), and the Gather of the token
    embedding (its indices are `input_ids`)."""
    inits = {t.name: t for t in proto.graph.initializer}
    picked = []
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "MatMul" and node.input[1] in inits:
            dims = inits[node.input[1]].dims
            if len(dims) == 2 and min(dims) >= 16:
                picked.append(node)
        elif node.op_type == "Gather" and node.input[0] in inits and node.input[1] == "input_ids":
            if len(inits[node.input[0]].dims) == 2:
                picked.append(node)
    return picked


def name_nodes(proto: onnx.ModelProto) -> None:
    """Give every unnamed top-level node a unique name (the quantizers select nodes by name)."""
    taken = {n.name for n in proto.graph.node}
    for i, node in enumerate(proto.graph.node):
        if not node.name:
            name = f"{node.op_type}_q{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def prepared_float(path: Path) -> onnx.ModelProto:
    """A saved float file with every weight an initializer and every node named."""
    proto = onnx.load(str(path))
    fold_weight_shaping(proto)
    name_nodes(proto)
    return proto


def quantize_file(float_path: Path, spec: QuantizeSpec) -> onnx.ModelProto:
    """The quantized model of a saved float file (its weights folded into initializers first,
    written beside it, then handed to the quantizer by path)."""
    proto = prepared_float(float_path)
    names = [n.name for n in weight_nodes(proto)]
    prepared = float_path.with_name("prepared.onnx")
    onnx.save_model(proto, prepared, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="prepared.onnx.data", size_threshold=1024)
    del proto
    return quantize_path(str(prepared), spec, names)


def quantize_path(path: str, spec: QuantizeSpec, nodes: list[str]) -> onnx.ModelProto:
    """ONNX Runtime's quantizer of the scheme applied to the model file at `path` (its tensors
    in external data), at the named `nodes`."""
    with _quiet():
        return _quantize(path, spec, nodes)


@contextlib.contextmanager
def _quiet():
    """The quantizers log a line per node (INFO) and advise pre-processing (root WARNING) that
    does not apply to weight-only quantization; our summary says what was quantized."""
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401  (its loggers exist from here on)
    import onnxruntime.quantization.quantize  # noqa: F401

    root, previous = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)
    quiet = [logging.getLogger(n) for n in logging.root.manager.loggerDict if n.startswith("onnxruntime")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(previous)
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def _quantize(path: str, spec: QuantizeSpec, names: list[str]) -> onnx.ModelProto:
    if not names:
        raise ExportCheckError("the model has no weight MatMul or embedding Gather to quantize")
    if spec.scheme == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(path, bits=4, block_size=spec.block, is_symmetric=spec.symmetric,
                                         accuracy_level=spec.accuracy_level or None, nodes_to_include=names,
                                         op_types_to_quantize=("MatMul", "Gather"),
                                         quant_axes=(("MatMul", 0), ("Gather", 1)))
        quantizer.process()
        return _functions_at_model_opset(quantizer.model.model)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:  # external data both ways: protobuf's 2 GB limit
        out = Path(tmp) / "quantized.onnx"
        quantize_dynamic(path, out, op_types_to_quantize=["MatMul", "Gather"], nodes_to_quantize=names,
                         per_channel=spec.per_channel, weight_type=QuantType.QInt8, reduce_range=REDUCE_RANGE,
                         use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(out))


def _functions_at_model_opset(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The 4-bit quantizer raises the model's default-domain opset to 21 (int4 tensors need
    it); ONNX requires a local function to import the same version as the model. Our
    functions' ops (Shape, Reshape, Where, Softmax, Loop ...) mean the same at 18 and 21:
    21 only adds types; the quantized file's parity is measured, not assumed (validate)."""
    version = next(op.version for op in proto.opset_import if op.domain in ("", "ai.onnx"))
    for function in proto.functions:
        for op in function.opset_import:
            if op.domain in ("", "ai.onnx"):
                op.version = version
    return proto


def quantized_node_count(proto: onnx.ModelProto) -> int:
    """Nodes of the quantized formats in the graph (MatMulNBits, GatherBlockQuantized,
    MatMulInteger, and the DequantizeLinear after a quantized Gather)."""
    kinds = {"MatMulNBits", "GatherBlockQuantized", "MatMulInteger"}
    return sum(n.op_type in kinds for n in proto.graph.node) + sum(
        n.op_type == "DequantizeLinear" and n.input[0].endswith("_quantized") for n in proto.graph.node)

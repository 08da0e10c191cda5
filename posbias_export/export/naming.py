"""The names a file is written with. Our exports call the cache past_key.N / past_value.N and
the axes batch, seq, past; the tools people serve models with find tensors and shape empty
caches by Hugging Face's conventions (Optimum's OnnxConfig, transformers.js, onnxruntime-genai
templates): past_key_values.N.key in, present.N.key out, axes batch_size, sequence_length,
past_sequence_length. Renaming is a last pass over the graph's inputs, outputs and symbolic
axes: the computation is untouched."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx

_CACHE = re.compile(r"^(past|present)_(cross_)?(key|value)\.(\d+)$")


@dataclass(frozen=True)
class Naming:
    name: str  # recorded in the file's metadata (posbias.names)
    dims: dict[str, str] = field(default_factory=dict)  # symbolic axis -> its name in the file
    cache_part: str = ""  # "decoder": a seq2seq decoder's self-attention cache (past_key_values.N.decoder.key)

    def tensor(self, ours: str) -> str:
        """Our graph input/output name -> the one written."""
        if self.name == "posbias":
            return ours
        match = _CACHE.match(ours)
        if not match:
            return ours
        direction, cross, kind, layer = match.groups()
        # a seq2seq decoder's cross-attention cache: past_key_values.N.encoder.key (Optimum's merged layout)
        part = ".encoder" if cross else (f".{self.cache_part}" if self.cache_part else "")
        return f"past_key_values.{layer}{part}.{kind}" if direction == "past" else f"present.{layer}{part}.{kind}"

    def dim(self, ours: str) -> str:
        """A symbolic axis (or an expression of them, "past + seq") -> the one written."""
        return re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: self.dims.get(m.group(0), m.group(0)), ours)


POSBIAS = Naming("posbias")
HUGGINGFACE = Naming("huggingface", {"batch": "batch_size", "seq": "sequence_length", "past": "past_sequence_length",
                                     "total": "total_sequence_length", "encoder_seq": "encoder_sequence_length",
                                     "encoder_past": "encoder_sequence_length_out"})
NAMINGS = {n.name: n for n in (POSBIAS, HUGGINGFACE)}


def _rename_dims(values, naming: Naming) -> None:
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = naming.dim(dim.dim_param)


def _rename_uses(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Every node input/output (in subgraphs too: a Loop body reads outer names) renamed."""
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename_uses(attr.g, mapping)
            for sub in attr.graphs:
                _rename_uses(sub, mapping)


def rename(proto: onnx.ModelProto, naming: Naming) -> dict[str, str]:
    """Rename the graph's inputs and outputs and the symbolic axes in place; returns the
    tensor mapping (ours -> written) of the names that changed."""
    graph = proto.graph
    mapping = {v.name: naming.tensor(v.name) for v in [*graph.input, *graph.output]}
    mapping = {a: b for a, b in mapping.items() if a != b}
    taken = {n for node in graph.node for n in [*node.input, *node.output]} | {i.name for i in graph.initializer}
    clash = sorted((set(mapping.values()) & taken) - set(mapping))
    if clash:
        raise ValueError(f"cannot rename to {clash[0]!r}: the graph already has a tensor of that name")
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = mapping.get(value.name, value.name)
    _rename_uses(graph, mapping)
    _rename_dims([*graph.input, *graph.output, *graph.value_info], naming)
    return mapping

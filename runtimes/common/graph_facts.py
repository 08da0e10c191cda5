"""What a file is, read from its graph rather than from its labels (metadata a tool may strip and a
person may edit): whether its cache is written in place (GroupQueryAttention, which writes the new
rows into the buffer it is given, is in the graph), and how many token ids it has rows for (the
rows of the table input_ids is looked up in: Gather, or int4's GatherBlockQuantized, which reads
past its table unchecked; in a quantized file with a tied table, the head's weight, gathered on
the axis of its vocabulary). Needs the onnx package; without it `read_graph_facts` gives None and the
caller falls back to the labels. The graph is read without any tensor's values (graph_only.py): a
file that holds its weights is not parsed whole."""
from __future__ import annotations

from dataclasses import dataclass

from .graph_only import load_graph_only

TOKEN_INPUT = "input_ids"
LOOKUPS = ("Gather", "GatherBlockQuantized")
# matmuls over integer weights: their CPU kernels run on the copies ONNX Runtime prepacks (an int4
# BLOOM-560m step takes 2.4 s with prepacking off, 36 ms with it on: benchmarks/serving.md)
QUANTIZED_MATMULS = frozenset({"MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                               "QLinearMatMul"})
# quantizers of activations with ONE scale per call (the whole input tensor's range): every row of a
# batch, and every token of a prompt run at once, share it, so a row's numbers depend on what else
# the call holds (ONNX Runtime's quantize_dynamic writes them; an int8 bloom with noisy weights: a
# prompt's logits 1.5 apart alone and beside two others). Per-row quantizers (MatMulNBits'
# accuracy level 4 quantizes each row's blocks) keep rows apart.
PER_CALL_SCALES = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul"})


@dataclass(frozen=True)
class GraphFacts:
    op_types: frozenset[str]
    embedding_rows: int | None  # None: input_ids feeds no table lookup (an encoder of features)

    @property
    def inplace_cache(self) -> bool:
        return "GroupQueryAttention" in self.op_types

    @property
    def quantized_weights(self) -> bool:
        return bool(self.op_types & QUANTIZED_MATMULS)

    @property
    def scales_per_call(self) -> bool:
        """Whether a row's numbers depend on the other rows and tokens of its call (PER_CALL_SCALES)."""
        return bool(self.op_types & PER_CALL_SCALES)


def _every_node(nodes):
    """The nodes and those of their subgraphs (an If's branches, a Loop's body: a merged decoder,
    Optimum's among them, holds every layer inside its If)."""
    for node in nodes:
        yield node
        for attribute in node.attribute:
            for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _every_node(graph.node)


def facts_of(proto) -> GraphFacts:
    """The facts of an onnx ModelProto (its functions' and subgraphs' nodes included)."""
    nodes = list(_every_node([*proto.graph.node, *(n for f in proto.functions for n in f.node)]))
    dims = {t.name: tuple(t.dims) for t in proto.graph.initializer if len(t.dims) >= 2}
    lookup = next((n for n in proto.graph.node if n.op_type in LOOKUPS and len(n.input) > 1
                   and n.input[1] == TOKEN_INPUT and n.input[0] in dims), None)
    if lookup is None:
        return GraphFacts(frozenset(n.op_type for n in nodes), None)
    # the axis looked up: a table's rows, or the columns of a tied head's int8 weight [K, N]
    axis = next((a.i for a in lookup.attribute if a.name in ("axis", "gather_axis")), 0)
    return GraphFacts(frozenset(n.op_type for n in nodes), int(dims[lookup.input[0]][axis]))


def read_graph_facts(model_path) -> GraphFacts | None:
    """The file's facts, or None where the onnx package is missing or cannot read it (the
    runtime's own load then says what is wrong with the file)."""
    try:
        import onnx  # noqa: F401 - parses what load_graph_only keeps
    except ImportError:
        return None
    try:
        return facts_of(load_graph_only(model_path))
    except Exception:  # noqa: BLE001 - a broken file is the runtime's to report, in its words
        return None


def token_limit(facts: GraphFacts | None, contract) -> int | None:
    """How many token ids the file has rows for: the graph's table when it can be read, else the
    file's label."""
    if facts is not None and facts.embedding_rows is not None:
        return facts.embedding_rows
    return contract.token_limit


def prepacking_pays(facts: GraphFacts | None) -> bool:
    """Whether a CPU decoder session should prepack its weights. Quantized matmuls need it. A
    float file's steps do not: prepacking off, a float32 BLOOM-560m session holds each weight
    once (peak 2.73 GB instead of 3.53 after a 512-token prompt) and its decode steps take
    0.98-1.05x the time; only a prefill is slower (1.04-1.15x; benchmarks/serving.md). An
    unreadable graph keeps ONNX Runtime's default (on)."""
    return facts is None or facts.quantized_weights


def inplace_cache(facts: GraphFacts | None, contract) -> bool:
    """Whether the file writes its cache in place: the graph when it can be read, else the label."""
    return facts.inplace_cache if facts is not None else contract.inplace_cache

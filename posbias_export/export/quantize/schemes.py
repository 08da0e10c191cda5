"""Weight quantization schemes, one class each: its options, its command-line flags, the call
into ONNX Runtime's quantizer, what the file records, the policy validate judges it by, and the
ops that show it in a graph. Nothing else dispatches on a scheme's name.

    int8: `quantize_dynamic` (MatMulInteger + DynamicQuantizeLinear, standard ONNX ops: every
          runtime that runs the float file runs it; what Optimum's ORTQuantizer writes), with
          7-bit weights (reduce_range): see Int8.REDUCE_RANGE
    int4: `MatMulNBitsQuantizer` (com.microsoft.MatMulNBits / GatherBlockQuantized, ONNX
          Runtime's contrib ops: what onnxruntime-genai's builder writes with `-p int4`)

The policy is a perplexity promise on the float model's own text (parity/quantized.py): mean
KL(float || quantized) within log(1 + x) nats and top-1 agreement on decided positions.
"""
from __future__ import annotations

import dataclasses

import math
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import onnx

BLOCK_SIZES = (16, 32, 64, 128, 256)
HEAD_PRECISIONS = ("int4", "int8", "float")
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: 0 unset, 1 float32, 2 float16, 3 bfloat16, 4 int8 compute


@dataclass(frozen=True)
class Policy:
    """What validate holds a scheme's file to (parity/quantized.py measures it)."""

    max_kl: float  # mean KL(float || quantized), nats per position
    min_top1: float  # top-1 agreement on positions where the float model is decided
    why: str
    decided: float = 0.5  # the float model's top-1 probability that makes a position decided
    # an embedder (an encoder file alone) is judged on its embeddings instead (parity/embedding.py)
    min_cosine: float = 1.0


class Scheme:
    """Base of the schemes: subclasses are frozen dataclasses of their options."""

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]]  # op types only this scheme writes: how a graph shows it
    policy: ClassVar[Policy]
    coarseness: ClassVar[int]  # a pair of files is judged by its coarser scheme

    @classmethod
    def option_flags(cls):
        """(field, flag, help) of each option the command line sets (a bool option's flag sets
        the opposite of its default)."""
        return [(f, f.metadata["flag"], f.metadata["help"]) for f in fields(cls) if "flag" in f.metadata]

    def flags(self) -> list[str]:
        """The command line that asks for this scheme with these options."""
        out = ["--quantize", self.name]
        for f, flag, _ in self.option_flags():
            value = getattr(self, f.name)
            if value != f.default:
                out += [flag] if isinstance(value, bool) else [flag, str(value)]
        return out

    def contract_fields(self, quantized_nodes: int) -> dict:
        """What a quantized file records (FileContract): the scheme, how many nodes, its options."""
        return {"quantized": self.name, "quantized_nodes": quantized_nodes, "quant": tuple(self.option_metadata().items())}

    def option_metadata(self) -> dict[str, str]:
        raise NotImplementedError

    def resolved(self, default_block: int | None = None, default_head: str | None = None) -> "Scheme":
        """The scheme with the options an architecture decides filled in (none by default)."""
        return self

    def quantize(self, path: str, nodes: list[str], head: tuple[str, ...] = ()) -> onnx.ModelProto:
        """ONNX Runtime's quantizer applied to the model file at `path` (tensors in external
        data), at the named nodes; `head`: the output head's nodes among them."""
        raise NotImplementedError

    def describe(self) -> str:
        return " ".join(self.flags())


@dataclass(frozen=True)
class Int8(Scheme):
    """Per-channel (default) or per-tensor int8 weight scales; activations quantized per row, as
    they run (quantize_dynamic's per-call scales rewritten: per_row.py)."""

    per_channel: bool = field(default=True, metadata={
        "flag": "--quant-per-tensor", "help": "int8: one scale per weight tensor (default: one per output channel)"})

    name: ClassVar[str] = "int8"
    ops: ClassVar[frozenset[str]] = frozenset({"MatMulInteger", "DynamicQuantizeLinear"})
    policy: ClassVar[Policy] = Policy(math.log(1.01), 0.99, "perplexity within 1% of float, in nats",
                                      min_cosine=0.99)
    coarseness: ClassVar[int] = 1
    # int8 weights in [-64, 64]: on x86 CPUs without VNNI (AVX2 alone, common in CPU servers) ONNX
    # Runtime multiplies uint8 activations by int8 weights with VPMADDUBSW, which saturates its
    # int16 sums of pairs (255 * 127 * 2 > 32767); 7-bit weights cannot (255 * 64 * 2 < 32767).
    # Measured on an AVX2-only EPYC, the ALiBi checkpoint at 1024 tokens: KL 0.0112 nats with
    # 8-bit weights, over the policy's 0.00995, and 0.0005 with 7-bit ones (U8U8 weights: 0.0004,
    # but a slower kernel on every CPU). The kernel and the format stay the default's.
    REDUCE_RANGE: ClassVar[bool] = True

    def option_metadata(self) -> dict[str, str]:
        return {"quant_per_channel": str(int(self.per_channel)), "quant_reduce_range": str(int(self.REDUCE_RANGE))}

    def quantize(self, path: str, nodes: list[str], head: tuple[str, ...] = ()) -> onnx.ModelProto:
        from onnxruntime.quantization import QuantType, quantize_dynamic  # int8: the head as every layer

        from ..graph_order import sort_graph
        from .per_row import activations_per_row

        with tempfile.TemporaryDirectory(dir=Path(path).parent) as tmp:  # external data both ways: protobuf's 2 GB
            out = Path(tmp) / "quantized.onnx"
            quantize_dynamic(path, out, op_types_to_quantize=["MatMul", "Gather"], nodes_to_quantize=nodes,
                             per_channel=self.per_channel, weight_type=QuantType.QInt8, reduce_range=self.REDUCE_RANGE,
                             use_external_data_format=True, extra_options={"MatMulConstBOnly": True})
            quantized = onnx.load(str(out))
        sort_graph(quantized.graph)  # its sort can put an If's outside read after the If (graph_order.py)
        activations_per_row(quantized, head)  # each row its own scale: rows apart from their batch (per_row.py)
        return quantized


@dataclass(frozen=True)
class Int4(Scheme):
    """Blocks of `block` weights per scale (and zero point unless symmetric); MatMulNBits'
    accuracy level 4 computes in int8 (1.8x faster decode than 0 at BLOOM-560m, equal
    perplexity: benchmarks/quantized.md)."""

    block: int | None = field(default=None, metadata={
        "flag": "--quant-block", "help": f"int4: weights per scale ({', '.join(map(str, BLOCK_SIZES))}; default the "
                                         "architecture's: 32, T5 16, measured in benchmarks/quantized.md)"})
    symmetric: bool = field(default=False, metadata={
        "flag": "--quant-symmetric", "help": "int4: no zero points (default: asymmetric)"})
    head: str | None = field(default=None, metadata={
        "flag": "--quant-head", "choices": HEAD_PRECISIONS,
        "help": "int4: the output head's precision (int4, int8: an 8-bit MatMulNBits, float: left as it is; default "
                "the architecture's: int4, the T5 decoder int8, measured in docs/quantized.md)"})
    accuracy_level: int = field(default=4, metadata={
        "flag": "--quant-accuracy-level",
        "help": "int4: MatMulNBits accuracy_level (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute; default 4: measured "
                "1.8x faster decode than 0 on CPU at equal perplexity, benchmarks/quantized.md)"})

    DEFAULT_BLOCK: ClassVar[int] = 32  # ours, BLOOM, MPT, Falcon (an imported architecture may say otherwise)
    DEFAULT_HEAD: ClassVar[str] = "int4"
    name: ClassVar[str] = "int4"
    ops: ClassVar[frozenset[str]] = frozenset({"MatMulNBits", "GatherBlockQuantized"})
    policy: ClassVar[Policy] = Policy(math.log(1.03), 0.95, "perplexity within 3% of float, in nats",
                                      min_cosine=0.97)
    coarseness: ClassVar[int] = 2

    def __post_init__(self):
        if self.block is not None and self.block not in BLOCK_SIZES:
            raise ValueError(f"quantization block must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block!r}")
        if self.head is not None and self.head not in HEAD_PRECISIONS:
            raise ValueError(f"quantized head must be one of {', '.join(HEAD_PRECISIONS)}, got {self.head!r}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy level must be one of {', '.join(map(str, ACCURACY_LEVELS))}, "
                             f"got {self.accuracy_level!r}")

    def resolved(self, default_block: int | None = None, default_head: str | None = None) -> "Int4":
        """This scheme with its block and head decided: those asked for, else the architecture's."""
        return dataclasses.replace(self, block=self.block or default_block or self.DEFAULT_BLOCK,
                                   head=self.head or default_head or self.DEFAULT_HEAD)

    def option_metadata(self) -> dict[str, str]:
        return {"quant_block": str(self.resolved().block), "quant_head": self.resolved().head,
                "quant_symmetric": str(int(self.symmetric)),
                "quant_accuracy_level": str(self.accuracy_level)}

    def quantize(self, path: str, nodes: list[str], head: tuple[str, ...] = ()) -> onnx.ModelProto:
        """`head`: the output head's nodes, quantized as `self.head` says (int4 with the rest;
        int8 in a second pass, an 8-bit MatMulNBits; float: left out)."""
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        spec = self.resolved()
        body = [n for n in nodes if spec.head == "int4" or n not in head]
        graph = onnx.load(path, load_external_data=False).graph
        candidates = [n.name for n in graph.node if n.op_type in ("MatMul", "Gather")]

        def nbits(model, bits, names):
            # the quantizer takes every MatMul / Gather of its op types whatever nodes_to_include
            # says (it only adds to them): the others are named in nodes_to_exclude
            quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=spec.block, is_symmetric=self.symmetric,
                                             accuracy_level=self.accuracy_level or None, nodes_to_include=names,
                                             nodes_to_exclude=[n for n in candidates if n not in names],
                                             op_types_to_quantize=("MatMul", "Gather"),
                                             quant_axes=(("MatMul", 0), ("Gather", 1)))
            quantizer.process()
            return quantizer.model.model

        model = nbits(path, 4, body)
        eight = [n for n in nodes if n in head] if spec.head == "int8" else []
        return nbits(model, 8, eight) if eight else model


SCHEMES: dict[str, type[Scheme]] = {cls.name: cls for cls in (Int8, Int4)}


def scheme(name: str, **options) -> Scheme:
    """The scheme called `name` with its options; ValueError (one line) for an unknown name or
    an option the scheme does not have."""
    if name not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got {name!r}")
    cls = SCHEMES[name]
    known = set(cls.__dataclass_fields__)
    wrong = sorted(set(options) - known)
    if wrong:
        raise ValueError(f"{', '.join(wrong)} do not apply to --quantize {name}")
    return cls(**options)


def scheme_in_graph(proto: onnx.ModelProto) -> str | None:
    """The scheme a graph's own nodes show (the coarsest present), or None for float weights."""
    ops = {n.op_type for n in proto.graph.node}
    found = [cls for cls in SCHEMES.values() if ops & cls.ops]
    return max(found, key=lambda cls: cls.coarseness).name if found else None


def checked_scheme(proto: onnx.ModelProto, label: str | None) -> str | None:
    """The file's scheme: what its graph shows, which a label (posbias.quantized) must agree
    with. The label alone never chooses a policy: a float file labelled int4 would be judged
    ~1000x more loosely. An int8 KV cache (kv_int8.py) rounds what the file computes as int8
    weights do: such a file is judged by the coarser of int8 and its weights' scheme.
    ValueError (one line) for an unknown or disagreeing label."""
    from .kv_int8 import has_int8_cache

    found = scheme_in_graph(proto)
    if label is not None and label not in SCHEMES:
        raise ValueError(f"the file's metadata posbias.quantized is {label[:40]!r}, not one of {', '.join(SCHEMES)}")
    if label is not None and label != found:
        shown = f"its graph's quantized ops are {found}'s" if found else "its graph has no quantized op (float weights)"
        raise ValueError(f"the file's metadata says posbias.quantized={label} but {shown}: refusing to judge it by "
                         "a label")
    return coarser([found, "int8"]) if has_int8_cache(proto) else found


def coarser(names) -> str | None:
    """The coarsest of some files' schemes (None: all float)."""
    named = [n for n in names if n]
    return max(named, key=lambda n: SCHEMES[n].coarseness) if named else None

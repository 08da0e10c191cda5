"""Exports that never hold the weights: trace a skeleton, stream the values into the file.

The graph does not depend on the weights' values, only on their shapes. So the model is traced
with its large parameters as fake tensors (shape and dtype, no storage), the exported graph
keeps a placeholder for each (an external-data reference to a pending location, its offset
the index of the reader it comes from), and `save` (files.py) streams every reader into the
file a few rows at a time, cast to the file's dtype and checked finite on the way. Small
tensors (norm weights, biases, ALiBi slopes) stay real: the optimizer reads and folds them as
before, so the graph is the one a traced model with real weights gives.

The one fold the optimizer makes on large constants is a Transpose whose only input is a
weight (nn.Linear's W^T): `fold_weight_transposes` does it on the placeholder and the writer
permutes each piece it reads instead.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import onnx
import onnx_ir as ir
import torch
from onnxscript.optimizer import constant_folding, optimize_ir
from torch import nn

from ..nn.lazy_weights import READERS_ATTR, ROWS_PER_READ, TensorReader, pieces, read_whole, weight_readers

# Tensors above this many elements are never read by the optimizer's folding (its own default
# limit), so tracing them as fakes changes nothing in the graph.
LARGE = constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
PENDING = "posbias-pending-weights"  # the location of a placeholder until save writes it


@dataclass(frozen=True)
class WeightRef:
    """What a placeholder initializer holds: a reader's tensor, in `dtype`, permuted by `perm`."""

    reader: TensorReader
    dtype: torch.dtype
    perm: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.reader.shape
        return tuple(shape[p] for p in self.perm) if self.perm else shape

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()

    def chunks(self):
        """The tensor's bytes, in order, as numpy arrays of at most a few tens of MB. A
        permuted tensor is read in slabs of its output's first axis (the source's axis perm[0])."""
        if not self.perm:
            for piece in pieces(self.reader):
                yield self.checked(piece)
            return
        whole = self.reader.shape
        if self.perm[0] == 0:  # rows stay rows: permute within each piece
            for piece in pieces(self.reader):
                yield self.checked(piece.permute(self.perm))
            return
        # W^T: the output's rows are the source's axis perm[0]; each output slab is assembled from
        # the source's row pieces, which land along the output's axis perm.index(0)
        out_rows = whole[self.perm[0]]
        per_row = int(torch.Size(whole).numel()) // max(1, out_rows)
        step = max(1, ROWS_PER_READ // max(1, per_row))
        for start in range(0, out_rows, step):
            stop = min(out_rows, start + step)
            slab = torch.cat([p.permute(self.perm)[start:stop] for p in pieces(self.reader)], dim=self.perm.index(0))
            yield self.checked(slab)

    def checked(self, piece: torch.Tensor):
        """A piece of the source as numpy in the file's dtype, refused if not finite."""
        return finite(piece, self.reader.name).to(self.dtype).contiguous().numpy()


def finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """`tensor`, or ValueError naming it when it holds NaN or infinity: no weight ships unchecked,
    whatever its size (the large ones are checked piece by piece as they are written)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"weight {name} holds NaN or infinity; refusing to export it")
    return tensor


def skeleton(model: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, dict[int, TensorReader]]:
    """A copy of `model` in `dtype`, in eval mode, to trace: each large floating parameter a
    fake tensor, the others real (read from their readers if the model was built lazily).
    Returns it with id(fake parameter) -> the reader of its values."""
    readers = weight_readers(model)
    memo: dict[int, object] = {id(getattr(model, READERS_ATTR, None)): None}  # readers are not copied
    large = {}  # id(meta stand-in) -> reader
    for param in {id(p): p for p in model.parameters()}.values():
        reader = readers[id(param)]
        if param.is_floating_point() and param.numel() > LARGE:
            memo[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
            large[id(memo[id(param)])] = reader
        elif param.device.type == "meta":  # a small weight of a lazy model, read whole: checked here
            memo[id(param)] = nn.Parameter(finite(read_whole(reader), reader.name).to(param.dtype), requires_grad=False)
    copied = copy.deepcopy(model, memo).eval().to(dtype)
    if hasattr(copied, READERS_ATTR):
        delattr(copied, READERS_ATTR)
    # meta stand-ins -> fake tensors on the CPU (the exporter traces with CPU inputs); a
    # parameter shared by two modules stays one tensor
    mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    swapped, fakes = {}, {}
    for module in copied.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in swapped:
                with mode:
                    fake = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
                swapped[id(param)] = fake
                fakes[id(fake)] = large[id(param)]  # .to() keeps the Parameter object
            module._parameters[name] = swapped[id(param)]
    return copied, fakes


def _is_pending(value: ir.Value | None) -> bool:
    tensor = value.const_value if value is not None else None
    return isinstance(tensor, ir.ExternalTensor) and tensor.location == PENDING


def _placeholder(value: ir.Value, index: int, ref: WeightRef) -> ir.ExternalTensor:
    return ir.ExternalTensor(PENDING, index, ref.nbytes, value.dtype, shape=ir.Shape(ref.shape), name=value.name)


def fold_weight_transposes(graph: ir.Graph, refs: list[WeightRef]) -> None:
    """Transpose(weight) -> one permuted placeholder, where the weight feeds only that node (as
    onnxscript's folding does for large constants)."""
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or not _is_pending(node.inputs[0]):
            continue
        source = node.inputs[0]
        if len(source.uses()) != 1 or source in graph.outputs:
            continue
        base = refs[source.const_value.offset]
        perm_attr = node.attributes.get("perm")
        perm = tuple(perm_attr.as_ints()) if perm_attr is not None else tuple(reversed(range(len(base.shape))))
        if base.perm:  # compose with an earlier fold
            perm = tuple(base.perm[p] for p in perm)
        out = node.outputs[0]
        refs.append(WeightRef(base.reader, base.dtype, perm))
        folded = ir.Value(name=out.name, shape=ir.Shape(refs[-1].shape), type=ir.TensorType(out.dtype or source.dtype))
        folded.const_value = _placeholder(folded, len(refs) - 1, refs[-1])
        ir.convenience.replace_all_uses_with(out, folded)
        graph.remove(node, safe=True)
        graph.register_initializer(folded)
        if not source.uses():
            graph.initializers.pop(source.name)


def placeholders(program_model: ir.Model, module: nn.Module, fakes: dict[int, TensorReader]) -> list[WeightRef]:
    """Replace the fake initializers of a fresh (unoptimized) export with pending placeholders,
    fold weight transposes, then run onnxscript's optimizer as the exporter would, barred from
    reading a placeholder. Returns the references the placeholders' offsets index."""
    names = {name: fakes[id(p)] for name, p in module.named_parameters(remove_duplicate=False) if id(p) in fakes}
    graph, refs = program_model.graph, []
    for name, value in graph.initializers.items():
        reader = names.get(name)
        if reader is None:
            continue
        if tuple(reader.shape) != tuple(value.shape.numpy()):
            raise ValueError(f"weight {reader.name} has shape {list(reader.shape)}, the model expects "
                             f"{list(value.shape.numpy())}")
        refs.append(WeightRef(reader, _torch_dtype(value.dtype)))
        value.const_value = _placeholder(value, len(refs) - 1, refs[-1])
    fold_weight_transposes(graph, refs)
    optimize_ir(program_model, should_fold=lambda node: False if any(_is_pending(v) for v in node.inputs) else None)
    return refs


def _torch_dtype(dtype: ir.DataType) -> torch.dtype:
    return {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16,
            ir.DataType.BFLOAT16: torch.bfloat16, ir.DataType.DOUBLE: torch.float64}[dtype]


def is_pending_tensor(tensor: onnx.TensorProto) -> bool:
    """Whether an initializer is a placeholder whose values `save` has still to write."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == PENDING for e in tensor.external_data)


def pending_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The graph's placeholder initializers, in file order."""
    return [t for t in proto.graph.initializer if is_pending_tensor(t)]


def pending_index(tensor: onnx.TensorProto) -> int:
    return int(next(e.value for e in tensor.external_data if e.key == "offset"))


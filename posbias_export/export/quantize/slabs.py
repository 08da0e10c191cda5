"""The graph's constant tensors read for quantization without holding the float model: a source
weight (a placeholder, streamed.py) a slab at a time, and the quantized tensors spilled to one file
beside the output as placeholders in turn, streamed into the model's data by `save` (files.py).
streamed.py (int4) and streamed_int8.py round what these slabs hold."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ...nn.lazy_weights import pieces
from ..streamed import PENDING, WeightRef, is_pending_tensor, pending_index

SPILL_MIN_BYTES = 1024  # smaller tensors stay in the model proto (what onnx.save_model's threshold keeps inline)
READ_BYTES = 64 << 20  # a spilled tensor is streamed out this many bytes at a time
SLAB_ELEMENTS = 1 << 22  # weights handed to ONNX Runtime's rounding per call (16 MB of float32)


@dataclass(frozen=True)
class SpilledRef:
    """What a placeholder holds when its bytes were computed here: a span of the spill file."""

    path: Path
    offset: int
    nbytes: int

    def chunks(self):
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            left = self.nbytes
            while left:
                piece = f.read(min(left, READ_BYTES))
                if not piece:
                    raise OSError(f"{self.path} ended {left} bytes early")
                left -= len(piece)
                yield np.frombuffer(piece, np.uint8)


class Weights:
    """The graph's constant tensors by name: placeholders read through their references (refs,
    appended to as tensors are spilled), the others as they are. One spill file per export."""

    def __init__(self, refs: list, spill: Path):
        self.refs, self.spill, self.end = refs, spill, 0
        spill.touch()

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        if not is_pending_tensor(tensor):
            return numpy_helper.to_array(tensor)
        ref = self.refs[pending_index(tensor)]
        out = np.empty(tuple(tensor.dims), onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        if isinstance(ref, WeightRef) and ref.perm == (1, 0):  # W^T: the source's rows fill columns
            at = 0
            for piece in pieces(ref.reader):  # WeightRef.chunks would hold the whole source per slab
                rows = ref.checked(piece)
                out[:, at:at + rows.shape[0]] = rows.T
                at += rows.shape[0]
            return out
        flat, at = out.reshape(-1).view(np.uint8), 0  # filled piece by piece: the tensor is held once
        for piece in ref.chunks():  # a WeightRef's: slabs along the first axis, in the file's dtype
            raw = piece.reshape(-1).view(np.uint8)
            flat[at:at + raw.size] = raw
            at += raw.size
        if at != flat.size:
            raise OSError(f"weight {tensor.name}: {at} bytes read of {flat.size}")
        return out

    def column_slabs(self, tensor: onnx.TensorProto):
        """A MatMul weight [K, N] as [K, c] slabs, left to right. A source weight read transposed
        (nn.Linear's W^T) is never whole in memory: each piece of its rows is a slab of columns."""
        ref = self.refs[pending_index(tensor)] if is_pending_tensor(tensor) else None
        if isinstance(ref, WeightRef) and ref.perm == (1, 0):
            for piece in pieces(ref.reader):
                yield ref.checked(piece).T
            return
        values = self.read(tensor)
        step = max(1, SLAB_ELEMENTS // max(1, values.shape[0]))
        for start in range(0, values.shape[1], step):
            yield values[:, start:start + step]

    def row_slabs(self, tensor: onnx.TensorProto):
        """A 2-D weight as slabs of an even number of rows, top to bottom (int4 packs two values
        a byte: each slab then packs into whole bytes); a source weight piece by piece."""
        ref = self.refs[pending_index(tensor)] if is_pending_tensor(tensor) else None
        if isinstance(ref, WeightRef) and not ref.perm:
            parts = (ref.checked(piece) for piece in pieces(ref.reader))
        else:
            values = self.read(tensor)
            step = max(2, SLAB_ELEMENTS // max(1, values.shape[1]))
            parts = (values[start:start + step] for start in range(0, values.shape[0], step))
        carried = None
        for part in parts:
            part = part if carried is None else np.concatenate([carried, part])
            keep = part.shape[0] // 2 * 2
            carried = part[keep:] if keep < part.shape[0] else None
            if keep:
                yield part[:keep]
        if carried is not None:  # an odd last row: its bytes end the packed data, as the whole's do
            yield carried

    def transposed(self, tensor: onnx.TensorProto, perm: tuple[int, ...], name: str) -> onnx.TensorProto | None:
        """A placeholder of a source weight's transpose (the writer permutes as it reads, as
        streamed.fold_weight_transposes does); None when `tensor` is not a source weight."""
        ref = self.refs[pending_index(tensor)] if is_pending_tensor(tensor) else None
        if not isinstance(ref, WeightRef):
            return None
        composed = tuple(ref.perm[p] for p in perm) if ref.perm else perm
        self.refs.append(WeightRef(ref.reader, ref.dtype, composed))
        return placeholder(name, tensor.data_type, self.refs[-1].shape, len(self.refs) - 1, self.refs[-1].nbytes)

    def keep(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """`tensor` (with its values) as the graph will hold it: inline if small, else its bytes
        appended to the spill file and the tensor a placeholder of them."""
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.ByteSize() <= SPILL_MIN_BYTES:
            return tensor
        # raw_data as the quantizer wrote it (int4: two per byte); a typed field's values as bytes
        raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        offset = -(-self.end // 4096) * 4096
        with open(self.spill, "r+b") as f:
            f.seek(offset)
            f.write(raw)
        self.end = offset + len(raw)
        self.refs.append(SpilledRef(self.spill, offset, len(raw)))
        return placeholder(tensor.name, tensor.data_type, tensor.dims, len(self.refs) - 1, len(raw))


def placeholder(name: str, data_type: int, dims, index: int, nbytes: int) -> onnx.TensorProto:
    """A pending tensor (streamed.py): its offset the index of its reference."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims), data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", PENDING), ("offset", str(index)), ("length", str(nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor

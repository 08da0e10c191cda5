"""A model file's graph without its weights' bytes.

`onnx.load(path, load_external_data=False)` leaves a large model's tensors in their own file, but a
file that holds its tensors (as one under 2 GB may: jina-v2-base's 547 MB) is parsed whole, and
the protobuf library copies each tensor out of the file's bytes: reading jina-v2-base's graph facts
that way peaked at 1082 MiB of RSS, and a server's replica that did it beside its session peaked at
1654 MiB while loading, where the session alone takes 700. Here the file is memory-mapped and
walked at the protobuf wire level: each top-level initializer keeps its name, type, dims and where
its values lie when they are in another file, not the values; the rest of the model is copied as
it is. What is parsed is then a few MB, and the file's pages are the kernel's page cache, not this
process's memory.
"""
from __future__ import annotations

import mmap

# field numbers of onnx.proto3 (ModelProto.graph, GraphProto.initializer, TensorProto's header)
MODEL_GRAPH, GRAPH_INITIALIZER = 7, 5
TENSOR_HEADER = frozenset({1, 2, 8, 13, 14})  # dims, data_type, name, external_data, data_location
RAW_DATA, EXTERNAL_DATA, DATA_LOCATION, EXTERNAL = 9, 13, 14, 1
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, start of the field's key, start of its payload, its end)."""
    pos = start
    while pos < end:
        key_at = pos
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == VARINT:
            _, stop = _varint(buf, pos)
        elif wire == FIXED64:
            stop = pos + 8
        elif wire == LENGTH:
            size, pos = _varint(buf, pos)
            stop = pos + size
        elif wire == FIXED32:
            stop = pos + 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {key_at}: not an ONNX model")
        if stop > end:
            raise ValueError(f"a field at byte {key_at} runs past its message: the file is cut short")
        yield key >> 3, wire, key_at, pos, stop
        pos = stop


def _message(field: int, payload: bytes) -> bytes:
    return _encode_varint(field << 3 | LENGTH) + _encode_varint(len(payload)) + payload


def _kept(buf, start: int, end: int, edit) -> bytes:
    """buf[start:end]'s fields, each copied, or replaced by edit(field, wire, start, stop) when
    that gives bytes (b"" drops the field)."""
    parts = []
    for field, wire, key_at, at, stop in _fields(buf, start, end):
        replaced = edit(field, wire, at, stop)
        parts.append(bytes(buf[key_at:stop]) if replaced is None else replaced)
    return b"".join(parts)


def _external_entries(location: str, offset: int, length: int) -> bytes:
    """TensorProto fields naming values that lie in `location` at `offset` (data_location EXTERNAL)."""
    entries = b"".join(_message(EXTERNAL_DATA, _message(1, key.encode()) + _message(2, value.encode()))
                       for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))))
    return entries + _encode_varint(DATA_LOCATION << 3 | VARINT) + _encode_varint(EXTERNAL)


def graph_only_bytes(buf, keep_bytes: int = 0, refer_to: str | None = None) -> bytes:
    """A serialized ModelProto whose top-level initializers keep name, data type and dims only
    (those of at most `keep_bytes` serialized bytes are kept whole: small constants' values).
    refer_to: the file's own name; each initializer's values are then not dropped but named where
    they lie in that file (external data at their offset: a runtime reads them from the file)."""
    def stripped(at, stop):
        parts, raw, typed = [], None, False
        for field, wire, key_at, f_at, f_stop in _fields(buf, at, stop):
            if field in TENSOR_HEADER:
                parts.append(bytes(buf[key_at:f_stop]))
            elif field == RAW_DATA:
                raw = (f_at, f_stop)
            else:
                typed = True  # values in a typed field (float_data, ...), or a field this walk does not know
        if refer_to is None:
            return b"".join(parts)
        if typed or raw is None:
            return None  # nothing to refer to in place: kept whole
        return b"".join(parts) + _external_entries(refer_to, raw[0], raw[1] - raw[0])

    def in_graph(field, wire, at, stop):
        if field == GRAPH_INITIALIZER and wire == LENGTH and stop - at > keep_bytes:
            header = stripped(at, stop)
            return None if header is None else _message(field, header)
        return None

    def in_model(field, wire, at, stop):
        if field == MODEL_GRAPH and wire == LENGTH:
            return _message(field, _kept(buf, at, stop, in_graph))
        return None

    return _kept(buf, 0, len(buf), in_model)


def load_graph_only(model_path, keep_bytes: int = 0, refer_in_place: bool = False):
    """The file's onnx ModelProto with its initializers' values left out (see above), but those
    of initializers of at most `keep_bytes` bytes. refer_in_place: each left-out initializer held
    in the file names its bytes there (location: the file's name), so a session made from the
    edited model (with the file's folder as its external data folder) reads the weights from the
    file and nothing holds them parsed."""
    import onnx
    from pathlib import Path

    with open(model_path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ValueError(f"{model_path} is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            refer_to = Path(model_path).name if refer_in_place else None
            return onnx.ModelProto.FromString(graph_only_bytes(buf, keep_bytes, refer_to))

"""The files a model is: its .onnx and every external-data file its graph names.

A model past ~1.8 GB is written as `x.onnx` (the graph) beside `x.onnx.data` (the tensors); a
command that writes a report or a model over either one destroys the model it was given. Every
check of outputs against inputs (atomic.clashing_input) expands an input model into these files.
"""
from __future__ import annotations

from pathlib import Path

# a graph file past this holds its tensors inside (external data keeps the .onnx small); reading
# such a file only to list locations would parse gigabytes
GRAPH_ONLY_BYTES = 256 << 20
DATA_SUFFIX = ".data"  # what our exporters and onnx's save_model(..., location=x.onnx.data) name it


def data_locations(model: Path) -> list[Path]:
    """External-data files named by `model`'s tensors, resolved beside it (the graph is read
    without them). When the graph cannot be read here (no onnx package, a large or unparsable
    file): the conventional `<model>.data` where it exists."""
    fallback = [p for p in (model.with_name(model.name + DATA_SUFFIX),) if p.is_file()]
    try:
        if model.stat().st_size > GRAPH_ONLY_BYTES:
            return fallback
        import onnx

        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model we can read: its owner reports that, not this check
        return fallback
    tensors = [*proto.graph.initializer, *(a.t for n in proto.graph.node for a in n.attribute if a.HasField("t"))]
    names = {entry.value for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL
             for entry in t.external_data if entry.key == "location"}
    return [model.parent / name for name in sorted(names)] or fallback


def model_files(path: Path) -> list[Path]:
    """[path] and, for an ONNX file, the external-data files it names."""
    path = Path(path)
    if path.suffix.lower() == ".onnx" and path.is_file():
        return [path, *data_locations(path)]
    return [path]

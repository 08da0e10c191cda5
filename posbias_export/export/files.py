"""Writing model files: fail early when the output cannot be written, then write atomically
(a temporary file in the same folder, renamed), so a failed run leaves no partial file and
never replaces an existing one; and the --work folder a long job (a bench) fills: one it made or
verified, its files in a private folder removed when the job ends."""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..runners import atomic
from .streamed import WeightRef, pending_index, pending_tensors

EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # protobuf's hard limit is 2 GB


def ensure_writable(path: str | os.PathLike) -> Path:
    """Fail before the (slow) export if the output cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise OSError(f"cannot write {path}: it is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OSError(f"cannot write {path}: directory {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise OSError(f"cannot write {path}: the existing file is read-only")
    try:  # the only reliable test (root ignores permission bits; read-only mounts do not)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{atomic().short_name(path.name)}.probe-"):
            pass
    except OSError as err:
        raise OSError(f"cannot write {path}: directory {parent} is not writable ({err.strerror})") from None
    return path


def check_outputs(outputs, inputs=()) -> None:
    """Before any work: every output path can be written and none of them is one of the inputs
    (writing a model over the checkpoint it came from would lose the checkpoint)."""
    outputs = [out for out in outputs if out]
    for out in outputs:
        ensure_writable(out)
    clash = atomic().clashing_input(outputs, inputs)
    if clash:
        raise OSError(f"refusing to write {clash[0]}: it is also an input ({Path(clash[1]).name}); "
                      "choose another output path")


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` whole or not at all (runtimes/common/atomic.py: a temporary beside
    it, flushed, renamed; removed on any failure, Ctrl-C or SIGTERM)."""
    return atomic().write_bytes(path, data)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, text)


def output_folder(path: str | os.PathLike) -> Path:
    """A folder results files go to (made if missing); a file in its place is a ValueError."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output folder {path} is a file")
    path.mkdir(parents=True, exist_ok=True)
    return path


WORK_MARK = ".posbias-bench-work"  # in every --work folder a bench made


def work_folder(path: Path, own_names=()) -> Path:
    """--work as a bench may use it: a folder it makes (new, or empty) or one it made before
    (its mark, or nothing in it but `own_names` and what starts with one of them followed by
    "_", the published models' folders and files). Anything else, `/` or a home folder say, is
    refused in one line before anything is written there: a bench writes only in a folder it
    made or verified."""
    path = check_work_folder(path, own_names)
    path.mkdir(parents=True, exist_ok=True)
    (path / WORK_MARK).touch()
    return path


def check_work_folder(path: Path, own_names=()) -> Path:
    """work_folder's refusals, with nothing made: a bench checks everything before it writes."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--work {path} is a file, not a folder")
    if path.is_dir() and not (path / WORK_MARK).is_file():
        own = set(own_names) | {"bench-files"}
        foreign = [e.name for e in path.iterdir()
                   if e.name not in own and e.name.split("_")[0] not in own and not e.name.endswith(".posbias-tmp")]
        if foreign:
            raise ValueError(f"--work {path} holds files no benchmark made ({foreign[0]!r} among them); give a new or "
                             "empty folder")
    return path


def scratch(work: Path):
    """A private folder inside `work` for every file a benchmark makes (exports, serving
    folders), removed when the run ends, killed or not (its writer's lock marks it live): a
    bench writes only what it made, and never over a file of the same name a user keeps there."""
    work.mkdir(parents=True, exist_ok=True)
    return atomic().temporary_folder(work / "bench-files")


def default_file_mode() -> int:
    """What open() would give a new file: 0666 minus the umask (temporary files get 0600)."""
    return atomic().default_file_mode()


@dataclass(frozen=True)
class SavedModel:
    model_bytes: int
    data_path: Path | None  # external data beside the model (models over ~2 GB), else None
    data_bytes: int = 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(length)


# protobuf field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9


def _one_name_per_bytes(graph: onnx.GraphProto) -> None:
    """Tensors that name the same bytes of the data file (tied.py's aliases) made one, the first
    name read everywhere: one file cannot point two tensors at one copy, and a second would
    store the bytes twice."""
    first, gone = {}, {}
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            where = tuple((e.key, e.value) for e in t.external_data)
            if where in first:
                gone[t.name] = first[where]
            else:
                first[where] = t.name
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = gone.get(name, name)
    for t in [t for t in graph.initializer if t.name in gone]:
        graph.initializer.remove(t)


def _inline_external(model_path: Path, data_path: Path, out_path: Path) -> None:
    """Rewrite a model whose tensors lie in `data_path` as one .onnx file, streaming: the model
    without those tensors, then a second `graph` field holding only them (protobuf merges
    repeated occurrences of a message field, so a reader sees one graph with every
    initializer), each tensor's bytes copied from the data file in pieces. Nothing the size of
    the weights is held."""
    proto = onnx.load_model(str(model_path), load_external_data=False)
    _one_name_per_bytes(proto.graph)
    moved = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for t in moved:
        proto.graph.initializer.remove(t)
    entries = []
    for t in moved:
        where = {e.key: e.value for e in t.external_data}
        header = onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type).SerializeToString()
        length = int(where["length"])
        entries.append((int(where.get("offset", 0)), length, header + _field(_RAW_DATA, length)))
    with open(out_path, "wb") as out, open(data_path, "rb") as data:
        out.write(proto.SerializeToString())
        out.write(_field(_GRAPH, sum(len(_field(_INITIALIZER, len(h) + n)) + len(h) + n for _, n, h in entries)))
        for offset, length, head in entries:
            out.write(_field(_INITIALIZER, len(head) + length) + head)
            data.seek(offset)
            while length:
                piece = data.read(min(length, 1 << 26))
                if not piece:
                    raise OSError(f"{data_path} ends before its tensors do")
                out.write(piece)
                length -= len(piece)


def _write_external(proto: onnx.ModelProto, data, data_name: str, pending: list[onnx.TensorProto],
                    refs: list[WeightRef]) -> None:
    """The pending weights streamed into the external data file, each at a 4096-byte aligned
    offset (ONNX Runtime memory-maps aligned tensors), their references pointed at it."""
    offset, written = 0, {}
    for t in pending:
        index = pending_index(t)
        ref = refs[index]
        if index not in written:  # placeholders of one reference (tied.py's aliases) share its bytes
            offset = -(-offset // 4096) * 4096
            data.seek(offset)
            for chunk in ref.chunks():  # a file write, not ndarray.tofile: a full disk is then ENOSPC, with its errno
                data.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            written[index] = offset
            offset += ref.nbytes
        del t.external_data[:]
        for key, value in (("location", data_name), ("offset", str(written[index])), ("length", str(ref.nbytes))):
            t.external_data.add(key=key, value=value)


def save_checked(proto: onnx.ModelProto, path: Path, check: Callable[[str], None],
                 refs: list[WeightRef] | None = None, external: bool = False) -> SavedModel:
    """Write to a temporary folder beside `path`, run `check` on the written file (by path, so
    models over protobuf's 2 GB limit are checked with their external data), then rename into
    place: a failure leaves no partial file and never clobbers an existing one. Models over
    ~2 GB keep their tensors in `<name>.data` beside the model, and so does any model with
    `external` (ONNX Runtime maps such tensors and releases what it prepacks, where it holds a
    one-file model's tensors as parsed as well: benchmarks/serving.md). Placeholder weights of a
    streamed export (streamed.py) are read from `refs` as they are written. Note: saving
    moves tensors out of `proto`."""
    path = Path(path)
    pending = pending_tensors(proto)
    if pending and refs is None:
        raise ValueError("the model holds weights still to be written: give their references")
    # the tensors decide; proto.ByteSize() itself fails past 2 GB
    total = sum(t.ByteSize() for t in proto.graph.initializer) + sum(refs[pending_index(t)].nbytes for t in pending)
    external = external or total > EXTERNAL_DATA_THRESHOLD
    data_name = path.name + ".data"
    with atomic().temporary_folder(path) as tmp:  # named after this process: a killed run's is swept later
        tmp_model, tmp_data = Path(tmp) / path.name, Path(tmp) / data_name
        if pending:  # streamed, checked with its tensors outside (the checker then reads no weights)
            with open(tmp_data, "wb") as data:
                _write_external(proto, data, data_name, pending, refs)
            onnx.save_model(proto, tmp_model)  # the small tensors stay inside the model
        elif external:
            # onnx refuses a location that exists relative to the WORKING folder (not the model's):
            # from inside the fresh temporary folder nothing there does
            with contextlib.chdir(tmp):
                onnx.save_model(proto, tmp_model.name, save_as_external_data=True, all_tensors_to_one_file=True,
                                location=data_name, size_threshold=1024)
        else:
            onnx.save_model(proto, tmp_model)
        check(str(tmp_model))
        if pending and not external:  # small enough for one file: the checked graph, its tensors moved in
            single = Path(tmp) / (".single-" + path.name)
            _inline_external(tmp_model, tmp_data, single)
            os.replace(single, tmp_model)
            tmp_data.unlink()
        written = [tmp_data, tmp_model] if external else [tmp_model]  # data first: the model never points at nothing
        for f in written:
            os.chmod(f, default_file_mode())
        saved = SavedModel(tmp_model.stat().st_size, path.parent / data_name if external else None,
                           tmp_data.stat().st_size if external else 0)
        for f in written:
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        for f in written:
            os.replace(f, path.parent / f.name)
    return saved

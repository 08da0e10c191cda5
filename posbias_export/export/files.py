"""Writing model files: fail early when the output cannot be written, then write atomically
(a temporary file in the same folder, renamed), so a failed run leaves no partial file and
never replaces an existing one."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..runners import atomic

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
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.probe-"):
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


def default_file_mode() -> int:
    """What open() would give a new file: 0666 minus the umask (temporary files get 0600)."""
    return atomic().default_file_mode()


@dataclass(frozen=True)
class SavedModel:
    model_bytes: int
    data_path: Path | None  # external data beside the model (models over ~2 GB), else None
    data_bytes: int = 0


def save_checked(proto: onnx.ModelProto, path: Path, check: Callable[[str], None]) -> SavedModel:
    """Write to a temporary folder beside `path`, run `check` on the written file (by path, so
    models over protobuf's 2 GB limit are checked with their external data), then rename into
    place: a failure leaves no partial file and never clobbers an existing one. Models over
    ~2 GB keep their tensors in `<name>.data` beside the model. Note: saving as external data
    moves the tensors out of `proto`."""
    path = Path(path)
    # the tensors decide; proto.ByteSize() itself fails past 2 GB
    external = sum(t.ByteSize() for t in proto.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    data_name = path.name + ".data"
    with atomic().temporary_folder(path) as tmp:  # named after this process: a killed run's is swept later
        tmp_model, tmp_data = Path(tmp) / path.name, Path(tmp) / data_name
        if external:
            onnx.save_model(proto, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
        else:
            onnx.save_model(proto, tmp_model)
        check(str(tmp_model))
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

"""Writing model files: fail early when the output cannot be written, then write atomically
(a temporary file in the same folder, renamed), so a failed run leaves no partial file and
never replaces an existing one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

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


def save_atomic(proto: onnx.ModelProto, path: Path) -> int:
    """Write to a temporary file in the same directory, then rename: a failure leaves no partial
    file and never clobbers an existing one. Models over ~2 GB get external data beside them."""
    path = Path(path)
    external = proto.ByteSize() > EXTERNAL_DATA_THRESHOLD
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        tmp_model = Path(tmp) / path.name
        if external:
            data_name = path.name + ".data"
            onnx.save_model(proto, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
            os.replace(Path(tmp) / data_name, path.parent / data_name)
        else:
            onnx.save_model(proto, tmp_model)
        size = tmp_model.stat().st_size
        os.replace(tmp_model, path)
    return size

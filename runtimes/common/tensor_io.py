"""Tensors in and out: .npz files or ONNX backend-test folders (input_N.pb / output_N.pb,
optionally grouped in test_data_set_N/ folders)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


class RunnerError(Exception):
    """A problem with the request (model, inputs, runtime): one line for the user."""



def default_file_mode() -> int:
    """What open() would give a new file: 0666 minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask

def _onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise RunnerError("reading/writing .pb tensors needs the 'onnx' package; use .npz files instead") from None
    return onnx, numpy_helper


def data_sets(path: str | os.PathLike) -> list[tuple[str, Path]]:
    """[(set name, location)]: one .npz, one folder of input_*.pb, or test_data_set_* folders."""
    path = Path(path)
    if not path.exists():
        raise RunnerError(f"inputs {path} do not exist")
    if path.is_file():
        if path.suffix != ".npz":
            raise RunnerError(f"inputs {path}: expected a .npz file or a folder of input_N.pb files")
        return [(path.stem, path)]
    sets = sorted((p for p in path.glob("test_data_set_*") if p.is_dir()), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if sets:
        return [(p.name, p) for p in sets]
    if list(path.glob("input_*.pb")):
        return [(path.name, path)]
    raise RunnerError(f"inputs {path}: no input_N.pb files and no test_data_set_N folders")


def read_tensors(location: Path, prefix: str = "input", names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Named arrays from a .npz, or from {prefix}_N.pb files (names from the protos, else `names`)."""
    if location.is_file():
        try:
            with np.load(location, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except Exception as err:
            raise RunnerError(f"cannot read {location}: {err}") from None
    onnx, numpy_helper = _onnx()
    files = sorted(location.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    out = {}
    for index, file in enumerate(files):
        proto = onnx.TensorProto()
        try:
            proto.ParseFromString(file.read_bytes())
            array = numpy_helper.to_array(proto)
        except Exception as err:
            raise RunnerError(f"cannot read tensor {file}: {err}") from None
        name = proto.name or (names[index] if names and index < len(names) else f"{prefix}_{index}")
        out[name] = array
    return out


def write_tensors(location: Path, arrays: dict[str, np.ndarray], prefix: str = "output") -> None:
    """Write arrays as .npz (location ends in .npz) or {prefix}_N.pb files; atomic per file."""
    location = Path(location)
    if location.suffix == ".npz":
        location.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=location.parent, suffix=".npz", delete=False) as tmp:
            np.savez(tmp, **arrays)
        os.chmod(tmp.name, default_file_mode())  # NamedTemporaryFile makes 0600; a results file is shared like any other
        os.replace(tmp.name, location)
        return
    onnx, numpy_helper = _onnx()
    location.mkdir(parents=True, exist_ok=True)
    for index, (name, array) in enumerate(arrays.items()):
        target = location / f"{prefix}_{index}.pb"
        tmp = target.with_suffix(".pb.tmp")
        tmp.write_bytes(numpy_helper.from_array(np.ascontiguousarray(array), name).SerializeToString())
        os.replace(tmp, target)

"""Tensors in and out: .npz files or ONNX backend-test folders (input_N.pb / output_N.pb,
optionally grouped in test_data_set_N/ folders)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .atomic import write_all, write_with


class RunnerError(Exception):
    """A problem with the request (model, inputs, runtime): one line for the user."""


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
    sets = [p for p in _numbered(path, "test_data_set_*") if p.is_dir()]
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
    files = _numbered(location, f"{prefix}_*.pb")
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
    """Write arrays as .npz (location ends in .npz) or {prefix}_N.pb files, each file atomic
    (atomic.py: whole or not at all, temporary removed on failure)."""
    location = Path(location)
    if location.suffix == ".npz":
        if not location.parent.is_dir():
            _make_folder(location.parent)
        def save(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a file object: given a name, savez would append .npz to it
                np.savez(f, **arrays)
        write_with(location, save)
        return
    onnx, numpy_helper = _onnx()
    made = not location.exists()
    _make_folder(location)
    files = {location / f"{prefix}_{index}.pb": numpy_helper.from_array(np.ascontiguousarray(array), name)
             .SerializeToString() for index, (name, array) in enumerate(arrays.items())}
    try:
        write_all(files)  # every tensor or none: a full disk at the last leaves no first ones
    except BaseException:
        if made:
            try:
                location.rmdir()  # the folder this run made, empty again
            except OSError:
                pass
        raise


def _make_folder(folder: Path) -> None:
    for part in [folder, *folder.parents]:
        if part.exists() and not part.is_dir():
            raise RunnerError(f"cannot write into {folder}: {part} is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"cannot make the output folder {folder}: {err.strerror}") from None


def _numbered(path: Path, pattern: str) -> list[Path]:
    """Files or folders named <stem>_<N>, by N; a name whose N is not a number is one line."""
    found = list(path.glob(pattern))
    bad = [p.name for p in found if not p.name.split(".")[0].rsplit("_", 1)[-1].isdigit()]
    if bad:
        raise RunnerError(f"{path / bad[0]}: expected a number after the last '_' (e.g. {pattern.replace('*', '0')})")
    return sorted(found, key=lambda p: int(p.name.split(".")[0].rsplit("_", 1)[1]))

"""The shared command line of the Python runners: MODEL INPUTS OUTPUTS, errors as one line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .tensor_io import RunnerError, data_sets, read_tensors, write_tensors


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), like every other error of the runners."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse(description: str, add_options=None, argv=None) -> argparse.Namespace:
    p = OneLineParser(description=description)
    p.add_argument("model", help="model.onnx")
    p.add_argument("inputs", help=".npz, a folder of input_N.pb, or a folder of test_data_set_N/ folders")
    p.add_argument("outputs", help=".npz or a folder (mirrors the inputs' test_data_set_N layout)")
    if add_options:
        add_options(p)
    return p.parse_args(argv)


def check_model_file(path: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise RunnerError(f"model {path} does not exist")
    if path.stat().st_size == 0:
        raise RunnerError(f"model {path} is empty")
    return path


def onnx_metadata(model_path: str) -> dict[str, str]:
    """The file's metadata_props, read with the onnx package when it is installed (else none)."""
    try:
        import onnx
    except ImportError:
        return {}
    try:
        return {p.key: p.value for p in onnx.load(model_path, load_external_data=False).metadata_props}
    except Exception:
        return {}  # the runtime's own load reports a broken file


def run_all(args, load, specs_of, run, name: str, metadata_of=None) -> int:
    """load(model_path) -> handle; specs_of(handle) -> [InputSpec]; run(handle, feeds) -> {name: array};
    metadata_of(handle) -> the file's metadata_props (default: read with onnx)."""
    from .feeds import check_feeds, with_token_limit

    try:
        handle = load(str(check_model_file(args.model)))
        metadata = metadata_of(handle) if metadata_of else onnx_metadata(args.model)
        specs = with_token_limit(specs_of(handle), metadata)
        sets = data_sets(args.inputs)
        out_root = Path(args.outputs)
        for set_name, location in sets:
            feeds = read_tensors(location, "input", [s.name for s in specs])
            check_feeds(feeds, specs)
            start = time.perf_counter()
            outputs = run(handle, feeds)
            elapsed = time.perf_counter() - start
            if out_root.suffix == ".npz":
                target = out_root if len(sets) == 1 else out_root.with_name(f"{out_root.stem}_{set_name}.npz")
            else:
                target = out_root / set_name if len(sets) > 1 or location.name.startswith("test_data_set_") else out_root
            write_tensors(target, outputs)
            print(f"{name}: {set_name} ran in {elapsed * 1e3:.1f} ms")
        return 0
    except RunnerError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2

"""The shared command line of the Python runners: MODEL INPUTS OUTPUTS, errors as one line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .graph_only import load_graph_only
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
    p.add_argument("--fresh-sessions", action="store_true",
                   help="a new session for every data set (default: one session runs them all in order, as a "
                        "server does; validate compares the two bit for bit)")
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


def contract_of(metadata: dict[str, str], model_path) -> "FileContract":
    """What the file says it is (common/contract.py); a damaged or forged label is one line."""
    from .contract import FileContract

    try:
        return FileContract.from_props(metadata)
    except ValueError as err:
        raise RunnerError(f"{model_path}: {err}") from None


def onnx_metadata(model_path: str) -> dict[str, str]:
    """The file's metadata_props, read with the onnx package when it is installed (else none)."""
    try:
        import onnx  # noqa: F401 - parses what load_graph_only keeps
    except ImportError:
        return {}
    try:
        return {p.key: p.value for p in load_graph_only(model_path).metadata_props}
    except Exception:
        return {}  # the runtime's own load reports a broken file


def output_targets(out_root: Path, sets) -> list[Path]:
    """Where each data set's outputs go: the .npz (one per set when there are several), or the
    folder (a test_data_set_N folder per set)."""
    if out_root.suffix == ".npz":
        return [out_root if len(sets) == 1 else out_root.with_name(f"{out_root.stem}_{name}.npz") for name, _ in sets]
    return [out_root / name if len(sets) > 1 or location.name.startswith("test_data_set_") else out_root
            for name, location in sets]


def run_all(args, load, specs_of, run, name: str, metadata_of=None) -> int:
    """load(model_path) -> handle; specs_of(handle) -> [InputSpec]; run(handle, feeds) -> {name: array};
    metadata_of(handle) -> the file's metadata_props (default: read with onnx). Every input is
    read and checked, and every set run, before any output is written: a refused or failed run
    creates nothing."""
    from .atomic import clashing_input, on_sigterm_raise
    from .feeds import check_feeds, with_token_limit
    from .graph_facts import read_graph_facts, token_limit

    on_sigterm_raise()
    try:
        model = check_model_file(args.model)
        sets = data_sets(args.inputs)
        targets = output_targets(Path(args.outputs), sets)
        clash = clashing_input(targets, [model, Path(args.inputs), *(location for _, location in sets)])
        if clash:
            raise RunnerError(f"refusing to write {clash[0]}: it is also an input ({clash[1].name})")
        facts = read_graph_facts(args.model)  # before the session: its parse is freed before the weights load
        handle = load(str(model))
        fresh = getattr(args, "fresh_sessions", False)
        metadata = metadata_of(handle) if metadata_of else onnx_metadata(args.model)
        limit = token_limit(facts, contract_of(metadata, args.model))
        specs = with_token_limit(specs_of(handle), limit)
        feeds = [read_tensors(location, "input", [s.name for s in specs]) for _, location in sets]
        for fed in feeds:
            check_feeds(fed, specs)
        results = []
        for index, ((set_name, _), fed) in enumerate(zip(sets, feeds)):
            if fresh and index:
                handle = load(str(model))
            start = time.perf_counter()
            results.append(run(handle, fed))
            print(f"{name}: {set_name} ran in {(time.perf_counter() - start) * 1e3:.1f} ms")
        for target, outputs in zip(targets, results):
            write_tensors(target, outputs)
        return 0
    except RunnerError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an output that cannot be written: a file in the way, read-only, a full disk
        print(f"{name}: error: {err if not err.filename else f'{err.filename}: {err.strerror}'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (atomic.Terminated): temporaries are gone
        print(f"{name}: {'terminated' if type(stop).__name__ == 'Terminated' else 'interrupted'}", file=sys.stderr)
        return 143 if type(stop).__name__ == "Terminated" else 130

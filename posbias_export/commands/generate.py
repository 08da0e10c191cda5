"""generate: lives with the runners (onnxruntime and numpy only): runtimes/ort/generate.py, or
runtimes/ort/seq2seq.py for a T5 folder written with --out-dir."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError


def run_generate(argv: list[str]) -> int:
    from ..parity import load_runner

    first = Path(argv[0]) if argv and not argv[0].startswith("-") else None
    runner = "ort/generate.py"
    if first is not None and first.is_dir():  # a folder written with --out-dir
        if (first / "encoder_model.onnx").is_file():
            runner = "ort/seq2seq.py"
        elif (first / "model.onnx").is_file():
            argv = [str(first / "model.onnx"), *argv[1:]]
    try:
        module = load_runner(runner)
    except FileNotFoundError as err:
        raise UsageError(f"{err} (a broken install: reinstall posbias_export)") from None
    return module.main(argv)

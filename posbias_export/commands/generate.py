"""generate: lives with the runners (onnxruntime and numpy only): runtimes/ort/generate.py."""
from __future__ import annotations

from ..errors import UsageError


def run_generate(argv: list[str]) -> int:
    from ..parity import load_runner

    try:
        module = load_runner("ort/generate.py")
    except FileNotFoundError as err:
        raise UsageError(f"{err} (a broken install: reinstall posbias_export)") from None
    return module.main(argv)

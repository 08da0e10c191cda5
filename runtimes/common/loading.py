"""Loading a runner script as a module, by its path under runtimes/ (the runners are scripts,
not a package; some folder names, like openvino/, would shadow the library they use)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

RUNTIMES_DIR = Path(__file__).resolve().parents[1]


def load_runner(relative: str) -> ModuleType:
    """e.g. load_runner("ort/run.py"); FileNotFoundError if the script is missing."""
    path = RUNTIMES_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(f"runner {path} not found")
    spec = importlib.util.spec_from_file_location("posbias_runner_" + "_".join(Path(relative).with_suffix("").parts), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""Where the torch-free runner scripts are (runtimes/: inside an installed package, beside it in
a source checkout) and their shared helpers (runtimes/common), which the package uses too: one
input check, one cache naming, one atomic write for both sides."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def _runtimes_dir() -> Path:
    package = Path(__file__).resolve().parent
    installed = package / "runtimes"  # a wheel ships the runners inside the package
    return installed if installed.is_dir() else package.parent / "runtimes"  # a source checkout


RUNTIMES_DIR = _runtimes_dir()


def runtimes_common(name: str) -> ModuleType:
    """A module of runtimes/common, imported the way the runners import it (common.<name>)."""
    sys.path.insert(0, str(RUNTIMES_DIR))
    try:
        return importlib.import_module(f"common.{name}")
    finally:
        sys.path.remove(str(RUNTIMES_DIR))


def atomic() -> ModuleType:
    """runtimes/common/atomic.py: the one way every file is written."""
    return runtimes_common("atomic")

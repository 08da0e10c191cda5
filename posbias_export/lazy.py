"""Package namespaces whose names import on first use: `import posbias_export` (and the
command line's usage errors) then do not wait for torch."""
from __future__ import annotations

import importlib


def lazy_names(package: str, homes: dict[str, str]):
    """(__getattr__, __dir__) for a package whose public names live in its submodules
    (`homes`: name -> submodule)."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    def __dir__():
        return sorted(homes)

    return __getattr__, __dir__

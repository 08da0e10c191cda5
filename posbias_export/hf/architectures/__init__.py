"""The imported architectures: every module here defines an `ImportedModel` subclass with a
`model_type`, which registers it (hf/imported.py ARCHITECTURES); importing this package imports
them all, as biases/ discovers its families. A new architecture is one file here."""
from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

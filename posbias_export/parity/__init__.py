"""Proving an export: the validate matrix (every runtime vs a float64 PyTorch reference), the
tolerance policy that judges it, and its rendering.

Names are imported on first use: the runtime table (runtimes.py) is torch-free, so the command
line can list runtimes and run the runners without paying for a torch import."""
from __future__ import annotations

from ..lazy import lazy_names

_HOMES = {
    "Cell": "matrix", "Matrix": "matrix", "run_matrix": "matrix",
    "ParityInputError": "reference", "load_model_file": "reference", "reference_model": "reference",
    "torch_outputs": "reference",
    "format_matrix": "report", "parity_markdown": "report",
    "DEFAULT_RUNTIMES": "runtimes", "RUNTIMES": "runtimes", "RUNTIMES_DIR": "runtimes",
    "installed_defaults": "runtimes", "load_runner": "runtimes",
    "BFLOAT16": "tolerance", "FLOAT16": "tolerance", "FLOAT32": "tolerance", "Parity": "tolerance", "TF32": "tolerance",
    "Tolerance": "tolerance", "compare": "tolerance",
}
__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)

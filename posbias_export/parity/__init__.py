"""Proving an export: the validate matrix (every runtime vs a float64 PyTorch reference), the
tolerance policy that judges it, and its rendering."""
from .matrix import Cell, Matrix, run_matrix
from .reference import ParityInputError, load_model_file, reference_model, torch_outputs
from .report import format_matrix, parity_markdown
from .runtimes import DEFAULT_RUNTIMES, RUNTIMES, RUNTIMES_DIR, load_runner
from .tolerance import BFLOAT16, FLOAT16, FLOAT32, Parity, Tolerance, compare

__all__ = ["BFLOAT16", "DEFAULT_RUNTIMES", "FLOAT16", "FLOAT32", "RUNTIMES", "RUNTIMES_DIR", "Cell", "Matrix",
           "Parity", "ParityInputError", "Tolerance", "compare", "format_matrix", "load_model_file", "load_runner",
           "parity_markdown", "reference_model", "run_matrix", "torch_outputs"]

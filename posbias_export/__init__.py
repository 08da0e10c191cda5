"""posbias_export: positional attention biases from PyTorch to ONNX with dynamic sequence axes.

Layers, bottom up: biases/ (one file per family) -> nn/ (config, models, attention forms,
checkpoints) -> export/ (passes, checks, ONNX functions) -> parity/ (validate matrix,
tolerance policy) -> study/, bench/ -> cli.py.

The public names below are imported on first use, so `python -m posbias_export validate ...`
or a usage error does not wait for torch to import.
"""
from __future__ import annotations

from .lazy import lazy_names

_HOMES = {
    "BIASES": "biases", "AttentionBias": "biases", "alibi_slopes": "biases", "create_bias": "biases",
    "t5_relative_bucket": "biases",
    "ExportOptions": "export", "ExportReport": "export", "export_onnx": "export", "quantization_scheme": "export",
    "AttentionSettings": "nn", "ModelConfig": "nn", "build_model": "nn", "load_checkpoint": "nn",
    "save_checkpoint": "nn",
}
__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)

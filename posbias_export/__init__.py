"""posbias_export: positional attention biases from PyTorch to ONNX with dynamic sequence axes.

Layers, bottom up: biases/ (one file per family) -> nn/ (config, models, attention forms,
checkpoints) -> export/ (passes, checks, ONNX functions) -> parity/ (validate matrix,
tolerance policy) -> study/, bench/ -> cli.py.
"""
from .biases import BIASES, AttentionBias, alibi_slopes, create_bias, t5_relative_bucket
from .export import ExportReport, export_onnx
from .nn import AttentionSettings, ModelConfig, build_model, load_checkpoint, save_checkpoint

__all__ = [
    "BIASES",
    "AttentionBias",
    "AttentionSettings",
    "ExportReport",
    "ModelConfig",
    "alibi_slopes",
    "build_model",
    "create_bias",
    "export_onnx",
    "load_checkpoint",
    "save_checkpoint",
    "t5_relative_bucket",
]

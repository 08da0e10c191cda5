"""posbias_export: positional attention biases from PyTorch to ONNX with dynamic sequence axes."""
from .biases import BIASES, AttentionBias, alibi_slopes, create_bias, t5_relative_bucket
from .checkpoint import load_checkpoint, save_checkpoint
from .export import ExportReport, export_onnx
from .model import ModelConfig, build_model

__all__ = [
    "BIASES",
    "AttentionBias",
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

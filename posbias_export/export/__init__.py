"""PyTorch -> ONNX: the export passes, the post-export checks, the posbias function library,
the blocked-attention graph, the ONNX Script-authored block, the file's contract and atomic files."""
from .checks import ExportCheckError
from .files import check_outputs, ensure_writable
from .contract import FileContract, attention_settings_of, model_config, read_contract
from .metadata import checkpoint_metadata, source_metadata
from .options import ExportOptions
from .pipeline import DTYPES, ExportReport, export_onnx
from .signature import INPUT_NAMES, OUTPUT_NAMES
from .quantize import scheme as quantization_scheme
from .targets import OPSETS, TARGETS

__all__ = ["DTYPES", "INPUT_NAMES", "OPSETS", "OUTPUT_NAMES", "TARGETS", "ExportCheckError", "ExportOptions", "ExportReport",
           "FileContract", "attention_settings_of", "check_outputs", "checkpoint_metadata", "ensure_writable", "export_onnx",
           "model_config", "quantization_scheme", "read_contract", "source_metadata"]

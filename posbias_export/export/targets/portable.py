"""--target portable (the default): runs everywhere. The blocked body multiplies, masks and
softmaxes each block with separate standard ops (blocked_body.py, its pieces in blocked_script.py);
quantized weights run on ONNX Runtime's CPU kernels."""
from . import Target
from .blocked_body import function_proto
from .gpu_notes import host_sync_note

TARGET = Target("portable", "runs everywhere (default)", body=function_proto, quantized=True, notes=host_sync_note)

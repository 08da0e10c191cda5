"""--target cuda: GPU-shaped blocks for ONNX Runtime CUDA, each block one standard ONNX
Attention op (opset 23; large blocks, no tensor past 2^31 elements); the body in gpu_body.py,
its pieces in gpu_script.py and gpu_table_script.py."""
from functools import partial

from ...nn.plans import GPU_DEFAULT_BLOCK
from . import Target
from .gpu_body import gpu_function_proto
from .gpu_notes import host_sync_note

TARGET = Target("cuda", "GPU-shaped blocks, each one ONNX Attention op (opset 23, large blocks, no tensor past 2^31 "
                "elements) for ONNX Runtime CUDA", body=partial(gpu_function_proto, fused="onnx"), fused_op="onnx",
                min_opset=23, default_block=GPU_DEFAULT_BLOCK, gpu=True, notes=host_sync_note)

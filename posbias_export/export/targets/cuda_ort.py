"""--target cuda-ort: cuda's body with ONNX Runtime's own com.microsoft.MultiHeadAttention per
block (ONNX Runtime only, CPU or CUDA; its flash and memory-efficient kernels)."""
from functools import partial

from ...nn.plans import GPU_DEFAULT_BLOCK
from . import Target
from .gpu_body import gpu_function_proto
from .gpu_notes import host_sync_note

TARGET = Target("cuda-ort", "the same with com.microsoft.MultiHeadAttention (ONNX Runtime only, CPU or CUDA)",
                body=partial(gpu_function_proto, fused="ort"), fused_op="ort", default_block=GPU_DEFAULT_BLOCK,
                gpu=True, notes=host_sync_note)

"""--target ort: a --kv-cache file whose cache is written in place (inplace_body.py: the family's
bias into com.microsoft.GroupQueryAttention, past and present bound to one buffer; ONNX Runtime
only); a file without a cache gets the portable blocked body."""
from __future__ import annotations

from . import Target
from .blocked_body import function_proto


def inplace_notes(request, proto) -> list[str]:
    if not (request.settings.cache == "inplace" and request.spec.kv_cache):
        return []
    notes = ["an in-place cache: bind each past_* and its present_* to one [batch, heads, capacity, head size] buffer "
             "and a step writes only its new rows (unbound, present grows as with --target portable); ONNX Runtime "
             "only (Python, Node, onnxruntime-genai); a prompt after cached tokens needs batch 1 (GroupQueryAttention's "
             "CPU kernel)"]
    # measured on ORT 1.31.1 CUDA (benchmarks/gpu_serving.md)
    if request.options.kv_dtype == "int8":
        notes.append("on ONNX Runtime CUDA an int8 cache does not run on the GPU: with float32 weights its attention "
                     "falls back to the CPU, with float16 the CUDA kernel refuses a bias with a quantized cache; serve "
                     "it on the CPU")
    elif request.options.kv_dtype == "float16":
        notes.append("a float16 cache: attention runs in float16 (on ONNX Runtime CUDA, GroupQueryAttention's float16 "
                     "kernel could take it: not measured there); on CPU it is slower than the float cache with quantized "
                     "weights (benchmarks/serving.md)")
    elif request.dtype != "float16":
        notes.append("on ONNX Runtime CUDA GroupQueryAttention has a float16 kernel only: this float32 file's attention "
                     "runs on the CPU there (the cache crosses to the host each step); for a GPU export --dtype float16")
    return notes


TARGET = Target("ort", "with --kv-cache: the cache written in place, past and present may share one buffer "
                "(com.microsoft.GroupQueryAttention with the family's bias; ONNX Runtime only, float32)",
                body=function_proto, inplace_cache=True, quantized=True, notes=inplace_notes)

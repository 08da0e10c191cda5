#!/usr/bin/env python3
"""Run an ONNX model with OpenVINO on the CPU, with the inference precision set explicitly.

    python runtimes/openvino/run.py model.onnx inputs/ outputs/ [--precision f32|bf16]

OpenVINO's CPU plugin silently defaults to bf16 on CPUs that support it (max diff ~4e-3 vs
f32 measured here), so the precision is always passed: f32 for parity, bf16 to measure it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.feeds import InputSpec  # noqa: E402
from common.runner_cli import parse, run_all  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402

OV_TO_NUMPY = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "i64": np.int64, "i32": np.int32, "boolean": np.bool_}


def compile_model(model_path: str, precision: str = "f32", threads: int = 0):
    try:
        import openvino as ov
    except ImportError:
        raise RunnerError("openvino is not installed (pip install openvino)") from None
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": precision}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    # The ONNX frontend directly: read_model would also try other frameworks on a bad file.
    frontend = ov.frontend.FrontEndManager().load_by_framework("onnx")
    if not frontend.supported(model_path):
        raise RunnerError(f"cannot load model {model_path}: not a valid ONNX model")
    try:
        with _without_local_functions(model_path) as readable_path:
            model = frontend.convert(frontend.load(readable_path))
        compiled = core.compile_model(model, "CPU", config)
    except RunnerError:
        raise
    except Exception as err:
        raise RunnerError(f"cannot load model {model_path}: {_message(err)}") from None
    actual = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower()
    if not any(name in actual for name in PRECISION_NAMES[precision]):
        raise RunnerError(f"OpenVINO ignored the precision hint: asked {precision}, got {actual}")
    return compiled


@contextlib.contextmanager
def _without_local_functions(model_path: str):
    """OpenVINO (2026.4) cannot convert model-local ONNX functions ("No conversion rule found
    for operations: posbias.Alibi"), so expand them with onnx's inliner first."""
    try:
        import onnx
        import onnx.inliner
    except ImportError:
        yield model_path  # nothing to inline without onnx; OpenVINO reports what it lacks
        return
    try:
        proto = onnx.load(model_path, load_external_data=False)
    except Exception as err:
        raise RunnerError(f"cannot load model {model_path}: {str(err).splitlines()[0]}") from None
    if not proto.functions:
        yield model_path
        return
    flat = onnx.inliner.inline_local_functions(onnx.load(model_path))
    with tempfile.TemporaryDirectory(prefix="posbias-ov-") as tmp:
        path = os.path.join(tmp, "inlined.onnx")
        onnx.save(flat, path)
        yield path


PRECISION_NAMES = {"f32": ("f32", "float32"), "bf16": ("bf16", "bfloat16")}


def _message(err: Exception) -> str:
    """OpenVINO messages start with a source location; keep the first line that says something."""
    lines = [l.strip() for l in str(err).splitlines() if l.strip() and not l.strip().startswith("Exception from")]
    return lines[0] if lines else type(err).__name__


def input_specs(compiled, dim_names: dict[str, dict[int, str]] | None = None) -> list[InputSpec]:
    """The inputs as OpenVINO sees them; a dynamic axis named as the file names it (`dim_names`):
    OpenVINO keeps no axis names, and the feed checks need them (a prefill's empty cache is
    allowed on the past axis only)."""
    specs = []
    for port in compiled.inputs:
        kind = port.get_element_type().get_type_name()
        if kind not in OV_TO_NUMPY:
            raise RunnerError(f"input {port.get_any_name()!r} has unsupported type {kind}")
        names = (dim_names or {}).get(port.get_any_name(), {})
        dims = tuple(d.get_length() if d.is_static else names.get(axis) for axis, d in enumerate(port.get_partial_shape()))
        specs.append(InputSpec(port.get_any_name(), np.dtype(OV_TO_NUMPY[kind]), dims))
    return specs


def onnx_dim_names(model_path: str) -> dict[str, dict[int, str]]:
    """{input: {axis: name}} of the file's symbolic input axes (empty without onnx)."""
    try:
        import onnx
    except ImportError:
        return {}
    graph = onnx.load(model_path, load_external_data=False).graph
    return {i.name: {axis: d.dim_param for axis, d in enumerate(i.type.tensor_type.shape.dim) if d.dim_param}
            for i in graph.input}


def run(compiled, feeds):
    try:
        result = compiled(feeds)
    except Exception as err:
        raise RunnerError(f"openvino failed: {_message(err)}") from None
    return {port.get_any_name(): np.asarray(result[port]) for port in compiled.outputs}


def main(argv=None) -> int:
    def options(p):
        p.add_argument("--precision", choices=("f32", "bf16"), default="f32")
        p.add_argument("--threads", type=int, default=0)

    args = parse(__doc__.splitlines()[0], options, argv)
    return run_all(args, lambda path: (compile_model(path, args.precision, args.threads), onnx_dim_names(path)),
                   lambda loaded: input_specs(*loaded), lambda loaded, feeds: run(loaded[0], feeds),
                   f"openvino-{args.precision}")


if __name__ == "__main__":
    sys.exit(main())

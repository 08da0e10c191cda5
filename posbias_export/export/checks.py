"""Post-export checks. The dynamo exporter can silently make an axis static, narrow its range
or bake a trace-length buffer and still return a model; these catch that. Each check raises
ExportCheckError with a sentence a user can act on."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto

from ..biases.onnx_domain import DOMAIN as FUNCTION_DOMAIN
from ..biases.onnx_domain import STANDARD_DOMAINS
from ..errors import ExportCheckError


def check_symbolic_axes(model: onnx.ModelProto, dynamic_axes: dict[str, tuple[int, ...]]) -> None:
    """Every axis we asked to be dynamic is a named symbol (dim_param), not a number."""
    values = {v.name: v for v in list(model.graph.input) + list(model.graph.output)}
    for name, axes in dynamic_axes.items():
        if name not in values:
            raise ExportCheckError(f"exported model has no input/output named {name!r}")
        dims = values[name].type.tensor_type.shape.dim
        for axis in axes:
            if axis >= len(dims) or not dims[axis].dim_param:
                shown = [d.dim_param or d.dim_value for d in dims]
                raise ExportCheckError(f"axis {axis} of {name!r} was exported static: shape {shown}")


def check_domains(model: onnx.ModelProto, ort_ops: tuple[tuple[str, str], ...] = (),
                  allowed_functions: tuple[str, ...] = (FUNCTION_DOMAIN,)) -> None:
    """Only standard ONNX ops; the `posbias` domain only as model-local functions; `ort_ops`:
    (domain, op) pairs of ONNX Runtime's contrib ops a target asks for."""
    local = {(f.domain, f.name) for f in model.functions}
    for domain, _ in local:
        if domain not in allowed_functions:
            raise ExportCheckError(f"unexpected local function domain {domain!r}")
    bodies = [model.graph.node] + [f.node for f in model.functions]
    for nodes in bodies:
        for node in nodes:
            if node.domain in STANDARD_DOMAINS or (node.domain, node.op_type) in ort_ops:
                continue
            if (node.domain, node.op_type) not in local:
                raise ExportCheckError(
                    f"non-standard op {node.domain}.{node.op_type}: a runtime would need a custom op"
                )


def initializer_signature(model: onnx.ModelProto) -> list[tuple[int, tuple[int, ...]]]:
    """Sorted (dtype, shape) of every initializer: equal for two trace lengths unless something
    sized by the trace length was baked in."""
    return sorted((t.data_type, tuple(t.dims)) for t in model.graph.initializer)


def initializer_bytes(model: onnx.ModelProto) -> int:
    total = 0
    for t in model.graph.initializer:
        count = 1
        for d in t.dims:
            count *= d
        total += count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type != TensorProto.STRING else 0
    return total


def check_no_trace_length_growth(a: onnx.ModelProto, b: onnx.ModelProto, len_a: int, len_b: int) -> None:
    sig_a, sig_b = initializer_signature(a), initializer_signature(b)
    if sig_a != sig_b:
        grown = sorted(set(sig_b) - set(sig_a))
        raise ExportCheckError(
            f"initializers depend on the trace length (traced at {len_a} and {len_b}; differing shapes "
            f"{grown[:4]}): something sized by the trace length was baked into the model"
        )


def check_full(model: onnx.ModelProto | str) -> None:
    """onnx.checker with full shape inference; give a path for models over 2 GB (external data)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as err:  # checker raises ValidationError / InferenceError
        raise ExportCheckError(f"onnx.checker full check failed: {err}") from None


def check_loads_in_ort(model: str, checker: bool = True) -> None:
    """onnx.checker without shape inference (it does not know ONNX Runtime's contrib ops), then
    an ONNX Runtime session with default options, as a user creates one: ONNX Runtime refuses
    some files only there (a LayerNormalization epsilon that is not positive)."""
    if checker:
        try:
            onnx.checker.check_model(model)
        except Exception as err:
            raise ExportCheckError(f"onnx.checker failed: {err}") from None
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # its own log line would be a second line on stderr; the error says it
    try:
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as err:
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        line = line.split("\x1b")[0].strip()  # a colour escape and ONNX Runtime's log line may follow
        raise ExportCheckError(f"ONNX Runtime does not load the file with default session options: {line}") from None


# Above this many weight bytes the session check is left out: a session holds about the weights
# again (prepacked copies), and a real-size export must stay lean (real_models.md); the config's
# values, the cause of the loads that failed, are checked before such an export starts.
SESSION_CHECK_MAX_BYTES = 256 << 20


def check_full_and_loads(model: str) -> None:
    """check_full, then ONNX Runtime's default session (small files)."""
    check_full(model)
    data = Path(model).with_name(Path(model).name + ".data")
    size = Path(model).stat().st_size + (data.stat().st_size if data.is_file() else 0)
    if size <= SESSION_CHECK_MAX_BYTES:
        check_loads_in_ort(model, checker=False)

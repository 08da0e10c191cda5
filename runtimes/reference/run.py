#!/usr/bin/env python3
"""Run an ONNX model with the ONNX reference evaluator (onnx.reference.ReferenceEvaluator).

    python runtimes/reference/run.py model.onnx inputs/ outputs/

Slow (numpy, op by op) but written from the ONNX specification: an independent opinion.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common.feeds import InputSpec  # noqa: E402
from common.runner_cli import parse, run_all  # noqa: E402
from common.tensor_io import RunnerError  # noqa: E402


def load(model_path: str):
    try:
        import onnx
    except ImportError:
        raise RunnerError("the onnx package is not installed") from None
    try:
        from contrib_ops import ContribEvaluator  # beside this script: ONNX Runtime's ops our GPU files call

        model = onnx.load(model_path)
        return model, ContribEvaluator(model)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunnerError(f"cannot load model {model_path}: {first}") from None


def input_specs(handle) -> list[InputSpec]:
    import onnx

    model, _ = handle
    specs = []
    for value in model.graph.input:
        t = value.type.tensor_type
        dims = tuple(d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim)
        specs.append(InputSpec(value.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims))
    return specs


def run(handle, feeds):
    model, evaluator = handle
    try:
        values = evaluator.run(None, feeds)
    except Exception as err:
        raise RunnerError(f"reference evaluator failed: {str(err).strip().splitlines()[0]}") from None
    return {o.name: np.asarray(v) for o, v in zip(model.graph.output, values)}


def main(argv=None) -> int:
    args = parse(__doc__.splitlines()[0], None, argv)
    return run_all(args, load, input_specs, run, "reference",
                   metadata_of=lambda handle: {p.key: p.value for p in handle[0].metadata_props})


if __name__ == "__main__":
    sys.exit(main())

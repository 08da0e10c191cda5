"""Our own files' matrix: every requested runtime on the same inputs, each output judged (by
judge.py) against a float64 PyTorch run of the model the file was exported from, in the file's
own attention form. Builds the cases and references; measuring and judging are shared."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import torch

from ..export import FileContract, attention_settings_of
from ..nn import DEFAULT_BLOCK
from .accuracy_level import level0_runs, note_disagreement
from .judge import Case, Reference, judge, policy_for
from .quantized import sampled_ids_cached
from .reference import (ModelFile, ParityInputError, generated_inputs, load_model_file, model_file, reference_model,
                        torch_args, torch_outputs)
from .runs import NOT_RUN, Cell, Matrix, RuntimeRun, runtime_outputs  # noqa: F401  (the matrix's public names)
from .runtimes import DEFAULT_RUNTIMES, RUNTIMES, runtimes_common


def check_user_inputs(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """The runners' own input check (runtimes/common/feeds.py), applied before PyTorch runs."""
    feeds_module, tensor_io = runtimes_common("feeds"), runtimes_common("tensor_io")
    InputSpec, check_feeds, RunnerError = feeds_module.InputSpec, feeds_module.check_feeds, tensor_io.RunnerError
    specs = []
    for value in proto.graph.input:
        t = value.type.tensor_type
        dims = tuple(d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim)
        specs.append(InputSpec(value.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims))
    try:
        check_feeds(feeds, feeds_module.with_token_limit(specs, FileContract.of(proto)))
    except RunnerError as err:
        raise ParityInputError(str(err)) from None


def quantized_inputs(contract: FileContract, model: torch.nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A generated LM case made into what the quantized policy judges on: its tokens replaced by
    tokens the float model samples itself, and a cached decoder's step made a prefill (an
    empty cache: random cached keys are not the model's)."""
    batch, length = feeds["input_ids"].shape
    vocab = contract.config_value("vocab_size", 256)
    lm = getattr(model, "lm", model)  # a --kv-cache file's reference wraps the DecoderLM
    ids = sampled_ids_cached(lm, batch, length, vocab, seed=length)
    out = {"input_ids": ids}
    if "attention_mask" in feeds:
        out["attention_mask"] = np.ones((batch, length), np.int64)
    cache = np.int8 if contract.kv_dtype == "int8" else None  # an int8 cache's empty past is int8
    for name, value in feeds.items():
        if runtimes_common("cache").is_cache_input(name):
            out[name] = value[:, :, :0].astype(cache or value.dtype)
    return out


def check_runtimes(runtimes) -> None:
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ParityInputError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")


def own_settings(contract: FileContract, arch: str):
    """The attention form a reference runs in: the file's own."""
    settings = attention_settings_of(contract)
    if arch == "attention" and settings.form == "blocked":
        # no padding in an attention file: every query blocking is the same math, and the GPU
        # targets' 4096-row blocks would make a float64 reference at 16k hold ~18 GB
        settings = dataclasses.replace(settings, block=min(settings.block, DEFAULT_BLOCK))
    return settings


def own_reference(model, contract: FileContract, feeds: dict[str, np.ndarray], settings, dtype: str) -> Reference:
    """float64 outputs, PyTorch's in the file's dtype, and (made when a policy asks) in bfloat16
    and float16 for the runtimes that compute in them."""
    args = torch_args(contract, feeds)
    lazy = {name: (lambda d=d: torch_outputs(model, args, d, settings))
            for name, d in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16))}
    lazy[dtype] = lazy[dtype]()
    return Reference(torch_outputs(model, args, torch.float64, settings), lazy)


def run_matrix(
    model_path: "str | Path | ModelFile",
    runtimes: tuple[str, ...] = DEFAULT_RUNTIMES,
    lengths: tuple[int, ...] = (1, 17, 1024),
    batch: int = 3,
    checkpoint: str | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    timeout: float = 1800.0,
    progress=None,
    order: bool = True,
) -> Matrix:
    """Measure every runtime on every case against float64 PyTorch. `inputs` (a user's own
    tensors) replaces the generated lengths. `order`: the order protocol (RuntimeRun.order_cells)
    as well. `progress(n)` is called as work completes."""
    check_runtimes(runtimes)
    file = load_model_file(model_file(model_path))
    contract = file.contract
    matrix = Matrix(str(file.path), contract.config["bias"], contract.arch)
    dtype, scheme = contract.dtype, file.scheme  # quantized weights: judged by parity/quantized.py's policy
    if inputs is not None:
        check_user_inputs(file.proto, inputs)
        named = [("inputs", inputs)]
    else:
        named = [(f"L={n} B={batch}", generated_inputs(contract, n, batch, seed=n)) for n in lengths]
    model = reference_model(contract, checkpoint)
    if scheme and inputs is None:  # the policy's inputs: text the float model writes (parity/quantized.py)
        named = [(case, quantized_inputs(contract, model, feeds)) for case, feeds in named]
    settings = own_settings(contract, matrix.arch)
    cases = [Case(name, feeds, own_reference(model, contract, feeds, settings, dtype)) for name, feeds in named]
    runs = list(runtime_outputs(runtimes, file.path, [c.feeds for c in cases], timeout, order))
    if scheme == "int4":  # and the same file at accuracy level 0 (parity/accuracy_level.py)
        runs += level0_runs(runtimes, file.path, [c.feeds for c in cases], timeout, order)
    judge(matrix, runs, cases, policy_for(dtype, scheme), progress=progress)
    note_disagreement(matrix, runs, cases)
    return matrix

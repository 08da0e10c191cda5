"""Our own files' plan: the cases, and a float64 PyTorch run of the model the file was exported
from, in the file's own attention form, as their reference; loop.py measures and judges it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import torch

from ..export import FileContract, attention_settings_of
from ..nn import DEFAULT_BLOCK
from .judge import Case, Reference, policy_for
from .loop import Plan, check_runtimes, measure
from .quantized import sampled_ids_cached
from .reference import (ModelFile, ParityInputError, generated_inputs, load_model_file, model_file, reference_model,
                        torch_args, torch_outputs)
from .runs import NOT_RUN, Cell, Matrix, RuntimeRun  # noqa: F401  (the matrix's public names)
from .runtimes import DEFAULT_RUNTIMES, runtimes_common


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
        facts = runtimes_common("graph_facts")
        check_feeds(feeds, feeds_module.with_token_limit(specs, facts.token_limit(facts.facts_of(proto),
                                                                                 FileContract.of(proto))))
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


def own_plan(file: ModelFile, lengths, batch: int, checkpoint: str | None, inputs) -> Plan:
    """Our own file's cases (generated lengths, or the user's tensors), each with the float64
    reference of the model the file was exported from, in the file's attention form."""
    contract = file.contract
    if inputs is not None:
        check_user_inputs(file.proto, inputs)
        named = [("inputs", inputs)]
    else:
        named = [(f"L={n} B={batch}", generated_inputs(contract, n, batch, seed=n, inplace=file.inplace_cache))
                 for n in lengths]
    model = reference_model(contract, checkpoint)
    if file.scheme and inputs is None:  # the policy's inputs: text the float model writes (parity/quantized.py)
        named = [(case, quantized_inputs(contract, model, feeds)) for case, feeds in named]
    matrix = Matrix(str(file.path), contract.config["bias"], contract.arch)
    settings = own_settings(contract, matrix.arch)
    cases = [Case(name, feeds, own_reference(model, contract, feeds, settings, contract.dtype)) for name, feeds in named]
    # quantized weights: judged by parity/quantized.py's policy
    policy = policy_for(contract.dtype, file.scheme, float16_cache=file.float16_cache)
    return Plan(matrix, cases, policy, file.path, file.scheme)


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
    return measure(own_plan(file, lengths, batch, checkpoint, inputs), runtimes, timeout, order, progress)

"""Weights read when they are used, not before.

A model can be built with its parameters on the meta device (nothing allocated, no random init)
and each parameter paired with a reader of its values: a safetensors slice, a memory-mapped
weights-only pickle, or a tensor already in memory. The export traces such a model and streams
every reader into the file a few rows at a time (export/streamed.py), so a model's bytes are
never held twice; `materialize` fills the parameters for eager PyTorch (validate, tests).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

READERS_ATTR = "_posbias_weight_readers"  # param name -> TensorReader, on a model built lazily
ROWS_PER_READ = 1 << 24  # elements per piece read while streaming (64 MB of float32)


class TensorReader(Protocol):
    """One stored tensor: its shape and dtype, and its rows [start, stop) along the first axis."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class MemoryReader:
    """A tensor already in memory (our own models, or a parameter that was loaded)."""

    name: str
    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor.detach()[start:stop] if self.tensor.dim() else self.tensor.detach()


@dataclass(frozen=True)
class RowRange:
    """Rows [start, stop) of another reader: one stored tensor that fills several parameters
    (a gated feed-forward's two halves), each read where it lies."""

    source: TensorReader
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.source.name}[{self.start}:{self.stop}]"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.source.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.source.rows(self.start + start, self.start + min(stop, self.stop - self.start))


def pieces(reader: TensorReader, max_elements: int | None = None):
    """The reader's tensor as consecutive row ranges of at most ~max_elements (default
    ROWS_PER_READ) each."""
    max_elements = max_elements or ROWS_PER_READ
    shape = reader.shape
    if not shape:
        yield reader.rows(0, 1)
        return
    per_row = max(1, int(torch.Size(shape[1:]).numel()))
    step = max(1, max_elements // per_row)
    for start in range(0, shape[0], step):
        yield reader.rows(start, min(shape[0], start + step))


def read_whole(reader: TensorReader) -> torch.Tensor:
    return torch.cat(list(pieces(reader)), 0) if reader.shape else reader.rows(0, 1)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init), while
    buffers stay real: the ALiBi slopes or T5 bucket tables that __init__ computes are small and
    needed as they are. (The register_parameter swap is what accelerate's init_empty_weights does
    with include_buffers=False.)"""
    original = nn.Module.register_parameter
    # the layers that size a parameter from the config allocate it before registering it: built
    # on meta directly, a config that lies (d_ff 10^12) allocates nothing and its shapes are then
    # refused against the weights' own
    inits = {cls: cls.__init__ for cls in (nn.Linear, nn.Embedding, nn.LayerNorm)}

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    def on_meta(init):
        def build(self, *args, **kwargs):
            kwargs.setdefault("device", "meta")
            init(self, *args, **kwargs)
        return build

    nn.Module.register_parameter = register
    for cls, init in inits.items():
        cls.__init__ = on_meta(init)
    _BUILDING[0] += 1
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        for cls, init in inits.items():
            cls.__init__ = init
        _BUILDING[0] -= 1


_BUILDING = [0]  # > 0 inside parameters_on_meta


def parameter_device() -> str:
    """Where a module's own parameter (torch.ones(dim) in a norm) is made: meta while a model is
    built from a folder (parameters_on_meta), else the CPU."""
    return "meta" if _BUILDING[0] else "cpu"


def attach_readers(model: nn.Module, readers: dict[str, TensorReader]) -> None:
    setattr(model, READERS_ATTR, dict(readers))


def weight_readers(model: nn.Module) -> dict[int, TensorReader]:
    """id(parameter) -> its reader: the model's own readers for a lazily built model, the
    parameter itself otherwise. Every meta parameter must have one."""
    own = getattr(model, READERS_ATTR, {})
    readers = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        if name in own:
            readers[id(param)] = own[name]
        elif param.device.type == "meta":
            raise ValueError(f"parameter {name} has no values (built on the meta device without a reader)")
        else:
            readers[id(param)] = MemoryReader(name, param)
    return readers


def materialize(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Read every meta parameter from its reader (for eager PyTorch); the model keeps no readers."""
    own = getattr(model, READERS_ATTR, {})
    params = dict(model.named_parameters(remove_duplicate=True))
    for name, reader in own.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        old = params[name]
        new = nn.Parameter(read_whole(reader).to(dtype), requires_grad=old.requires_grad)
        for m in model.modules():  # tied parameters: every module holding the same tensor
            for n, p in list(m._parameters.items()):
                if p is old:
                    m._parameters[n] = new
        module._parameters[leaf] = new
    if own:
        delattr(model, READERS_ATTR)
    return model

"""A published configuration's random-weight folder written tensor by tensor into safetensors
shards with an index, as large checkpoints are published (MPT-7B: two bfloat16 shards): only
one tensor and one shard's worth of them are in memory, never the model."""
from __future__ import annotations

import json
from pathlib import Path

SHARD_BYTES = 10 << 30  # MPT-7B's published shards are ~10 GB and ~3.4 GB


def write_sharded(published: tuple, out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """OUT/config.json, model-0000N-of-0000M.safetensors and model.safetensors.index.json for a
    published configuration (published.PUBLISHED's (model class, config class, fields)), each tensor
    drawn as the model's own initializer draws it (_Initializer); a tied head is not written
    (transformers ties it on load)."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    model_class, config_class, fields = published
    config = getattr(tf, config_class)(**fields)
    with torch.device("meta"):
        model = getattr(tf, model_class)(config)
    shapes, held = [], set()
    for key, t in model.state_dict(keep_vars=True).items():  # a tensor held twice (a tied head, T5's shared
        if id(t) not in held:                                  # table in its encoder) is written once
            held.add(id(t))
            shapes.append((key, tuple(t.shape)))
    torch_dtype = getattr(torch, dtype)
    size = torch.empty((), dtype=torch_dtype).element_size()
    shards, current, current_bytes = [], [], 0
    for key, shape in shapes:  # the tensors grouped in order, each shard up to SHARD_BYTES
        nbytes = size * int(torch.Size(shape).numel())
        if current and current_bytes + nbytes > SHARD_BYTES:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((key, shape))
        current_bytes += nbytes
    shards.append(current)
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total, drawn = {}, 0, _Initializer(model, seed)
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in shard:
            tensors[key] = drawn.tensor(key).to(torch_dtype)
            weight_map[key] = file
            total += tensors[key].numel() * size
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    config.architectures, config.dtype = [model_class], dtype
    config.save_pretrained(out)
    return out


def hash_key(key: str) -> int:
    """A stable per-tensor seed (Python's hash() changes between processes)."""
    import zlib

    return zlib.crc32(key.encode())


class _Initializer:
    """Each tensor drawn by the model's own initializer (transformers' _init_weights: T5 scales each
    projection by its fan-in, MPT draws N(0, 0.02)), one small module at a time: the tensor's owner's
    parent (an attention, a feed-forward) when it is under UNIT_BYTES, else the owner alone, made
    real on the CPU, initialised, read, and put back on the meta device; each unit seeded by name."""

    UNIT_BYTES = 1 << 30

    def __init__(self, model, seed: int):
        self.model, self.seed, self.unit, self.name = model, seed, None, None

    def tensor(self, key: str):
        owner = key.rpartition(".")[0]
        parent = owner.rpartition(".")[0]
        unit = parent if parent and _bytes(self.model.get_submodule(parent)) <= self.UNIT_BYTES else owner
        if unit != self.name:
            self._make(unit)
        try:  # detached: a copy made from a parameter would keep it alive through its autograd graph
            return self.model.get_parameter(key).detach()
        except AttributeError:
            return self.model.get_buffer(key)

    def _make(self, name: str) -> None:
        import torch

        if self.unit is not None:
            self.unit.to("meta")
        self.unit, self.name = self.model.get_submodule(name), name
        self.unit.to_empty(device="cpu")
        torch.manual_seed(self.seed * 100003 + hash_key(name))
        with torch.no_grad():  # children first, as transformers' own apply(): a parent's rule wins
            self.unit.apply(self.model._init_weights)
            self.model._init_weights(self.model)  # the model's own rule for its tables


def _bytes(module) -> int:
    return sum(4 * p.numel() for p in module.parameters())

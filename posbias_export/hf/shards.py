"""A published configuration's random-weight folder written tensor by tensor into safetensors
shards with an index, as large checkpoints are published (MPT-7B: two bfloat16 shards): only
one tensor and one shard's worth of them are in memory, never the model."""
from __future__ import annotations

import json
from pathlib import Path

SHARD_BYTES = 10 << 30  # MPT-7B's published shards are ~10 GB and ~3.4 GB
INIT_STD = 0.02  # the configurations' initializer range


def write_sharded(published: tuple, out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """OUT/config.json, model-0000N-of-0000M.safetensors and model.safetensors.index.json for a
    published configuration (published.PUBLISHED's (model class, config class, fields)): norms'
    weights 1 and biases 0, other tensors normal(0, 0.02), each drawn from its own seeded
    generator; a tied head is not written (transformers ties it on load)."""
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
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in shard:
            tensors[key] = _random(key, shape, torch_dtype, seed * 100003 + hash_key(key))
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


def _random(key: str, shape: tuple, dtype, seed: int):
    import torch

    if "norm" in key or key.endswith(".bias"):
        return (torch.ones if key.endswith("weight") and "norm" in key else torch.zeros)(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * INIT_STD).to(dtype)

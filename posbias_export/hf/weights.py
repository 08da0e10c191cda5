"""Pair each parameter of an imported model with the folder tensor that fills it (read later:
streamed into an export, or materialized for eager PyTorch): a missing weight, a shape the
config does not imply, or a weight nothing uses is one readable line, before anything is read."""
from __future__ import annotations

from pathlib import Path

import torch

from ..nn import non_finite_tensor
from ..nn.lazy_weights import RowRange, TensorReader, attach_readers, materialize
from .folder import FolderError
from .layers import ImportedModel


def attach_weights(model: ImportedModel, state: dict[str, TensorReader], where: Path) -> None:
    used, readers = set(), {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            key, rows = model.weight_key(name), model.weight_rows(name)
            tensor = state.get(key)
            if tensor is None:
                raise FolderError(f"{where}: weight {key} is missing (the config describes a {model.model_type} "
                                  f"with {model.num_layers} layers; the weights do not match it)")
            whole = tuple(param.shape) if rows is None else (rows[2], *param.shape[1:])
            if tuple(tensor.shape) != whole:
                raise FolderError(f"{where}: weight {key} has shape {list(tensor.shape)}, the config implies "
                                  f"{list(whole)}")
            tensor = tensor if rows is None else RowRange(tensor, rows[0], rows[1])
            if not tensor.dtype.is_floating_point:
                raise FolderError(f"{where}: weight {key} is {tensor.dtype}, not a floating-point tensor")
            readers[name] = tensor
            used.add(key)
    check_tied_copies(model, state, where)
    unused = sorted(k for k in state if k not in used and k not in model.tied_keys
                    and not k.startswith(model.ignored_prefixes))
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise FolderError(f"{where}: weight {unused[0]}{more} has no place in a {model.model_type} model with this "
                          "config (a different architecture or a config that does not match the weights?)")
    attach_readers(model, readers)


def check_tied_copies(model: ImportedModel, state: dict[str, TensorReader], where: Path) -> None:
    """A folder that says its head is tied (tie_word_embeddings) may still store lm_head.weight:
    a copy of the embedding is fine; a different head is not this config's model (transformers
    then uses the stored head, we would tie), so it is refused in one line, read row block by
    row block (no second copy of a large table in memory)."""
    if not getattr(model, "tied", False):
        return
    embedding = state.get(model.embedding_key)
    for key in model.tied_keys:
        head = state.get(key)
        if head is None or embedding is None or tuple(head.shape) != tuple(embedding.shape):
            continue
        rows = head.shape[0]
        for start in range(0, rows, 4096):
            stop = min(start + 4096, rows)
            if not torch.equal(head.rows(start, stop).float(), embedding.rows(start, stop).float()):
                raise FolderError(f"{where}: config.json says tie_word_embeddings but {key} differs from "
                                  f"{model.embedding_key}: set tie_word_embeddings to false for a head of its own, "
                                  f"or drop {key}")


def load_weights(model: ImportedModel, where: Path) -> None:
    """Read every attached weight into the model (float32), refusing NaN or infinity."""
    materialize(model)
    bad = non_finite_tensor(model)
    if bad:
        raise FolderError(f"{where}: weight {model.weight_key(bad)} holds NaN or infinity")

"""Pair each parameter of an imported model with the folder tensor that fills it (read later:
streamed into an export, or materialized for eager PyTorch): a missing weight, a shape the
config does not imply, or a weight nothing uses is one readable line, before anything is read."""
from __future__ import annotations

from pathlib import Path

import torch

from ..nn import non_finite_tensor
from ..nn.lazy_weights import RowRange, TensorReader, attach_readers, materialize
from .folder import FolderError
from .imported import ImportedModel


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
    check_tied_copies(model, state, used, where)
    unused = sorted(k for k in state if k not in used and k not in model.tied_keys
                    and not k.startswith(model.ignored_prefixes))
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise FolderError(f"{where}: weight {unused[0]}{more} has no place in a {model.model_type} model with this "
                          "config (a different architecture or a config that does not match the weights?)")
    attach_readers(model, readers)


def check_tied_copies(model: ImportedModel, state: dict[str, TensorReader], used: set[str], where: Path) -> None:
    """Every tied key the folder stores and the model does not read (model.tied_keys: T5's
    encoder.embed_tokens and decoder.embed_tokens beside shared, a tied lm_head) must be a copy
    of the table the model reads there (its embedding). transformers holds one table for all of
    them and fills it from whichever key it reads last, so a folder whose copies differ has no one
    model: refused in one line (tie_word_embeddings false keeps a head of its own, which the model
    then reads). Compared row block by row block: no second copy of a large table in memory."""
    embedding = state.get(model.embedding_key)
    for key in model.tied_keys:
        copy = state.get(key)
        if key in used or copy is None or embedding is None:
            continue
        if tuple(copy.shape) != tuple(embedding.shape) or not _equal_rows(copy, embedding):
            raise FolderError(f"{where}: {key} differs from {model.embedding_key}, which the model reads in its "
                              f"place: {_tied_advice(key)}")


def _equal_rows(a: TensorReader, b: TensorReader, block: int = 4096) -> bool:
    rows = a.shape[0]
    return all(torch.equal(a.rows(start, min(start + block, rows)).float(), b.rows(start, min(start + block, rows)).float())
               for start in range(0, rows, block))


def _tied_advice(key: str) -> str:
    if key.endswith("lm_head.weight"):
        return "set tie_word_embeddings to false in config.json for a head of its own, or drop the key"
    return "the model has one embedding table; drop the key or make it a copy"


def load_weights(model: ImportedModel, where: Path) -> None:
    """Read every attached weight into the model (float32), refusing NaN or infinity."""
    materialize(model)
    bad = non_finite_tensor(model)
    if bad:
        raise FolderError(f"{where}: weight {model.weight_key(bad)} holds NaN or infinity")

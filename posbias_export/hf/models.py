"""The imported architectures (each registers itself: hf/layers.py ARCHITECTURES) and
load_model, which builds one from a folder."""
from __future__ import annotations

import os

from . import bloom, falcon, mpt, t5, t5_decoder  # noqa: F401  (each module registers its architecture)
from .folder import FolderError, read_folder
from .layers import ARCHITECTURES, PARTS, ImportedModel
from .weights import load_weights

SUPPORTED = tuple(ARCHITECTURES)  # model_type values
PART_NAMES = ("encoder", "decoder")  # of a T5 encoder-decoder folder; "encoder" is every other folder's model


def architecture(model_type: str) -> type[ImportedModel]:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown model type {model_type!r}; choose from {', '.join(SUPPORTED)}")
    return ARCHITECTURES[model_type]


def load_model(folder: str | os.PathLike, part: str = "encoder") -> ImportedModel:
    """Our float32 model with the folder's weights, in eval mode (ValueError for a bad folder).
    part="decoder": the decoder of a T5ForConditionalGeneration folder."""
    if part not in PART_NAMES:
        raise ValueError(f"part must be one of {', '.join(PART_NAMES)}, got {part!r}")
    source = read_folder(folder, ARCHITECTURES, part)
    cls = ARCHITECTURES[source.model_type] if part == "encoder" else PARTS.get((source.model_type, part))
    if cls is None:
        raise FolderError(f"{source.path} holds no T5 decoder (--part decoder needs a T5ForConditionalGeneration folder)")
    model = cls.from_folder(source)
    load_weights(model, source.state, source.path)
    model.source_dir = source.path.resolve()
    return model.float().eval()

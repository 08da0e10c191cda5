"""The imported architectures (hf/architectures/, discovered and registered on import:
hf/imported.py ARCHITECTURES) and load_model, which builds one from a folder."""
from __future__ import annotations

import os

from . import architectures  # noqa: F401  (every module there registers its architecture)
from .folder import FolderError, read_folder
from .imported import ARCHITECTURES, PARTS, ImportedModel
from ..nn.lazy_weights import parameters_on_meta
from .weights import attach_weights, load_weights

SUPPORTED = tuple(ARCHITECTURES)  # model_type values
PART_NAMES = ("encoder", "decoder")  # of a T5 encoder-decoder folder; "encoder" is every other folder's model


def architecture(model_type: str) -> type[ImportedModel]:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown model type {model_type!r}; choose from {', '.join(SUPPORTED)}")
    return ARCHITECTURES[model_type]


def load_model(folder: str | os.PathLike, part: str = "encoder", lazy: bool = False) -> ImportedModel:
    """Our float32 model with the folder's weights, in eval mode (ValueError for a bad folder).
    part="decoder": the decoder of a T5ForConditionalGeneration folder. lazy: the parameters
    stay on the meta device, each paired with its reader (the export streams them into the
    file: nothing the size of the model is allocated); NaN or infinity is then found as the
    weights are written."""
    if part not in PART_NAMES:
        raise ValueError(f"part must be one of {', '.join(PART_NAMES)}, got {part!r}")
    source = read_folder(folder, ARCHITECTURES, part)
    cls = ARCHITECTURES[source.model_type] if part == "encoder" else PARTS.get((source.model_type, part))
    if cls is None:
        raise FolderError(f"{source.path} holds no T5 decoder (--part decoder needs a T5ForConditionalGeneration folder)")
    with parameters_on_meta():  # no allocation, no random init: the folder fills every parameter
        model = cls.from_folder(source)
    attach_weights(model, source.state, source.path)
    if not lazy:
        load_weights(model, source.path)
    model.source_dir = source.path.resolve()
    return model.float().eval()


def has_decoder(folder: str | os.PathLike) -> bool:
    """An encoder-decoder folder (T5ForConditionalGeneration), not an encoder alone: the model
    type has a decoder part and the weights' headers hold its layers. Nothing is built, and a
    bad folder is its FolderError, not "no decoder"."""
    import re
    from pathlib import Path

    from .folder import read_config, weight_files, weight_shapes

    model_type, _ = read_config(Path(folder), ARCHITECTURES)
    decoder = PARTS.get((model_type, "decoder"))
    if decoder is None:
        return False
    pattern = re.compile(re.escape(decoder.layer_key).replace(r"\{\}", r"\d+"))
    return any(pattern.match(key) for key in weight_shapes(weight_files(Path(folder))))

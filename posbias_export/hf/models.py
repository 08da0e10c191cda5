"""model_type -> our implementation; load_model builds one from a folder."""
from __future__ import annotations

import os

from .bloom import BloomLM
from .falcon import FalconLM
from .folder import read_folder
from .layers import ImportedModel
from .mpt import MptLM
from .t5 import T5Encoder
from .weights import load_weights

IMPLEMENTATIONS = {"bloom": BloomLM, "mpt": MptLM, "falcon": FalconLM, "t5": T5Encoder}


def load_model(folder: str | os.PathLike) -> ImportedModel:
    """Our float32 model with the folder's weights, in eval mode (ValueError for a bad folder)."""
    source = read_folder(folder)
    model = IMPLEMENTATIONS[source.model_type](source.config)
    load_weights(model, source.state, source.path)
    model.source_dir = source.path.resolve()
    return model.float().eval()

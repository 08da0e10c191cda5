"""model_type -> our implementation; load_model builds one from a folder."""
from __future__ import annotations

import json
import os

from .bloom import BloomLM
from .falcon import FalconLM
from .folder import FolderError, read_folder
from .layers import ImportedModel
from .mpt import MptLM
from .t5 import T5Encoder
from .t5_decoder import T5Decoder
from .weights import load_weights

IMPLEMENTATIONS = {"bloom": BloomLM, "mpt": MptLM, "falcon": FalconLM, "t5": T5Encoder}


PARTS = ("encoder", "decoder")  # of a T5 encoder-decoder folder


def load_model(folder: str | os.PathLike, part: str = "encoder") -> ImportedModel:
    """Our float32 model with the folder's weights, in eval mode (ValueError for a bad folder).
    part="decoder": the decoder of a T5ForConditionalGeneration folder."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    source = read_folder(folder)
    if part == "decoder":
        if source.model_type != "t5" or not any(k.startswith("decoder.") for k in source.state):
            raise FolderError(f"{source.path} holds no T5 decoder (--part decoder needs a T5ForConditionalGeneration "
                              "folder)")
        raw = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
        # original T5 ties the head to the embedding and rescales; v1.1 ships its own lm_head
        model = T5Decoder(source.config, own_head="lm_head.weight" in source.state and
                          raw.get("tie_word_embeddings") is False, rescale=raw.get("tie_word_embeddings") is not False)
    else:
        model = IMPLEMENTATIONS[source.model_type](source.config)
    load_weights(model, source.state, source.path)
    model.source_dir = source.path.resolve()
    return model.float().eval()

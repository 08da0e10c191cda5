"""What an exported file records about itself (metadata_props, prefix `posbias.`), so it can
be validated later on its own: the model config, the arch, dtype, opset, the attention form."""
from __future__ import annotations

from pathlib import Path

import onnx

from ..nn import AttentionSettings, file_sha256

PREFIX = "posbias."
FORMAT_VERSION = "1"


def checkpoint_metadata(checkpoint: str | Path) -> dict[str, str]:
    """Where the weights are (absolute: the file may be validated from another folder) and their hash."""
    return {"checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": file_sha256(checkpoint)}


def source_metadata(checkpoint: str | Path | None, seed: int = 0) -> dict[str, str]:
    """Where an export's weights come from: a checkpoint (its path and hash), else the init seed."""
    return checkpoint_metadata(checkpoint) if checkpoint else {"seed": str(seed)}


def write_metadata(proto: onnx.ModelProto, meta: dict[str, str]) -> None:
    onnx.helper.set_model_props(proto, {PREFIX + k: v for k, v in meta.items()})


def read_metadata(model: onnx.ModelProto) -> dict[str, str]:
    """Our metadata_props, without the prefix."""
    return {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}


def settings_from_metadata(meta: dict[str, str]) -> AttentionSettings:
    """The attention form the file was exported in: a reference run in the same form computes
    equal math on real tokens and the same (arbitrary) output on fully padded query rows, and
    in blocks a float64 reference fits at 16k tokens too."""
    from .targets import attention_settings

    form = meta.get("attention", "plain")
    block = int(meta["attention_block"]) if "attention_block" in meta else AttentionSettings.block
    return attention_settings(int(meta.get("opset", 18)), form, meta.get("target", "portable"), block, functions=False)

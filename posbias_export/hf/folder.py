"""A local Hugging Face model folder: its config (read with transformers' own config class, so
defaults are the library's) and its weights (safetensors, sharded or not, or a weights-only
pytorch_model.bin). Nothing is downloaded and no code from the folder runs; every problem is
one ValueError line naming the folder."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED = ("bloom", "mpt", "falcon", "t5")  # model_type values
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class FolderError(ValueError):
    """A folder we cannot read as a supported model."""


@dataclass
class ModelFolder:
    path: Path
    model_type: str
    config: object  # the transformers PretrainedConfig subclass of model_type
    state: dict[str, torch.Tensor]


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise FolderError("reading a Hugging Face folder needs transformers: pip install 'posbias_export[hf]'") from None
    return transformers


def read_config(path: Path) -> tuple[str, dict]:
    """model_type and the raw config.json; refuses folders that need their own code."""
    if not path.is_dir():
        raise FolderError(f"{path} is not a folder (a Hugging Face model folder holds config.json and weights)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FolderError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise FolderError(f"{config_file} is not valid JSON: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise FolderError(f"{config_file} holds {type(raw).__name__}, not a JSON object")
    if raw.get("auto_map"):
        raise FolderError(f"{path} needs trust_remote_code (config.json maps to custom code in auto_map); only the "
                          f"transformers implementations of {', '.join(SUPPORTED)} are supported")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise FolderError(f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)} "
                          "(falcon with alibi=true)")
    return model_type, raw


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights, by transformers' parameter name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single, index, pickle = (path / name for name in WEIGHT_FILES)
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(weight_map, dict):
                raise FolderError(f"{index} has no weight_map")
            state = {}
            for shard in sorted(set(weight_map.values())):
                if not (path / shard).is_file():
                    raise FolderError(f"{index} names {shard}, which is missing from {path}")
                state.update(load_file(path / shard))
            return state
        if pickle.is_file():  # weights only: no code in the pickle runs
            return torch.load(pickle, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError) as err:
        if isinstance(err, FolderError):
            raise
        raise FolderError(f"cannot read the weights in {path}: {str(err).strip().splitlines()[0]}") from None
    raise FolderError(f"{path} has no weights ({', '.join(WEIGHT_FILES)})")


def read_folder(path) -> ModelFolder:
    path = Path(path)
    model_type, raw = read_config(path)
    transformers = transformers_module()
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    try:
        config = config_class.from_dict(raw)
    except (ValueError, TypeError, KeyError) as err:
        raise FolderError(f"{path}/config.json does not describe a {model_type} model: {str(err).splitlines()[0]}") from None
    if model_type == "falcon" and not config.alibi:
        raise FolderError(f"{path}: this Falcon uses rotary positions (alibi=false); only Falcon with alibi=true "
                          "has a positional attention bias to export")
    return ModelFolder(path, model_type, config, read_state(path))

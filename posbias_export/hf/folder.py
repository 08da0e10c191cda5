"""A local Hugging Face model folder: its config (read with transformers' own config class, so
defaults are the library's) and its weights (safetensors, sharded or not, or a weights-only
pytorch_model.bin). Nothing is downloaded and no code from the folder runs; every problem is
one ValueError line naming the folder."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class FolderError(ValueError):
    """A folder we cannot read as a supported model."""


@dataclass
class ModelFolder:
    path: Path
    model_type: str
    config: object  # the transformers PretrainedConfig subclass of model_type
    state: dict[str, torch.Tensor]
    raw: dict  # config.json as written


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise FolderError("reading a Hugging Face folder needs transformers: pip install 'posbias_export[hf]'") from None
    return transformers


def read_config(path: Path, supported: tuple[str, ...]) -> tuple[str, dict]:
    """model_type and the raw config.json; refuses folders that need their own code and
    model types outside `supported`."""
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
                          f"transformers implementations of {', '.join(supported)} are supported")
    model_type = raw.get("model_type")
    if model_type not in supported:
        raise FolderError(f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(supported)} "
                          "(falcon with alibi=true)")
    return model_type, raw


def folder_files(path) -> list[Path]:
    """Every file an import of the folder may read: its own files and the shards its weight
    index names (an output must be none of them)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = [p for p in path.iterdir() if p.is_file()]
    index = path / WEIGHT_FILES[1]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") if index.is_file() else None
    except (ValueError, UnicodeDecodeError, OSError, AttributeError):
        weight_map = None
    if isinstance(weight_map, dict):
        files += [path / str(shard) for shard in set(weight_map.values())]
    return [path, *files]


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


def read_folder(path, architectures: dict) -> ModelFolder:
    """The folder's config and weights; `architectures` (model_type -> class, hf/layers.py) say
    which model types are supported and may refuse a config (check_config)."""
    path = Path(path)
    model_type, raw = read_config(path, tuple(architectures))
    transformers = transformers_module()
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    try:
        config = config_class.from_dict(raw)
    except (ValueError, TypeError, KeyError) as err:
        raise FolderError(f"{path}/config.json does not describe a {model_type} model: {str(err).splitlines()[0]}") from None
    refusal = architectures[model_type].check_config(config, path)
    if refusal:
        raise FolderError(refusal)
    return ModelFolder(path, model_type, config, read_state(path), raw)

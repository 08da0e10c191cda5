"""A local Hugging Face model folder: its config (read with transformers' own config class, so
defaults are the library's) and its weights (safetensors, sharded or not, or a weights-only
pytorch_model.bin). Nothing is downloaded and no code from the folder runs; every problem is
one ValueError line naming the folder."""
from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import first_line
from ..nn.lazy_weights import MemoryReader, TensorReader

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class FolderError(ValueError):
    """A folder we cannot read as a supported model."""


@dataclass
class ModelFolder:
    path: Path
    model_type: str
    config: object  # the transformers PretrainedConfig subclass of model_type
    state: dict[str, TensorReader]  # transformers' names -> readers (nothing loaded yet)
    raw: dict  # config.json as written


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise FolderError("reading a Hugging Face folder needs transformers: pip install 'posbias_export[hf]'") from None
    return transformers


def float32_pretrained(cls, folder):
    """transformers' model of `folder` in float32, whatever dtype its config names (transformers
    5 loads in the config's dtype by default: a bfloat16 config rounds float32 weights, and a
    reference row computed from them fails a correct file)."""
    major = int(transformers_module().__version__.split(".")[0])
    return cls.from_pretrained(str(folder), **{"dtype" if major >= 5 else "torch_dtype": torch.float32}).float()


def read_json_object(file: Path) -> dict:
    """A JSON object from a file the folder supplies (runtimes/common/json_files.py, which the
    runners read the same files with): any problem is one FolderError."""
    from ..runners import runtimes_common

    json_files = runtimes_common("json_files")
    try:
        return json_files.read_json_object(file)
    except runtimes_common("tensor_io").RunnerError as err:
        raise FolderError(str(err)) from None


# Values a file built from the config would carry into ONNX Runtime, which refuses some (a
# LayerNormalization epsilon that is NaN or not positive) only when a session is made.
POSITIVE_BELOW_ONE = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
# sizes every architecture builds layers from: a positive integer where given (null where the config
# class fills it in, as T5's num_decoder_layers); torch would end in a traceback on nn.Linear(768, -5)
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "d_model", "d_ff", "d_kv", "num_heads", "num_layers", "num_decoder_layers", "n_layer", "n_head", "n_embed",
         "n_heads", "n_layers", "expansion_ratio", "max_position_embeddings", "relative_attention_num_buckets",
         "relative_attention_max_distance", "num_kv_heads", "n_head_kv", "num_key_value_heads")
# activation names the layers look up in transformers' table (T5's dense_act_fn, BERT's hidden_act)
ACTIVATIONS = ("dense_act_fn", "hidden_act")


def _numbers(value, where: str):
    """(path, number) of every number in a JSON value (nested objects and lists)."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{where}[{index}]")


def check_token_ids(values: dict, file: Path, vocab: int | None = None) -> None:
    """pad/bos/eos/decoder-start ids: null, an integer id in [0, vocab), or (eos) a non-empty
    list of them."""
    for key in TOKEN_IDS:
        value = values.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        bad = not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 or (vocab and i >= vocab)
                             for i in ids)
        if bad:
            bound = f" below the vocabulary size {vocab}" if vocab else ""
            raise FolderError(f"{file}: {key} must be a token id (an integer >= 0{bound})"
                              f"{' or a non-empty list of them' if key == 'eos_token_id' else ''}, got {value!r}"[:300])


def check_config_values(raw: dict, file: Path) -> None:
    """Every number finite; epsilons in (0, 1); token ids integers in range: before anything is
    built (transformers' config classes accept all of these)."""
    for where, number in _numbers(raw, ""):
        if not math.isfinite(number):
            raise FolderError(f"{file}: {where} is {number}, not a finite number")
    for key in POSITIVE_BELOW_ONE:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1):
            raise FolderError(f"{file}: {key} must be a number in (0, 1), got {value!r}")
    for key in SIZES:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise FolderError(f"{file}: {key} must be a positive integer, got {value!r}"[:300])
    check_activations(raw, file)
    vocab = raw.get("vocab_size")
    check_token_ids(raw, file, vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None)


def check_activations(raw: dict, file: Path) -> None:
    """An activation named in the config is one transformers has (its table is what the layers use)."""
    named = {key: raw[key] for key in ACTIVATIONS if raw.get(key) is not None}
    if not named:
        return
    from transformers.activations import ACT2FN

    for key, value in named.items():
        if not isinstance(value, str) or value not in ACT2FN:
            raise FolderError(f"{file}: {key} {value!r} is not an activation transformers knows "
                              f"(e.g. {', '.join(sorted(ACT2FN)[:6])})"[:300])


def read_config(path: Path, architectures: dict) -> tuple[str, dict]:
    """Our name for the folder's architecture and the raw config.json. An architecture claims a
    folder (ImportedModel.claims: by default, its model_type without custom code; JinaBERT by its
    config and tensor names, its custom code never run); a folder that needs code no
    architecture claims, or of another model type, is refused."""
    if not path.is_dir():
        raise FolderError(f"{path} is not a folder (a Hugging Face model folder holds config.json and weights)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FolderError(f"{path} has no config.json: not a Hugging Face model folder")
    raw = read_json_object(config_file)
    check_config_values(raw, config_file)
    claimed = next((name for name, cls in architectures.items() if cls.claims(raw, path)), None)
    if claimed:
        return claimed, raw
    supported = ", ".join(architectures)
    if raw.get("auto_map"):
        raise FolderError(f"{path} needs trust_remote_code (config.json maps to custom code in auto_map) and is none "
                          f"of the architectures we implement ourselves; supported: {supported}")
    raise FolderError(f"{path}: model_type {raw.get('model_type')!r} is not supported; supported: {supported} "
                      "(falcon with alibi=true)")


def tensor_names(path: Path) -> set[str]:
    """The names of the folder's weights, read from their headers (nothing loaded); empty where
    the folder has none."""
    try:
        return set(weight_shapes(weight_files(path)))
    except FolderError:
        return set()


def resolves_inside(file: Path, folder: Path) -> bool:
    """Whether a file the folder names is the folder's own: it resolves inside the folder, or,
    in the Hugging Face cache's layout (snapshots/<revision>/NAME is a link to ../../blobs/<hash>),
    to a blob of the same repository. A link anywhere else (a secret beside the download) is not."""
    root, target = Path(folder).resolve(), Path(file).resolve()
    if target.is_relative_to(root):
        return True
    return root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs"


def index_shards(path: Path) -> list[Path] | None:
    """The shard files a model.safetensors.index.json names, checked before any is opened: a
    JSON object whose weight_map maps tensor names to file names inside the folder (not an
    absolute path, no way out of it). None when the folder has no index."""
    index = path / WEIGHT_FILES[1]
    if not index.is_file():
        return None
    data = read_json_object(index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise FolderError(f"{index} has no weight_map (a JSON object of tensor name -> shard file)")
    shards = []
    for name in sorted({v for v in weight_map.values() if isinstance(v, str)}):
        if Path(name).is_absolute() or ".." in Path(name).parts or not resolves_inside(path / name, path):
            raise FolderError(f"{index} names {name}, outside the folder: only shards inside {path} are read")
        shards.append(path / name)
    if any(not isinstance(v, str) for v in weight_map.values()):
        raise FolderError(f"{index}: every weight_map entry must name a shard file, found "
                          f"{next(v for v in weight_map.values() if not isinstance(v, str))!r}")
    return shards


def folder_files(path) -> list[Path]:
    """Every file an import of the folder may read: its own files and the shards its weight
    index names (an output must be none of them)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = [p for p in path.iterdir() if p.is_file()]
    try:
        files += index_shards(path) or []
    except FolderError:
        pass  # an import refuses the index itself
    return [path, *files]


def own_file(folder: Path, file: Path) -> Path:
    """A file the folder supplies, checked as every such file is: it resolves inside the folder
    (or to its blob in the Hugging Face cache's layout) and is a regular file. A link out of the
    folder (a secret beside the download, another model's weights) is one FolderError."""
    if not resolves_inside(file, folder):
        raise FolderError(f"{file} links to {Path(file).resolve()}, outside {folder}: a folder's files are its own "
                          "(put the file itself in the folder)")
    if not Path(file).resolve().is_file():
        raise FolderError(f"{file} is not a regular file")
    return Path(file)


def weight_files(path: Path) -> list[Path]:
    """The files holding the weights, in the order transformers prefers them, each the folder's own."""
    single, _, pickled = (path / name for name in WEIGHT_FILES)
    if single.is_file():
        return [own_file(path, single)]
    shards = index_shards(path)
    if shards is not None:
        missing = [s for s in shards if not s.is_file()]
        if missing:
            raise FolderError(f"{path / WEIGHT_FILES[1]} names {missing[0].name}, which is missing from {path}")
        return shards
    if pickled.is_file():
        return [own_file(path, pickled)]
    raise FolderError(f"{path} has no weights ({', '.join(WEIGHT_FILES)})")


def _readable(err: BaseException, path: Path) -> FolderError:
    if isinstance(err, pickle.UnpicklingError):  # torch's weights-only load refused an object: code would run
        return FolderError(f"cannot read the weights in {path}: the pickle holds objects other than tensors "
                           "(loading them could run code); only plain state dicts are read")
    return FolderError(f"cannot read the weights in {path}: {first_line(err, 200)}")


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the files' headers (safetensors) or a memory map (a
    weights-only pytorch_model.bin): nothing the size of the model is allocated."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for file in files:
        try:
            if file.suffix == ".bin":
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                    raise FolderError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
                shapes.update({k: tuple(v.shape) for k, v in state.items()})
                continue
            with safe_open(str(file), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except FolderError:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
            raise _readable(err, file.parent) from None
    return shapes


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class SafetensorsReader:
    """One tensor of a safetensors file, read a range of rows at a time (the file is mapped,
    not loaded)."""

    def __init__(self, handle, file: Path, key: str):
        self.file, self.name = file, key
        piece = handle.get_slice(key)
        self.shape = tuple(piece.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
        if self.dtype is None:
            raise FolderError(f"{file}: weight {key} has dtype {piece.get_dtype()}, which cannot be read")

    def rows(self, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        # opened per read: the mapping closes with it, so pages read once do not stay in this
        # process's resident memory (a file the size of the model would count in full)
        with safe_open(str(self.file), framework="pt") as handle:
            piece = handle.get_slice(self.name)
            return piece[start:stop] if self.shape else piece[...]


def open_state(files: list[Path]) -> dict[str, TensorReader]:
    """A reader for every tensor of the folder's weights, by transformers' parameter name:
    safetensors are memory-mapped, a pytorch_model.bin is loaded weights-only with mmap (no
    code in a pickle runs). Nothing the size of the model is read here."""
    from safetensors import SafetensorError, safe_open

    state: dict[str, TensorReader] = {}
    for file in files:
        try:
            if file.suffix == ".bin":
                loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                    raise FolderError(f"{file} holds a {type(loaded).__name__}, not a state dict of tensors")
                state.update({k: MemoryReader(k, v) for k, v in loaded.items()})
                continue
            with safe_open(str(file), framework="pt") as handle:
                state.update({k: SafetensorsReader(handle, file, k) for k in handle.keys()})
        except FolderError:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
            raise _readable(err, file.parent) from None
    return state


def read_folder(path, architectures: dict, part: str = "encoder") -> ModelFolder:
    """The folder's config and weights; `architectures` (model_type -> class, hf/imported.py) say
    which model types are supported and may refuse a config. The config's sizes are checked
    against the weights' shapes (read from their headers) before anything is allocated."""
    path = Path(path)
    model_type, raw = read_config(path, architectures)
    transformers = transformers_module()
    config_class = transformers.AutoConfig.for_model(architectures[model_type].config_model_type or model_type).__class__
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its warnings on odd values: our checks below say it in one line
    try:
        config = config_class.from_dict(raw)
    except Exception as err:  # noqa: BLE001 - transformers 5 validates with huggingface_hub's own error types
        raise FolderError(f"{path}/config.json does not describe a {model_type} model: {first_line(err, 200)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    refusal = architectures[model_type].check_config(config, path)
    if refusal:
        raise FolderError(refusal)
    files = weight_files(path)
    architectures[model_type].check_sizes(config, weight_shapes(files), path, part)
    return ModelFolder(path, model_type, config, open_state(files), raw)

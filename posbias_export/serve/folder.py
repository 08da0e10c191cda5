"""What `serve DIR` serves: a folder written by `--out-dir`, read once and told apart by its files.

    decoder   model.onnx with a KV cache (genai_config.json beside it)  -> /v1/completions
    seq2seq   encoder_model.onnx + decoder_model_merged.onnx            -> /v1/completions
    embedder  model.onnx without a cache, modules.json (pooling)         -> /v1/embeddings

Every folder brings its tokenizer.json; the served model's name is the folder's (what
`GET /v1/models` lists and a request's `model` must name). Nothing here imports torch: a
replica needs numpy, onnxruntime, tokenizers and the runners.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("decoder", "seq2seq", "embedder")
# the context a decoder's slots hold when the folder does not say (genai_config.json's context_length)
DEFAULT_CONTEXT = 2048


class FolderError(ValueError):
    """A folder `serve` cannot serve: one line saying why."""


@dataclass(frozen=True)
class ServedFolder:
    path: Path
    role: str  # what the folder serves: decoder, seq2seq or embedder
    name: str
    files: dict[str, Path]  # part -> file: model / encoder / decoder, tokenizer
    context: int  # the longest prompt + completion a request may ask for
    pooling: str = "mean"  # an embedder's: "mean" (with L2 normalisation, as its clients do) or "cls"
    settings: dict = field(default_factory=dict)  # eos / pad / decoder start ids from the folder's configs

    @classmethod
    def read(cls, folder) -> "ServedFolder":
        path = Path(folder)
        if not path.is_dir():
            raise FolderError(f"{folder} is not a folder (serve takes a folder written by --out-dir)")
        tokenizer = path / "tokenizer.json"
        if not tokenizer.is_file():
            raise FolderError(f"{folder} has no tokenizer.json (serve takes a folder written by --out-dir)")
        config = json_object(path / "config.json")
        settings = {**config, **json_object(path / "generation_config.json")}
        if (path / "encoder_model.onnx").is_file() and (path / "decoder_model_merged.onnx").is_file():
            return cls(path, "seq2seq", path.name, {"encoder": path / "encoder_model.onnx",
                                                    "decoder": path / "decoder_model_merged.onnx",
                                                    "tokenizer": tokenizer},
                       _context(config, None), settings=settings)
        model = path / "model.onnx"
        if not model.is_file():
            raise FolderError(f"{folder} has neither model.onnx nor encoder_model.onnx + decoder_model_merged.onnx "
                              "(serve takes a folder written by --out-dir)")
        if _is_decoder(path, model):
            genai = json_object(path / "genai_config.json")
            return cls(path, "decoder", path.name, {"model": model, "tokenizer": tokenizer},
                       _context(config, genai.get("model", {}).get("context_length")), settings=settings)
        # an embedder's clients truncate to the tokenizer's model_max_length (jina-v2: 8192, its config 8192 too)
        limit = json_object(path / "tokenizer_config.json").get("model_max_length")
        limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit < 1 << 24 else None
        return cls(path, "embedder", path.name, {"model": model, "tokenizer": tokenizer}, _context(config, limit),
                   pooling=_pooling(path), settings=settings)


def json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FolderError(f"{path} is not a JSON file: {err}") from None
    if not isinstance(data, dict):
        raise FolderError(f"{path} does not hold a JSON object")
    return data


def _is_decoder(path: Path, model: Path) -> bool:
    """Told by the files --out-dir writes beside the model (genai_config.json for a decoder,
    modules.json for an embedder), else by the graph's inputs. Reading the graph parses the whole
    file when its weights are inside it (a 550 MB jina-v2-base took 1.2 GB in the server's driver and
    ingress at start); the replica's session checks the inputs against the role (engines)."""
    if (path / "genai_config.json").is_file():
        return True
    if (path / "modules.json").is_file():
        return False
    return _has_cache(model)


def _has_cache(model: Path) -> bool:
    """Whether the file takes a KV cache (past_key_values.N.key inputs), read without its weights."""
    from ..runners import runtimes_common

    try:
        graph = runtimes_common("graph_only").load_graph_only(model).graph
    except Exception as err:  # noqa: BLE001 - protobuf's own errors: a file that is not a model
        raise FolderError(f"cannot read {model}: {str(err).strip().splitlines()[0] if str(err).strip() else err}") from None
    return any(i.name.startswith("past_key_values.") for i in graph.input)


def _context(config: dict, declared) -> int:
    """The context a request may fill: the folder's declared one (genai_config's context_length, an
    embedder tokenizer's model_max_length), else the config's position limit, else
    DEFAULT_CONTEXT (our files extrapolate: a config's limit is what the folder says, not a cap of
    the file)."""
    for value in (declared, config.get("max_position_embeddings"), config.get("n_positions"),
                  config.get("max_seq_len")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_CONTEXT


def _pooling(path: Path) -> str:
    """sentence-transformers' pooling config (1_Pooling/config.json): mean unless it asks for CLS."""
    pooling = json_object(path / "1_Pooling" / "config.json")
    return "cls" if pooling.get("pooling_mode_cls_token") and not pooling.get("pooling_mode_mean_tokens") else "mean"

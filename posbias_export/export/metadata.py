"""What an exported file records about itself (metadata_props, prefix `posbias.`), so it can
be validated later on its own: the model config, the arch, dtype, opset, the attention form."""
from __future__ import annotations

from collections.abc import Mapping
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


# Node metadata torch.onnx writes that names files on the exporting machine (our source and the
# virtual environment's, absolute): nothing a user of the file needs, and not ours to publish.
MACHINE_NODE_KEYS = ("pkg.torch.onnx.stack_trace",)


def drop_machine_paths(proto: onnx.ModelProto) -> None:
    """Remove MACHINE_NODE_KEYS from every node: the graph's, the local functions', and those of
    every subgraph (If / Loop bodies)."""
    from .functions import all_nodes

    for node in [*all_nodes(proto.graph.node), *(n for f in proto.functions for n in all_nodes(f.node))]:
        kept = [p for p in node.metadata_props if p.key not in MACHINE_NODE_KEYS]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)


def write_metadata(proto: onnx.ModelProto, meta: dict[str, str]) -> None:
    onnx.helper.set_model_props(proto, {PREFIX + k: v for k, v in meta.items()})


def add_metadata(proto: onnx.ModelProto, meta: dict[str, str]) -> None:
    """`meta` written beside what the file already records (a key given replaces its value)."""
    onnx.helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props},
                                        **{PREFIX + k: v for k, v in meta.items()}})


# Keys whose value is a positive integer wherever it is read (sizes, lengths, the opset).
INTEGER_KEYS = ("vocab_size", "opset", "trace_len", "attention_block", "max_positions", "quantized_nodes")


def read_metadata(model: onnx.ModelProto) -> dict[str, str]:
    """Our metadata_props, without the prefix, checked: a file's metadata is input like any
    other (a forged or damaged file): integers are integers, and our own models' `config` is the
    JSON object of a ModelConfig. ValueError names the key."""
    meta = {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}
    for key in INTEGER_KEYS:
        if key in meta and not (meta[key].isascii() and meta[key].isdigit() and int(meta[key]) > 0):
            raise ValueError(f"the file's metadata {PREFIX}{key} is {meta[key][:40]!r}, not a positive integer")
    if "config" in meta and meta.get("source") != "huggingface":
        config_from_metadata(meta)
    return meta


def config_from_metadata(meta: dict[str, str]):
    """The ModelConfig our own file records, or ValueError (a forged or damaged `config`)."""
    import json

    from ..nn import ModelConfig

    try:
        raw = json.loads(meta["config"])
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
        return ModelConfig.from_dict(raw)
    except RecursionError:
        raise ValueError(f"the file's metadata {PREFIX}config is not a model config: nested too deeply") from None
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"the file's metadata {PREFIX}config is not a model config: "
                         f"{str(err).splitlines()[0][:200] if str(err) else type(err).__name__}") from None


def settings_from_metadata(meta: dict[str, str]) -> AttentionSettings:
    """The attention form the file was exported in: a reference run in the same form computes
    equal math on real tokens and the same (arbitrary) output on fully padded query rows, and
    in blocks a float64 reference fits at 16k tokens too."""
    from .targets import attention_settings

    form = meta.get("attention", "plain")
    block = int(meta["attention_block"]) if "attention_block" in meta else AttentionSettings.block
    return attention_settings(int(meta.get("opset", 18)), form, meta.get("target", "portable"), block, functions=False)


class FileMetadata(Mapping):
    """A file's metadata, read and checked once (`of`): the `posbias.` keys as a read-only
    mapping (read_metadata's checks), and the quantization scheme its graph shows, which a
    `quantized` label must agree with (schemes.checked_scheme). ValueError names what is wrong."""

    def __init__(self, raw: dict[str, str], scheme: str | None):
        self._raw, self.scheme = dict(raw), scheme

    @classmethod
    def of(cls, proto: onnx.ModelProto) -> "FileMetadata":
        from .schemes import checked_scheme

        raw = read_metadata(proto)
        return cls(raw, checked_scheme(proto, raw.get("quantized")))

    def __getitem__(self, key: str) -> str:
        return self._raw[key]

    def __iter__(self):
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def imported(self) -> bool:
        """Exported from a Hugging Face folder (judged against that folder's model)."""
        return self._raw.get("source") == "huggingface"

    @property
    def dtype(self) -> str:
        return self._raw.get("dtype", "float32")

    @property
    def trace_len(self) -> int:
        return int(self._raw.get("trace_len", 16))

"""What a file is, in one typed value: FileContract.

The exporter writes it once (`to_props`: the file's `posbias.*` metadata_props) and every reader
reads it back once (`FileContract.of(model)`, `from_props`, `of_path`: the graph's metadata only,
never the weights), checked: a file's metadata is input like any other (a damaged or forged
file), so an integer is an integer, a flag is 0 or 1, and our own models' `config` is a JSON
object. ValueError names the key. Torch-free, like every runner: the package and the runners
read files through this one module (the package checks `config` further as a ModelConfig).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

PREFIX = "posbias."
FORMAT_VERSION = "1"
IMPORTED = "huggingface"  # `source` of a file exported from a Hugging Face folder


@dataclass(frozen=True)
class FileContract:
    # what the model is: ours (config), or a Hugging Face folder's (source, model_type, where)
    arch: str = "lm"
    bias: str | None = None
    config: Mapping | None = None  # our ModelConfig as a dict, parsed once
    bias_params: Mapping | None = None
    source: str = "posbias"
    model_type: str | None = None
    model_dir: str | None = None  # where the folder lay when the file was exported
    model_name: str | None = None  # a shipped folder's name (--out-dir: the file travels with it)
    weights_sha256: str | None = None  # the folder's weight files, name:hash,...
    vocab_size: int | None = None
    # how it was exported
    dtype: str = "float32"
    opset: int = 18
    trace_len: int = 16
    attention_mask: bool = False
    kv_cache: bool = False
    functions: str = "local"  # or "inlined"
    attention: str = "plain"  # or "blocked"
    attention_block: int | None = None
    target: str = "portable"
    names: str = "posbias"  # the input/output names: ours, or the clients' (huggingface)
    logits: str = "all"  # or "last": the last position's only
    max_positions: int | None = None  # a learned position table's size bounds the context
    # its weights
    checkpoint: str | None = None
    checkpoint_sha256: str | None = None
    seed: int | None = None
    quantized: str | None = None  # the scheme's name (the graph must show it: export/schemes.py)
    quantized_nodes: int | None = None
    quant: tuple[tuple[str, str], ...] = ()  # the scheme's options, quant_* keys
    kv_dtype: str = "float"  # or "float16" (float32 weights), "int8"
    kv_calibration: str | None = None
    format_version: str = FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = field(default=())  # keys the exporting caller added

    # --- reading ---------------------------------------------------------------------------

    @classmethod
    def from_props(cls, props: Mapping[str, str]) -> "FileContract":
        """From metadata_props (`posbias.` keys; others ignored), checked."""
        raw = {k[len(PREFIX):]: v for k, v in props.items() if k.startswith(PREFIX)}
        known = {f.name for f in fields(cls)} - {"quant", "extra"}
        values: dict = {}
        quant, extra = [], []
        for key, value in raw.items():
            if key.startswith("quant_"):
                quant.append((key, value))
            elif key in known:
                values[key] = _parsed(key, value)
            else:
                extra.append((key, value))
        if values.get("config") is not None and raw.get("source") == IMPORTED:
            values["config"] = None  # an imported file's config is its folder's, read there
        return cls(**values, quant=tuple(quant), extra=tuple(extra))

    @classmethod
    def of(cls, model) -> "FileContract":
        """From an onnx ModelProto (or anything with metadata_props)."""
        return cls.from_props({p.key: p.value for p in model.metadata_props})

    @classmethod
    def of_path(cls, path: str) -> "FileContract":
        """From a file on disk: its graph only (no weight is read); needs onnx."""
        from .graph_only import load_graph_only

        return cls.of(load_graph_only(path))

    # --- writing ---------------------------------------------------------------------------

    def to_props(self) -> dict[str, str]:
        """The metadata_props that say all of this (defaults included: a reader never guesses)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("quant", "extra"):
                out.update(value)
            elif value is not None:
                out[f.name] = _written(value)
        return {PREFIX + k: v for k, v in out.items()}

    # --- what readers ask -------------------------------------------------------------------

    @property
    def imported(self) -> bool:
        """Exported from a Hugging Face folder (judged against that folder's model)."""
        return self.source == IMPORTED

    @property
    def ours(self) -> bool:
        """One of our own models, rebuilt from `config`."""
        return not self.imported and self.config is not None

    @property
    def inplace_cache(self) -> bool:
        """A --kv-cache --target ort file: its cache is written in place (a buffer bound once)."""
        return self.kv_cache and self.target == "ort"

    @property
    def token_limit(self) -> int | None:
        """How many token ids the model has rows for (a language model), from the label."""
        if self.vocab_size is not None:
            return self.vocab_size
        if self.arch != "lm" or not self.config:
            return None
        value = self.config.get("vocab_size")
        return value if isinstance(value, int) and value > 0 else None

    def config_value(self, key: str, default=None):
        return (self.config or {}).get(key, default)

    def option(self, key: str, default: str | None = None) -> str | None:
        """A key outside the contract's fields: a scheme option (quant_*) or the caller's own."""
        return dict(self.quant + self.extra).get(key, default)


INTEGER_KEYS = ("vocab_size", "opset", "trace_len", "attention_block", "max_positions", "quantized_nodes", "seed")
FLAG_KEYS = ("attention_mask", "kv_cache")
JSON_KEYS = ("config", "bias_params")


def _parsed(key: str, value: str):
    if key in INTEGER_KEYS:
        positive = key != "seed"
        if not (value.isascii() and value.isdigit() and (int(value) > 0 or not positive)):
            raise ValueError(f"the file's metadata {PREFIX}{key} is {value[:40]!r}, not a "
                             f"{'positive ' if positive else ''}integer")
        return int(value)
    if key in FLAG_KEYS:
        if value not in ("0", "1"):
            raise ValueError(f"the file's metadata {PREFIX}{key} is {value[:40]!r}, not 0 or 1")
        return value == "1"
    if key in JSON_KEYS:
        try:
            parsed = json.loads(value)
        except RecursionError:
            raise ValueError(f"the file's metadata {PREFIX}{key} is not a model config: nested too deeply") from None
        except ValueError as err:
            raise ValueError(f"the file's metadata {PREFIX}{key} is not a model config: not JSON "
                             f"({str(err).splitlines()[0][:120]})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"the file's metadata {PREFIX}{key} is not a model config: a JSON "
                             f"{type(parsed).__name__}, not an object")
        return parsed
    return value


def _written(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, Mapping):
        return json.dumps(dict(value), sort_keys=True)
    return str(value)

"""What an exported file records about itself (metadata_props, prefix `posbias.`), so it can
be validated later on its own: the model config, the arch, dtype, opset, the attention form."""
from __future__ import annotations

import json
from pathlib import Path

import onnx

from ..nn import AttentionSettings, ModelConfig, file_sha256

PREFIX = "posbias."
FORMAT_VERSION = "1"


def export_metadata(cfg: ModelConfig, arch: str, dtype: str, opset: int, trace_len: int, settings: AttentionSettings,
                    attention_mask: bool, kv_cache: bool, inline_functions: bool, extra: dict | None) -> dict[str, str]:
    meta = {
        "config": json.dumps(cfg.to_dict(), sort_keys=True),
        "bias": cfg.bias,
        "bias_params": json.dumps(cfg.bias_params, sort_keys=True),
        "arch": arch,
        "dtype": dtype,
        "opset": str(opset),
        "trace_len": str(trace_len),
        "attention_mask": str(int(attention_mask or kv_cache)),
        "kv_cache": str(int(kv_cache)),
        "functions": "inlined" if inline_functions else "local",
        "attention": settings.form,
        "format_version": FORMAT_VERSION,
    }
    if settings.form == "blocked":
        meta["attention_block"] = str(settings.block)
        meta["target"] = settings.target
    if cfg.position == "learned":
        meta["max_positions"] = str(cfg.max_positions)  # runners refuse longer inputs with a clear error
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta


def checkpoint_metadata(checkpoint: str | Path) -> dict[str, str]:
    """Where the weights are (absolute: the file may be validated from another folder) and their hash."""
    return {"checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": file_sha256(checkpoint)}


def write_metadata(proto: onnx.ModelProto, meta: dict[str, str]) -> None:
    onnx.helper.set_model_props(proto, {PREFIX + k: v for k, v in meta.items()})


def read_metadata(model: onnx.ModelProto) -> dict[str, str]:
    """Our metadata_props, without the prefix."""
    return {p.key[len(PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(PREFIX)}


def settings_from_metadata(meta: dict[str, str]) -> AttentionSettings:
    """The attention form the file was exported in: a reference run in the same form computes
    equal math on real tokens and the same (arbitrary) output on fully padded query rows, and
    in blocks a float64 reference fits at 16k tokens too."""
    return AttentionSettings(
        form=meta.get("attention", "plain"),
        block=int(meta.get("attention_block", AttentionSettings.block)),
        impl="sdpa" if int(meta.get("opset", 18)) >= 23 and meta.get("attention", "plain") == "plain" else "explicit",
        target=meta.get("target", "portable"),
    )

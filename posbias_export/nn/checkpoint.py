"""Checkpoints that load without executing code: safetensors (preferred) or a weights-only
torch file. The model config travels inside, so a checkpoint alone rebuilds its model."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import first_line
from ..runners import atomic
from .config import ARCHS, ModelConfig
from .model import build_model

CONFIG_KEY = "posbias.config"
ARCH_KEY = "posbias.arch"


class CheckpointError(ValueError):
    pass


def save_checkpoint(model: torch.nn.Module, path: str | os.PathLike, extra: dict | None = None) -> None:
    """safetensors file with the config (and `extra` strings) in its metadata; atomic."""
    path = Path(path)
    meta = {CONFIG_KEY: json.dumps(model.cfg.to_dict(), sort_keys=True), ARCH_KEY: getattr(model, "arch", "lm")}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    atomic().write_with(path, lambda tmp: save_file(state, str(tmp), metadata=meta))


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict | None, str | None]:
    """(state_dict, config dict or None, arch or None). Never unpickles arbitrary objects."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):  # torch.save zip archive
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"cannot read torch checkpoint {path}: {first_line(err)}") from None
        if isinstance(obj, dict) and "state_dict" in obj:
            return obj["state_dict"], _saved_config(path, obj.get("config")), obj.get("arch")
        if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj, None, None
        raise CheckpointError(f"torch checkpoint {path} holds neither a state_dict nor {{'state_dict', 'config'}}")
    try:
        state = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: not a safetensors or torch file ({err})") from None
    return state, _saved_config(path, meta.get(CONFIG_KEY)), meta.get(ARCH_KEY)


def _saved_config(path: Path, text: str | dict | None) -> dict | None:
    """The config a checkpoint carries (JSON text or a dict), or None; a broken one names the file and field."""
    if text is None or isinstance(text, dict):
        return text
    try:
        cfg = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: metadata field {CONFIG_KEY} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"checkpoint {path}: metadata field {CONFIG_KEY} is not a JSON object")
    return cfg


def file_sha256(path: str | os.PathLike) -> str:
    """Content hash of a checkpoint: an export records it, validate checks it (the file moved or changed?)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_card(path: str | os.PathLike) -> dict:
    """The training card a checkpoint of `train` carries in its safetensors metadata
    (posbias.card: corpus, steps, train_len, command ...); {} for any other checkpoint."""
    import json

    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            card = json.loads((f.metadata() or {}).get("posbias.card", "{}"))
    except Exception:  # noqa: BLE001 - not a safetensors file, or a card that is not JSON: no card
        return {}
    return card if isinstance(card, dict) else {}


def checkpoint_config(path, saved_cfg: dict | None, given: dict | ModelConfig | None = None) -> ModelConfig:
    """The config a checkpoint is loaded with: its saved one, which options given alongside (a
    dict of ModelConfig fields, or a whole ModelConfig) may repeat but not contradict; without a
    saved config, the options alone (the bias at least)."""
    given = given.to_dict() if isinstance(given, ModelConfig) else dict(given or {})
    if saved_cfg is None:
        if "bias" not in given:
            raise CheckpointError(f"checkpoint {path} carries no config; pass the model options explicitly "
                                  "(--bias is required)")
        return ModelConfig(**given)
    try:
        saved = ModelConfig.from_dict(saved_cfg)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: its saved config is invalid: {first_line(err)}") from None
    merged = {**saved.to_dict(), **given, "bias_params": {**saved.bias_params, **given.get("bias_params", {})}}
    if ModelConfig.from_dict(merged) != saved:
        differ = sorted(k for k, v in given.items() if saved.to_dict().get(k) != v)
        raise CheckpointError(f"options {', '.join(differ or sorted(given))} contradict the checkpoint's saved config "
                              f"({path}); drop them")
    return saved


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | dict | None = None, arch: str | None = None) -> torch.nn.Module:
    """Rebuild the model a checkpoint was saved from. `cfg` (a ModelConfig, or the fields some
    options set) is used when the file carries no config; when both exist and disagree, that is
    an error rather than a silent choice (checkpoint_config)."""
    state, saved_cfg, saved_arch = read_checkpoint(path)
    cfg = checkpoint_config(path, saved_cfg, cfg)
    arch = arch or saved_arch or "lm"
    if saved_arch and arch != saved_arch:
        raise CheckpointError(f"checkpoint {path} is a {saved_arch!r} model, not {arch!r}")
    if arch not in ARCHS:
        raise CheckpointError(f"unknown arch {arch!r} in checkpoint {path}")
    model = build_model(cfg, seed=0, arch=arch)
    try:
        model.load_state_dict(state, strict=True)
    except ValueError as err:  # a bias rejected a value, e.g. KERPLE r2 > 2
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    except RuntimeError as err:
        first = str(err).splitlines()
        raise CheckpointError(f"checkpoint {path} does not fit the model: {' '.join(l.strip() for l in first[:3])}") from None
    bad = non_finite_tensor(model)
    if bad:
        raise CheckpointError(f"checkpoint {path}: tensor {bad!r} holds NaN or infinity")
    return model.eval()


def model_for(given: dict, checkpoint: str | os.PathLike | None = None, arch: str | None = None,
              seed: int = 0) -> torch.nn.Module:
    """The model an export asks for: the checkpoint's (options given must agree with its saved
    config), else a fresh one from the options (seeded)."""
    if checkpoint:
        return load_checkpoint(checkpoint, given, arch)
    if "bias" not in given:
        raise ValueError("--bias is required (or --checkpoint with a saved config)")
    return build_model(ModelConfig(**given), seed=seed, arch=arch or "lm")


def non_finite_tensor(model: torch.nn.Module) -> str | None:
    """The name of the first floating parameter or buffer holding NaN or inf, else None (meta
    tensors hold no values: their readers are checked as they are read)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all()):
            return name
    return None

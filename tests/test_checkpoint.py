"""Checkpoints load without executing code and rebuild the exact model."""
from __future__ import annotations

import pickle

import pytest
import torch

import posbias_export as pbe
from posbias_export.nn.checkpoint import CheckpointError, load_checkpoint
from conftest import SMALL, lm_inputs


@pytest.mark.parametrize("bias", pbe.BIASES)
def test_safetensors_round_trip(tmp_path, bias):
    model = pbe.build_model(pbe.ModelConfig(bias=bias, **SMALL), seed=2)
    pbe.save_checkpoint(model, tmp_path / "m.safetensors")
    again = load_checkpoint(tmp_path / "m.safetensors")
    ids = lm_inputs(2, 50)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=1e-6, atol=1e-6)


def test_weights_only_torch_file(tmp_path):
    model = pbe.build_model(pbe.ModelConfig(bias="t5", **SMALL), seed=1)
    torch.save({"config": model.cfg.to_dict(), "state_dict": model.state_dict(), "arch": "lm"}, tmp_path / "m.pt")
    again = load_checkpoint(tmp_path / "m.pt")
    ids = lm_inputs(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids))


class _Evil:
    def __reduce__(self):
        return (print, ("code ran",))


def test_pickled_code_is_not_executed(tmp_path, capsys):
    torch.save({"state_dict": {}, "payload": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="cannot read torch checkpoint"):
        load_checkpoint(tmp_path / "evil.pt")
    assert "code ran" not in capsys.readouterr().out


def test_config_needed_when_file_has_none(tmp_path):
    # not the seed a fresh build uses: the loaded weights must come from the file
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=5)
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="carries no config"):
        load_checkpoint(tmp_path / "bare.pt")
    loaded = load_checkpoint(tmp_path / "bare.pt", cfg=model.cfg)
    ids = lm_inputs(2, 30)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)  # the very same weights


def test_shape_mismatch_is_clear(tmp_path):
    model = pbe.build_model(pbe.ModelConfig(bias="alibi", **SMALL), seed=0)
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_checkpoint(tmp_path / "bare.pt", cfg=pbe.ModelConfig(bias="alibi", num_heads=4, dim=128))

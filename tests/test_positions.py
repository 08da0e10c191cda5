"""Absolute and rotary position schemes: formulas, resizing, log-n scaling, export parity."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import posbias_export as pbe
import tiers
from posbias_export.nn.positions import RotaryEmbedding, logn_scale, resize_learned_table, sinusoidal_embedding
from posbias_export.parity import compare, torch_outputs
from conftest import SMALL, lm_inputs, ort_session


def test_sinusoidal_matches_vaswani_formula():
    pos = torch.arange(0, 300)
    got = sinusoidal_embedding(pos, 16).double().numpy()
    t = np.arange(300, dtype=np.float64)[:, None]
    i = np.arange(8, dtype=np.float64)[None]
    ref = np.empty((300, 16))
    ref[:, 0::2] = np.sin(t / 10000 ** (2 * i / 16))
    ref[:, 1::2] = np.cos(t / 10000 ** (2 * i / 16))
    np.testing.assert_allclose(got, ref, atol=300 * 2 ** -22)  # float32 angles t*w: abs error ~ t ulp


def test_rope_scalings():
    base = RotaryEmbedding(32, 10000.0).inv_freq.double()
    linear = RotaryEmbedding(32, 10000.0, "linear", 4.0).inv_freq.double()
    ntk = RotaryEmbedding(32, 10000.0, "ntk", 4.0).inv_freq.double()
    torch.testing.assert_close(linear, base / 4, rtol=1e-6, atol=0)  # position interpolation: t/s
    k = torch.arange(16, dtype=torch.float64)
    expected = (10000.0 * 4.0 ** (32 / 30)) ** (-2 * k / 32)  # NTK-aware: base * s^(d/(d-2))
    torch.testing.assert_close(ntk, expected.float().double(), rtol=1e-6, atol=0)
    assert ntk[0] == base[0] and torch.isclose(ntk[-1], base[-1] / 4, rtol=0.1)  # high freq kept, lowest ~ /s


def test_logn_scale():
    q_pos = torch.tensor([0, 63, 64 * 64 - 1])
    torch.testing.assert_close(logn_scale(q_pos, 64), torch.tensor([1.0, 1.0, 2.0]))


@pytest.mark.parametrize("method", ["interpolate", "copy"])
def test_resize_learned_table(method):
    table = torch.arange(8, dtype=torch.float32).repeat(3, 1).T  # [8, 3], row t = t
    big = resize_learned_table(table, 15, method)
    assert big.shape == (15, 3)
    expected = torch.arange(15) * 0.5 if method == "interpolate" else torch.arange(15) % 8
    torch.testing.assert_close(big[:, 0], expected.float())


def test_learned_positions_refuse_beyond_table():
    cfg = pbe.ModelConfig(bias="none", position="learned", max_positions=32, **SMALL)
    model, sibling = pbe.build_model(cfg, seed=0), pbe.build_model(cfg, seed=1)
    with pytest.raises(IndexError):
        model(lm_inputs(1, 40))
    model.resize_positions(64, "copy")
    assert model(lm_inputs(1, 40)).shape == (1, 40, 256)
    # the resized model has a config of its own; the shared one (the caller's, the sibling's) is unchanged
    assert model.cfg.max_positions == 64 and all(b.cfg is model.cfg for b in model.blocks)
    assert cfg.max_positions == 32 and sibling.cfg.max_positions == 32


@pytest.mark.parametrize("kwargs", tiers.cases([
    dict(position="sinusoidal"), dict(position="learned", max_positions=128),
    dict(rope=True, rope_scaling="ntk", rope_factor=4.0), dict(rope=True, rope_scaling="linear", rope_factor=2.0),
    dict(bias="alibi", logn_train_len=16),
], ["sinusoidal", "learned", "rope-ntk", "rope-linear", "alibi-logn"], slow={"sinusoidal", "rope-linear", "learned"}))
def test_position_schemes_export_and_match(tmp_path, kwargs):
    cfg = pbe.ModelConfig(**{"bias": "none", **SMALL, **kwargs})
    model = pbe.build_model(cfg, seed=0)
    pbe.export_onnx(model, tmp_path / "m.onnx")
    session = ort_session(tmp_path / "m.onnx")
    for length in (1, 17, 100):
        ids = lm_inputs(3, length, seed=length)
        got = session.run(None, {"input_ids": ids.numpy()})[0]
        parity = compare(got, torch_outputs(model, (ids,), torch.float64), torch_outputs(model, (ids,), torch.float32))
        assert parity.passed, f"L={length}: {parity}"


def test_learned_export_records_table_size(tmp_path):
    import onnx

    from posbias_export.export import FileContract

    model = pbe.build_model(pbe.ModelConfig(bias="none", position="learned", max_positions=48, **SMALL), seed=0)
    pbe.export_onnx(model, tmp_path / "m.onnx", check_growth=False)
    assert FileContract.of_path(tmp_path / "m.onnx").max_positions == 48

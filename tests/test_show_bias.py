"""show-bias: the picture's pixels follow the family's float64 reference() (sampled at every
cell's centre, through the axes' own transform), for every family; masked cells are grey; bad
input is one line and writes nothing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import posbias_export as pbe
from posbias_export.cli import main as cli_main

pytest.importorskip("matplotlib")
LENGTH = 12


def _pixels_follow_the_reference(fig, axes, grid, png):
    """Each cell's centre pixel is the colour the reference value maps to (grey where masked)."""
    from matplotlib.colors import to_rgba
    from matplotlib.image import imread

    from posbias_export.biases.drawing import MASKED_COLOR, color_scale

    image = imread(str(png))[..., :3]  # [rows, cols, RGB] in 0..1
    height = image.shape[0]
    cmap, norm = color_scale(grid)
    for h, ax in enumerate(axes):
        for i in range(grid.shape[1]):
            for j in range(grid.shape[2]):
                x, y = ax.transData.transform((j, i))  # display pixels, origin bottom left
                got = image[int(height - y), int(x)]
                value = grid[h, i, j]
                want = np.array(to_rgba(MASKED_COLOR)[:3] if np.isnan(value) else cmap(norm(value))[:3])
                assert np.abs(got - want).max() <= 2 / 255, (h, i, j, value, got, want)


@pytest.mark.parametrize("name", pbe.BIASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_picture_follows_the_reference(tmp_path, name, causal):
    from posbias_export.biases import create_bias
    from posbias_export.biases.drawing import draw_bias

    bias = create_bias(name, 3, causal=causal, seed=1)
    png = tmp_path / "bias.png"
    fig, axes, grid = draw_bias(bias, LENGTH, png)
    pos = np.arange(LENGTH)
    ref = np.broadcast_to(bias.reference(pos, pos), grid.shape)
    visible = ~np.isnan(grid)
    np.testing.assert_array_equal(grid[visible], ref[visible])  # the values drawn are reference()'s
    assert visible[:, np.tril_indices(LENGTH)[0], np.tril_indices(LENGTH)[1]].any()
    if causal:
        assert np.isnan(grid[:, np.triu_indices(LENGTH, 1)[0], np.triu_indices(LENGTH, 1)[1]]).all()
    _pixels_follow_the_reference(fig, axes, grid, png)


def test_the_command_draws_hyper_parameters_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "w.png"
    assert cli_main(["show-bias", "window", "--bias-param", "window=3", "--length", "10", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    for argv, words in ((["show-bias", "nope", "--out", str(tmp_path / "a.png")], "unknown bias 'nope'"),
                        (["show-bias", "alibi", "--length", "5000", "--out", str(tmp_path / "b.png")],
                         "length must be an integer in [2, 1024]"),
                        (["show-bias", "window", "--bias-param", "window=0", "--out", str(tmp_path / "c.png")],
                         "window"),
                        (["show-bias", "alibi", "--out", str(tmp_path / "missing" / "d.png")], "missing")):
        capsys.readouterr()
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.png"]  # nothing partial left behind


def test_a_trained_checkpoint_is_drawn_from_its_learned_values(tmp_path):
    """--checkpoint: the first layer of the trained model (its learned KERPLE parameters)."""
    from posbias_export.biases import AttentionBias
    from posbias_export.biases.drawing import bias_grid
    from posbias_export.nn import load_checkpoint

    ckpt = str(Path(__file__).resolve().parents[1] / "models" / "kerple_log.safetensors")
    assert cli_main(["show-bias", "kerple_log", "--checkpoint", ckpt, "--length", "16",
                     "--out", str(tmp_path / "k.png")]) == 0
    trained = next(m for m in load_checkpoint(ckpt).modules() if isinstance(m, AttentionBias))
    fresh = pbe.create_bias("kerple_log", trained.num_heads, seed=0)
    assert not np.allclose(bias_grid(trained, 16), bias_grid(fresh, 16), equal_nan=True)


def test_the_format_follows_the_suffix(tmp_path, capsys):
    """SVG and PDF are written as what their names say; a suffix with no format is refused, not
    given PNG bytes (before: bias.svg held a PNG)."""
    for name, magic in (("b.svg", b"<?xml"), ("b.pdf", b"%PDF"), ("b.PNG", b"\x89PNG")):
        assert cli_main(["show-bias", "alibi", "--length", "8", "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(magic), name
    capsys.readouterr()
    assert cli_main(["show-bias", "alibi", "--out", str(tmp_path / "b.jpg")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "format comes from its suffix" in err[0], err
    assert not (tmp_path / "b.jpg").exists()

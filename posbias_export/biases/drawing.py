"""A family's bias as a picture, one panel per head, drawn from its float64 `reference()` (the
paper's formula, not our PyTorch or ONNX code): the first look at a family, for its users and
for whoever adds one (`python -m posbias_export show-bias NAME --out bias.png`).

Query i down, key j across; one colour scale for every head (a colour bar says the values);
positions a query cannot see (the causal mask, a window's reach) are grey.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .base import MASK_PENALTY, AttentionBias

MAX_LENGTH = 1024  # L x L cells per head: a picture, not a benchmark
MAX_HEADS = 128  # one panel each: BLOOM-176B's 112 heads fit
MASKED_COLOR = "lightgrey"


def bias_grid(bias: AttentionBias, length: int) -> np.ndarray:
    """[H, L, L] float64: reference(0..L-1, 0..L-1) per head, NaN where the query cannot see the
    key (causal: j > i; a family's own mask, written as the lowest float32)."""
    pos = np.arange(length)
    ref = np.asarray(bias.reference(pos, pos), np.float64)  # [H|1, L, L]
    grid = np.array(np.broadcast_to(ref, (ref.shape[0], length, length)))
    masked = grid <= MASK_PENALTY  # FLOAT32_LOWEST: a masked key (window)
    if bias.causal:
        masked |= np.triu(np.ones((length, length), bool), 1)
    grid[masked] = np.nan
    return grid


def color_scale(grid: np.ndarray):
    """(colormap with grey for NaN, Normalize over the visible values of every head)."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    visible = grid[~np.isnan(grid)]
    low, high = (float(visible.min()), float(visible.max())) if visible.size else (0.0, 0.0)
    if high - low < 1e-12:  # a constant bias (none): centre it in the scale
        low, high = low - 0.5, high + 0.5
    return colormaps["viridis"].with_extremes(bad=MASKED_COLOR), Normalize(low, high)


PICTURE_FORMATS = ("png", "svg", "pdf")  # by the output's suffix


def picture_format(path: str | Path) -> str:
    """The format the output's suffix names; ValueError for any other (bytes of one format under
    another's name open nowhere)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PICTURE_FORMATS:
        raise ValueError(f"{path}: the picture's format comes from its suffix: "
                         f"{', '.join('.' + f for f in PICTURE_FORMATS)}")
    return suffix


def draw_bias(bias: AttentionBias, length: int, path: str | Path, title: str = ""):
    """Write the picture to `path` (PNG, SVG or PDF by its suffix, atomically); returns (figure,
    axes per head, grid). ValueError for a length outside [2, MAX_LENGTH], another suffix, or
    without matplotlib."""
    from ..plots import pyplot_for
    from ..runners import atomic

    if isinstance(length, bool) or not isinstance(length, int) or not 2 <= length <= MAX_LENGTH:
        raise ValueError(f"length must be an integer in [2, {MAX_LENGTH}] (a picture of L x L cells), got {length!r}")
    picture_format(path)  # before anything is drawn
    plt = pyplot_for(Path(path))
    if plt is None:
        raise ValueError("show-bias draws with matplotlib: pip install matplotlib")
    grid = bias_grid(bias, length)
    heads = grid.shape[0]
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1.2, 3.2 * rows + 0.8), dpi=100, squeeze=False)
    fig.subplots_adjust(wspace=0.4, hspace=0.4)
    cmap, norm = color_scale(grid)
    for h, ax in enumerate(axes.ravel()):
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(grid[h], cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title("every head" if heads == 1 else f"head {h}", fontsize=9)
        ax.set_xlabel("key j", fontsize=8)
        ax.set_ylabel("query i", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="added to the score (grey: masked)")
    fig.suptitle(title or f"{bias.name}, {'causal' if bias.causal else 'bidirectional'}, {length} positions",
                 fontsize=10)
    atomic().write_with(Path(path), lambda tmp: fig.savefig(tmp, dpi=100, format=picture_format(path)))
    return fig, axes.ravel()[:heads], grid

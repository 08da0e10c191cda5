"""matplotlib is an optional extra (`pip install posbias_export[plots]`): results files are
written without it, and the figure is skipped with one line. Every figure here plots against
sequence length: log2 lengths across, log values up, written atomically."""
from __future__ import annotations

import sys
from pathlib import Path


def pyplot_for(path: Path):
    """matplotlib.pyplot (headless), or None after saying on stderr that `path` is skipped."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: skipped {path} (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def length_axes(ax, xlabel: str, ylabel: str, title: str, fontsize=None, log_values: bool = True) -> None:
    ax.set_xscale("log", base=2)
    if log_values:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=fontsize)
    ax.grid(True, which="both", alpha=0.3)


def save_figure(plt, fig, path: Path, title: str | None = None, fontsize=None, dpi: int = 110) -> None:
    from .runners import atomic

    if title:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    atomic().write_with(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    plt.close(fig)

"""matplotlib is an optional extra (`pip install posbias_export[plots]`): results files are
written without it, and the figure is skipped with one line."""
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

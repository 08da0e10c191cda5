"""The text corpus: raw bytes (the models are byte-level) and a fixed held-out split."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

HELDOUT_FRACTION = 0.1


def read_corpus(path: str | Path) -> tuple[np.ndarray, str]:
    """(bytes as uint8 array, sha256 hex)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus {path} does not exist")
    data = path.read_bytes()
    if len(data) < 1024:
        raise ValueError(f"corpus {path} is too small ({len(data)} bytes; need at least 1024)")
    return np.frombuffer(data, dtype=np.uint8), hashlib.sha256(data).hexdigest()


def split(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, held out): the held-out split is the last 10%."""
    cut = int(len(data) * (1 - HELDOUT_FRACTION))
    return data[:cut], data[cut:]

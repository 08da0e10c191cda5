"""Inputs for whatever a file asks, by input name: one generator per name, shared by validate's
cases of imported models, the benches and the client checks. A case is token ids and a mask
[B, L] (and, for a seq2seq decoder, the encoder's tensors); each input the file declares is made
from it by its name's generator, so a new input name is one entry here."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cache import is_cache_input


@dataclass
class Case:
    ids: np.ndarray  # [B, L] int64
    mask: np.ndarray  # [B, L] int64, 0 on padding
    named: dict[str, np.ndarray] = field(default_factory=dict)  # given as they are (encoder_hidden_states, ...)


def padded_batch(length: int, batch: int, vocab: int, seed: int = 0) -> Case:
    """`batch` rows of `length` random tokens, rows after the first right-padded to lengths down
    to half: texts of different lengths, as embedding servers batch them (the benches' case)."""
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int64)
    mask = np.ones_like(ids)
    for row in range(1, batch):
        mask[row, length - row * length // (2 * batch):] = 0
    return Case(ids, mask)


def _positions(case: Case, shape, dtype) -> np.ndarray:
    return np.clip(case.mask.cumsum(-1) - 1, 0, None).astype(np.int64)  # padding-aware, as transformers counts


def _empty_cache(case: Case, shape, dtype) -> np.ndarray:
    # a prefill: the past axis (the only dynamic one past the batch) empty
    return np.zeros([case.ids.shape[0] if i == 0 else (d if isinstance(d, int) else 0) for i, d in enumerate(shape)],
                    dtype)


GENERATORS = {
    "input_ids": lambda case, shape, dtype: case.ids,
    "attention_mask": lambda case, shape, dtype: case.mask,
    "token_type_ids": lambda case, shape, dtype: np.zeros_like(case.ids),  # one segment: what embedding clients send
    "position_ids": _positions,
    "use_cache_branch": lambda case, shape, dtype: np.array([False]),  # a merged seq2seq decoder's prefill
}


class UnknownInput(ValueError):
    pass


def feeds_for(declared, case: Case) -> dict[str, np.ndarray]:
    """declared: (name, shape, numpy dtype) of each input the file declares (shape entries: int
    for a fixed axis, anything else for a dynamic one). UnknownInput names an input no
    generator makes."""
    feeds = {}
    for name, shape, dtype in declared:
        if name in case.named:
            feeds[name] = case.named[name]
        elif name in GENERATORS:
            feeds[name] = GENERATORS[name](case, shape, dtype)
        elif is_cache_input(name):
            feeds[name] = _empty_cache(case, shape, dtype)
        else:
            raise UnknownInput(f"cannot feed input {name!r}: inputs are made for {', '.join(GENERATORS)}, past "
                               "key/value tensors and the named encoder tensors")
    return feeds

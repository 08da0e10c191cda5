"""Do two greedy runs write the same tokens? One answer for the benches, the client checks and
the GPU tools: after the first difference the two runs condition on different text, so only
the tokens before it agree; each run is cut after its first stop id (an end-of-sequence)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def until_stop(tokens: Sequence[int], start: int = 0, stop_ids: Iterable[int] = ()) -> list[int]:
    """The tokens up to and including the first stop id at or after `start` (the prompt's end)."""
    tokens, stops = list(tokens), set(stop_ids)
    cut = next((i for i in range(start, len(tokens)) if tokens[i] in stops), None)
    return tokens if cut is None else tokens[: cut + 1]


def agreeing(a: Sequence[int], b: Sequence[int], start: int = 0, stop_ids: Iterable[int] = ()) -> int:
    """How many tokens from `start` on the two runs share before their first difference."""
    stops = tuple(stop_ids)
    a, b = until_stop(a, start, stops)[start:], until_stop(b, start, stops)[start:]
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def same_tokens(a: Sequence[int], b: Sequence[int], start: int = 0, stop_ids: Iterable[int] = ()) -> bool:
    """The two runs write the same tokens, each up to its first stop id."""
    stops = tuple(stop_ids)
    return until_stop(a, start, stops) == until_stop(b, start, stops)

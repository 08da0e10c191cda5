"""JSON objects from the files a serving folder holds (config.json, generation_config.json), read
the one safe way: invalid text, bytes that are not UTF-8, nesting too deep for the parser and
another JSON type are each one RunnerError line. Standard library only."""
from __future__ import annotations

import json
from pathlib import Path

from .tensor_io import RunnerError


def read_json_object(file: Path) -> dict:
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise RunnerError(f"{file} is not valid JSON: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise RunnerError(f"{file} is not valid JSON: nested too deeply") from None
    except OSError as err:
        raise RunnerError(f"cannot read {file}: {err.strerror}") from None
    if not isinstance(data, dict):
        raise RunnerError(f"{file} holds {type(data).__name__}, not a JSON object")
    return data


def token_id(value, file: Path, key: str, vocab: int | None) -> int | None:
    """A token id a file names: None, or an integer in [0, vocab)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (vocab is not None and value >= vocab):
        bound = f" below the vocabulary size {vocab}" if vocab is not None else ""
        raise RunnerError(f"{file}: {key} must be a token id (an integer >= 0{bound}), got {value!r}"[:300])
    return value


def token_ids(value, file: Path, key: str, vocab: int | None) -> tuple[int, ...]:
    """The end-of-sequence ids a file names: one id or a non-empty list of them (instruct models
    stop at any of several, as transformers does), every one checked; () for none."""
    if value is None:
        return ()
    values = value if isinstance(value, list) and value else [value]
    try:
        return tuple(token_id(v, file, key, vocab) for v in values)
    except RunnerError:
        bound = f" below the vocabulary size {vocab}" if vocab is not None else ""
        raise RunnerError(f"{file}: {key} must be a token id or a non-empty list of them (integers >= 0{bound}), "
                          f"got {value!r}"[:300]) from None

"""What every command's parser shares: one-line usage errors and the argument types."""
from __future__ import annotations

import argparse

from ..errors import UsageError

PROG = "posbias-export"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one readable line instead of usage + message
        raise UsageError(message)


def parser(name: str, description: str, epilog: str | None = None) -> Parser:
    return Parser(prog=f"{PROG} {name}".strip(), description=description, epilog=epilog,
                  formatter_class=argparse.RawDescriptionHelpFormatter)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


LIST_MAX = 1 << 20  # a length, count or context past this is a typo, not a run (hours, terabytes)


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if max(values) > LIST_MAX:
        raise argparse.ArgumentTypeError(f"expected integers up to {LIST_MAX}, got {max(values)}")
    return values


def name_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key.strip(), value.strip()

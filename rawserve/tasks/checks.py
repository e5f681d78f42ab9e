"""Small checkers for request values: each returns the value to pass on or raises ValueError.

Shared by the task modules. Plain Python only: the server imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Checker = Callable[[Any], Any]


class BlankInput(ValueError):
    """Well-formed input with nothing in it (empty or whitespace-only text): answered 422."""


# --- parameter values ----------------------------------------------------------------


def int_range(low: int, high: int) -> Checker:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}")
        return value

    return check


def float_range(low: float, high: float) -> Checker:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return float(value)

    return check


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def one_of(*choices: str) -> Checker:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return value

    return check


def short_text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise ValueError("must be a non-empty string of at most 1000 characters")
    return value


def text_list(max_items: int) -> Checker:
    def check(value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if (
            not isinstance(value, list)
            or not 1 <= len(value) <= max_items
            or not all(isinstance(v, str) and v for v in value)
        ):
            raise ValueError(f"must be a string or a list of 1 to {max_items} non-empty strings")
        return value

    return check


def lower_one_of(*choices: str) -> Checker:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return value.lower()

    return check


# --- inputs ----------------------------------------------------------------------------


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("each input must be a string")
    return not_blank(value)


def not_blank(value: str, what: str = "the text") -> str:
    if not value.strip():
        raise BlankInput(f"{what} is empty or only whitespace")
    return value

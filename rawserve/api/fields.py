"""A JSON object body read field by field, for the routes whose bodies are objects of named
fields (TEI's, OpenAI's): unknown fields are refused (OpenAI's routes) or ignored (TEI's, as
TEI ignores them), and each getter checks its field's type and range and says what is
wrong (400). `null` reads as absent.

Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from rawserve.http.errors import BadRequest


class Fields:
    def __init__(self, document: Any, allowed: Collection[str], ignore_unknown: bool = False):
        if not isinstance(document, dict):
            raise BadRequest("the JSON body must be an object")
        unknown = sorted(set(document) - set(allowed))
        if unknown and not ignore_unknown:
            names = ", ".join(repr(name)[:60] for name in unknown[:10])
            raise BadRequest(f"unknown field(s): {names} (allowed: {', '.join(sorted(allowed))})")
        self.document: dict[str, Any] = document

    def get(self, name: str) -> Any:
        return self.document.get(name)

    def required(self, name: str) -> Any:
        value = self.document.get(name)
        if value is None:
            raise BadRequest(f'"{name}" is required')
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.document.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadRequest(f'"{name}" must be true or false')
        return value

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.document.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise BadRequest(f'"{name}" must be an integer from {low} to {high}')
        return value

    def number(self, name: str, low: float, high: float) -> float | None:
        value = self.document.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f'"{name}" must be a number')
        if not low <= value <= high:  # also refuses NaN
            raise BadRequest(f'"{name}" must be between {low} and {high}')
        return float(value)

    def string(self, name: str) -> str | None:
        value = self.document.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise BadRequest(f'"{name}" must be a string')
        return value

    def choice(self, name: str, choices: Collection[str], default: str) -> str:
        value = self.document.get(name)
        if value is None:
            return default
        if not isinstance(value, str) or value not in choices:
            raise BadRequest(f'"{name}" must be one of {", ".join(choices)}')
        return value


def unicode_text(value: str, name: str = "the text") -> str:
    """`value`, refused when it cannot be UTF-8 (a lone surrogate from a JSON escape)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadRequest(f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return value

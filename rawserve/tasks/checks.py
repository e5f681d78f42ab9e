"""Small checkers for request values: each returns the value to pass on or raises ValueError,
and carries the JSON schema of the values it takes (for /openapi.json: the one place that
says what a parameter may be).

Shared by the task modules. Plain Python only: the server imports them.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]


@dataclass(frozen=True)
class Checker:
    schema: Schema  # what `function` takes, as JSON Schema
    function: Callable[[Any], Any]

    def __call__(self, value: Any) -> Any:
        return self.function(value)


def checker(schema: Schema) -> Callable[[Callable[[Any], Any]], Checker]:
    """Decorates a check function with the schema of what it takes."""

    def wrap(function: Callable[[Any], Any]) -> Checker:
        return Checker(schema, function)

    return wrap


# --- output shapes, for the schemas of answers -----------------------------------------

NUMBER = {"type": "number"}
LABEL_SCORE: Schema = {
    "type": "object",
    "required": ["label", "score"],
    "properties": {"label": {"type": "string"}, "score": NUMBER},
}
LABEL_SCORES: Schema = {"type": "array", "items": LABEL_SCORE}


def one_or_list(schema: Schema) -> Schema:
    """An output that is `schema`, or a list of them (when top_k asks for several)."""
    return {"anyOf": [schema, {"type": "array", "items": schema}]}


class BlankInput(ValueError):
    """Well-formed input with nothing in it (empty or whitespace-only text): answered 422."""


# --- parameter values ----------------------------------------------------------------


def int_range(low: int, high: int) -> Checker:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be an integer from {low} to {high}")
        return value

    return Checker({"type": "integer", "minimum": low, "maximum": high}, check)


def float_range(low: float, high: float, above_low: bool = False) -> Checker:
    """A number from `low` to `high`; `above_low`: `low` itself excluded (a factor that
    divides, where 0 would be a division)."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        if above_low and not low < value <= high:
            raise ValueError(f"must be above {low} and at most {high}")
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return float(value)

    bound = "exclusiveMinimum" if above_low else "minimum"
    return Checker({"type": "number", bound: low, "maximum": high}, check)


@checker({"type": "boolean"})
def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


class Unserved(ValueError):
    """A parameter value the server cannot honour (answered 422): it is never ignored."""


# what `ignored` checkers answer: the parameter is left out of the model's parameters
IGNORED = None


def ignored(*off: Any) -> Checker:
    """A parameter accepted only at its "off" values, and then left out: clients such as
    TGI's send every parameter they know, null or false when unset. Any other value is
    `Unserved`, never silently ignored."""
    shown = " or ".join("null" if v is None else repr(v).lower() for v in (None, *off))

    def check(value: Any) -> None:
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off):
            raise Unserved(f"is not supported by this server: it takes only {shown}")
        return IGNORED

    return Checker({"enum": [None, *off]}, check)


def one_of(*choices: str) -> Checker:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return value

    return Checker({"enum": list(choices)}, check)


@checker({"type": "string", "minLength": 1, "maxLength": 1000})
def short_text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise ValueError("must be a non-empty string of at most 1000 characters")
    return value


def text_list(max_items: int, min_items: int = 1) -> Checker:
    """A text or a list of texts, none blank nor only control or format characters (a
    zero-shot label of spaces, or of a zero-width space, was scored as one, where an empty
    one was refused; a fill-mask target of one was refused by transformers alone, but
    beside another target was dropped unsaid)."""

    def check(value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if (
            not isinstance(value, list)
            or not min_items <= len(value) <= max_items
            or not all(isinstance(v, str) and shows(v) for v in value)
        ):
            raise ValueError(
                f"must be a string or a list of {min_items} to {max_items} strings, none blank "
                "(nor only control or format characters)"
            )
        return value

    nonempty = {"type": "string", "minLength": 1, "pattern": r"\S"}
    items = {"type": "array", "items": nonempty, "minItems": min_items, "maxItems": max_items}
    return Checker({"oneOf": [nonempty, items]}, check)


def lower_one_of(*choices: str) -> Checker:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return value.lower()

    # any case: "left", "Left", "LEFT"
    spelt = "|".join("".join(f"[{c.lower()}{c.upper()}]" for c in choice) for choice in choices)
    return Checker({"type": "string", "pattern": f"^({spelt})$"}, check)


# --- inputs ----------------------------------------------------------------------------


@checker({"type": "string"})
def text(value: Any) -> str:
    """A text an encoder reads: not blank, and not only characters it skips (`visible`)."""
    if not isinstance(value, str):
        raise ValueError("each input must be a string")
    return visible(value)


@checker({"type": "string"})
def prompt(value: Any) -> str:
    """A prompt a generation model continues: not blank. A byte-level tokenizer (GPT-2's,
    Llama's byte fallback, BART's) reads a zero-width space or a NUL as tokens of its
    own, as TGI, vLLM and OpenAI take such a prompt."""
    if not isinstance(value, str):
        raise ValueError("each input must be a string")
    return not_blank(value)


def not_blank(value: str, what: str = "the text") -> str:
    if not value.strip():
        raise BlankInput(f"{what} is empty or only whitespace")
    return value


def visible(value: str, what: str = "the text") -> str:
    """`value`, not blank nor only control and format characters, which an encoder's
    tokenizer skips: a classifier scored a zero-width space as it scores "" (a made-up
    answer), where question answering refused it."""
    not_blank(value, what)
    if not shows(value):
        raise BlankInput(
            f"{what} is empty to a model: only control or format characters (zero-width "
            "spaces, NUL, a byte-order mark)"
        )
    return value


def shows(value: str) -> bool:
    """Whether `value` has a character other than whitespace, control and format ones."""
    # (stops at the first visible character: a real text's first, or close to it)
    return not all(unicodedata.category(char) in INVISIBLE or char.isspace() for char in value)


# Unicode's control and format characters: an encoder's tokenizer skips them (BERT's), or
# reads bytes that mean nothing to it
INVISIBLE = frozenset({"Cc", "Cf"})

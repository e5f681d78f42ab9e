"""Request bodies declared once: a `Body` names each field of a route's JSON object with a
`Field`, which holds both the JSON Schema of its values (for `/openapi.json`) and the
check that reads a value (400 saying what is wrong), as TEI declares a request type with
serde's `Deserialize` and utoipa's `ToSchema` on one struct. A handler reads its body
through the same `Body` that describes it, so the two cannot drift.

Unknown fields are refused (OpenAI's routes) or ignored (TEI's, as TEI ignores them);
`null` reads as absent. Fields are read when a handler asks for them, so a request's
refusals come in the order its handler meets them; each names its field (the `param` of
OpenAI's error object).

Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rawserve.api.routing import DocContext, Schema
from rawserve.http.errors import BadRequest, HTTPError, UnknownFields

# (field name, value (never None unless the field reads null), the route's context) → value
Reader = Callable[[str, Any, "DocContext | None"], Any]
MODEL_DESCRIPTION = (
    "The served model to use, by name (see GET /v1/models); with one model served, any name; "
    "none: the first that fits the route."
)


@dataclass(frozen=True)
class Field:
    """One field: the schema of its values, how a value is read, and its default."""

    schema: Schema | Callable[[DocContext], Schema]
    read: Reader | None = None  # None: taken as it is
    default: Any = None  # what an absent (or null) field reads as
    reads_null: bool = False  # the reader is given an absent field too (it says why it is needed)
    required: bool = False  # documented as required (the reader refuses it missing)
    description: str = ""

    def schema_in(self, context: DocContext) -> Schema:
        schema = self.schema(context) if callable(self.schema) else dict(self.schema)
        if self.default is not None:
            schema["default"] = self.default
        if self.description:
            schema["description"] = self.description
        return schema


@dataclass(frozen=True)
class Body:
    """A route's JSON object body: its fields (a "model" field is always one), and whether
    fields it does not name are ignored or refused."""

    fields: Mapping[str, Field]
    ignore_unknown: bool = False
    with_model: bool = True
    description: str = ""
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = (*self.fields, *(("model",) if self.with_model else ()))
        object.__setattr__(self, "names", names)

    def read(self, document: Any) -> Fields:
        """The body as fields to read; 400 when it is not an object or (where refused)
        has fields this body does not name."""
        return Fields(document, self)

    def schema(self, context: DocContext) -> Schema:
        properties = {name: spec.schema_in(context) for name, spec in self.fields.items()}
        if self.with_model:
            properties["model"] = MODEL.schema_in(context)
        schema: Schema = {
            **({"description": self.description} if self.description else {}),
            "type": "object",
            "required": [name for name, spec in self.fields.items() if spec.required],
            "properties": properties,
        }
        if not self.ignore_unknown:
            schema["additionalProperties"] = False
        return schema


class Fields:
    """A JSON object body, read field by field as its `Body` declares them."""

    def __init__(self, document: Any, body: Body):
        if not isinstance(document, dict):
            raise BadRequest("the JSON body must be an object")
        unknown = sorted(set(document) - set(body.names))
        if unknown and not body.ignore_unknown:
            names = ", ".join(repr(name)[:60] for name in unknown[:10])
            allowed = ", ".join(sorted(body.names))
            # (no param: OpenAI names none for an unknown field)
            raise UnknownFields(f"unknown field(s): {names} (allowed: {allowed})")
        self.document: dict[str, Any] = document
        self.body = body

    def get(self, name: str) -> Any:
        return self.document.get(name)

    def value(self, name: str, context: DocContext | None = None) -> Any:
        """The field `name` read as its `Body` declares it (its default when absent)."""
        spec = self.body.fields[name] if name != "model" else MODEL
        value = self.document.get(name)
        if value is None and not spec.reads_null:
            return spec.default
        if spec.read is None:
            return value
        try:
            return spec.read(name, value, context)
        except HTTPError as error:  # OpenAI's error object names the field at fault
            error.param = error.param or name
            raise


# --- the kinds of field ----------------------------------------------------------------


def read_boolean(name: str, value: Any, context: DocContext | None) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f'"{name}" must be true or false')
    return value


def read_integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f'"{name}" must be an integer from {low} to {high}')
    return value


def read_number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f'"{name}" must be a number')
    if not low <= value <= high:  # also refuses NaN
        raise BadRequest(f'"{name}" must be between {low} and {high}')
    return float(value)


def read_string(name: str, value: Any, context: DocContext | None) -> str:
    if not isinstance(value, str):
        raise BadRequest(f'"{name}" must be a string')
    return value


def read_choice(name: str, value: Any, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise BadRequest(f'"{name}" must be one of {", ".join(choices)}')
    return value


def flag(default: bool, description: str = "") -> Field:
    """true or false."""
    return Field({"type": ["boolean", "null"]}, read_boolean, default, description=description)


def whole(low: int, high: int, documented_high: Callable[[DocContext], int] | None = None) -> Field:
    """An integer from `low` to `high` (documented up to what the model takes, where that is
    known and less)."""

    def schema(context: DocContext) -> Schema:
        top = documented_high(context) if documented_high is not None else high
        return {"type": ["integer", "null"], "minimum": low, "maximum": top}

    return Field(schema, lambda name, value, _: read_integer(name, value, low, high))


def text(description: str = "") -> Field:
    """A string."""
    return Field({"type": ["string", "null"]}, read_string, description=description)


def one_of(choices: Sequence[str], default: str) -> Field:
    """One of `choices`, spelt as they are."""
    return Field(
        {"enum": [*choices, None]},
        lambda name, value, _: read_choice(name, value, choices),
        default,
    )


MODEL = text(MODEL_DESCRIPTION)


def texts_schema(context: DocContext) -> Schema:
    """One text, or a list of 1 to the input cap of them."""
    many = {"type": "array", "items": {"type": "string"}, "minItems": 1}
    return {"oneOf": [{"type": "string"}, {**many, "maxItems": context.max_inputs}]}


def item_name(name: str, index: int, count: int) -> str:
    """`name`, and which of `count` items it is where there are several: of a list of 32
    with one blank text, a refusal naming only its field left its client to guess."""
    return name if count == 1 else f"{name} at index {index}"


def names_after(first: str, name: str, count: int) -> list[str]:
    """What to call a field `first` and the `count` items of field `name` after it, where
    a route runs them as one list (/rerank's query and texts): index 0 is `name`'s own
    first, not the `first` field."""
    return [first, *(item_name(name, index, count) for index in range(count))]


def unicode_text(value: str, name: str = "the text") -> str:
    """`value`, refused when it cannot be UTF-8 (a lone surrogate from a JSON escape)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadRequest(f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return value

"""JSON schemas from the wild, compiled as the worker compiles them: annotations llguidance
could take for constraints, tools that share an `$id`, and faults said in the client's
terms (`rawserve.worker.grammars`, `rawserve.api.openai_tools`)."""

from __future__ import annotations

import functools
from typing import Any

import pytest


@functools.cache
def grammars() -> Any:
    from rawserve.worker.grammars import Grammars
    from tests.tiny_models import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    return Grammars(tokenizer, len(tokenizer))


def holds(grammar: dict[str, Any], text: str) -> bool:
    """Whether `grammar`, compiled as the worker compiles it, lets a model write `text`."""
    matcher = grammars().matcher(grammar)
    ids = grammars().hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def refusal(grammar: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as refused:
        grammars().matcher(grammar)
    return str(refused.value)


# the tester's: pydantic's `Annotated[Union[Text, Container], Field(discriminator="type")]`
# within the Container it is a child of
DISCRIMINATED = {
    "$defs": {
        "Text": {
            "type": "object",
            "properties": {"type": {"const": "text", "type": "string"}, "text": {"type": "string"}},
            "required": ["type", "text"],
        },
        "Container": {
            "type": "object",
            "properties": {
                "type": {"const": "container", "type": "string"},
                "children": {
                    "type": "array",
                    "items": {
                        "discriminator": {
                            "mapping": {"container": "#/$defs/Container", "text": "#/$defs/Text"},
                            "propertyName": "type",
                        },
                        "oneOf": [{"$ref": "#/$defs/Text"}, {"$ref": "#/$defs/Container"}],
                    },
                },
            },
            "required": ["type", "children"],
        },
    },
    "$ref": "#/$defs/Container",
}
NESTED = (
    '{"type": "container", "children": [{"type": "text", "text": "a"}, '
    '{"type": "container", "children": []}]}'
)


@pytest.mark.parametrize(
    "annotation",
    [
        {},
        {"deprecated": True},
        {"nullable": True},
        {"x-order": 1},
        {"externalDocs": {"url": "https://example.com"}},
        {"xml": {"name": "child"}},
        {"example": {"type": "text"}},
    ],
)
def test_annotations_beside_a_recursive_union_are_left_be(annotation):
    """pydantic writes `discriminator` (and `deprecated`) beside a union, OpenAPI
    `nullable`, `x-*`, `externalDocs`, `xml`: llguidance took each, beside a reference
    within a cycle, for a constraint, and refused the schema (422 "circular references
    with sibling keys"). They are annotations, as JSON Schema takes them: dropped."""
    schema: Any = DISCRIMINATED
    if annotation:
        container = schema["$defs"]["Container"]
        items = {**container["properties"]["children"]["items"], **annotation}
        children = {**container["properties"]["children"], "items": items}
        container = {**container, "properties": {**container["properties"], "children": children}}
        schema = {**schema, "$defs": {**schema["$defs"], "Container": container}}
    grammar = {"type": "json", "value": schema}
    assert holds(grammar, NESTED)
    assert not holds(grammar, '{"type": "container", "children": [{"type": "text"}]}')
    assert not holds(grammar, '{"type": "text", "text": "a"}')


def test_a_property_named_as_an_annotation_is_a_property():
    """Only a schema's own keys are annotations: a property named "discriminator" (or
    "nullable") is held to its schema, and data under `const` is as written."""
    listed = {"discriminator": {"type": "integer"}, "nullable": {"const": {"x-a": 1}}}
    schema = {"type": "object", "properties": listed, "required": ["discriminator", "nullable"]}
    grammar = {"type": "json", "value": schema}
    assert holds(grammar, '{"discriminator": 1, "nullable": {"x-a": 1}}')
    assert not holds(grammar, '{"discriminator": "a", "nullable": {"x-a": 1}}')
    assert not holds(grammar, '{"discriminator": 1, "nullable": {}}')

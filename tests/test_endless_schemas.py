"""Which JSON schemas no answer of finite length satisfies (rawserve.worker.endless_schemas)."""

import pytest

from rawserve.worker import endless_schemas
from rawserve.worker.endless_schemas import endless_part

NODE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}


def holding(name: str, kind: object = "object") -> dict:
    return {"type": kind, "properties": {name: {"$ref": f"#/$defs/{name}"}}, "required": [name]}


def held_by_each_other(b_type: object) -> dict:
    return {"$defs": {"a": holding("b"), "b": holding("a", b_type)}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    ("schema", "endless"),
    [
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, None),
        ({"$ref": "#"}, "#"),
        ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, "#/$defs/n"),
        # a linked list ends with null; a tree with a leaf of no children
        (
            {
                "anyOf": [
                    {"type": "null"},
                    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
                ]
            },
            None,
        ),
        (
            {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
            None,
        ),
        # ... but not where each node must hold at least one child
        (
            {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
                "required": ["kids"],
            },
            "#",
        ),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 1},
            None,
        ),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2},
            "#",
        ),
        # a part only an optional property reaches: the model may begin it, and never end
        (
            {"type": "array", "items": {"$ref": "#/$defs/n"}, "$defs": {"n": NODE}},
            "#/$defs/n",
        ),
        # two parts that hold each other; one that may be null ends them both
        (held_by_each_other("object"), "#/$defs/a"),
        (held_by_each_other(["object", "null"]), None),
        # a property named as a keyword is a property; an enum's value is data
        ({"type": "object", "properties": {"enum": {"$ref": "#"}}, "required": ["enum"]}, "#"),
        (
            {"type": "object", "properties": {"a": {"enum": [{"$ref": "#"}]}}, "required": ["a"]},
            None,
        ),
        # a JSON pointer's escapes; an anchor's name is not judged
        (
            {
                "$defs": {"a/b": NODE | {"properties": {"c": {"$ref": "#/$defs/a~1b"}}}},
                "$ref": "#/$defs/a~1b",
            },
            "#/$defs/a~1b",
        ),
        ({"$ref": "#top"}, None),
    ],
)
def test_a_part_whose_every_value_holds_another_of_itself_is_found(schema, endless):
    assert endless_part(schema) == endless


def test_a_reference_within_a_resource_is_to_that_resources_root():
    """A tool's parameters are a resource of their own (`$id`) inside the call's grammar:
    their "#/$defs/n" is theirs, not the whole grammar's."""
    parameters = {"$id": "urn:x:tool:f", "$defs": {"n": NODE}, "type": "object"}
    call = {"type": "object", "properties": {"arguments": parameters}, "required": ["arguments"]}
    assert endless_part({"anyOf": [call, {"type": "integer"}]}) is None  # (n: never asked)
    parameters = {**parameters, "properties": {"q": {"$ref": "#/$defs/n"}}, "required": ["q"]}
    call = {**call, "properties": {"arguments": parameters}}
    assert endless_part({"anyOf": [call, {"type": "integer"}]}) == "#/$defs/n"


def test_a_schema_past_the_work_allowed_is_not_judged(monkeypatch):
    """A long chain of parts, each ending only through the next, judged in a pass a part:
    past the budget the judgement is left to llguidance's own bounds, never slow."""
    chain = {
        f"d{i}": {
            "type": "object",
            "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["n"],
        }
        for i in range(100)
    }
    schema = {"$defs": {**chain, "d100": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    assert endless_part(schema) is None
    del schema["$defs"]["d100"]  # (the last now refers nowhere: not judged, taken as ending)
    schema["$defs"]["d99"]["properties"]["n"] = {"$ref": "#/$defs/d0"}
    assert endless_part(schema) == "#/$defs/d0"
    monkeypatch.setattr(endless_schemas, "BUDGET", 50)
    assert endless_part(schema) is None

"""A JSON schema as llguidance compiles it (and rawserve judges it): without annotations
llguidance could take for constraints, its counts integers, its objects closed.
"""

from __future__ import annotations

from typing import Any

from rawserve.worker.endless_schemas import DEFINITIONS, LISTED, NAMED

# the keywords whose value is a schema, a list of schemas, or schemas by name
SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "if", "then", "else")
SUBSCHEMA_LISTS = LISTED
SUBSCHEMA_MAPS = NAMED | DEFINITIONS
# what holds an object's keys beside its own properties: closed, one would refuse the other's
COMPOSING = {"allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "not"}
# JSON Schema's keywords (drafts 4 to 2020-12) that llguidance reads, implements or refuses
# by name; any other key of a schema is an annotation, as JSON Schema takes it (OpenAPI's
# and pydantic's `discriminator`, `nullable`, `example`, `externalDocs`, `xml`, `x-*`), and
# so are `deprecated` and `contentSchema`. llguidance ignores an annotation, but beside a
# reference within a cycle takes it for a constraint to intersect, and refused the schema
# ("circular references with sibling keys"): a recursive discriminated union of pydantic's
KEYWORDS = frozenset(
    {
        *("$schema", "$id", "id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor"),
        *("$recursiveRef", "$recursiveAnchor", "$vocabulary", "$comment", "$defs"),
        *("definitions", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"),
        *("dependentSchemas", "dependencies", "prefixItems", "items", "additionalItems"),
        *("contains", "properties", "patternProperties", "additionalProperties"),
        *("propertyNames", "unevaluatedItems", "unevaluatedProperties", "type", "enum"),
        *("const", "multipleOf", "maximum", "exclusiveMaximum", "minimum"),
        *("exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems"),
        *("uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties"),
        *("required", "dependentRequired", "title", "description", "default", "readOnly"),
        *("writeOnly", "examples", "format", "contentEncoding", "contentMediaType"),
    }
)
# the keywords whose value is a count: an integer, which JSON may write as 1.0
COUNTS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
    | {"minContains", "maxContains"}
)
OPTIONS = "x-guidance"  # llguidance's own, at the root: how the JSON is laid out
# the keywords whose values are schemas, for the walk that drops annotations (all of them:
# what is under "not" too)
EVERY_ONE = frozenset(
    {*SUBSCHEMA, "not", "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
)
EVERY_MAP = SUBSCHEMA_MAPS | {"dependencies"}  # (an older draft's: schemas, or lists of names)


def compilable(schema: Any) -> Any:
    """`schema` as it is compiled (and judged): without annotations llguidance could take
    for constraints (`KEYWORDS`), its objects closed (`closed_objects`)."""
    bare = without_annotations(schema)
    if isinstance(schema, dict) and OPTIONS in schema:
        bare[OPTIONS] = schema[OPTIONS]
    return closed_objects(bare)


def without_annotations(schema: Any) -> Any:
    """`schema` without the keys of its subschemas that are not JSON Schema's keywords
    (nor `deprecated`, `contentSchema`); a property's name is a name, whatever it is
    (a property named "discriminator" stays), and data (`const`, `enum`) is as written.
    A count written as an integral float (`"minItems": 1.0`) is that integer."""
    if not isinstance(schema, dict):
        return schema
    bare = {key: value for key, value in schema.items() if key in KEYWORDS}
    for keyword in COUNTS & bare.keys():  # (JSON's 1.0 is 1; llguidance refused it)
        if isinstance(bare[keyword], float) and bare[keyword].is_integer():
            bare[keyword] = int(bare[keyword])
    for keyword in EVERY_ONE & bare.keys():
        bare[keyword] = without_annotations(bare[keyword])
    for keyword in SUBSCHEMA_LISTS & bare.keys():
        if isinstance(bare[keyword], list):
            bare[keyword] = [without_annotations(each) for each in bare[keyword]]
    for keyword in EVERY_MAP & bare.keys():
        if isinstance(bare[keyword], dict):
            named = bare[keyword].items()
            bare[keyword] = {name: without_annotations(each) for name, each in named}
    return bare


def closed_objects(schema: Any) -> Any:
    """`schema` with each object that lists its properties and leaves `additionalProperties`
    unstated taking those alone, as xgrammar (vLLM's default) and outlines (TGI's) generate
    it; llguidance follows JSON Schema, which lets other keys in: a model wrote keys of its
    own into a call's arguments, which the function called with them refuses. What states
    `additionalProperties` (or `unevaluatedProperties`) is held to what it says, an object
    that requires a key it does not list stays open, and so does a schema that composes an
    object of several (properties beside an anyOf or a $ref, an allOf of two): as written."""
    return schema if composes(schema) else closed(schema)


def composes(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if "properties" in schema and COMPOSING & schema.keys():
        return True
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return True
    return any(composes(each) for each in subschemas(schema))


def subschemas(schema: dict[str, Any]) -> list[Any]:
    found = [schema.get(keyword) for keyword in SUBSCHEMA]
    found += [
        each for k in SUBSCHEMA_LISTS if isinstance(schema.get(k), list) for each in schema[k]
    ]
    found += [
        each
        for k in SUBSCHEMA_MAPS
        if isinstance(schema.get(k), dict)
        for each in schema[k].values()
    ]
    return [each for each in found if isinstance(each, dict)]


def closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)  # (what is under "not" is left as written: closed, it would open)
    for keyword in SUBSCHEMA:
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = closed(schema[keyword])
    for keyword in SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            schema[keyword] = [closed(each) for each in schema[keyword]]
    for keyword in SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = {name: closed(each) for name, each in schema[keyword].items()}
    listed = schema.get("properties")
    required = schema.get("required", [])
    if (
        isinstance(listed, dict)
        and not {"additionalProperties", "unevaluatedProperties"} & schema.keys()
        and isinstance(required, list)
        and all(isinstance(key, str) and key in listed for key in required)
    ):
        schema["additionalProperties"] = False
    return schema

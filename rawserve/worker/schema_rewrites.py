"""A JSON schema as llguidance compiles it (and rawserve judges it): without annotations
llguidance could take for constraints, its counts integers, its objects closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from rawserve.worker.endless_schemas import DEFINITIONS, LISTED, NAMED
from rawserve.worker.schema_references import begins_resource

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
        *("required", "dependentRequired", "title", "description", "readOnly"),
        *("writeOnly", "format", "contentEncoding", "contentMediaType"),
    }
)
# (`default` and `examples`, which llguidance names too, are annotations dropped: a value
# in them, any JSON, can be one it cannot take, an integer past 64 bits, and a tool's
# `default` refused the whole request even with tool_choice "auto")
# the keywords whose value is a count: an integer, which JSON may write as 1.0
COUNTS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
    | {"minContains", "maxContains"}
)
# the keywords whose values are schemas, for the walk that drops annotations (all of them:
# what is under "not" too)
EVERY_ONE = frozenset(
    {*SUBSCHEMA, "not", "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
)
EVERY_MAP = SUBSCHEMA_MAPS | {"dependencies"}  # (an older draft's: schemas, or lists of names)


@dataclass
class Pointed:
    """Where the schema's JSON pointers lead from a resource's root, step by step: a key
    that is no keyword stays where a pointer passes through it (OpenAPI's
    "#/components/schemas/Pet", "#/x-defs/A"), and what it ends at is a schema."""

    steps: dict[str, Pointed] = field(default_factory=dict)
    ends: bool = False

    def step(self, key: str | int) -> Pointed:
        return self.steps.get(str(key), NOWHERE)


NOWHERE = Pointed()


def pointed(schema: Any) -> Pointed:
    """The steps of every JSON pointer a `$ref` in `schema` gives (its fragment), from the
    root of a resource (taken together: any resource's keeps a key any pointer names). A
    walk of its own: a schema nests thousands deep."""
    root = Pointed()
    waiting = [schema]
    while waiting:
        part = waiting.pop()
        if isinstance(part, list):
            waiting += part
        elif isinstance(part, dict):
            reference = part.get("$ref")
            if isinstance(reference, str) and "#/" in reference:
                here = root
                for step in unquote(reference.partition("#")[2]).split("/")[1:]:
                    here = here.steps.setdefault(
                        step.replace("~1", "/").replace("~0", "~"), Pointed()
                    )
                here.ends = True
            waiting += part.values()
    return root


def compilable(schema: Any) -> Any:
    """`schema` as it is compiled (and judged): without annotations llguidance could take
    for constraints (`KEYWORDS`), read one way by llguidance and the judgement (`Reading`),
    its objects closed (`closed_objects`)."""
    reading = Reading(pointed(schema), siblings_ignored(schema))
    # (llguidance's own "x-guidance" at the root is an annotation too: its separators
    # made an answer that is no JSON, its "lenient" a "not" unheld)
    return closed_objects(without_annotations(schema, reading))


# The dialects llguidance reads by name (drafts 3 to 2020-12), each in one spelling: its
# drafts 3 to 7 under http, 2019-09 and 2020-12 under https. Another, such as OpenAPI
# 3.1's, json-schema.org's unversioned "schema#", or a draft under the other scheme, it
# took for a document to fetch and refused as a $ref outside the schema: a draft is read
# in its spelling, any other as the latest draft, as xgrammar reads any.
DRAFT = re.compile(
    r"^https?://json-schema\.org/(draft-0[3467]/schema|draft/20(?:19-09|20-12)/schema)#?$"
)


def dialect(declared: Any) -> str | None:
    """A root `$schema` as llguidance names its draft; None for none, or one it does not
    name (read as the latest draft)."""
    found = DRAFT.match(declared) if isinstance(declared, str) else None
    if found is None:
        return None
    scheme = "http" if found[1].startswith("draft-0") else "https"
    return f"{scheme}://json-schema.org/{found[1]}{'#' if declared.endswith('#') else ''}"


def siblings_ignored(schema: Any) -> bool:
    """Whether the schema's draft (its root's `$schema`: 3, 4, 6 or 7) makes a `$ref`'s
    siblings ignored, as llguidance reads them."""
    declared = dialect(schema.get("$schema")) if isinstance(schema, dict) else None
    return declared is not None and declared.startswith("http://json-schema.org/draft-0")


@dataclass(frozen=True)
class Reading:
    """What the walk that drops annotations knows of the whole schema: where its JSON
    pointers lead (`root`), and whether its draft ignores a `$ref`'s siblings."""

    root: Pointed
    siblings_ignored: bool


def without_annotations(schema: Any, reading: Reading, here: Pointed | None = None) -> Any:
    """`schema` without the keys of its subschemas that are not JSON Schema's keywords
    (nor `deprecated`, `contentSchema`), but for those a JSON pointer passes through
    (`reading.root`: the steps of them all from a resource's root, `here`: from `schema`;
    None: `schema` is the root), whose schemas it leads to lose theirs; a property's name
    is a name, whatever it is (a property named "discriminator" stays), and data (`const`,
    `enum`) is as written. A count written as an integral float (`"minItems": 1.0`) is
    that integer.

    So that llguidance and the judgement read it alike, a `$schema` below the root is
    dropped (llguidance read a nested one's draft, the judgement the root's: a draft 4
    part's `id`s, which the judgement did not take for resources, led llguidance down a
    chain of 1,000), and, where the draft ignores a `$ref`'s siblings, an `$id` beside a
    `$ref` (llguidance ignores it there; the judgement took it for a resource's, judged a
    short part, and llguidance followed a chain of 1,000 from the root: SIGSEGV)."""
    if not isinstance(schema, dict):
        return schema
    nested = here is not None
    root = reading.root
    here = root if here is None or begins_resource(schema) else here
    bare = {key: value for key, value in schema.items() if key in KEYWORDS}
    declared = None if nested else dialect(bare.get("$schema"))
    if declared is None:  # (a nested one, or one llguidance does not name)
        bare.pop("$schema", None)
    else:
        bare["$schema"] = declared
    if reading.siblings_ignored and "$ref" in bare:
        for keyword in ("$id", "id"):  # (an anchor's `"$id": "#name"` it reads still)
            if isinstance(bare.get(keyword), str) and not bare[keyword].startswith("#"):
                del bare[keyword]
    for key in (here.steps.keys() & schema.keys()) - KEYWORDS:  # (pointed into: kept)
        bare[key] = pointed_part(schema[key], reading, here.steps[key])
    for keyword in COUNTS & bare.keys():  # (JSON's 1.0 is 1; llguidance refused it)
        if isinstance(bare[keyword], float) and bare[keyword].is_integer():
            bare[keyword] = int(bare[keyword])
    for keyword in EVERY_ONE & bare.keys():
        bare[keyword] = without_annotations(bare[keyword], reading, here.step(keyword))
    for keyword in SUBSCHEMA_LISTS & bare.keys():
        if isinstance(bare[keyword], list):
            steps = here.step(keyword)
            listed = enumerate(bare[keyword])
            bare[keyword] = [
                without_annotations(each, reading, steps.step(i)) for i, each in listed
            ]
    for keyword in EVERY_MAP & bare.keys():
        if isinstance(bare[keyword], dict):
            steps = here.step(keyword)
            named = bare[keyword].items()
            bare[keyword] = {
                name: without_annotations(each, reading, steps.step(name)) for name, each in named
            }
    return bare


def pointed_part(part: Any, reading: Reading, here: Pointed) -> Any:
    """What a key no keyword names holds, a JSON pointer passing through it: a schema
    where one ends (without its annotations), else only what the pointers pass through."""
    if here.ends:
        return without_annotations(part, reading, here)
    if isinstance(part, dict):
        return {
            key: pointed_part(part[key], reading, here.steps[key])
            for key in here.steps.keys() & part.keys()
        }
    if isinstance(part, list):
        return [pointed_part(each, reading, here.step(i)) for i, each in enumerate(part)]
    return part


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
    found += [value for key, value in schema.items() if kept_for_pointers(key)]
    return [each for each in found if isinstance(each, dict)]


def kept_for_pointers(key: str) -> bool:
    """Whether a key of a schema as compiled is one kept as a JSON pointer passes
    through it: after `without_annotations`, any but a keyword."""
    return key not in KEYWORDS


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
    for key, value in schema.items():  # (what a pointer leads to, as "$defs" holds it)
        if kept_for_pointers(key) and isinstance(value, dict):
            schema[key] = closed(value)
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

"""Which JSON schemas a grammar cannot hold an answer to: those no answer of finite length
satisfies, and those whose references nest too deep (rawserve.worker.endless_schemas)."""

import re

import pytest

from rawserve.tasks.text_generation import TOOL_RESOURCE
from rawserve.worker import endless_schemas, schema_chains
from rawserve.worker.endless_schemas import MOST_NESTED_LEVELS, schema_fault


def endless_part(schema: object) -> str | None:
    """The reference to the part the fault names ("#": the whole schema); None: none."""
    fault = schema_fault(schema)
    if fault is None:
        return None
    named = re.match(r'no answer can complete it: (?:"(.*?)" in )?the schema has no', fault.words)
    assert named is not None, fault.words
    return named[1] or "#"


def chain(length: int, required: bool = True, last: object = None) -> dict:
    """$defs d0 .. d{length-1}, each referring to the next (the last to `last`'s, or to
    d0: a cycle)."""
    parts = {
        f"d{i}": {
            "type": "object",
            "properties": {"n": {"$ref": f"#/$defs/d{i + 1 if i + 1 < length else 'end'}"}},
            **({"required": ["n"]} if required else {}),
        }
        for i in range(length)
    }
    parts["dend"] = last if last is not None else {"$ref": "#/$defs/d0"}
    return {"$defs": parts, "$ref": "#/$defs/d0"}


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
        # a JSON pointer's escapes
        (
            {
                "$defs": {"a/b": NODE | {"properties": {"c": {"$ref": "#/$defs/a~1b"}}}},
                "$ref": "#/$defs/a~1b",
            },
            "#/$defs/a~1b",
        ),
        # a property required and held by the additional properties' or a pattern's schema
        ({"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}}, "#"),
        (
            {
                "type": "object",
                "required": ["x"],
                "patternProperties": {"^x$": {"$ref": "#"}},
                "additionalProperties": False,
            },
            "#",
        ),
        ({"type": "object", "required": ["y"], "patternProperties": {"^x$": {"$ref": "#"}}}, None),
        # an older draft's fragment "$id" names a part: its "#" is still the whole schema's
        (
            {
                "type": ["object", "null"],
                "properties": {
                    "child": {
                        "$id": "#/properties/child",
                        "type": "object",
                        "properties": {"inner": {"$ref": "#"}},
                        "required": ["inner"],
                    }
                },
                "required": ["child"],
            },
            None,
        ),
    ],
)
def test_a_part_whose_every_value_holds_another_of_itself_is_found(schema, endless):
    assert endless_part(schema) == endless


def test_a_reference_within_a_resource_is_to_that_resources_root():
    """A tool's parameters are a resource of their own (`$id`) inside the call's grammar:
    their "#/$defs/n" is theirs, not the whole grammar's."""
    parameters = {"$id": TOOL_RESOURCE + "bad", "$defs": {"n": NODE}, "type": "object"}
    call = {"type": "object", "properties": {"arguments": parameters}, "required": ["arguments"]}
    assert schema_fault({"anyOf": [call, {"type": "integer"}]}) is None  # (n: never asked)
    parameters = {**parameters, "properties": {"q": {"$ref": "#/$defs/n"}}, "required": ["q"]}
    call = {**call, "properties": {"arguments": parameters}}
    fault = schema_fault({"anyOf": [call, {"type": "integer"}]})
    assert fault is not None  # named as the function's (several tools: which one)
    assert "\"#/$defs/n\" in the parameters' schema of function 'bad' has no" in fault.words


def spelled_chain(length: int, root_id: str | None, refer: str, ids: str | None = None) -> dict:
    """A chain of `length` $defs each referring to the next as `refer` spells it ("{n}":
    the next's name), the root's `$id` `root_id`, each part's `$id` as `ids` spells it."""
    parts = {
        f"d{i}": {
            **({"$id": ids.format(n=f"d{i}")} if ids else {}),
            "type": "object",
            "properties": {"n": {"$ref": refer.format(n=f"d{i + 1}")}},
        }
        for i in range(length)
    }
    parts[f"d{length}"] = {
        **({"$id": ids.format(n=f"d{length}")} if ids else {}),
        "type": "integer",
    }
    schema = {"$defs": parts, "$ref": refer.format(n="d0")}
    return schema if root_id is None else {"$id": root_id, **schema}


@pytest.mark.parametrize(
    ("root_id", "refer", "ids"),
    [
        ("http://example.com/root.json#", "http://example.com/root.json#/$defs/{n}", None),
        ("http://example.com/root.json#", "root.json#/$defs/{n}", None),
        (None, "json-schema:///#/$defs/{n}", None),
        (None, "/#/$defs/{n}", None),
        ("https://example.com/root", "HTTPS://EXAMPLE.com/root#/$defs/{n}", None),
        ("https://example.com/root", "https://example.com/x/../root#/$defs/{n}", None),
        ("https://example.com/root", "https://example.com/r%6Fot#/$defs/{n}", None),
        (None, "{n}.json", "./{n}.json"),
    ],
)
def test_references_are_followed_as_llguidance_follows_them(root_id, refer, ids):
    """A tester's: references llguidance follows and the judgement did not (it compared
    URIs as written, against no base), a chain of 1,000 accepted unjudged, then SIGSEGV.
    They are resolved as llguidance resolves them (against json-schema:///, normalised, a
    root `$id` without its "#"), judged, and the deep ones refused."""
    assert schema_fault(spelled_chain(20, root_id, refer, ids)) is None
    fault = schema_fault(spelled_chain(1000, root_id, refer, ids))
    assert fault is not None and "its subschemas nest" in fault.words, fault


def test_draft_4s_id_names_a_resource_where_the_schema_is_draft_4s():
    """llguidance takes draft 4's `id` for `$id` where `$schema` names draft 4: a chain of
    references by it is followed (and one of 1,000 refused), a short one accepted."""
    draft4 = "http://json-schema.org/draft-04/schema#"

    def draft4_chain(length: int) -> dict:
        schema = spelled_chain(length, "http://example.com/root.json", "root.json#/definitions/{n}")
        schema["definitions"] = schema.pop("$defs")
        return {"$schema": draft4, "id": schema.pop("$id"), **schema}

    assert schema_fault(draft4_chain(20)) is None
    fault = schema_fault(draft4_chain(1000))
    assert fault is not None and "its subschemas nest" in fault.words, fault
    sub = {"id": "sub.json", "definitions": {"x": {"type": "integer"}}}
    nested = {"$schema": draft4, "id": "http://example.com/root.json", "definitions": {"s": sub}}
    assert schema_fault({**nested, "$ref": "http://example.com/sub.json#/definitions/x"}) is None


@pytest.mark.parametrize(
    "reference",
    [
        "#top",  # no such anchor
        "#/$defs/nowhere",
        "https://example.com/other.json#/$defs/d1",
        "file:///etc/passwd",
        "urn:example:elsewhere#/$defs/d1",
    ],
)
def test_a_reference_the_judgement_cannot_follow_is_refused(reference):
    """What the judgement cannot follow may be what llguidance follows (and a chain of them
    took the worker down): never accepted unjudged, refused in the client's words."""
    schema = {"$id": "https://example.com/root.json", "$defs": {"d1": NODE}, "$ref": reference}
    fault = schema_fault(schema)
    assert fault is not None, reference
    assert fault.words == (
        f"the schema refers to {reference!r}, outside it: a $ref is followed only within "
        "the schema (a JSON pointer, an anchor, or an $id it gives)"
    )
    parameters = {"$id": TOOL_RESOURCE + "f", "properties": {"q": {"$ref": reference}}}
    fault = schema_fault({"type": "object", "properties": {"arguments": parameters}})
    assert fault is not None and fault.words.startswith(
        f"the parameters' schema of function 'f' refers to {reference!r}"
    )


def test_a_schema_past_the_work_allowed_is_refused_as_too_large_to_judge(monkeypatch):
    """A long chain of parts, each ending only through the next, judged in a pass a part.
    Past the budget the schema was left unjudged, to llguidance: a deep chain padded with
    200,000 zeros under a keyword of the client's own took the worker down. Only JSON
    Schema's keywords are walked, and what is past the budget is refused."""
    assert schema_fault(chain(100, last={"type": "integer"})) is None
    assert endless_part(chain(100)) == "#/$defs/d0"  # (a cycle that never ends)
    padded = {**chain(1000, last={"type": "integer"}), "x-pad": [0] * 200_000}
    fault = schema_fault(padded)
    assert fault is not None and "nest 2,00" in fault.words, fault
    monkeypatch.setattr(endless_schemas, "BUDGET", 50)
    fault = schema_fault(chain(100))
    assert fault is not None and fault.words.startswith("the schema is too large to judge")


def wrapped(schema: dict, levels: int) -> dict:
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("required", [True, False])
def test_references_nested_past_what_llguidance_follows_are_refused(required):
    """llguidance compiles a reference's target within its referrer's: a chain of 1,000
    (two levels each) overflowed its stack and took the worker down (SIGSEGV), and so did
    250 of twenty levels each, or a cycle as long. Within the bound a chain or a cycle is
    judged as any other schema."""
    most = MOST_NESTED_LEVELS
    ending = {"type": "integer"}
    assert schema_fault(chain(most // 2 - 10, required, last=ending)) is None
    for deep in (chain(most // 2 + 10, required, last=ending), chain(3000, required, ending)):
        fault = schema_fault(deep)
        assert fault is not None and "its subschemas nest" in fault.words, fault
    fault = schema_fault(chain(most // 2 + 10, required))  # (a cycle: its last to its first)
    assert fault is not None and "its subschemas nest" in fault.words, fault
    # fewer references, each part deeper (the levels of each part counted)
    parts = {f"d{i}": wrapped({"$ref": f"#/$defs/d{i + 1}"}, 20) for i in range(30)}
    deeper = {"$defs": {**parts, "d30": ending}, "$ref": "#/$defs/d0"}
    fault = schema_fault(deeper)
    assert fault is not None and "its subschemas nest" in fault.words, fault
    parts = {f"d{i}": wrapped({"$ref": f"#/$defs/d{i + 1}"}, 5) for i in range(30)}
    assert schema_fault({"$defs": {**parts, "d30": ending}, "$ref": "#/$defs/d0"}) is None
    # many parts side by side, each referred to once from the root: not nested
    wide = {"$defs": {f"d{i}": {"type": "integer"} for i in range(3 * most)}}
    wide["properties"] = {f"p{i}": {"$ref": f"#/$defs/d{i}"} for i in range(3 * most)}
    assert schema_fault(wide) is None


def test_references_nesting_exactly_the_levels_followed_are_taken_and_one_more_is_not():
    """The bound is the most levels llguidance is let follow ("at most 512 are followed"):
    a chain nesting exactly that many is judged as any other schema, not refused."""
    most, ending = MOST_NESTED_LEVELS, {"type": "integer"}
    exactly = chain(most // 2 - 1, last=ending)  # two levels a part, and the root's
    assert schema_fault(exactly) is None
    fault = schema_fault(chain(most // 2 - 1, last=wrapped(ending, 1)))
    assert fault is not None and f"nest {most + 1:,} levels deep" in fault.words, fault


def one_union_of_node_types(types: int) -> dict:
    """pydantic's `Node = TypeAliasType("Node", Union[Node0, ..., NodeN])`, each node type
    {kind, value, children: Optional[list[Node]]}: one definition every type refers back to."""
    children = {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/Node"}}, {"type": "null"}]}
    parts = {
        f"Node{i}": {
            "type": "object",
            "properties": {
                "kind": {"const": f"Node{i}", "type": "string"},
                "value": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
                "children": {**children, "default": None},
            },
            "required": ["kind"],
        }
        for i in range(types)
    }
    parts["Node"] = {"anyOf": [{"$ref": f"#/$defs/Node{i}"} for i in range(types)]}
    properties = {"root": {"$ref": "#/$defs/Node"}}
    return {"$defs": parts, "type": "object", "properties": properties, "required": ["root"]}


@pytest.mark.parametrize("types", [130, 1000])
def test_a_union_every_node_type_refers_back_to_nests_one_type_deep(types):
    """llguidance compiles a target within its referrer's only the first time it meets it:
    under the union, one node type, and the union again already met. The bound summed the
    whole cycle (131 types: "nest 524 levels deep") though llguidance compiles 1,000 types
    in 0.2 s; a chain as long still nests (test above)."""
    import llguidance

    from rawserve.worker.grammars import grammar_text

    schema = one_union_of_node_types(types)
    assert schema_fault(schema) is None
    text = grammar_text({"type": "json", "value": schema})
    assert llguidance.LLMatcher.validate_grammar(text) == ""


def test_the_bound_on_nesting_is_never_below_the_longest_chain_met_once(monkeypatch):
    """The bound `too_deep` takes (hubs of a cycle once each) against every chain of
    references that meets no part twice, on small graphs of every shape: never below."""
    import random

    monkeypatch.setattr(schema_chains, "MOST_NESTED_LEVELS", 0)  # (always looked into)
    chosen = random.Random(7)
    for _ in range(3000):
        nodes = [(), *((f"d{i}",) for i in range(chosen.randint(1, 7)))]
        dense = chosen.random()
        refers = {a: [b for b in nodes[1:] if chosen.random() < dense] for a in nodes}
        levels = {node: chosen.randint(1, 5) for node in nodes}

        def longest_met_once(node, met, levels=levels, refers=refers):
            below = [longest_met_once(t, met | {t}) for t in refers[node] if t not in met]
            return levels[node] + max(below, default=0)

        bound = schema_chains.longest_chain(refers, levels, lambda: None)
        assert bound >= longest_met_once((), {()}), (refers, levels)


def test_a_chain_listed_from_its_root_is_judged_in_work_linear_in_its_size():
    """150 parts of 20 required integers, each requiring the next (the last a string),
    all listed from the root: judged again in full until nothing changed, the judgement
    took more than 200,000 steps ("too large to judge") for ~3,300 parts."""
    parts = {}
    for i in range(150):
        listed = {f"f{j}": {"type": "integer"} for j in range(20)}
        listed["next"] = {"$ref": f"#/$defs/d{i + 1}" if i < 149 else "#/$defs/leaf"}
        parts[f"d{i}"] = {"type": "object", "properties": listed, "required": list(listed)}
    parts["leaf"] = {"type": "string"}
    listed = {f"p{i}": {"$ref": f"#/$defs/d{i}"} for i in range(150)}
    schema = {"type": "object", "$defs": parts, "properties": listed}
    judgement = endless_schemas.Judgement(schema)
    assert judgement.endless() is None
    assert endless_schemas.BUDGET - judgement.left < 20_000  # (~3,300 parts, twice or so)


URI = "https://example.com/t"


@pytest.mark.parametrize(
    ("schema", "endless"),
    [
        # a $ref beside what it adds: its target's property required there
        (
            {
                "$defs": {
                    "N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/M"}}},
                    "M": {"$ref": "#/$defs/N", "required": ["next"]},
                },
                "$ref": "#/$defs/M",
            },
            "#/$defs/M",
        ),
        # required across an allOf's parts, or by one it refers to
        (
            {
                "type": "object",
                "allOf": [{"properties": {"a": {"$ref": "#"}}}, {"required": ["a"]}],
            },
            "#",
        ),
        (
            {
                "$defs": {"Req": {"required": ["child"]}},
                "type": "object",
                "properties": {"child": {"$ref": "#"}},
                "allOf": [{"$ref": "#/$defs/Req"}],
            },
            "#",
        ),
        # ... but not where the allOf's required property may be null
        (
            {
                "type": "object",
                "allOf": [
                    {"properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
                    {"required": ["a"]},
                ],
            },
            None,
        ),
        # an anchor; a full URI to the root's `$id`; one relative to it
        (
            {
                "$defs": {"N": {"$anchor": "node", **NODE, "properties": {"c": {"$ref": "#node"}}}},
                "$ref": "#node",
            },
            "#node",
        ),
        ({"$id": URI, **NODE, "properties": {"c": {"$ref": URI}}}, URI),
        (
            {
                "$id": URI,
                "$defs": {"n": {"$id": "node", **NODE, "properties": {"c": {"$ref": "node"}}}},
                "$ref": "node",
            },
            "node",
        ),
        # at least one property, and only one that never ends; or another that may
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#"}},
                "minProperties": 1,
                "additionalProperties": False,
            },
            "#",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#"}, "b": {"type": "integer"}},
                "minProperties": 1,
                "additionalProperties": False,
            },
            None,
        ),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "minProperties": 1}, None),
        # a count written as an integral float is that count
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1.0}, "#"),
    ],
)
def test_a_part_held_to_more_than_itself_is_judged_with_it(schema, endless):
    """Each streamed '{' then failed ("a step of the grammar needs more work than
    allowed"): what a part is held to besides its own keys (a $ref's target, an allOf's
    parts), an anchor's or a URI's target, a least number of properties."""
    assert endless_part(schema) == endless


def unions_of_node_types(unions: int, types: int) -> dict:
    """A syntax tree's: `unions` recursive unions (Stmt, Expr, Decl...), each of `types`
    node types that refer back to their own union and to another (each in turn)."""
    parts: dict = {}
    for u in range(unions):
        for t in range(types):
            properties = {
                "kind": {"const": f"U{u}T{t}"},
                "left": {"$ref": f"#/$defs/U{(u + t) % unions}"},
                "items": {"type": "array", "items": {"$ref": f"#/$defs/U{u}"}},
            }
            parts[f"U{u}T{t}"] = {"type": "object", "properties": properties, "required": ["kind"]}
        parts[f"U{u}"] = {"anyOf": [{"$ref": f"#/$defs/U{u}T{t}"} for t in range(types)]}
    return {"$defs": parts, "$ref": "#/$defs/U0"}


def test_several_recursive_unions_nest_a_node_type_each_between_them():
    """A tester's: five recursive unions of 40 node types each (about 30 levels as
    llguidance nests them, 0.04 s to compile) were refused as 'nest 611 levels': taking
    out four hubs left cycles, and the whole was counted. Eight are taken out."""
    assert schema_fault(unions_of_node_types(5, 40)) is None
    assert schema_fault(unions_of_node_types(8, 40)) is None


@pytest.mark.parametrize(
    "schema",
    [
        {
            "$defs": {"A": {"type": "integer", "allOf": [{"type": "number", "minimum": 0}]}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/A"}},
            "required": ["a"],
        },
        {"$defs": {"Num": {"type": "number"}}, "$ref": "#/$defs/Num", "type": "integer"},
        {"$defs": {"S": {"type": "string"}}, "$ref": "#/$defs/S", "type": "integer"},
    ],
)
def test_a_part_whose_types_meet_in_none_or_in_an_integer_is_not_called_endless(schema):
    """A reviewer's: an integer held to a number beside it (an integer is one) was refused
    as 'no value of finite length'; no type in common is no value at all, endless or not
    (llguidance's to refuse), never 'each value of it must hold another'."""
    assert schema_fault(schema) is None


def test_a_clients_pattern_is_matched_within_a_bound_and_in_unicode_classes():
    """`re` backtracked on `^(a|aa)+$` against a required name of 60 a's and '!': the
    judgement held the worker's thread for minutes (a reviewer's: killed as hung twice).
    Patterns are matched with a time bound (past it: not judged), and `\\p{L}`, which `re`
    cannot read, is read: its endless part is judged."""
    import time

    slow = {
        "type": "object",
        "required": ["a" * 60 + "!"],
        "patternProperties": {"^(a|aa)+$": {"$ref": "#"}},
    }
    began = time.monotonic()
    schema_fault(slow)
    assert time.monotonic() - began < 5
    lettered = {
        "type": "object",
        "required": ["x"],
        "patternProperties": {"^\\p{L}$": {"$ref": "#"}},
        "additionalProperties": False,
    }
    assert endless_part(lettered) == "#"


def test_the_time_for_patterns_runs_from_the_first_match_not_from_the_start(monkeypatch):
    """A tester's 570 KB schema: an endless part held by a pattern, beside a definition
    padded to take longer to walk than the patterns' time: counted from the judgement's
    start, the time was spent before the first match, and the part went unjudged (a 200
    stream, then an error event, 4 times in 5)."""
    monkeypatch.setattr(endless_schemas, "PATTERN_SECONDS", 0.01)
    schema = {
        "$defs": {
            "A": {
                "type": "object",
                "required": ["x"],
                "patternProperties": {"^x$": {"$ref": "#/$defs/A"}},
                "additionalProperties": False,
            },
            "padding": {"anyOf": [{}] * 90_000},  # (walked for $ids and anchors)
        },
        "$ref": "#/$defs/A",
    }
    assert endless_part(schema) == "#/$defs/A"

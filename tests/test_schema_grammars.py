"""JSON schemas from the wild, compiled as the worker compiles them: annotations llguidance
could take for constraints, tools that share an `$id`, and faults said in the client's
terms (`rawserve.worker.grammars`, `rawserve.api.openai_tools`)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from rawserve.api.openai_tools import Tools


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


def test_llguidances_own_options_in_a_schema_are_an_annotation():
    """A root "x-guidance" is an `x-` key as any other: its separators wrote answers that
    are no JSON (`{"a" = 1}`, finish_reason "stop"), its "lenient" left a "not" unheld."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    laid_out = {**schema, "x-guidance": {"key_separator": " = ", "whitespace_flexible": True}}
    assert holds({"type": "json", "value": laid_out}, '{"a": 1}')
    assert not holds({"type": "json", "value": laid_out}, '{"a" = 1}')
    assert not holds({"type": "json", "value": laid_out}, '{"a":\n\n 1}')
    lenient = {"type": "string", "not": {"const": "z"}, "x-guidance": {"lenient": True}}
    assert "not" in refusal({"type": "json", "value": lenient})


def test_an_annotations_value_past_64_bits_is_no_fault():
    """`default` and `examples` hold any JSON, which llguidance was given and could not
    take: a tool's `"default": 10**29` refused its whole chat request, tool_choice "auto"."""
    big = 123456789012345678901234567890
    schema = {"type": "object", "properties": {"a": {"type": "integer", "default": big}}}
    annotated = {**schema, "examples": [{"a": big}], "required": ["a"]}
    assert holds({"type": "json", "value": annotated}, '{"a": 7}')
    assert not holds({"type": "json", "value": annotated}, '{"a": "7"}')
    # a constraint past 64 bits is still said, as one
    bounded = {"type": "integer", "maximum": big}
    assert "past 64 bits" in refusal({"type": "json", "value": bounded})


@pytest.mark.parametrize(
    ("pattern", "taken", "refused"),
    [
        (r"\d{4}", "2026", "\u0661\u0662\u0663\u0664"),  # not Arabic-Indic digits
        (r"\w+", "ab_9", "\u00e9t\u00e9"),
        (r"\s", "\t", "\u3000"),
        (r"[\d_]+", "1_2", "\u0661"),  # within a class too
        (r"[^\d]+", "\u0661\u00e9", "5"),
        (r"\D\W\S", "\u0661\u00e9\u00e9", "1a "),
        (r"\\d", "\\d", "5"),  # an escaped backslash and a d
        (r"\p{Nd}", "\u0661", "a"),  # Unicode's, asked by name
        (r"(?x) a \s b", "a b", "a\u3000b"),  # verbose: the class's space is no blank
        (r"(?x) a \S b", "a\u00e9b", "a b"),
        (r"(?i)\w{2}", "kS", "\u212a\u017f"),  # (?i) folds k and s to Kelvin and long s
        (r"(?i)\W", "\u212a", "k"),
        (r"[]\d]+", "]1", "a"),  # a "]" first in a class is a character
        (r"[^]\d]+", "a\u0661", "1"),
        (r"(?i)[\w.-]+", "a.B-k", "\u212a"),  # within a class too (an email's, say)
        (r"(?i)[^\W]+", "kS", "\u017f"),
        (r"(?i)[\dk]+", "1K", "a"),  # (a class without \w keeps its letters' folding)
    ],
)
def test_a_regexs_classes_are_ascii_as_tgi_and_vllm_read_them(pattern, taken, refused):
    """\\d, \\w and \\s read as outlines (TGI's), xgrammar (vLLM's) and a JSON schema's
    `pattern` read them: \\d{4} wrote Arabic-Indic digits, which JavaScript reads as none."""
    assert holds({"type": "regex", "value": pattern}, taken)
    assert not holds({"type": "regex", "value": pattern}, refused)


def test_a_verbose_pattern_of_several_lines_is_refused_not_misread():
    """llguidance wrote a line's end as an escape, which ends no comment and matches a
    newline: "(?x)1 # one\\n a" matched "1", the rest dropped without a word."""
    for pattern in ("(?x)1 # one\n a", "(?x)1\n a"):
        said = refusal({"type": "regex", "value": pattern})
        assert "a verbose (?x) pattern of several lines is not read here" in said
    assert holds({"type": "regex", "value": "(?x)1 a # one"}, "1a")  # on one line: read
    assert holds({"type": "regex", "value": "1\na"}, "1\na")  # (not verbose: a newline)


def test_a_bad_regex_is_told_as_the_client_wrote_it():
    said = refusal({"type": "regex", "value": r"\d("})
    assert "\\d(" in said and "[0-9]" not in said and "unclosed group" in said
    for ranged in (r"[\d-z]", r"[a-\d]"):  # a class is no range's end (its nested one was)
        assert "invalid range boundary" in refusal({"type": "regex", "value": ranged})
    assert holds({"type": "regex", "value": r"[\d-]+"}, "1-")  # a "-" last is a character


@pytest.mark.parametrize(
    "dialect",
    [
        "https://spec.openapis.org/oas/3.1/dialect/base",  # OpenAPI 3.1's
        "http://json-schema.org/schema#",  # json-schema.org's unversioned name
        "https://example.com/my-dialect",
        "https://json-schema.org/draft-07/schema#",  # a draft under the other scheme
        "http://json-schema.org/draft/2020-12/schema",
        "https://json-schema.org/draft-04/schema",
    ],
)
def test_a_dialect_llguidance_does_not_name_is_read_as_the_latest_draft(dialect):
    """It was taken for a document to fetch, and refused 422 for a `$ref` the schema does
    not have; xgrammar (vLLM's) reads any. A draft under the other scheme is that draft."""
    grammar = {"type": "json", "value": {"$schema": dialect, "type": "integer"}}
    assert holds(grammar, "5")
    assert not holds(grammar, '"a"')


def test_a_property_named_as_an_annotation_is_a_property():
    """Only a schema's own keys are annotations: a property named "discriminator" (or
    "nullable") is held to its schema, and data under `const` is as written."""
    listed = {"discriminator": {"type": "integer"}, "nullable": {"const": {"x-a": 1}}}
    schema = {"type": "object", "properties": listed, "required": ["discriminator", "nullable"]}
    grammar = {"type": "json", "value": schema}
    assert holds(grammar, '{"discriminator": 1, "nullable": {"x-a": 1}}')
    assert not holds(grammar, '{"discriminator": "a", "nullable": {"x-a": 1}}')
    assert not holds(grammar, '{"discriminator": 1, "nullable": {}}')


def test_a_key_a_reference_points_into_is_kept():
    """OpenAPI's tool schemas keep their parts under "components" ("#/components/schemas/
    Pet"), others under a key of their own ("#/x-defs/A"): dropped as annotations, the
    schema was refused ("Pointer '/components/schemas/Pet' does not exist"). Such a key
    stays, holding only what pointers lead to, and the schemas it holds are compiled (and
    judged) as those under "$defs": their annotations dropped, their objects closed."""
    pet = {
        "type": "object",
        "nullable": True,  # (OpenAPI's: an annotation, and beside a recursive one refused)
        "properties": {
            "n": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/components/schemas/Pet", "x-a": 1}},
        },
        "required": ["n"],
    }
    components = {"schemas": {"Pet": pet}, "responses": {"x": {"description": "..."}}}
    schema = {"type": "object", "properties": {"pet": {"$ref": "#/components/schemas/Pet"}}}
    grammar = {"type": "json", "value": {**schema, "required": ["pet"], "components": components}}
    assert holds(grammar, '{"pet": {"n": 1, "kids": [{"n": 2}]}}')
    assert not holds(grammar, '{"pet": {"n": "a"}}')
    assert not holds(grammar, '{"pet": {"n": 1, "other": 2}}')  # (closed, as $defs' are)
    endless = {**pet, "required": ["n", "kids"], "properties": {"kids": {"$ref": "#/x-defs/A"}}}
    grammar = {"type": "json", "value": {"$ref": "#/x-defs/A", "x-defs": {"A": endless}}}
    assert "no answer can complete it" in refusal(grammar)  # (judged)
    named = {"type": "object", "properties": {"a": {"$ref": "#/x-defs/A"}}, "required": ["a"]}
    parameters = {**named, "x-defs": {"A": {"type": "integer"}}}
    tools = Tools([{"name": "f", "parameters": parameters}], "f")
    assert holds(tools.grammar(), '{"name": "f", "arguments": {"a": 1}}')
    assert not holds(tools.grammar(), '{"name": "f", "arguments": {"a": "b"}}')


def parameters_with(own_id: str, x: dict[str, Any], **more: Any) -> dict[str, Any]:
    properties = {"v": {"$ref": "#/$defs/x"}, **more}
    return {"$id": own_id, "type": "object", "$defs": {"x": x}, "properties": properties}


def test_tools_whose_parameters_share_an_id_are_each_held_to_their_own():
    """Two tools' parameters with one `$id` were one resource to llguidance: a call of a
    was held to b's `$defs` ({"v": "bee"} taken, {"v": 1} refused). Each tool's resource is
    its own, and its references lead where they led: by the `$id`, relative to it, to a
    part an older draft's `"$id": "#name"` names."""
    shared = "https://example.com/params.json"
    a = parameters_with(shared, {"type": "integer"})
    b = parameters_with(shared, {"type": "string", "enum": ["bee"]})
    calls = Tools([{"name": "a", "parameters": a}, {"name": "b", "parameters": b}], "required")
    grammar = calls.grammar()
    assert holds(grammar, '{"name": "a", "arguments": {"v": 1}}')
    assert not holds(grammar, '{"name": "a", "arguments": {"v": "bee"}}')
    assert holds(grammar, '{"name": "b", "arguments": {"v": "bee"}}')
    assert not holds(grammar, '{"name": "b", "arguments": {"v": 1}}')
    # a reference by the root's `$id`, and one relative to it, into a resource of its own
    node = {"$id": "node.json", "type": "integer"}
    by_uri = parameters_with(
        shared,
        {"$ref": f"{shared}#/$defs/y"},
        w={"$ref": "node.json"},
        u={"$ref": "https://example.com/node.json"},
    )
    by_uri["$defs"] = {**by_uri["$defs"], "y": {"type": "boolean"}, "node": node}
    tools = Tools([{"name": "a", "parameters": a}, {"name": "c", "parameters": by_uri}], "c")
    assert holds(tools.grammar(), '{"name": "c", "arguments": {"v": true, "w": 1, "u": 2}}')
    assert not holds(tools.grammar(), '{"name": "c", "arguments": {"v": 1}}')
    assert not holds(tools.grammar(), '{"name": "c", "arguments": {"w": true}}')
    # draft-07's `"$id": "#root"`: a name for the root ("Anchor 'root' does not exist")
    anchored = {"$id": "#root", "type": "object", "properties": {"n": {"$ref": "#root"}}}
    tools = Tools([{"name": "a", "parameters": a}, {"name": "r", "parameters": anchored}], "r")
    assert holds(tools.grammar(), '{"name": "r", "arguments": {"n": {"n": {}}}}')
    assert not holds(tools.grammar(), '{"name": "r", "arguments": {"n": 1}}')


def test_a_response_formats_id_leaves_it_a_resource_of_its_own():
    shared = "https://example.com/params.json"
    tools = Tools(
        [{"name": "a", "parameters": parameters_with(shared, {"type": "integer"})}],
        "auto",
        answer_format=parameters_with(shared, {"type": "boolean"}),
    )
    assert holds(tools.grammar(), '{"content": {"v": true}}')
    assert not holds(tools.grammar(), '{"content": {"v": 1}}')
    assert holds(tools.grammar(), '{"name": "a", "arguments": {"v": 1}}')


# a reference beside a constraint within a cycle: llguidance refuses it, naming the part
SIBLING = {
    "$defs": {
        "B": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/B", "minProperties": 1}},
        }
    },
    "$ref": "#/$defs/B",
}


@pytest.mark.parametrize(
    ("parameters", "said"),
    [
        (SIBLING, "not supported: #/$defs/B (in the parameters' schema of function 'f')"),
        (
            {"type": "object", "properties": {"a": {"$ref": "1/a"}}},
            "the parameters' schema of function 'f' refers to '1/a', outside it",
        ),
    ],
)
def test_a_fault_names_the_part_as_the_client_does(parameters, said):
    """llguidance's messages named rawserve's own resource ("urn:rawserve:tool:f#/$defs/B")
    and its placeholder for a schema without `$id` ("json-schema:///#/$defs/B", "the
    schema refers to 'json-schema:///1/a'"): the part is named by its reference, and
    whose it is."""
    grammar = Tools([{"name": "f", "parameters": parameters}], "f").grammar()
    message = refusal(grammar)
    assert said in message
    for internal in ("urn:rawserve", "json-schema:"):
        assert internal not in message
    message = refusal({"type": "json", "value": SIBLING})
    assert message.endswith("not supported: #/$defs/B")
    message = refusal({"type": "json", "value": {"$ref": "1/a"}})
    assert "the schema refers to '1/a', outside it" in message
    for answer_format, whose in (
        (SIBLING, "(in the response_format's schema)"),
        ({"$ref": "1/a"}, "the response_format's schema refers to '1/a', outside it"),
    ):
        tools = Tools([{"name": "f"}], "auto", answer_format=answer_format)
        message = refusal(tools.grammar())
        assert whose in message
        assert "urn:rawserve" not in message and "json-schema:" not in message


def test_the_keywords_said_at_fault_leave_unique_items_out():
    """uniqueItems is taken as an annotation (pydantic writes it for a set): where
    llguidance lists it beside keywords it cannot hold, the refusal names only the ones
    really at fault; a list not in its JSON is said as it came."""
    from rawserve.worker.grammars import unheld_keywords

    said = unheld_keywords('["uniqueItems", "dependentSchemas"]')
    assert said == 'the schema uses keywords a grammar cannot hold: ["dependentSchemas"]'
    assert unheld_keywords("[not, json]").endswith("cannot hold: [not, json]")


def test_a_relative_reference_against_a_base_with_no_path_is_joined_below_its_root():
    """A tool's `$id` of a host alone ("https://example.com") and a `$ref` of "b.json":
    RFC 3986 joins them with a "/" between (5.2.3); without it the
    reference named no resource of the schema's ("https://example.comb.json")."""
    from rawserve.worker.schema_references import joined

    assert joined("https://example.com", "b.json") == "https://example.com/b.json"
    assert joined("https://example.com/a/c.json", "b.json") == "https://example.com/a/b.json"


def test_a_schema_is_judged_as_it_is_compiled():
    """An object that lists its properties and leaves `additionalProperties` unstated is
    compiled closed: `minProperties` 1 with one property that never ends streamed '{' and
    then failed; the judgement looked at it open."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "minProperties": 1}
    assert "no answer can complete it" in refusal({"type": "json", "value": endless})


def test_a_count_written_as_an_integral_float_is_that_integer():
    """JSON's 1.0 is 1: llguidance refused `"minItems": 1.0` ("Expected positive integer
    for 'minItems', got 1.0")."""
    counted = {"type": "array", "items": {"type": "integer"}, "minItems": 1.0, "maxItems": 2.0}
    grammar = {"type": "json", "value": counted}
    assert holds(grammar, "[1, 2]")
    assert not holds(grammar, "[]") and not holds(grammar, "[1, 2, 3]")
    named = {"type": "string", "minLength": 2.0, "maxLength": 3.0}
    assert holds({"type": "json", "value": named}, '"ab"')
    assert not holds({"type": "json", "value": named}, '"a"')


@pytest.mark.parametrize("name", ["default", "example", "examples", "enum", "const"])
def test_a_property_or_definition_named_as_a_data_keyword_is_rebased(name):
    """A tester's: a tool's references by its `$id` inside a property (or a $defs entry)
    named "default" were left as written, the `$id` no longer the tool's ("the schema
    refers to 'https://example.com/order.json', outside it"). Only a schema's own data
    keywords hold data; a property's or a definition's name is a name."""
    order = "https://example.com/order.json"
    money = {"$ref": f"{order}#/$defs/money"}
    parameters = {
        "$id": order,
        "type": "object",
        "properties": {name: money, "total": {"$ref": f"#/$defs/{name}"}},
        "$defs": {
            "money": {"type": "integer"},
            name: {"type": "object", "properties": {"a": money}},
        },
    }
    tools = Tools([{"name": "f", "parameters": parameters}], "f")
    assert holds(
        tools.grammar(), f'{{"name": "f", "arguments": {{"{name}": 1, "total": {{"a": 2}}}}}}'
    )
    assert not holds(tools.grammar(), f'{{"name": "f", "arguments": {{"{name}": "x"}}}}')
    assert not holds(tools.grammar(), '{"name": "f", "arguments": {"total": {"a": "x"}}}')
    # data is as written: a "$ref" under a schema's own `default` is no reference
    data = {**parameters, "properties": {"d": {"type": "object", "default": money}}}
    tools = Tools([{"name": "f", "parameters": data}], "f")
    assert (
        tools.grammar()["value"]["properties"]["arguments"]["properties"]["d"]["default"] == money
    )


def test_two_tools_giving_one_nested_id_to_different_schemas_are_refused():
    """A tester's: two tools' parameters gave "$defs": {"val": {"$id": ".../value.json"}}
    an integer v in one and a string v in the other; llguidance took them for one
    resource, and held a call of the first to the second's (its string taken). Refused,
    naming the `$id`; given alike, it is one schema, and taken."""
    from rawserve.http.errors import UnprocessableInput

    def parameters(kind: str) -> dict[str, Any]:
        value = {"$id": "https://example.com/common/value.json", "type": "object"}
        value |= {"properties": {"v": {"type": kind}}, "required": ["v"]}
        listed = {"x": {"$ref": "https://example.com/common/value.json"}}
        return {"type": "object", "properties": listed, "required": ["x"], "$defs": {"val": value}}

    tools = [{"name": "f1", "parameters": parameters("integer")}]
    both = Tools([*tools, {"name": "f2", "parameters": parameters("string")}], "required")
    with pytest.raises(UnprocessableInput) as refused:
        both.grammar()
    assert refused.value.message.startswith(
        'the $id "https://example.com/common/value.json" is given to two different schemas '
        "(in the parameters of function f1, and in the parameters of function f2)"
    )
    formatted = Tools(tools, "auto", answer_format=parameters("string"))
    with pytest.raises(UnprocessableInput, match="function f1, and in the response_format"):
        formatted.grammar()
    alike = Tools([*tools, {"name": "f2", "parameters": parameters("integer")}], "required")
    assert holds(alike.grammar(), '{"name": "f2", "arguments": {"x": {"v": 1}}}')
    assert not holds(alike.grammar(), '{"name": "f1", "arguments": {"x": {"v": "a"}}}')


def chain(length: int, reference: str = "#/definitions/N{}") -> dict[str, Any]:
    """`length` definitions, each an object whose `n` refers to the next."""
    return {
        f"N{i}": {"type": "object", "properties": {"n": {"$ref": reference.format(i + 1)}}}
        for i in range(length)
    } | {f"N{length}": {"type": "integer"}}


def test_a_schema_is_judged_as_llguidance_reads_its_draft():
    """A tester's crashes (SIGSEGV, the judgement having accepted): draft 7 ignores an
    `$id` beside a `$ref`, which the judgement took for a resource's, judging a short part
    while llguidance followed 1,000 references from the root; a `$schema` below the root
    was read by llguidance (a draft 4 part's `id`s) and not by the judgement. Both now
    read one schema: the `$id` beside a `$ref` dropped under drafts 4 to 7, a nested
    `$schema` dropped."""
    from rawserve.worker.endless_schemas import schema_fault
    from rawserve.worker.schema_rewrites import compilable

    draft7 = "http://json-schema.org/draft-07/schema#"
    beside = {"$id": "http://e.com/p", "$ref": "#/definitions/N0", "definitions": {"N0": {}}}
    schema = {
        "$schema": draft7,
        "type": "object",
        "properties": {"r": {"$ref": "#/definitions/P"}},
        "definitions": {**chain(1000), "P": beside},
    }
    fault = schema_fault(compilable(schema))
    assert fault is not None and "nest 2,00" in fault.words, fault
    kept = compilable({**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"})
    assert kept["definitions"]["P"]["$id"] == "http://e.com/p"  # (2020-12 reads it)
    nested = compilable({"properties": {"a": {"$schema": draft7, "type": "integer"}}})
    assert nested["properties"]["a"] == {"type": "integer"}
    assert compilable({"$schema": draft7})["$schema"] == draft7
    # a draft 7 tool's parameters whose root is a `$ref` (zod-to-json-schema's named form)
    zod = {
        "$schema": draft7,
        "$ref": "#/definitions/Params",
        "definitions": {
            "Params": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
    grammar = Tools([{"name": "f", "parameters": zod}], "required").grammar()
    assert holds(
        grammar, '{"name": "f", "arguments": {"q": "x"}}'
    )  # (was "Pointer ... does not exist")


def test_an_anchor_given_to_two_parts_is_refused_where_a_reference_names_it():
    """`$anchor: "foo"` on one part, `"$id": "#foo"` on another: llguidance took one by
    its draft and the judgement the other (a chain of 1,000 behind it: SIGSEGV)."""
    from rawserve.worker.endless_schemas import schema_fault

    schema = {
        "$defs": {"N0": {"$anchor": "foo", "type": "integer"}, "S": {"$id": "#foo"}},
        "type": "object",
        "properties": {"r": {"$ref": "#foo"}},
    }
    fault = schema_fault(schema)
    assert fault is not None and "an anchor it gives two parts" in fault.words
    assert schema_fault({**schema, "properties": {}}) is None  # (named by no reference)

"""OpenAI's tools without a server: the grammar an answer is held to, the tools a body
offers, a generated answer read back as a call or words, and words read out of their
JSON as it grows (`rawserve.api.openai_tools`)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import jsonschema
import pytest

from rawserve.api.openai_tools import (
    FUNCTION_CALL,
    MAX_TOOLS,
    NO_ARGUMENTS,
    TOOL_CHOICE,
    WORDS,
    ForcedCall,
    StreamedWords,
    Tools,
    chat_tools,
    read_function_call,
    read_functions,
    read_tool_choice,
    read_tools,
)
from rawserve.http.errors import BadRequest

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "weather", "parameters": CITY}
TIME = {"name": "time"}


def call(name, arguments):
    if arguments is not NO_ARGUMENTS:  # (its references resolved in it)
        arguments = {"$id": f"urn:rawserve:tool:{name}", **arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def test_the_grammar_is_a_call_of_the_tools_asked_for_or_words_where_auto():
    both = [WEATHER, TIME]
    required = {"anyOf": [call("weather", CITY), call("time", NO_ARGUMENTS)]}
    assert Tools(both, "required").grammar() == {"type": "json", "value": required}
    auto = {"anyOf": [*required["anyOf"], WORDS]}
    assert Tools(both, "auto").grammar() == {"type": "json", "value": auto}
    assert Tools(both, "time").grammar() == {"type": "json", "value": call("time", NO_ARGUMENTS)}
    assert not Tools(both, "none").held and Tools(both, "auto").held


def test_where_several_calls_are_allowed_the_answer_may_be_a_list_of_them():
    one = call("weather", CITY)
    several = {"type": "array", "items": one, "minItems": 1}
    assert Tools([WEATHER], "required", parallel=True).grammar() == {
        "type": "json",
        "value": {"anyOf": [one, several]},
    }
    assert Tools([WEATHER], "auto", parallel=True).grammar()["value"] == {
        "anyOf": [one, several, WORDS]
    }
    either = {"anyOf": [one, call("time", NO_ARGUMENTS)]}
    assert Tools([WEATHER, TIME], "required", parallel=True).grammar()["value"] == {
        "anyOf": [*either["anyOf"], {"type": "array", "items": either, "minItems": 1}]
    }
    # a function named is called once, as OpenAI's older functions call one at a time,
    # whatever parallel_tool_calls says
    assert not chat_tools([WEATHER], "weather", parallel=True).parallel
    assert chat_tools([WEATHER], None, parallel=True, older=True) == Tools(
        [WEATHER], "auto", older=True
    )


def test_a_functions_references_are_to_its_own_parameters():
    """pydantic writes a nested model as `{"$ref": "#/$defs/Place"}` beside the `$defs`;
    held inside the call's grammar, "#" was the call's root, and the grammar a 422."""
    import llguidance

    from rawserve.worker.grammars import grammar_text

    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    parameters = {"properties": {"place": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": place}}
    tools = Tools([{"name": "go", "parameters": parameters}, TIME], "auto", parallel=True)
    assert llguidance.LLMatcher.validate_grammar(grammar_text(tools.grammar())) == ""


def test_a_calls_arguments_are_an_object_where_its_parameters_leave_the_type_out():
    """Without "type", a schema of properties holds any JSON (`null`, a number): a call's
    arguments are still an object, which every client unpacks as the function's."""
    untyped = {"properties": {"q": {"type": "string"}}, "required": ["q"]}
    grammar = Tools([{"name": "find", "parameters": untyped}], "find").grammar()["value"]
    arguments = grammar["properties"]["arguments"]
    jsonschema.validate({"q": "x"}, arguments)
    for written in (None, 5, "q", ["q"]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(written, arguments)
    typed = Tools([WEATHER], "weather").grammar()["value"]["properties"]["arguments"]
    assert typed["type"] == "object"


def test_the_tools_a_body_offers_and_the_choice_among_them():
    offered = [{"type": "function", "function": {**WEATHER, "description": "d", "strict": True}}]
    assert read_tools("tools", offered, None) == [{**WEATHER, "description": "d"}]
    assert chat_tools(None, None) is None and chat_tools([], "auto") is None
    assert chat_tools([WEATHER], None) == Tools([WEATHER], "auto")
    with pytest.raises(BadRequest, match="offers no tools"):
        chat_tools(None, "required")
    with pytest.raises(BadRequest, match="names time, which is not among the tools"):
        chat_tools([WEATHER], "time")


def test_a_tool_choice_names_a_function_as_openai_or_tgi_writes_it():
    """TGI reads any text but "none", "auto" and "required" as a function's name
    (InferenceClient's `chat_completion(..., tool_choice="weather")`)."""
    assert read_tool_choice("tool_choice", "weather", None) == "weather"
    forced = {"type": "function", "function": {"name": "weather"}}
    assert read_tool_choice("tool_choice", forced, None) == ForcedCall("weather")
    assert chat_tools([WEATHER], "weather") == Tools([WEATHER], "weather")
    assert chat_tools([WEATHER], ForcedCall("weather")).callable() == ["weather"]
    with pytest.raises(BadRequest, match='"tool_choice" names rain, which is not among'):
        chat_tools([WEATHER], read_tool_choice("tool_choice", "rain", None))
    # (an empty name forced no function: it was read as "auto")
    empty = {"type": "function", "function": {"name": ""}}
    for refused in ("", 3, {"type": "file_search"}, empty):
        with pytest.raises(BadRequest, match='"tool_choice" must be'):
            read_tool_choice("tool_choice", refused, None)
        assert not jsonschema.Draft202012Validator(TOOL_CHOICE).is_valid(refused)


@pytest.mark.parametrize("mode", ["none", "auto", "required"])
@pytest.mark.parametrize("older", [False, True])
def test_a_function_named_as_a_mode_is_called_when_it_is_forced(mode, older):
    """OpenAI's names take "none", "auto" and "required": forcing a function so named
    read as that mode (forced "none", the answer was words, no call)."""
    function = {"name": mode, "parameters": CITY}
    if older:
        choice = read_function_call("function_call", {"name": mode}, None)
    else:
        forced = {"type": "function", "function": {"name": mode}}
        choice = read_tool_choice("tool_choice", forced, None)
    tools = chat_tools([function, TIME], choice, parallel=True, older=older)
    assert tools is not None and tools.held and not tools.parallel
    assert tools.callable() == [mode]
    assert tools.grammar()["value"]["properties"]["name"] == {"const": mode}
    message, finish = tools.message(f'{{"name": "{mode}", "arguments": {{"city": "x"}}}}')
    assert finish is None  # a forced call ends as words do
    called = message["function_call"] if older else message["tool_calls"][0]["function"]
    assert called["name"] == mode


def test_the_limits_on_tools_take_what_openai_and_the_schema_take():
    """128 tools and a name of 64 characters, OpenAI's most (and the schema's), are
    taken; one more of either is refused."""

    def tools(count, name="f"):
        return [{"type": "function", "function": {"name": f"{name}{i}"}} for i in range(count)]

    assert len(read_tools("tools", tools(MAX_TOOLS), None)) == MAX_TOOLS
    with pytest.raises(BadRequest, match="at most 128 tools"):
        read_tools("tools", tools(MAX_TOOLS + 1), None)
    longest = "n" * 63  # and its index: 64 characters
    assert read_tools("tools", tools(1, longest), None)[0]["name"] == longest + "0"
    with pytest.raises(BadRequest):
        read_tools("tools", tools(1, longest + "x"), None)


def test_a_tools_parameters_must_be_the_schema_of_an_object():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(BadRequest, match="must be a schema of an object"):
        read_tools("tools", [tool], None)


def test_a_calls_arguments_keep_their_keys_as_the_model_wrote_them():
    """Keys beyond ASCII are sent back as written, as their values are (not escaped)."""
    message, _ = Tools([{"name": "f"}], "auto").message(
        '{"name": "f", "arguments": {"ville": "Zürich", "café": 1}}'
    )
    assert message["tool_calls"][0]["function"]["arguments"] == '{"ville": "Zürich", "café": 1}'


def test_the_older_functions_and_the_choice_among_them():
    assert read_functions("functions", [{**WEATHER, "strict": None}], None) == [WEATHER]
    assert read_function_call("function_call", {"name": "weather"}, None) == ForcedCall("weather")
    assert read_function_call("function_call", "auto", None) == "auto"
    for refused in ("required", {"name": ""}):
        with pytest.raises(BadRequest, match='"function_call" must be'):
            read_function_call("function_call", refused, None)
        assert not jsonschema.Draft202012Validator(FUNCTION_CALL).is_valid(refused)
    # a function forced by name is named so, where none is offered ("auto" is taken)
    with pytest.raises(BadRequest, match='"function_call" names the function .auto., and the'):
        chat_tools(None, ForcedCall("auto"), older=True)
    with pytest.raises(BadRequest, match='"function_call" names time, which is not among the f'):
        chat_tools([WEATHER], "time", older=True)
    with pytest.raises(BadRequest, match='"function_call" is .weather., and the request offers'):
        chat_tools(None, "weather", older=True)


def test_an_answer_is_read_back_as_a_call_or_words():
    tools = Tools([WEATHER, TIME], "auto")
    message, reason = tools.message('{"name": "weather", "arguments": {"city": "rome"}}')
    assert reason == "tool_calls" and message["content"] is None
    [made] = message["tool_calls"]
    assert made["type"] == "function" and made["id"].startswith("call_")
    assert made["function"] == {"name": "weather", "arguments": '{"city": "rome"}'}
    assert tools.message('{"content": "it is sunny"}') == (
        {"role": "assistant", "content": "it is sunny"},
        None,
    )
    # cut by max_tokens: the words written
    assert tools.message('{"content": "it is su') == (
        {"role": "assistant", "content": "it is su"},
        None,
    )


def test_calls_cut_by_max_tokens_are_read_back_as_far_as_they_came():
    """As OpenAI's: the whole calls, then the one cut, its arguments as far as they came,
    and the finish reason left "length"; never the grammar's {"name", ...} as words."""
    tools = Tools([WEATHER, TIME], "required", parallel=True)
    message, reason = tools.message('{"name": "weather", "arguments": {"city": "ro')
    assert reason is None and message["content"] is None
    assert [call["function"] for call in message["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "ro'}
    ]
    listed = '[{"name": "time", "arguments": {}}, {"name": "weather", "arguments": {"ci'
    message, reason = tools.message(listed)
    assert reason is None
    assert [call["function"] for call in message["tool_calls"]] == [
        {"name": "time", "arguments": "{}"},
        {"name": "weather", "arguments": '{"ci'},
    ]
    for before_a_name in ("{", '{"name"', '{"name": "', "[", '[{"name": "'):
        # a call required of two: no words (content null, as a call's message), not empty ones
        assert tools.message(before_a_name) == ({"role": "assistant", "content": None}, None)
    # cut in its name, or before it, where only one function can be meant: that one's
    # call (it was no call at all; OpenAI's cut calls carry their names)
    whole_names = ('{"name": "weather"', '{"name": "weather", "argu')  # (a tester)
    for cut_in_the_name in (*whole_names, '{"name": "weath', '{"name": "w', '[{"name": "we'):
        message, reason = tools.message(cut_in_the_name)
        assert [call["function"] for call in message["tool_calls"]] == [
            {"name": "weather", "arguments": ""}
        ]
    for choice in ("weather", "required"):
        one = Tools([WEATHER], choice) if choice == "required" else Tools([WEATHER, TIME], choice)
        for before_a_name in ("", "{", '{"name": "', '{"name": "weath'):
            message, reason = one.message(before_a_name)
            assert reason is None and message["content"] is None
            assert [call["function"] for call in message["tool_calls"]] == [
                {"name": "weather", "arguments": ""}
            ]
    for named_whole in whole_names:
        message, reason = tools.message(named_whole)
        assert [call["function"] for call in message["tool_calls"]] == [
            {"name": "weather", "arguments": ""}
        ]
    named = Tools([WEATHER], "weather").message('{"name": "weather", "arguments": {')
    assert named[0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": "{"}
    older = Tools([WEATHER], "auto", older=True).message('{"name": "weather", "arguments": ')
    called = {"name": "weather", "arguments": ""}
    assert older == ({"role": "assistant", "content": None, "function_call": called}, None)
    # a later call cut before its name is read as a first one is: the one function it
    # can be (it was dropped); the white space a call's arguments were cut after kept
    one = Tools([WEATHER], "required", parallel=True)
    whole = '[{"name": "weather", "arguments": {}}, '
    for later in ("", "{", '{"', '{"name"', '{"name":', '{"name": ', '{"name": "'):
        message, _ = one.message(whole + later)
        assert [call["function"] for call in message["tool_calls"]] == [
            {"name": "weather", "arguments": "{}"},
            {"name": "weather", "arguments": ""},
        ]
    # (a whole call cut before its comma or its list's end is all there is)
    message, _ = one.message(whole.removesuffix(", "))
    assert [call["function"] for call in message["tool_calls"]] == [
        {"name": "weather", "arguments": "{}"}
    ]
    message, _ = one.message('{"name": "weather", "arguments": {"city": ')
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": '


@pytest.mark.parametrize("older", [False, True])
def test_an_answer_that_may_be_words_cut_before_it_said_anything_is_its_text(older):
    """`tool_choice` "auto", cut by max_tokens before it named a call or wrote a word:
    its text as content, as vLLM answers what it cannot read as a call. It was "" (a
    tester's `{"c`, its tokens listed in its log probabilities); a call named is the
    call, with its arguments as far as they came, as where a call is required."""
    auto = Tools([WEATHER, TIME], "auto", parallel=not older, older=older)
    cut = ('{"c', '{"content": "', "{", '{"name": "', '[{"name": "', "[")
    for text in cut[:4] if older else cut:
        assert auto.message(text) == ({"role": "assistant", "content": text}, None)
    # a name begun that only one function's fits: a call of it
    called = auto.message('{"name": "weath')[0]
    called = called["function_call"] if older else called["tool_calls"][0]["function"]
    assert called == {"name": "weather", "arguments": ""}
    assert auto.message('{"content": "it is') == ({"role": "assistant", "content": "it is"}, None)
    required = replace(auto, choice="required")
    for named in ('{"name": "weather", "argu', '{"name": "weather", "arguments": {"city": "ro'):
        message, reason = auto.message(named)
        assert reason is None and message["content"] is None
        called = message["function_call"] if older else message["tool_calls"][0]["function"]
        if not older:
            assert called == required.message(named)[0]["tool_calls"][0]["function"]
        assert called["name"] == "weather" and named.endswith(called["arguments"])
    formatted = replace(auto, answer_format=PERSON)  # (its JSON as far as it came, or the text)
    assert formatted.message('{"c') == ({"role": "assistant", "content": '{"c'}, None)


def test_a_list_of_calls_is_read_back_as_a_call_each():
    message, reason = Tools([WEATHER, TIME], "required", parallel=True).message(
        '[{"name": "weather", "arguments": {"city": "rome"}}, {"name": "time", "arguments": {}}]'
    )
    assert reason == "tool_calls"
    assert [made["function"] for made in message["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "rome"}'},
        {"name": "time", "arguments": "{}"},
    ]
    assert len({made["id"] for made in message["tool_calls"]}) == 2


def test_a_calls_arguments_keep_the_numbers_and_text_the_model_wrote():
    """Read as floats, 1e999 came back as Infinity: not JSON, and a JavaScript client's
    JSON.parse of the arguments failed; the arguments are still JSON, and the same JSON."""
    written = '{"days": 1e999, "t": -0.10, "n": [2, 3.5e-3], "city": "Zürich"}'
    generated = '{"name": "weather", "arguments": ' + written + "}"
    message, _ = Tools([WEATHER], "required").message(generated)
    arguments = message["tool_calls"][0]["function"]["arguments"]
    assert arguments == written
    assert json.loads(arguments) == json.loads(generated)["arguments"]
    # an integer past Python's 4,300 digits (a ValueError, read as a call cut short: the
    # call was sent as words), and -0, written back as 0
    written = '{"days": ' + "7" * 5000 + ', "t": -0}'
    generated = '{"name": "weather", "arguments": ' + written + "}"
    message, reason = Tools([WEATHER], "required").message(generated)
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == written
    nested = '{"name": "weather", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    assert Tools([WEATHER], "required").message(nested) == (
        {"role": "assistant", "content": nested},
        None,
    )


def test_an_older_functions_call_is_read_back_as_the_messages_function_call():
    message, reason = Tools([WEATHER], "auto", older=True).message(
        '{"name": "weather", "arguments": {"city": "rome"}}'
    )
    assert reason == "function_call"
    assert message == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "weather", "arguments": '{"city": "rome"}'},
    }


@pytest.mark.parametrize("older", [False, True])
def test_a_call_of_the_function_named_ends_as_words_do(older):
    """OpenAI ends a call it was told to make with finish_reason "stop" (vLLM too, since
    its #25054): the worker's reason stands. "auto" and "required" end with the calls."""
    generated = '{"name": "weather", "arguments": {"city": "rome"}}'
    message, reason = Tools([WEATHER, TIME], "weather", older=older).message(generated)
    assert reason is None
    assert message["function_call" if older else "tool_calls"]
    for choice in ("auto", "required")[: 1 if older else 2]:
        _, reason = Tools([WEATHER, TIME], choice, older=older).message(generated)
        assert reason == ("function_call" if older else "tool_calls")


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_words_are_read_out_of_their_json_a_whole_character_at_a_time(step):
    answer = '{"content": "a \\"quote\\", \\u00e9t\\u00e9 \\ud83d\\ude00 and a\\nline"}'
    words = StreamedWords()
    pieces = [words.add(answer[i : i + step]) for i in range(0, len(answer), step)]
    assert "".join(pieces) == json.loads(answer)["content"] == words.sent
    assert all("\\" not in piece for piece in pieces)  # never half an escape


def test_a_call_sends_no_words():
    words = StreamedWords()
    answer = '{"name": "time", "arguments": {}}'
    assert [words.add(character) for character in answer] == [""] * len(answer)
    assert words.sent == ""


PERSON = {
    "type": "object",
    "properties": {"place": {"$ref": "#/$defs/Place"}},
    "required": ["place"],
    "$defs": {"Place": CITY},
}


def test_with_a_response_format_an_answer_calls_or_follows_the_format():
    """What agent SDKs send (tools, and a response_format for the final answer): it was a
    400; the answer that does not call is the format's JSON, its references its own."""
    import llguidance

    from rawserve.worker.grammars import grammar_text

    tools = Tools([WEATHER, TIME], "auto", answer_format=PERSON)
    held = tools.grammar()["value"]["anyOf"][-1]
    assert held["properties"]["content"] == {"$id": "urn:rawserve:response-format", **PERSON}
    assert llguidance.LLMatcher.validate_grammar(grammar_text(tools.grammar())) == ""
    answer = '{"place": {"city": "rome", "n": 1e999}}'  # (as written: 1e999 is no float)
    assert tools.message('{"content": ' + answer + "}") == (
        {"role": "assistant", "content": answer},
        None,
    )
    assert tools.message('{"content": {"place": {"ci') == (
        {"role": "assistant", "content": '{"place": {"ci'},
        None,
    )
    _, reason = tools.message('{"name": "time", "arguments": {}}')
    assert reason == "tool_calls"
    # where a call is required, the calls alone hold the answer (as in vLLM)
    required = Tools([WEATHER, TIME], "required", answer_format=PERSON)
    assert required.grammar() == Tools([WEATHER, TIME], "required").grammar()


@pytest.mark.parametrize("step", [1, 2, 5])
def test_an_answer_held_to_a_format_is_streamed_as_written(step):
    answer = '{"content": {"place": {"city": "a \\"b\\" \\u00e9"}}}'
    words = Tools([WEATHER], "auto", answer_format=PERSON).words()
    pieces = "".join(words.add(answer[i : i + step]) for i in range(0, len(answer), step))
    assert pieces == words.sent == answer[len('{"content": ') : -1]
    call = Tools([WEATHER], "auto", answer_format=PERSON).words()
    assert call.add('{"name": "weather", "arguments": {"city": "x"}}') == ""


@functools.cache
def byte_level_tokens():
    import llguidance.hf

    from tests.tiny_models import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def held_to(grammar):
    """Whether a text is one that `grammar` lets a model write, a byte-level token at a time."""
    import llguidance

    from rawserve.worker.grammars import grammar_text

    tokenizer, tokens = byte_level_tokens()

    def holds(text):
        matcher = llguidance.LLMatcher(tokens, grammar_text(grammar), log_level=0)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    return holds


def test_a_calls_arguments_take_only_the_parameters_listed():
    """JSON Schema lets keys a schema does not list into an object; LangChain's `@tool`
    schemas leave `additionalProperties` out, and a model wrote `"": ...` keys beside the
    arguments, which the function called with them refused. Unstated, only the listed
    properties come, as xgrammar (vLLM) and outlines (TGI) generate them; stated, it holds."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    parameters = {
        "properties": {"place": {"$ref": "#/$defs/Place"}, "days": {"type": "integer"}},
        "$defs": {"Place": place},
    }
    holds = held_to(Tools([{"name": "go", "parameters": parameters}], "go").grammar())
    assert holds('{"name": "go", "arguments": {"place": {"city": "rome"}, "days": 2}}')
    assert not holds('{"name": "go", "arguments": {"place": {"city": "rome"}, "": 2}}')
    assert not holds('{"name": "go", "arguments": {"place": {"city": "rome", "n": 1}}}')
    # a listed key comes once (in the schema's order): no duplicate keys
    assert not holds('{"name": "go", "arguments": {"days": 1, "days": 2}}')
    stated = {**parameters, "additionalProperties": {"type": "integer"}}
    open_call = held_to(Tools([{"name": "go", "parameters": stated}], "go").grammar())
    assert open_call('{"name": "go", "arguments": {"days": 1, "n": 2}}')
    # the same for a response_format
    answer_format = {"type": "json", "value": {"type": "object", "properties": {"a": {}}}}
    assert held_to(answer_format)('{"a": 1}')
    assert not held_to(answer_format)('{"a": 1, "b": 2}')


def test_objects_are_closed_where_their_schema_leaves_additional_properties_out():
    from rawserve.worker.schema_rewrites import closed_objects

    item = {"properties": {"a": {}}}
    schema = {
        "properties": {
            "list": {"items": item},
            "either": {"anyOf": [item, {"type": "null"}]},
            "other": {"not": item},  # (left as written: closed, it would let more in)
        },
        "$defs": {"Item": item},
    }
    closed = closed_objects(schema)
    for instance in ({"x": 1}, {"list": [{"x": 1}]}, {"either": {"x": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, closed)
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    assert closed["properties"]["other"] == {"not": item} and "additionalProperties" not in item
    for stated in ({"additionalProperties": True}, {"unevaluatedProperties": False}):
        assert closed_objects({**item, **stated}) == {**item, **stated}
    # a key required and not listed, and objects of several schemas, are left open
    unlisted = {**item, "required": ["b"]}
    assert closed_objects(unlisted) == unlisted
    for composed in (
        {"allOf": [item, {"properties": {"b": {}}}]},
        {"$ref": "#/$defs/Item", "properties": {"b": {}}, "$defs": {"Item": item}},
        {"properties": {"kind": {}}, "anyOf": [item, {"properties": {"b": {}}}]},
        {"properties": {"deep": {"properties": {"kind": {}}, "oneOf": [item]}}},
    ):
        assert closed_objects(composed) == composed
        jsonschema.validate({"a": 1, "b": 2, "kind": 3}, composed)
    # an allOf of one schema composes nothing: pydantic wraps a described reference in one
    described = {"allOf": [{"$ref": "#/$defs/Item"}], "description": "the item"}
    wrapped = closed_objects({"properties": {"item": described}, "$defs": {"Item": item}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"item": {"a": 1, "x": 2}}, wrapped)


@pytest.mark.parametrize("older", [False, True])
def test_an_answer_that_calls_a_tool_is_one_the_published_document_describes(older):
    """/openapi.json said a chat answer ends in "stop" or "length" only: a client made
    from it, or a check of answers against it, refused the server's own tool calls."""
    from rawserve.api.schemas import OPENAI_CHAT_CHUNK, OPENAI_CHAT_RESPONSE

    tools = Tools([WEATHER], "auto", older=older)
    message, finish = tools.message('{"name": "weather", "arguments": {"city": "Paris"}}')
    assert finish == ("function_call" if older else "tool_calls")
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m"}
    jsonschema.validate({**answer, "choices": [choice], "usage": usage}, OPENAI_CHAT_RESPONSE)
    last = {"index": 0, "delta": {}, "finish_reason": finish}
    # (with `include_usage`, every chunk but the last carries "usage": null, as OpenAI's)
    chunk = {**answer, "object": "chat.completion.chunk", "choices": [last], "usage": None}
    jsonschema.validate(chunk, OPENAI_CHAT_CHUNK)
    jsonschema.validate({**chunk, "choices": [], "usage": usage}, OPENAI_CHAT_CHUNK)

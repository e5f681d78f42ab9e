"""OpenAI's tools on the chat route: the functions a model may call, a grammar that holds
its answer to a call of one of them, and the answer read back as OpenAI's `tool_calls`.

TGI's way, which asks nothing of the model but its chat template: the tools go to the
template (`apply_chat_template(..., tools=...)`; a template that leaves them out gets them
described at the end of the last message, in the worker), and what is generated is held
to JSON (`rawserve.worker.grammars`): `{"name": ..., "arguments": {...}}` for a call,
the arguments held to the function's own JSON schema, or, where `tool_choice` is "auto",
`{"content": "..."}` for an answer in words. With a `response_format` beside the tools
(as agent SDKs send it: the answer calls, or else follows the format), the answer that
does not call is `{"content": ...}` holding JSON of that format, read back as the
message's content as written; where a call is required, the calls' grammar holds the
answer alone, as vLLM's does. Where `parallel_tool_calls` allows (OpenAI's
default) and no one function is named, an answer may also be a list of calls, each read
back as a call of its own.
OpenAI's older form, `functions` and `function_call`, is the same with one call an answer,
read back as the message's `function_call`.

Streamed, an answer in words is sent as it comes (`StreamedWords` reads the words out of
the JSON as it grows, or the format's JSON itself); calls are sent whole at its end, in
one chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urldefrag, urljoin

from rawserve.api.routing import DocContext, Schema
from rawserve.http.errors import BadRequest, UnprocessableInput
from rawserve.tasks.text_generation import FORMAT_RESOURCE, TOOL_RESOURCE

MAX_TOOLS = 128
# an older draft's `$id` that names a part (an anchor), not a resource
ANCHOR_ID = re.compile(r"#[A-Za-z_][-A-Za-z0-9._]*")
# the keywords of a schema whose values are data, never schemas: a "$ref" in them is data
DATA = frozenset({"const", "enum", "default", "examples", "example"})
# the keywords whose values are schemas by name: a name is a name, whatever it is (a
# property named "default" holds a schema, not data)
BY_NAME = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


def typed_function(function: Schema) -> Schema:
    """`{"type": "function", "function": {...}}`: a tool, or the choice of one."""
    named = {"type": "object", "required": ["name"], "properties": function}
    return {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": named},
    }


FUNCTION = {
    "name": {"type": "string", "pattern": FUNCTION_NAME},
    "description": {"type": "string"},
    "parameters": {"type": "object"},
    "strict": {"type": ["boolean", "null"]},
}
TOOLS: Schema = {
    "type": ["array", "null"],
    "items": typed_function(FUNCTION),
    "maxItems": MAX_TOOLS,
}
FUNCTIONS: Schema = {
    "type": ["array", "null"],
    "items": {"type": "object", "required": ["name"], "properties": FUNCTION},
    "maxItems": MAX_TOOLS,
}
TOOL_CHOICE: Schema = {
    "anyOf": [
        {"enum": ["none", "auto", "required", None]},
        {"type": "string", "minLength": 1, "description": "a function's name (TGI's)"},
        # (its "type" may be left out, as vLLM takes it)
        {**typed_function({"name": {"type": "string", "minLength": 1}}), "required": ["function"]},
    ]
}
FUNCTION_CALL: Schema = {
    "anyOf": [
        {"enum": ["none", "auto", None]},
        {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}},
        },
    ]
}
# a function without parameters takes none (OpenAI: "an empty parameter list")
NO_ARGUMENTS: Schema = {"type": "object", "properties": {}, "additionalProperties": False}
# the answer in words, where the model may also choose not to call
WORDS: Schema = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
    "additionalProperties": False,
}


MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ForcedCall:
    """A choice of the function an answer must call, as OpenAI names it
    (`{"type": "function", "function": {"name"}}`): a function may be named "auto"."""

    name: str


@dataclass(frozen=True)
class Tools:
    """The functions a chat offers (OpenAI's `{"name", "description", "parameters"}`), and
    which of them the answer must call: "auto" (any, or none), "required" (any), one by
    its name, or "none" (the template shows them; the answer is words)."""

    functions: list[dict[str, Any]]
    choice: str
    parallel: bool = False  # an answer may call several (OpenAI's `parallel_tool_calls`)
    older: bool = False  # asked as `functions`: the call read back as a `function_call`
    # the JSON schema of an answer that does not call (the request's response_format)
    answer_format: dict[str, Any] | None = None
    forced: bool = False  # `choice` names the function to call, whatever its name

    @property
    def mode(self) -> str:
        """ "none", "auto", "required", or "function": the function `choice` names."""
        return "function" if self.forced or self.choice not in MODES else self.choice

    @property
    def held(self) -> bool:
        """Whether the answer is held to a call (or, with "auto", to words in JSON)."""
        return self.mode != "none"

    def grammar(self) -> dict[str, Any]:
        """What a held answer is held to, as the worker takes a grammar (TGI's shape)."""
        if self.mode in ("auto", "required"):
            answers = [call_schema(function) for function in self.functions]
        else:
            answers = [call_schema(f) for f in self.functions if f["name"] == self.choice]
        if self.parallel:  # or a list of calls
            call = answers[0] if len(answers) == 1 else {"anyOf": list(answers)}
            answers.append({"type": "array", "items": call, "minItems": 1})
        if self.mode == "auto":
            answers.append(WORDS if self.answer_format is None else formatted(self.answer_format))
        one_schema_an_id(answers)
        return {"type": "json", "value": answers[0] if len(answers) == 1 else {"anyOf": answers}}

    def message(self, text: str) -> tuple[dict[str, Any], str | None]:
        """The assistant's message for what a held answer generated, and the finish
        reason a call gives (None for words, and for a call of the function the request
        named, which OpenAI and vLLM end with "stop"). An answer cut by `max_tokens` is
        read as `cut_message` says (the finish reason stays "length")."""
        try:
            answer = json.loads(text, parse_float=WrittenNumber, parse_int=WrittenNumber)
            calls = answer if isinstance(answer, list) else [answer]
            functions = [
                {"name": call["name"], "arguments": as_written(call.get("arguments"))}
                for call in calls
                if isinstance(call, dict) and "name" in call
            ]
        except RecursionError:  # nested past the parser's limit: as it came
            return {"role": "assistant", "content": text}, None
        except ValueError:  # cut short
            return self.cut_message(text), None
        if not calls or len(functions) < len(calls):
            content = answer.get("content") if isinstance(answer, dict) else None
            if content is not None and self.answer_format is not None:
                # the format's JSON as written (not read and written again), its braces off
                content = text.strip().removeprefix(FORMATTED_OPENING).removesuffix("}")
            return {"role": "assistant", "content": text if content is None else content}, None
        named = self.mode == "function"  # a call forced: it ends as words do
        if named:
            return self._called(functions), None
        return self._called(functions), "function_call" if self.older else "tool_calls"

    def cut_message(self, text: str) -> dict[str, Any]:
        """The message of an answer `max_tokens` cut: its whole calls and the one it was
        cut in, that one's arguments as far as they came, as OpenAI's; or its words as
        far as they came (the format's JSON, with a response_format). Cut in a call's
        name, or before it, where only one function can be meant (the request names it,
        or offers one, or the name's beginning fits one alone), the call is that one's
        (OpenAI's cut calls carry their names: one cut in `"weath` was no call at all);
        else a forced call says nothing (no words either, as a call's message), and one
        that may be words ("auto") says the text generated, as vLLM answers what it
        cannot read as a call: never an empty answer for tokens the model made (a
        tester's `{"c` was "")."""
        names = self.callable()
        cut = cut_calls(text, names)  # (None: words, not calls)
        # before the name: a call for sure where it must call, or where what came can
        # begin no words (`[`, `{"n`)
        a_call = self.mode != "auto" or not WORDS_OPENING.startswith(text.strip())
        if cut == [] and a_call and len(names) == 1:
            return self._called([{"name": names[0], "arguments": ""}])
        if cut or (cut is not None and self.mode != "auto"):
            return self._called(cut)
        if self.answer_format is not None:  # the format's JSON as far as it came
            written = text.removeprefix(FORMATTED_OPENING)
        else:
            words = StreamedWords()
            words.add(text)
            written = words.sent
        return {"role": "assistant", "content": written or text}

    def callable(self) -> list[str]:
        """The names of the functions the answer may call."""
        if self.mode in ("auto", "required"):
            return [function["name"] for function in self.functions]
        return [self.choice]

    def _called(self, functions: list[dict[str, str]]) -> dict[str, Any]:
        """The message that calls `functions` (none: a forced call cut before its name
        came: no words either, as every other call's message says)."""
        if not functions:
            return {"role": "assistant", "content": None}
        if self.older:
            return {"role": "assistant", "content": None, "function_call": functions[0]}
        tool_calls = [
            {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": function}
            for function in functions
        ]
        return {"role": "assistant", "content": None, "tool_calls": tool_calls}

    def words(self) -> StreamedWords:
        """A reader of the words (or the format's JSON) of an answer that does not call."""
        return StreamedWords(formatted=self.answer_format is not None)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": function} for function in self.functions]


def cut_calls(text: str, names: Sequence[str]) -> list[dict[str, str]] | None:
    """The calls of an answer cut short: each whole one, then the one it was cut in, with
    its arguments as far as they came (none where its name did not come whole and could
    be more than one of `names`, those it may call); None where the answer is no call
    (words). Read in the grammar's layout (`", "`, `": "`); the white space it was cut
    after kept (arguments "as far as they came")."""
    body = text.lstrip()
    listed = body.startswith("[")
    rest = body[1:].lstrip() if listed else body
    if not listed and not rest.startswith(CALL_OPENING):
        # cut before its name: a call, or (`{"`) words, that said nothing yet
        return [] if CALL_OPENING.startswith(rest) else None
    decoder = json.JSONDecoder(parse_float=WrittenNumber, parse_int=WrittenNumber)
    calls: list[dict[str, str]] = []
    another = False  # (a comma after a whole call: another call follows)
    while rest.startswith(CALL_OPENING):
        try:
            call, end = decoder.raw_decode(rest)
        except RecursionError:  # nested past the parser's limit, not cut: as it came
            return None
        except ValueError:  # the call it was cut in
            if (cut := cut_call(rest, names)) is not None:
                calls.append(cut)
            return calls
        calls.append({"name": call["name"], "arguments": as_written(call.get("arguments"))})
        after = rest[end:].lstrip()
        another, rest = after.startswith(","), after.removeprefix(",").lstrip()
    # cut before a later call's name (`, {"`): the one function it can be, as a first
    # call cut so is (`cut_message`)
    cut = cut_call(CALL_OPENING, names) if another and CALL_OPENING.startswith(rest) else None
    return calls if cut is None else [*calls, cut]


def cut_call(text: str, names: Sequence[str]) -> dict[str, str] | None:
    """The call `text` was cut in, its arguments as far as they came ("" before they
    began); None where its name did not come whole and could be more than one of
    `names` (the grammar writes only those: one they begin alike is the one)."""
    named = CUT_CALL.match(text)
    if named is None:
        begun = CUT_NAME.match(text)
        could_be = [name for name in names if begun and name.startswith(begun[1] or "")]
        return {"name": could_be[0], "arguments": ""} if len(could_be) == 1 else None
    name, after = json.loads(f'"{named[1]}"'), named[2]
    if (given := CUT_ARGUMENTS.match(after)) is not None:
        return {"name": name, "arguments": given[1]}
    if ARGUMENTS_KEY.startswith(after):  # cut in the key: its name is whole all the same
        return {"name": name, "arguments": ""}
    return None


def one_schema_an_id(answers: list[Schema]) -> None:
    """Refuse (422) the answers' schemas where two of their parts give one `$id` to
    different schemas: llguidance takes them for one resource, and held a call of one tool
    to another's (its integer taken as the other's string). A tool's own root is its own
    already (`own_resource`); one part given to several tools alike is one schema."""
    given: dict[str, tuple[str, Any]] = {}
    for answer in answers:
        for uri, part in nested_ids(answer):
            first, schema = given.setdefault(uri, (whose_part(answer), part))
            if schema != part:
                raise UnprocessableInput(
                    f'the $id "{uri}" is given to two different schemas ({first}, and '
                    f"{whose_part(answer)}): a grammar takes one resource for both; give "
                    "each its own $id",
                    param="tools",
                )


def whose_part(answer: Schema) -> str:
    arguments = answer.get("properties", {}).get("arguments")
    if isinstance(arguments, dict) and str(arguments.get("$id", "")).startswith(TOOL_RESOURCE):
        return f"in the parameters of function {arguments['$id'].removeprefix(TOOL_RESOURCE)}"
    return "in the response_format"


def nested_ids(schema: Schema) -> list[tuple[str, Any]]:
    """Each part of `schema` beneath a resource's root (rawserve's own: a tool's
    parameters, a format) that begins a resource of its own (an `$id` not a fragment),
    its `$id` absolute (`rebased`) and the part as it is compiled."""
    found: list[tuple[str, Any]] = []
    waiting: list[tuple[Any, bool]] = [(schema, False)]
    while waiting:
        part, nested = waiting.pop()
        if isinstance(part, list):
            waiting += [(each, nested) for each in part]
            continue
        if not isinstance(part, dict):
            continue
        given = part.get("$id")
        if isinstance(given, str) and given and not given.startswith("#"):
            if nested and not given.startswith((TOOL_RESOURCE, FORMAT_RESOURCE)):
                found.append((given, part))
            nested = True
        for key, value in part.items():
            if key in BY_NAME and isinstance(value, dict):
                waiting += [(each, nested) for each in value.values()]
            elif key not in DATA:
                waiting.append((value, nested))
    return found


def call_schema(function: dict[str, Any]) -> Schema:
    arguments = function.get("parameters") or NO_ARGUMENTS
    if arguments is not NO_ARGUMENTS:
        # a resource of its own: a reference in it ("#/$defs/...", as pydantic writes
        # them) is to its own root still, not to the call's that holds it; an object where
        # it leaves its type out (it would hold nothing else: `null` would do)
        resource = TOOL_RESOURCE + function["name"]
        arguments = own_resource({"type": "object", **arguments}, resource)
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def formatted(answer_format: dict[str, Any]) -> Schema:
    """An answer that does not call: `{"content": ...}`, the content held to the format."""
    # a resource of its own, as a function's parameters are (its references to its root)
    content = own_resource(answer_format, FORMAT_RESOURCE)
    return {**WORDS, "properties": {"content": content}}


def own_resource(schema: Schema, resource: str) -> Schema:
    """`schema` as the resource named `resource`, whatever `$id` it gives its root: two
    tools whose parameters gave the same one were one resource to llguidance, and a call of
    the first was held to the second's `$defs`. Its references lead where they led: one
    that names its root by that `$id` names it by `resource`, one relative to it is made
    absolute, and an older draft's `"$id": "#name"` at its root is the anchor it named."""
    given = schema.get("$id")
    rest = {key: value for key, value in schema.items() if key != "$id"}
    if isinstance(given, str) and ANCHOR_ID.fullmatch(given):
        rest = {"$anchor": given[1:], **rest}
    elif isinstance(given, str) and given and not given.startswith("#"):
        rest = rebased(rest, given, urldefrag(given).url, resource)
    return {"$id": resource, **rest}


def rebased(part: Any, base: str, root: str, resource: str) -> Any:
    """`part` of a schema (a schema, or a list of them) whose root's `$id` was `root`,
    within the resource `base` begins, its references and `$id`s absolute, those to `root`
    to `resource` instead (a reference within the resource, `#...`, is left as written: it
    leads where it led). What a schema's data keywords hold is data, left as written."""
    if isinstance(part, list):
        return [rebased(each, base, root, resource) for each in part]
    if not isinstance(part, dict):
        return part
    part = dict(part)
    given = part.get("$id")
    if isinstance(given, str) and given and not given.startswith("#"):
        base = part["$id"] = urljoin(base, given)
    reference = part.get("$ref")
    if isinstance(reference, str) and not reference.startswith("#"):
        target = urldefrag(urljoin(base, reference))
        whole = resource if target.url == root else target.url
        part["$ref"] = f"{whole}#{target.fragment}" if target.fragment else whole
    for key, value in part.items():
        if key in BY_NAME and isinstance(value, dict):
            named = value.items()
            part[key] = {name: rebased(each, base, root, resource) for name, each in named}
        elif key not in DATA and isinstance(value, dict | list):
            part[key] = rebased(value, base, root, resource)
    return part


def read_tools(name: str, value: Any, context: DocContext | None) -> list[dict[str, Any]]:
    """OpenAI's tools: functions, each with a name and a JSON schema of its arguments."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise BadRequest(f'"{name}" must be a list of at most {MAX_TOOLS} tools')
    functions = []
    for tool in value:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise BadRequest('each tool must be {"type": "function", "function": {"name", ...}}')
        functions.append(function)
    return read_functions(name, functions, context)


def read_functions(name: str, value: Any, context: DocContext | None) -> list[dict[str, Any]]:
    """Functions, each with a name and a JSON schema of its arguments (OpenAI's older
    `functions`; each of `tools` holds one)."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise BadRequest(f'"{name}" must be a list of at most {MAX_TOOLS} functions')
    functions: dict[str, dict[str, Any]] = {}
    for function in value:
        if not isinstance(function, dict) or "name" not in function:
            raise BadRequest(
                'each function must be {"name", "description", "parameters"}'
                + (' (a tool\'s "function")' if name == "tools" else "")
            )
        named = function.get("name")
        if (
            not isinstance(named, str)
            or not named
            or len(named) > 64
            or not all(c.isascii() and (c.isalnum() or c in "_-") for c in named)
        ):
            raise BadRequest("a function's name must be 1-64 letters, digits, _ or -")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"the parameters of {named} must be a JSON schema (an object)")
        # a call's arguments are an object (OpenAI's rule, and what agents parse them as):
        # a schema of another type made `"arguments": "\"abc\""`
        if parameters and parameters.get("type", "object") != "object":
            raise BadRequest(
                f'the parameters of {named} must be a schema of an object ("type": "object"),'
                f" not {json.dumps(parameters['type'])}"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"the description of {named} must be a text")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise BadRequest(f'"strict" of {named} must be true or false')
        if named in functions:
            raise BadRequest(f"two tools are named {named}")
        functions[named] = {
            key: function[key] for key in ("name", "description", "parameters") if key in function
        }
    return list(functions.values())


def read_tool_choice(name: str, value: Any, context: DocContext | None) -> str | ForcedCall:
    """ "none", "auto", "required", or the name of the function the answer must call: as
    OpenAI names it (`{"type": "function", "function": {"name"}}`), or by itself, as TGI
    reads any other text (InferenceClient's `tool_choice="get_weather"`)."""
    if isinstance(value, str) and value:
        return value
    function = value.get("function") if isinstance(value, dict) else None
    # (a choice without "type" is a function's, as vLLM takes it; another type is none)
    # (an empty name forced no function: it was read as "auto")
    if (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and function["name"]
        and value.get("type", "function") == "function"
    ):
        return ForcedCall(function["name"])
    raise BadRequest(
        f'"{name}" must be "none", "auto", "required" or {{"type": "function", "function": '
        '{"name": ...}}'
    )


def read_function_call(name: str, value: Any, context: DocContext | None) -> str | ForcedCall:
    """OpenAI's older `function_call`: "none", "auto", or `{"name": ...}`, the function the
    answer must call."""
    if value in ("none", "auto"):
        return str(value)
    if isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"]:
        return ForcedCall(value["name"])
    raise BadRequest(f'"{name}" must be "none", "auto" or {{"name": ...}}')


def chat_tools(
    functions: list[dict[str, Any]] | None,
    choice: str | ForcedCall | None,
    parallel: bool = False,
    older: bool = False,
) -> Tools | None:
    """The tools a chat's answer may call; None where it calls none. `older`: asked as
    `functions` and `function_call` (one call an answer)."""
    choice_field, offered = ("function_call", "functions") if older else ("tool_choice", "tools")
    forced = isinstance(choice, ForcedCall)
    named = choice.name if isinstance(choice, ForcedCall) else choice
    if not functions:
        if forced or named not in (None, "none", "auto"):
            said = f"names the function {named!r}" if forced else f"is {named!r}"
            raise BadRequest(
                f'"{choice_field}" {said}, and the request offers no {offered}',
                param=choice_field,
            )
        return None
    named = named or "auto"
    tools = Tools(functions, named, older=older, forced=forced)
    if tools.mode == "function" and named not in (function["name"] for function in functions):
        raise BadRequest(
            f'"{choice_field}" names {named}, which is not among the {offered}', param=choice_field
        )
    # a function named is called once (OpenAI's "forced function": exactly one call)
    several = parallel and not older and tools.mode in ("auto", "required")
    return replace(tools, parallel=several)


class WrittenNumber(str):
    """A JSON number as the model wrote it: read as a float, 1e999 would be written back
    as Infinity, which is not JSON; read as an int, one of over 4,300 digits is an error
    (Python's bound), and -0 would be written back as 0."""


def as_written(value: Any) -> str:
    """A call's arguments (read with their numbers as written) as a text of JSON again."""
    if isinstance(value, WrittenNumber):
        return str(value)
    if isinstance(value, dict):
        members = (
            f"{json.dumps(key, ensure_ascii=False)}: {as_written(item)}"
            for key, item in value.items()
        )
        return "{" + ", ".join(members) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(as_written(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


# how an answer in words begins, as the grammar lays JSON out (a space after the colon);
# one held to a response_format begins without the quote
WORDS_OPENING = '{"content": "'
FORMATTED_OPENING = '{"content": '
CALL_OPENING = '{"name": '
# a call cut in its arguments: its name whole, its arguments as far as they came
CUT_CALL = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)"(.*)\Z', re.DOTALL)
# a call cut in its name, or before it (OpenAI's names need no escapes)
CUT_NAME = re.compile(r'\{"name": ?(?:"([a-zA-Z0-9_-]*))?\Z')
CUT_ARGUMENTS = re.compile(r', "arguments":\s?(.*)\Z', re.DOTALL)
ARGUMENTS_KEY = ', "arguments": '


class StreamedWords:
    """A streamed answer held to tools, read as it comes: where it writes words
    (`{"content": "..."}`), the words, decoded from JSON a whole character at a time;
    where it calls, nothing until its end (`sent` stays empty). `formatted`: the content
    is JSON of the request's response_format, sent as written but for its last character
    (which may be the closing brace around it)."""

    def __init__(self, formatted: bool = False) -> None:
        self.formatted = formatted
        self.opening = FORMATTED_OPENING if formatted else WORDS_OPENING
        self.raw = ""  # the JSON so far
        self.read = len(self.opening)  # where the words not yet decoded start in it
        self.sent = ""
        self.closed = False  # the words' closing quote has come

    def add(self, piece: str) -> str:
        """The words `piece` completes ("" while none: still the opening, a call, or an
        escape not yet whole)."""
        self.raw += piece
        if self.closed or not self.raw.startswith(self.opening):
            return ""
        if self.formatted:
            written = self.raw[self.read : -1]
            self.read += len(written)
            self.sent += written
            return written
        words = []
        while self.read < len(self.raw):
            character = self.raw[self.read]
            if character == '"':
                self.closed = True
                break
            length = escape_length(self.raw, self.read) if character == "\\" else 1
            if self.read + length > len(self.raw):
                break  # an escape not yet whole
            words.append(json.loads(f'"{self.raw[self.read : self.read + length]}"'))
            self.read += length
        self.sent += "".join(words)
        return "".join(words)


def words_end(raw: str, length: int) -> int | None:
    """Where in `raw`, an answer held to tools (a reasoning model's thinking before it,
    perhaps), the first `length` characters of its words end; None where it holds none.
    The words open at the last `WORDS_OPENING`: a thinking may quote one (the first was
    taken, and the tokens listed ended inside the thinking), and none follows the words'
    own, in which a quote is escaped."""
    start = raw.rfind(WORDS_OPENING)
    if start < 0:
        return None
    at = start + len(WORDS_OPENING)
    for _ in range(length):
        if at >= len(raw):
            break
        at += escape_length(raw, at) if raw[at] == "\\" else 1
    return at


def escape_length(raw: str, start: int) -> int:
    """The length of the JSON escape at `start`: `\\uXXXX` (twice for a surrogate pair), or a
    backslash and one character."""
    if raw[start + 1 : start + 2] != "u":
        return 2
    high = raw[start + 2 : start + 6]
    if len(high) == 4 and 0xD800 <= int(high, 16) < 0xDC00:
        return 12  # a character beyond the first 65,536: two escapes
    return 6

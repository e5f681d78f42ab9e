"""OpenAI's chat messages: reading a chat body's `messages` into what the chat template
takes (role and text content, an assistant's tool calls with their arguments as objects, a
tool's answer to one), and the schema `/openapi.json` shows for one message. What an
answer's message carries beside its content, sent back with it, is taken and dropped
(an assistant's refusal is the text it answered; a reasoning model's thinking goes to the
template as `reasoning_content`, which reasoning models' templates read). The rest of the
chat body is `openai_generation`'s. Server process; plain Python.
"""

from __future__ import annotations

from typing import Any

from rawserve.api.fields import unicode_text
from rawserve.api.routing import DocContext, Schema
from rawserve.http.errors import BadRequest
from rawserve.shared import json_text

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# what an answer's message carries beside its content, sent back with it as OpenAI's SDK
# dumps it (`message.model_dump()`): an assistant's refusal, web search's citations, audio,
# and the structured answer that the SDK's `parse()` read out of the content (dropped)
ANSWER_KEYS = {"refusal", "annotations", "audio", "parsed"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call"}
MESSAGE_KEYS |= ANSWER_KEYS
# an assistant's thinking, sent back as a reasoning model's answer had it (vLLM's and
# DeepSeek's name, and the newer vLLM's): the template's `reasoning_content`
REASONING_KEYS = ("reasoning_content", "reasoning")
MESSAGE_KEYS |= set(REASONING_KEYS)

# OpenAI's mark of where a cacheable prompt prefix ends (on any text part): a hint to
# its prompt cache, which changes no answer; taken and dropped
CACHE_BREAKPOINT = "prompt_cache_breakpoint"


def read_messages(name: str, value: Any, context: DocContext | None) -> list[dict[str, str]]:
    if value is None:
        raise BadRequest(f'"{name}" is required')
    return messages(value)


def messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as the chat template takes them: role and text content, an
    assistant's tool calls (their arguments as objects, as templates write them) and a
    tool's answer to one. A refusal names where its fault is, `messages[2].content[0]`,
    in its text and its `param`, as OpenAI's do."""
    if not isinstance(value, list) or not value:
        raise BadRequest('"messages" must be a non-empty list of {"role", "content"}')
    checked = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        try:
            checked.append(one_message(message))
        except BadRequest as exc:
            inner = f"{where}.{exc.param}" if exc.param else where
            raise BadRequest(f"{inner}: {exc.message}", param=inner) from None
    return checked


def one_message(message: Any) -> dict[str, Any]:
    """One message of `messages`; a refusal's `param` is where in it the fault is
    (`content[1]`), or None: the message as a whole."""
    if not isinstance(message, dict):
        raise BadRequest(
            'each message must be {"role", "content"} (and "name"; an assistant\'s '
            '"tool_calls", a tool\'s "tool_call_id")'
        )
    if unknown := sorted(set(message) - MESSAGE_KEYS):
        raise BadRequest(
            f"a message cannot have {', '.join(repr(key)[:60] for key in unknown[:10])}"
            f" (its fields: {', '.join(sorted(MESSAGE_KEYS))})"
        )
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"each message's role must be one of {', '.join(ROLES)}", param="role")
    entry: dict[str, Any] = {"role": role}
    refusal = refusal_text(message, role)
    calls = message.get("tool_calls")  # null (TGI's client sends it) or []: none
    if not isinstance(calls, (list, type(None))):
        raise BadRequest("a message's tool_calls must be a list of tool calls", param="tool_calls")
    if (called := message.get("function_call")) is not None:  # OpenAI's older form
        calls = [*(calls or []), {"function": called}]
    if role == "function":  # OpenAI's older tool's answer: a tool's, as templates take it
        role = entry["role"] = "tool"
    thought = reasoning_text(message, role)
    content = message.get("content")
    if calls:
        if role != "assistant":
            sent, what = (
                ("tool_calls", "tool calls")
                if message.get("tool_calls")
                else ("function_call", "a function call")
            )
            raise BadRequest(f"only an assistant's message has {what}", param=sent)
        entry["tool_calls"] = []
        for number, call in enumerate(calls):
            try:
                entry["tool_calls"].append(template_call(call))
            except BadRequest as exc:  # (the older function_call is the last)
                field = "function_call" if called is not None and number == len(calls) - 1 else None
                raise BadRequest(exc.message, param=field or f"tool_calls[{number}]") from None
        # (null beside calls)
        entry["content"] = "" if content in (None, "") else message_text(content)
    else:
        # (an assistant's null beside its refusal, or beside thinking that never closed)
        if content is None and thought is not None:
            content = ""
        if content in (None, "") and refusal:
            content = refusal
        if content is None and role == "assistant":
            raise BadRequest("an assistant's message needs its content or its tool calls")
        entry["content"] = message_text(content)
    if thought is not None:
        entry["reasoning_content"] = thought
    for key in ("name", "tool_call_id"):
        if (given := message.get(key)) is not None:
            if not isinstance(given, str):
                raise BadRequest(f"a message's {key} must be a string", param=key)
            entry[key] = unicode_text(given, f"a message's {key}")
    return entry


def refusal_text(message: dict[str, Any], role: str) -> str | None:
    """An assistant's refusal, the text it answered (None: none). An answer's other fields
    sent back with it are dropped: its citations, and its audio where it had none (rawserve
    answers no audio, and takes none)."""
    if message.get("audio") is not None:
        raise BadRequest("a message's audio is not supported by this server: it takes only null")
    if not isinstance(message.get("annotations", []), (list, type(None))):
        raise BadRequest("a message's annotations must be a list")
    refusal = message.get("refusal")
    if refusal is None:
        return None
    if role != "assistant" or not isinstance(refusal, str):
        raise BadRequest("only an assistant's message has a refusal, a text")
    return unicode_text(refusal, "a message's refusal")


def reasoning_text(message: dict[str, Any], role: str) -> str | None:
    """An assistant's thinking, under either name (None: none)."""
    given = [message[key] for key in REASONING_KEYS if message.get(key) is not None]
    if not given:
        return None
    if role != "assistant" or not all(isinstance(text, str) for text in given):
        raise BadRequest("only an assistant's message has reasoning_content, a text")
    return unicode_text(given[0], "a message's reasoning_content")


def template_call(call: Any) -> dict[str, Any]:
    """An assistant's tool call as chat templates take it: its arguments an object where
    OpenAI's text of them is one (or is empty: a call without arguments)."""
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or not isinstance(function.get("arguments"), str)
    ):
        raise BadRequest(
            'each tool call must be {"id", "type": "function", "function": {"name", '
            '"arguments": a text of JSON}}'
        )
    # none written (a call of a function without parameters) are none, as vLLM reads them;
    # a text that is no JSON, or nests past a body's levels, is given as it is (an
    # object 500 deep could not be pickled to the worker)
    written = function["arguments"]
    try:
        arguments = json_text.loads(written, deepest=json_text.MAX_DEPTH) if written.strip() else {}
    except (ValueError, RecursionError):  # (a text nested past the parser's limit)
        arguments = written
    entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        entry["id"] = call["id"]
    return entry


def message_text(content: Any) -> str:
    """A message's content: a text, or a list of text parts (joined; an assistant's
    refusal part is the text it answered)."""
    if isinstance(content, str):
        return unicode_text(content, "a message's content")
    if not isinstance(content, list) or not content:
        raise BadRequest(
            "a message's content must be a text or a non-empty list of text parts",
            param="content",
        )
    texts = []
    for number, part in enumerate(content):
        try:
            texts.append(part_text(part))
        except BadRequest as exc:
            raise BadRequest(exc.message, param=f"content[{number}]") from None
    return "".join(texts)


def part_text(part: Any) -> str:
    """One part of a message's content: a text part's text, or a refusal part's."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("text", "refusal"):
        shown = f" (not {kind!r:.40})" if isinstance(kind, str) else ""
        raise BadRequest(
            'content parts must be {"type": "text", "text": ...}: text only, this server '
            f"reads no images, audio or files{shown}"
        )
    key = "refusal" if kind == "refusal" else "text"
    if not isinstance(part.get(key), str):
        raise BadRequest(f"a {kind} part's {key!r} must be a text")
    if unknown := sorted(set(part) - {"type", key, CACHE_BREAKPOINT}):
        raise BadRequest(
            f"a {kind} part cannot have {', '.join(repr(name)[:60] for name in unknown[:10])}"
            f" (its fields: type, {key})"
        )
    return unicode_text(part[key], "a message's content")


# --- the schema of one message ------------------------------------------------------------

TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"const": "text"},
        "text": {"type": "string"},
        CACHE_BREAKPOINT: {"type": ["object", "null"]},
    },
    "additionalProperties": False,
}
REFUSAL_PART: Schema = {  # an assistant's, sent back as OpenAI's answer had it
    "type": "object",
    "required": ["type", "refusal"],
    "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
    "additionalProperties": False,
}
TOOL_CALL: Schema = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [TEXT_PART, REFUSAL_PART]}, "minItems": 1},
                {"type": "null"},  # (an assistant's, beside its tool calls)
            ]
        },
        "name": {"type": "string"},
        "tool_calls": {"type": ["array", "null"], "items": TOOL_CALL},
        "function_call": {"anyOf": [TOOL_CALL["properties"]["function"], {"type": "null"}]},
        "tool_call_id": {"type": "string"},
        # an answer's, sent back with it: what an assistant refused with, citations (dropped)
        "refusal": {"type": ["string", "null"]},
        "annotations": {"type": ["array", "null"]},
        "audio": {"type": "null"},
        "parsed": {},  # the SDK's `parse()` result: any JSON
        # a reasoning model's answer's thinking, sent back with it
        "reasoning_content": {"type": ["string", "null"]},
        "reasoning": {"type": ["string", "null"]},
    },
    "additionalProperties": False,
    # only an assistant's may be without its content (beside its tool calls or refusal)
    "if": {"properties": {"role": {"const": "assistant"}}},
    "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
}

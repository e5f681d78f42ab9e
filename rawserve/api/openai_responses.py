"""OpenAI's Responses API for text-generation models, `POST /v1/responses`: its body read
into a chat (`openai_generation`'s, so a response is generated as a chat is: the same
template, sampling, grammar, deadline and queue), and its answers, a Response object whole
or as the SDK's stream of named events.

Served: `input` (a text, or messages whose content is a text or text parts), `instructions`
(a system message first), `max_output_tokens`, `temperature`, `top_p`, `stream` and
`text.format` (chat's `response_format`). Nothing is stored (`store` is taken, as false);
`metadata` and `user` are checked, then dropped. What needs stored responses or tools
(`previous_response_id`, `conversation`, `background`, tools, input items that are not
messages: images, files, function outputs) is refused with 400 naming its field. Server
process; plain Python.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from typing import Any

from rawserve.api.fields import Body, Field, flag, text, unicode_text, whole
from rawserve.api.openai_answers import Streamed, cut_at_stop, finish_reason, stops_from, usage
from rawserve.api.openai_generation import (
    COMMON,
    MAX_NEW_TOKENS,
    METADATA,
    OPENAI_RESPONSE_FORMAT,
    GenerationRequest,
    parse_chat,
    read_metadata,
    read_response_format,
    refuse_unserved,
    unserved,
)
from rawserve.api.routing import DocContext, Schema
from rawserve.api.streaming import TokenStream, merged
from rawserve.http.encoding import dumps
from rawserve.http.errors import BadRequest, HTTPError

ROLES = ("user", "assistant", "system", "developer")
# the text parts a message's content may hold: the client's, and an earlier answer's
# (sent back as the SDK dumps an output item)
PART_KEYS = {
    "input_text": {"type", "text"},
    "output_text": {"type", "text", "annotations", "logprobs"},
}
# (an earlier answer's `id`, `status` and `phase`, null or OpenAI's "commentary" or
# "final_answer", come back with it and are dropped)
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
INPUT_HELP = (
    '"input" must be a text or a non-empty list of messages {"role", "content"}, each '
    'content a text or a list of {"type": "input_text", "text"} parts (this server serves '
    "text messages only: no images, files or function call outputs)"
)


def read_input(name: str, value: Any, context: DocContext | None) -> list[dict[str, str]]:
    """`input` as a chat's messages: a text is the user's."""
    if value is None:
        raise BadRequest(f'"{name}" is required')
    if isinstance(value, str):
        return [{"role": "user", "content": unicode_text(value, '"input"')}]
    if not isinstance(value, list) or not value:
        raise BadRequest(INPUT_HELP)
    return [input_message(item) for item in value]


def input_message(item: Any) -> dict[str, str]:
    if (
        not isinstance(item, dict)
        or item.get("type", "message") != "message"
        or not set(item) <= MESSAGE_KEYS
        or item.get("role") not in ROLES
    ):
        raise BadRequest(INPUT_HELP)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": item["role"], "content": unicode_text(content, '"input"')}
    if not isinstance(content, list) or not content:
        raise BadRequest(INPUT_HELP)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_KEYS or not isinstance(part.get("text"), str):
            raise BadRequest(INPUT_HELP)
        if not {"type", "text"} <= set(part) <= PART_KEYS[kind]:
            raise BadRequest(INPUT_HELP)
        texts.append(unicode_text(part["text"], '"input"'))
    return {"role": item["role"], "content": "".join(texts)}


def read_text(name: str, value: Any, context: DocContext | None) -> dict[str, Any] | None:
    """`text`: its `format` as chat's `response_format` (None: free text)."""
    if not isinstance(value, dict) or not set(value) <= {"format", "verbosity"}:
        raise BadRequest(f'"{name}" must be {{"format": {{"type": ...}}}}')
    if value.get("verbosity") not in (None, "medium"):
        raise BadRequest(f'"{name}.verbosity" is not supported by this server: it takes only null')
    form = value.get("format")
    if form is None:
        return None
    if isinstance(form, dict) and form.get("type") == "json_schema":
        # (chat's form holds the schema one level down)
        inner = {
            key: form[key] for key in ("name", "schema", "strict", "description") if key in form
        }
        form = {"type": "json_schema", "json_schema": inner}
    try:
        return read_response_format(name, form, context)
    except BadRequest:
        raise BadRequest(
            f'"{name}.format" must be {{"type": "text"}}, {{"type": "json_object"}} or '
            '{"type": "json_schema", "name": ..., "schema": {...}}'
        ) from None


TEXT_FORMAT = OPENAI_RESPONSE_FORMAT["properties"]["type"]
RESPONSES = Body(
    {
        "input": Field(
            {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]},
            read_input,
            reads_null=True,
            required=True,
        ),
        "instructions": text("a system message before the input"),
        "max_output_tokens": whole(1, MAX_NEW_TOKENS),
        "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"],
        "stream": COMMON["stream"],
        "text": Field(
            {
                "type": ["object", "null"],
                "properties": {"format": {"type": "object", "properties": {"type": TEXT_FORMAT}}},
            },
            read_text,
        ),
        # nothing is stored: taken as false, as OpenAI's clients send it
        "store": flag(False, "taken; nothing is stored"),
        "metadata": Field(METADATA, read_metadata),
        "user": text(),
        "safety_identifier": text(),
        "prompt_cache_key": text(),
        "parallel_tool_calls": flag(True),
        # what needs stored responses, tools or OpenAI's models: their off values only
        "previous_response_id": unserved({"type": "null"}),
        "conversation": unserved({"type": "null"}),
        "background": unserved({"enum": [False, None]}, False),
        "tools": unserved({"enum": [[], None]}, []),
        "tool_choice": unserved({"enum": ["none", "auto", None]}, "none", "auto"),
        "include": unserved({"enum": [[], None]}, []),
        "reasoning": unserved({"type": "null"}),
        "prompt": unserved({"type": "null"}),
        "truncation": unserved({"enum": ["disabled", None]}, "disabled"),
        "service_tier": unserved({"enum": ["auto", "default", None]}, "auto", "default"),
        "top_logprobs": unserved({"enum": [0, None]}, 0),
        "max_tool_calls": unserved({"type": "null"}),
        # (no delta is padded: obfuscation taken off only)
        "stream_options": unserved(
            {"type": ["object", "null"]}, {}, {"include_obfuscation": False}
        ),
    }
)
UNSERVED = (
    "previous_response_id",
    "conversation",
    "background",
    "tools",
    "tool_choice",
    "include",
    "reasoning",
    "prompt",
    "truncation",
    "service_tier",
    "top_logprobs",
    "max_tool_calls",
    "stream_options",
)
BOOKKEEPING = (
    "store",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "parallel_tool_calls",
)
# a Response's settings, said back as it was asked (OpenAI's answer repeats them)
SETTINGS = ("instructions", "max_output_tokens", "temperature", "top_p")


def parse_response(document: Any) -> tuple[GenerationRequest, dict[str, Any]]:
    """The chat a Responses body asks for, and the settings its answer says back."""
    fields = RESPONSES.read(document)
    refuse_unserved(fields, UNSERVED)
    for name in BOOKKEEPING:  # checked, then dropped
        fields.value(name)
    messages = fields.value("input")
    instructions = fields.value("instructions")
    if instructions is not None:
        system = {"role": "system", "content": unicode_text(instructions, '"instructions"')}
        messages = [system, *messages]
    chat: dict[str, Any] = {"messages": messages}
    for name, chats in (
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
    ):
        if (value := fields.value(name)) is not None:
            chat[chats] = value
    form = fields.value("text")
    if form is not None:
        chat["response_format"] = form  # (the grammar, in the form chat takes too)
    generation = replace(parse_chat(chat), max_tokens_field="max_output_tokens")
    settings = {name: fields.value(name) for name in SETTINGS}
    settings["text"] = {"format": (fields.get("text") or {}).get("format")}
    return generation, settings


def event(kind: str, number: int, **fields: Any) -> bytes:
    """One of the stream's events, named as the SDK reads them."""
    document = {"type": kind, "sequence_number": number, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + dumps(document) + b"\n\n"


class ResponseAnswer:
    """A Response: its ids, the settings it says back, and its message's text whole or as
    events."""

    def __init__(
        self, model: str, settings: dict[str, Any], clock: Callable[[], float] = time.time
    ):
        self.model = model
        self.settings = settings
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(clock())

    def response(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        form = self.settings["text"]["format"] or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "none",
            "tools": [],
            "store": False,
            "previous_response_id": None,
            "metadata": {},
            **{name: self.settings[name] for name in SETTINGS},
            "text": {"format": form},
            "usage": None,
            **fields,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [output_text(text)],
        }

    def finished(self, output: dict[str, Any], text: str) -> dict[str, Any]:
        """The Response once `output` has finished: incomplete where its tokens ran out."""
        counted = usage([output])
        used = {
            "input_tokens": counted["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": counted["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": output["details"].get("reasoning_tokens", 0)
            },
            "total_tokens": counted["total_tokens"],
        }
        if finish_reason(output["details"]) == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            status, incomplete = "completed", None
        message = self.message(text, status)
        return self.response(status, [message], incomplete_details=incomplete, usage=used)

    def whole(
        self, outputs: Sequence[dict[str, Any]], stops: Sequence[str], *_: Any
    ) -> dict[str, Any]:
        """The Response (`_`: chat's echoes and choice count; a Response has none and one)."""
        [output] = outputs
        return self.finished(
            output, cut_at_stop(output["generated_text"], stops, stops_from(output))
        )

    async def events(
        self, streams: Sequence[TokenStream], stops: Sequence[str], *_: Any
    ) -> AsyncGenerator[bytes, None]:
        """OpenAI's events for a streamed Response: it opens, its message and text part
        open, the text comes as deltas, each closes, and the Response ends completed,
        incomplete, or failed (a deadline or error once the answer has begun)."""
        number = iter(range(1 << 62))
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            opened = self.response("in_progress", [])
            yield event("response.created", next(number), response=opened)
            yield event("response.in_progress", next(number), response=opened)
            item = self.message("", "in_progress")
            yield event("response.output_item.added", next(number), output_index=0, item=item)
            part = output_text("")
            yield event("response.content_part.added", next(number), **where, part=part)
            choice = Streamed()
            async for _index, chunk in merged(streams):
                if chunk is not None:
                    sending = choice.add(chunk.token, stops, None)
                    if sending is not None:
                        yield self.delta(next(number), where, sending[0])
            try:
                output = streams[0].output()
            except HTTPError as error:  # OpenAI's stream ends so when its answer fails
                streams[0].ended_with(error)
                failure = {"code": "server_error", "message": error.message}
                # the text sent before the failure stays in it, as OpenAI's keeps it
                said = [self.message(choice.sent, "incomplete")] if choice.sent else []
                failed = self.response("failed", said, error=failure)
                yield event("response.failed", next(number), response=failed)
                return
            if (sending := choice.rest(output, stops)) is not None:
                yield self.delta(next(number), where, sending[0])
            answered = self.finished(output, choice.sent)
            [message] = answered["output"]
            [part] = message["content"]
            text_done = {**where, "text": choice.sent, "logprobs": []}
            yield event("response.output_text.done", next(number), **text_done)
            yield event("response.content_part.done", next(number), **where, part=part)
            yield event("response.output_item.done", next(number), output_index=0, item=message)
            ended = "response." + answered["status"]  # completed or incomplete, as OpenAI's
            yield event(ended, next(number), response=answered)
        finally:
            for stream in streams:
                stream.close()

    def delta(self, number: int, where: dict[str, Any], text: str) -> bytes:
        return event("response.output_text.delta", number, **where, delta=text, logprobs=[])


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


USAGE: Schema = {
    "type": ["object", "null"],
    "required": ["input_tokens", "output_tokens", "total_tokens"],
    "properties": {
        "input_tokens": {"type": "integer"},
        "output_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}
MESSAGE_ITEM: Schema = {
    "type": "object",
    "required": ["type", "role", "content"],
    "properties": {"type": {"const": "message"}, "role": {"const": "assistant"}},
}
RESPONSE_SCHEMA: Schema = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]},
        "incomplete_details": {
            "anyOf": [{"type": "null"}, {"properties": {"reason": {"const": "max_output_tokens"}}}]
        },
        "model": {"type": "string"},
        "output": {"type": "array", "items": MESSAGE_ITEM},
        "usage": USAGE,
    },
}
EVENT_SCHEMA: Schema = {
    "type": "object",
    "description": "each as `event: <type>` and `data: <this>`: response.created, "
    "response.in_progress, response.output_item.added, response.content_part.added, "
    "response.output_text.delta..., response.output_text.done, response.content_part.done, "
    "response.output_item.done, then response.completed, response.incomplete or "
    "response.failed",
    "required": ["type", "sequence_number"],
    "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer"}},
}

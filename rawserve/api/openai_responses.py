"""OpenAI's Responses API for text-generation models, `POST /v1/responses`: its body read
into a chat (`openai_generation`'s, so a response is generated as a chat is: the same
template, sampling, grammar, deadline and queue), and its answers, a Response object whole
or as the SDK's stream of named events.

Served: `input` (a text, or messages whose content is a text or text parts, an
assistant's refusal part the text it answered: read by `openai_responses_input`),
`instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`,
`stream`, `text.format` (chat's `response_format`), and `include`'s
`"message.output_text.logprobs"` with `top_logprobs` (the answer's tokens' log
probabilities on its text part and its deltas, as chat lists them). Nothing is stored (`store` is
taken, as false); `metadata` and `user` are checked, then dropped. What needs stored
responses or tools (`previous_response_id`, `conversation`, `background`, tools, input
items that are not messages: images, files, function outputs) is refused with 400 naming
its field.

A reasoning model's thinking (`reasoning`) is a `reasoning` item before the message, its
text as a `reasoning_text` part (as vLLM sends an open model's raw thinking; no summary),
the message's text the answer alone; whole or streamed (`response.reasoning_text.delta`
events, then the message's). Thinking never closed (`max_output_tokens` reached inside it)
is a reasoning item alone. A `reasoning` item sent back among the input goes to the
template as the next assistant message's `reasoning_content`, as chat's does; a
`reasoning.effort` is chat's `reasoning_effort` (the template's to read). Server
process; plain Python.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from rawserve.api.fields import Body, Field, flag, text, unicode_text, whole
from rawserve.api.openai_answers import (
    Release,
    Streamed,
    cut_at_stop,
    finish_reason,
    stops_from,
    usage,
)
from rawserve.api.openai_generation import (
    COMMON,
    MAX_NEW_TOKENS,
    MAX_TOP_N_TOKENS,
    METADATA,
    OPENAI_RESPONSE_FORMAT,
    PROMPT_CACHE,
    REASONING_EFFORTS,
    SCHEMA_NAME_SCHEMA,
    GenerationRequest,
    check_schema_description,
    parse_chat,
    read_metadata,
    read_response_format,
    refuse_unserved,
    template_effort,
    unserved,
    with_logprobs,
)
from rawserve.api.openai_logprobs import Listed, answer_tokens, chat_logprobs
from rawserve.api.openai_responses_input import read_input, refuse_unknown
from rawserve.api.reasoning import CONTENT, REASONING, Thinking, split_answer
from rawserve.api.routing import DocContext, Schema
from rawserve.api.streaming import TokenStream, event_json, merged
from rawserve.http.errors import BadRequest

# the fields of each `text.format` (a json_schema's schema beside its name, not inside
# chat's "json_schema"; a json_object's schema as chat takes it)
FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type", "schema"},
    "json_schema": {"type", "name", "schema", "strict", "description"},
}


def read_reasoning(name: str, value: Any, context: DocContext | None) -> Any:
    """OpenAI's reasoning settings: an `effort` (chat's `reasoning_effort`, which the
    model's template may read), no summary (what a model thinks is said as it is)."""
    if not isinstance(value, dict) or not (
        set(value) <= {"effort", "summary", "generate_summary"}
        and value.get("effort") in (None, *REASONING_EFFORTS)
        and value.get("summary") is None
        and value.get("generate_summary") is None
    ):
        raise BadRequest(
            f'"{name}" is not supported by this server: it takes only null, or an '
            f'"effort" ({", ".join(REASONING_EFFORTS)}) with no summary',
            param=name,
        )
    return value


NO_REASONING = {"effort": None, "summary": None}  # a Response's reasoning, unasked
# what `include` may ask for: the answer's tokens' log probabilities (the others need
# stored responses, tools or images)
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def read_include(name: str, value: Any, context: DocContext | None) -> list[str]:
    """`include`: what the answer adds; of OpenAI's, only its tokens' log probabilities."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadRequest(f'"{name}" must be a list of texts', param=name)
    for item in value:
        if item != OUTPUT_LOGPROBS:
            raise BadRequest(
                f'"{name}" {item!r} is not supported by this server: it takes only '
                f'"{OUTPUT_LOGPROBS}"',
                param=name,
            )
    return value


def read_text(name: str, value: Any, context: DocContext | None) -> dict[str, Any] | None:
    """`text`: its `format` as chat's `response_format` (None: free text)."""
    if not isinstance(value, dict):
        raise BadRequest(f'"{name}" must be {{"format": {{"type": ...}}}}')
    refuse_unknown(value, {"format", "verbosity"}, name, f'"{name}"')
    if value.get("verbosity") not in (None, "medium"):
        raise BadRequest(
            f'"{name}.verbosity" is not supported by this server: it takes only null or "medium"',
            param=f"{name}.verbosity",
        )
    form = value.get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if isinstance(kind, str) and kind in FORMAT_KEYS:
        refuse_unknown(form, FORMAT_KEYS[kind], f"{name}.format", f'a "{kind}" format')
    if kind == "json_schema":
        form = chat_json_schema(form, f"{name}.format")
    try:
        return read_response_format(name, form, context)
    except BadRequest as error:
        inner = f"{name}.json_schema."  # (chat's place of the fields a Response's format has)
        if error.param is not None and error.param.startswith(inner):
            param = f"{name}.format." + error.param.removeprefix(inner)
            raise BadRequest(error.message.replace(error.param, param), param=param) from None
        raise BadRequest(
            f'"{name}.format" must be {{"type": "text"}}, {{"type": "json_object"}} or '
            '{"type": "json_schema", "name": ..., "schema": {...}}',
            param=f"{name}.format",
        ) from None


def chat_json_schema(form: dict[str, Any], at: str) -> dict[str, Any]:
    """A json_schema `text.format` (`at`) in chat's form, its schema one level down; 400
    naming its field where its name is not OpenAI's (1 to 64 letters, digits, _ or -)."""
    check_schema_description(at, form)
    inner = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
    return {"type": "json_schema", "json_schema": inner}


TEXT_FORMAT = OPENAI_RESPONSE_FORMAT["properties"]["type"]
RESPONSES = Body(
    {
        "input": Field(
            # (a text is the user's message; else items: messages, earlier answers' parts)
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "object"}},
                ]
            },
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
                "properties": {
                    "format": {
                        "type": "object",
                        "properties": {"type": TEXT_FORMAT, "name": SCHEMA_NAME_SCHEMA},
                    }
                },
            },
            read_text,
        ),
        # nothing is stored: taken as false, as OpenAI's clients send it
        "store": flag(False, "taken; nothing is stored"),
        "metadata": Field(METADATA, read_metadata),
        "user": text(),
        "safety_identifier": text(),
        **PROMPT_CACHE,
        "parallel_tool_calls": flag(True),
        # what needs stored responses, tools or OpenAI's models: their off values only
        "previous_response_id": unserved({"type": "null"}),
        "conversation": unserved({"type": "null"}),
        "background": unserved({"enum": [False, None]}, False),
        "tools": unserved({"enum": [[], None]}, []),
        "tool_choice": unserved({"enum": ["none", "auto", None]}, "none", "auto"),
        "include": Field(
            {"type": ["array", "null"], "items": {"enum": [OUTPUT_LOGPROBS]}}, read_include
        ),
        "reasoning": Field(
            {
                "type": ["object", "null"],
                "properties": {
                    "effort": {"enum": [*REASONING_EFFORTS, None]},
                    "summary": {"type": "null"},
                    "generate_summary": {"type": "null"},
                },
                "additionalProperties": False,
            },
            read_reasoning,
        ),
        "prompt": unserved({"type": "null"}),
        "truncation": unserved({"enum": ["disabled", None]}, "disabled"),
        "service_tier": unserved({"enum": ["auto", "default", None]}, "auto", "default"),
        # the likeliest tokens listed beside each (with include's logprobs; else none)
        "top_logprobs": whole(0, MAX_TOP_N_TOKENS),
        "max_tool_calls": unserved({"type": "null"}),
        "moderation": unserved({"type": "null"}),
        "context_management": unserved({"enum": [[], None]}, []),
        "image": unserved({"type": "null"}),
        "access_programs": unserved({"type": "null"}),
        "background_options": unserved({"type": "null"}),
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
    "reasoning",
    "prompt",
    "truncation",
    "service_tier",
    "max_tool_calls",
    "moderation",
    "context_management",
    "image",
    "access_programs",
    "background_options",
    "stream_options",
)
BOOKKEEPING = (
    "store",
    "metadata",
    "user",
    "safety_identifier",
    *PROMPT_CACHE,
    "parallel_tool_calls",
)
# a Response's settings, said back as it was asked (OpenAI's answer repeats them; the
# temperature and top_p as sampled: `sampled_with`)
SETTINGS = (
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "top_logprobs",
)
# what identifies the asker and the cache, said back as sent (null where not)
ECHOED = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention")


def parse_response(
    document: Any, reads_effort: bool = False
) -> tuple[GenerationRequest, dict[str, Any]]:
    """The chat a Responses body asks for, and the settings its answer says back
    (`reads_effort`: the model's template reads a `reasoning_effort`, which
    `reasoning.effort` sets)."""
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
    effort = (fields.value("reasoning") or {}).get("effort")
    if template_effort(effort, reads_effort, "reasoning.effort"):
        chat["reasoning_effort"] = effort
    parsed = parse_chat(chat, reads_effort=reads_effort)
    generation = replace(parsed, max_tokens_field="max_output_tokens")
    if generation.grammar_field == "response_format":  # a Responses body's is its "text"
        generation = replace(generation, grammar_field="text.format")
    if OUTPUT_LOGPROBS in (fields.value("include") or ()):  # (top_logprobs alone: none, as vLLM)
        generation = with_logprobs(generation, fields.value("top_logprobs") or 0)
    settings = {name: fields.value(name) for name in SETTINGS}
    settings.update({name: fields.get(name) for name in ECHOED})
    settings["metadata"] = fields.value("metadata") or {}
    settings["text"] = {"format": (fields.get("text") or {}).get("format")}
    # as asked (OpenAI's default "auto"): with no tools, either says the same
    settings["tool_choice"] = fields.get("tool_choice") or "auto"
    settings["reasoning"] = {**NO_REASONING, "effort": effort}  # (said back, as OpenAI's)
    return generation, settings


def sampled_with(settings: dict[str, Any], sampling: Any) -> dict[str, Any]:
    """`settings` with the temperature and top_p the answer is sampled with where the
    request left them out, as OpenAI says them back: `sampling` is the model's (its
    worker's report: whether it samples, at what temperature and top_p); 0 is greedy.
    Without a report (a handler's model) they are said back as asked."""
    if not isinstance(sampling, dict):
        return settings
    temperature, top_p = settings["temperature"], settings["top_p"]
    if temperature is None:  # (a top_p below 1 samples, as the worker reads it)
        samples = sampling["do_sample"] or (top_p is not None and top_p < 1)
        temperature = sampling["temperature"] if samples else 0.0
    if top_p is None:
        top_p = sampling["top_p"]
    return {**settings, "temperature": temperature, "top_p": top_p}


def event(kind: str, number: int, **fields: Any) -> bytes:
    """One of the stream's events, named as the SDK reads them."""
    document = {"type": kind, "sequence_number": number, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + event_json(document) + b"\n\n"


class ResponseAnswer:
    """A Response: its ids, the settings it says back, and its items (a reasoning model's
    thinking, then its message) whole or as events."""

    def __init__(
        self,
        model: str,
        settings: dict[str, Any],
        clock: Callable[[], float] = time.time,
        thinking: str | None = None,
        logprobs: int | None = None,
    ):
        self.model = model
        self.settings = settings
        self.clock = clock
        # None: no log probabilities asked; else the alternatives each token lists
        self.logprobs = logprobs
        # a reasoning model's answer: where its thinking opens (`reasoning`); None: all text
        self.thinking = thinking
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.created_at = int(clock())

    def response(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        form = self.settings["text"]["format"] or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": None,  # (set once it has completed)
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "tool_choice": self.settings.get("tool_choice", "auto"),
            "reasoning": self.settings.get("reasoning", NO_REASONING),
            "tools": [],
            "store": False,
            "previous_response_id": None,
            **{name: self.settings[name] for name in SETTINGS},
            **{name: self.settings.get(name) for name in ECHOED},
            "truncation": "disabled",  # (the only one served)
            "service_tier": "default",  # (what "auto" is served as, as OpenAI says it)
            "background": False,  # (the only one served)
            "metadata": self.settings["metadata"],
            "text": {"format": form, "verbosity": "medium"},  # (the only one served)
            "usage": None,
            **fields,
        }

    def message(self, text: str, status: str, tokens: Sequence[Listed] = ()) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [self.output_text(text, tokens)],
        }

    def output_text(self, text: str, tokens: Sequence[Listed] = ()) -> dict[str, Any]:
        """The message's text part, with its tokens' log probabilities where asked."""
        part = output_text(text)
        if self.logprobs is not None:
            part["logprobs"] = self.listing(tokens)
        return part

    def listing(self, tokens: Sequence[Listed]) -> list[dict[str, Any]]:
        """Tokens as a text part and its deltas list them (chat's entries); none where no
        log probabilities were asked."""
        return chat_logprobs(tokens)["content"] if self.logprobs is not None else []

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": [] if status == "in_progress" else [reasoning_text(text)],
        }

    def items(
        self,
        reasoning: str | None,
        text: str | None,
        status: str,
        tokens: Sequence[Listed] = (),
    ) -> list[dict[str, Any]]:
        """The output: the thinking (done once the answer followed it; none where it was
        empty, as a stream announces none), then the answer (`tokens`: its text's)."""
        items = []
        if reasoning:
            items.append(self.reasoning(reasoning, "completed" if text is not None else status))
        if text is not None:
            items.append(self.message(text, status, tokens))
        return items

    def finished(
        self,
        output: dict[str, Any],
        reasoning: str | None,
        text: str | None,
        tokens: Sequence[Listed] = (),
    ) -> dict[str, Any]:
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
            status, incomplete, completed_at = "incomplete", {"reason": "max_output_tokens"}, None
        else:
            status, incomplete, completed_at = "completed", None, int(self.clock())
        items = self.items(reasoning, text, status, tokens)
        return self.response(
            status, items, incomplete_details=incomplete, usage=used, completed_at=completed_at
        )

    def whole(
        self, outputs: Sequence[dict[str, Any]], stops: Sequence[str], *_: Any
    ) -> dict[str, Any]:
        """The Response (`_`: chat's echoes and choice count; a Response has none and one)."""
        [output] = outputs
        generated = output["generated_text"]
        text = cut_at_stop(generated, stops, stops_from(output))
        reasoning: str | None = None
        content: str | None = text
        if self.thinking is not None:
            reasoning, content = split_answer(text, output["details"], self.thinking)
        tokens: list[Listed] = []
        if self.logprobs is not None and content is not None:
            tokens = answer_tokens(output["details"], len(text), len(generated))
            tokens = tokens_from(tokens, len(text) - len(content))  # (the thinking's: not)
        return self.finished(output, reasoning, content, tokens)

    async def events(
        self, streams: Sequence[TokenStream], stops: Sequence[str], *_: Any
    ) -> AsyncGenerator[bytes, None]:
        """OpenAI's events for a streamed Response: it opens; a reasoning model's thinking
        item and its reasoning text part open, the thinking comes as deltas, and each
        closes; the message and its text part open, the text comes as deltas, each closes;
        and the Response ends completed, incomplete, or failed (a deadline or error once
        the answer has begun)."""
        items = StreamedItems(self, iter(range(1 << 62)))
        try:
            opened = self.response("in_progress", [])
            yield items.event("response.created", response=opened)
            yield items.event("response.in_progress", response=opened)
            thinking = None if self.thinking is None else Thinking(self.thinking)
            if thinking is None:  # (a reasoning model's message opens after its thinking)
                for sent in items.add([(CONTENT, "")]):
                    yield sent
            choice = Streamed()
            async for _index, chunk in merged(streams):
                if chunk is None:
                    continue
                if thinking is not None and chunk.opened is not None:  # its first token
                    thinking = Thinking(chunk.opened)
                sending = choice.add(chunk.token, stops, self.logprobs)
                if sending is not None:
                    items.place(sending)
                    for sent in items.add(pieces(thinking, sending[0])):
                        yield sent
            output = streams[0].output()
            rest = choice.rest(output, stops)
            ending = pieces(thinking, rest[0] if rest is not None else "")
            if thinking is not None:
                ending += thinking.end()
                if not thinking.thought:  # all of it the answer (empty, perhaps)
                    ending.append((CONTENT, ""))
            if rest is not None:
                items.place(rest)
            for sent in items.add(ending) + items.add_the_rest():
                yield sent
            thought = items.reasoning if thinking is not None and thinking.thought else None
            answered = self.finished(output, thought, items.text, items.tokens)
            for sent in items.close(answered["output"]):
                yield sent
            ended = "response." + answered["status"]  # completed or incomplete, as OpenAI's
            yield items.event(ended, response=answered)
        except Exception as exc:  # noqa: BLE001 - OpenAI's stream ends so when its answer
            # fails (or a bug of the server's fails it)
            error = streams[0].failed(exc)
            failure = {"code": "server_error", "message": error.message}
            # the text sent before the failure stays in it, as OpenAI's keeps it
            said = items.said("incomplete")
            failed = self.response("failed", said, error=failure)
            yield items.event("response.failed", response=failed)
        finally:
            for stream in streams:
                stream.close()


def tokens_from(tokens: Sequence[Listed], start: int) -> list[Listed]:
    """The tokens of the text from `start` characters on (a reasoning model's answer's,
    after its thinking's; `answers`)."""
    placed = placed_tokens(tokens, 0)
    return [token for token, at in placed if answers(token, at, start)]


def placed_tokens(tokens: Sequence[Listed], offset: int) -> list[tuple[Listed, int]]:
    """Tokens with where each one's text starts, the first's at `offset`."""
    placed = []
    for token in tokens:
        placed.append((token, offset))
        offset += len(token.text)
    return placed


def answers(token: Listed, at: int, start: int) -> bool:
    """Whether a token whose text starts `at` is the answer's, which starts at `start`: its
    text reaches into the answer (a token of the tag's end and the answer's first word
    is), or it starts there (one that adds no text: an end of sequence)."""
    return at >= start or at + len(token.text) > start


def pieces(thinking: Thinking | None, text: str) -> list[tuple[str, str]]:
    """An answer's next text as thinking and answer (all answer where none is split)."""
    if thinking is None:
        return [(CONTENT, text)] if text else []
    return thinking.add(text)


class StreamedItems:
    """A streamed Response's output items as they open, grow and close: the thinking's
    (`reasoning_text`), then the message's (`output_text`), each at its output index."""

    def __init__(self, answer: ResponseAnswer, numbers: Iterator[int]) -> None:
        self.answer = answer
        self.numbers = numbers
        self.open: str | None = None  # the kind of the item open now
        self.kinds: list[str] = []  # of the items opened, in order
        self.reasoning = ""
        self.text: str | None = None  # the message's text, once it opened
        # where log probabilities are asked: the message's tokens sent, those whose text
        # went out and are not listed yet (with where each starts), and where the message's
        # text starts in the answer's (after a reasoning model's thinking and its tag)
        self.tokens: list[Listed] = []
        self.unlisted: list[tuple[Listed, int]] = []
        self.fed = 0  # the answer's text split so far
        self.answer_start: int | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        return event(kind, next(self.numbers), **fields)

    def where(self, kind: str) -> dict[str, Any]:
        item = self.answer.reasoning_id if kind == REASONING else self.answer.message_id
        return {"item_id": item, "output_index": self.kinds.index(kind), "content_index": 0}

    def place(self, release: Release) -> None:
        """The answer's next text with its tokens (`Streamed`'s), before it is split into
        `add`'s pieces."""
        text, tokens, offset = release
        self.unlisted += placed_tokens(tokens, offset)
        self.fed += len(text)

    def listing(self) -> list[dict[str, Any]]:
        """The message's tokens not listed yet, listed now (those of the thinking dropped):
        the answer's text starts where its first piece began (nothing is held back once
        it has: the piece ends where the text split so far does)."""
        start = self.answer_start
        if start is None:
            return []
        tokens = [token for token, at in self.unlisted if answers(token, at, start)]
        self.unlisted = []
        self.tokens += tokens
        return self.answer.listing(tokens)

    def add_the_rest(self) -> list[bytes]:
        """Once the answer has ended: its tokens that no text followed (an end of
        sequence), in a delta of no text."""
        if self.open != CONTENT:
            return []
        if self.answer_start is None:  # (an answer of no text: its end of sequence, say)
            self.answer_start = self.fed
        listing = self.listing()
        if not listing:
            return []
        where = self.where(CONTENT)
        return [self.event("response.output_text.delta", **where, delta="", logprobs=listing)]

    def add(self, pieces: list[tuple[str, str]]) -> list[bytes]:
        """The events that send `pieces`: an item opens as its first piece comes (the
        thinking's closes as the answer's opens); the answer's pieces carry the tokens
        placed before them (`place`)."""
        sent = []
        for kind, piece in pieces:
            if kind == REASONING and not piece:  # (empty thinking is no item: `items`)
                continue
            if self.open != kind:
                if self.open == REASONING:
                    sent += self.close([self.answer.reasoning(self.reasoning, "completed")])
                sent += self.start(kind)
            if not piece:
                continue
            if kind == REASONING:
                self.reasoning += piece
                name = "response.reasoning_text.delta"
                sent.append(self.event(name, **self.where(kind), delta=piece))
            else:
                self.text = (self.text or "") + piece
                if self.answer_start is None:  # (the last piece: see `listing`)
                    self.answer_start = self.fed - len(piece)
                listing = self.listing()
                name = "response.output_text.delta"
                sent.append(self.event(name, **self.where(kind), delta=piece, logprobs=listing))
        return sent

    def start(self, kind: str) -> list[bytes]:
        self.open = kind
        self.kinds.append(kind)
        if kind == REASONING:
            item, part = self.answer.reasoning("", "in_progress"), reasoning_text("")
        else:
            self.text = ""
            item, part = self.answer.message("", "in_progress"), output_text("")
        index = len(self.kinds) - 1
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", **self.where(kind), part=part),
        ]

    def close(self, items: list[dict[str, Any]]) -> list[bytes]:
        """The events that close the item open now, as `items` (the output) ends it."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        [item] = [
            one for one in items if one["type"] == ("reasoning" if kind == REASONING else "message")
        ]
        [part] = item["content"]
        where = self.where(kind)
        if kind == REASONING:
            done = self.event("response.reasoning_text.done", **where, text=part["text"])
        else:
            listing = part.get("logprobs", [])
            done = self.event(
                "response.output_text.done", **where, text=part["text"], logprobs=listing
            )
        index = where["output_index"]
        return [
            done,
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def said(self, status: str) -> list[dict[str, Any]]:
        """The items sent before a failure, with what they held."""
        said = []
        if REASONING in self.kinds:
            closed = self.open != REASONING
            said.append(self.answer.reasoning(self.reasoning, "completed" if closed else status))
        if CONTENT in self.kinds:  # (announced, though no text came yet)
            said.append(self.answer.message(self.text or "", status, self.tokens))
        return said


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


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
REASONING_ITEM: Schema = {
    "type": "object",
    "description": "a reasoning model's thinking, before its message",
    "required": ["type", "summary", "content"],
    "properties": {
        "type": {"const": "reasoning"},
        "content": {
            "type": "array",
            "items": {"properties": {"type": {"const": "reasoning_text"}}},
        },
    },
}
RESPONSE_SCHEMA: Schema = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "completed_at": {
            "type": ["integer", "null"],
            "description": "when it completed (Unix seconds); null unless completed",
        },
        "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]},
        "incomplete_details": {
            "anyOf": [{"type": "null"}, {"properties": {"reason": {"const": "max_output_tokens"}}}]
        },
        "model": {"type": "string"},
        "output": {"type": "array", "items": {"anyOf": [REASONING_ITEM, MESSAGE_ITEM]}},
        "usage": USAGE,
    },
}
EVENT_SCHEMA: Schema = {
    "type": "object",
    "description": "each as `event: <type>` and `data: <this>`: response.created, "
    "response.in_progress, (a reasoning model's thinking: response.output_item.added, "
    "response.content_part.added, response.reasoning_text.delta..., "
    "response.reasoning_text.done, response.content_part.done, "
    "response.output_item.done), response.output_item.added, response.content_part.added, "
    "response.output_text.delta..., response.output_text.done, response.content_part.done, "
    "response.output_item.done, then response.completed, response.incomplete or "
    "response.failed",
    "required": ["type", "sequence_number"],
    "properties": {"type": {"type": "string"}, "sequence_number": {"type": "integer"}},
}

"""OpenAI's generation shapes: reading `/v1/chat/completions` and `/v1/completions` bodies
into prompts and worker parameters, and writing their answers, whole or as SSE chunks.

What OpenAI's API has and rawserve does not serve (several choices, tools, log
probabilities, echo, penalties) is refused with 400 naming it, never ignored. Text stops
before a stop sequence, as OpenAI's does, streamed too: text that may be the start of a
stop sequence is held back until the next token says. Server process; plain Python.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rawserve import __version__
from rawserve.api.bodies import check_client_batch
from rawserve.api.fields import Fields, unicode_text
from rawserve.api.streaming import TokenStream, sse
from rawserve.http.errors import BadRequest, HTTPError, openai_error_document
from rawserve.tasks import CHAT_PARAM, InvalidRequest, check_new_tokens, text_generation
from rawserve.tasks.text_generation import MAX_STOP_SEQUENCES

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_NEW_TOKENS = 4096
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# finish reasons: the worker's (TGI's) → OpenAI's
FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}
COMMON_FIELDS = (
    "model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
    "n", "user", "frequency_penalty", "presence_penalty", "logprobs", "logit_bias",
    "repetition_penalty",  # not OpenAI's: TGI's (its client sends it) and vLLM's
)  # fmt: skip
# OpenAI's answers name the backend's configuration; TGI's client requires it
SYSTEM_FINGERPRINT = f"rawserve-{__version__}"
CHAT_FIELDS = (
    *COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "response_format",
)  # fmt: skip
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "echo", "suffix", "best_of")


@dataclass(frozen=True)
class GenerationRequest:
    items: list[Any]  # prompts (texts), or chats ({"messages": [...]})
    params: dict[str, Any]  # the worker's text-generation parameters
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    max_tokens_field: str = "max_tokens"  # the field that set params["max_new_tokens"]


def refuse_unserved(fields: Fields, names: Sequence[str], allowed: Sequence[Any]) -> None:
    """400 for a field set to something other than its "off" values (null, false, 0...)."""
    for name in names:
        value = fields.get(name)
        # false is not 0 here (Python says it is)
        if value is not None and not any(
            value == off and isinstance(value, bool) == isinstance(off, bool) for off in allowed
        ):
            raise BadRequest(f'"{name}" is not supported by this server')


def generation_params(
    fields: Fields, max_tokens_field: str, default: int | None
) -> GenerationRequest:
    """The parameters both routes share."""
    refuse_unserved(fields, ("logit_bias",), ({},))
    refuse_unserved(fields, ("frequency_penalty", "presence_penalty"), (0,))
    n = fields.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadRequest('"n" must be 1: one choice per request')
    fields.string("user")
    params: dict[str, Any] = {"return_full_text": False, "details": True}
    max_tokens = fields.integer(max_tokens_field, 1, MAX_NEW_TOKENS)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = fields.integer("max_tokens", 1, MAX_NEW_TOKENS)
        max_tokens_field = "max_tokens"
    if max_tokens is None:
        max_tokens = default
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    temperature = fields.number("temperature", 0.0, 2.0)
    if temperature is not None:  # 0: greedy; more: sampling at that temperature
        params["temperature"] = temperature
        params["do_sample"] = temperature > 0
    top_p = fields.number("top_p", 0.0, 1.0)
    if top_p == 0:
        raise BadRequest('"top_p" must be above 0')
    if top_p is not None:
        params["top_p"] = top_p
    repetition_penalty = fields.number("repetition_penalty", 0.0, 100.0)
    if repetition_penalty == 0:
        raise BadRequest('"repetition_penalty" must be above 0 (1: no penalty)')
    if repetition_penalty is not None:
        params["repetition_penalty"] = repetition_penalty
    seed = fields.integer("seed", 0, 2**32 - 1)
    if seed is not None:
        params["seed"] = seed
    stop = stop_sequences(fields.get("stop"))
    if stop:
        params["stop"] = stop
    stream = fields.boolean("stream", False)
    include_usage = False
    options = fields.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest('"stream_options" goes with "stream": true')
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest('"stream_options" must be {"include_usage": true or false}')
        include_usage = Fields(options, ("include_usage",)).boolean("include_usage", False)
    return GenerationRequest([], params, stop, stream, include_usage, max_tokens_field)


def stop_sequences(value: Any) -> list[str]:
    """OpenAI's "stop": the text-generation task's own rule, worded as OpenAI's field."""
    if value is None:
        return []
    try:
        stops = text_generation.stop_sequences(value)
    except ValueError:
        raise BadRequest(
            f'"stop" must be a text or a list of at most {MAX_STOP_SEQUENCES} non-empty texts '
            "of at most 200 characters"
        ) from None
    return [unicode_text(s, '"stop"') for s in stops]


def parse_chat(document: Any) -> GenerationRequest:
    fields = Fields(document, CHAT_FIELDS)
    refuse_unserved(fields, ("logprobs",), (False,))
    refuse_unserved(fields, ("top_logprobs",), ())
    refuse_unserved(fields, ("tools", "functions"), ([],))
    refuse_unserved(fields, ("tool_choice", "function_call"), ("none",))
    refuse_unserved(fields, ("parallel_tool_calls",), (False, True))
    refuse_unserved(fields, ("response_format",), ({"type": "text"},))
    request = generation_params(fields, "max_completion_tokens", None)
    chat = {"messages": messages(fields.required("messages"))}
    params = {**request.params, CHAT_PARAM: True}
    return replace(request, items=[chat], params=params)


def messages(value: Any) -> list[dict[str, str]]:
    """OpenAI's messages as the chat template takes them: role and text content."""
    if not isinstance(value, list) or not value:
        raise BadRequest('"messages" must be a non-empty list of {"role", "content"}')
    checked = []
    for message in value:
        # "tool_calls" unset (null, as TGI's client sends it) is no tool call
        if (
            not isinstance(message, dict)
            or not set(message) <= {"role", "content", "name", "tool_calls"}
            or message.get("tool_calls") is not None
        ):
            raise BadRequest(
                'each message must be {"role", "content"} (and "name"); tool calls are not '
                "supported"
            )
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"each message's role must be one of {', '.join(ROLES)}")
        entry = {"role": role, "content": message_text(message.get("content"))}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise BadRequest("a message's name must be a string")
            entry["name"] = unicode_text(name, "a message's name")
        checked.append(entry)
    return checked


def message_text(content: Any) -> str:
    """A message's content: a text, or a list of text parts (joined)."""
    if isinstance(content, str):
        return unicode_text(content, "a message's content")
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
                or set(part) - {"type", "text"}
            ):
                raise BadRequest('content parts must be {"type": "text", "text": ...}: text only')
            texts.append(unicode_text(part["text"], "a message's content"))
        return "".join(texts)
    raise BadRequest("a message's content must be a text or a list of text parts")


def parse_completion(document: Any, max_prompts: int) -> GenerationRequest:
    fields = Fields(document, COMPLETION_FIELDS)
    refuse_unserved(fields, ("echo",), (False,))
    refuse_unserved(fields, ("suffix", "logprobs"), ())
    refuse_unserved(fields, ("best_of",), (1,))
    request = generation_params(fields, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    prompt = fields.required("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest('"prompt" must be a text or a non-empty list of texts (not token ids)')
    if not all(prompts):
        raise BadRequest('"prompt" must not be empty')
    check_client_batch(len(prompts), max_prompts)
    if request.stream and len(prompts) > 1:
        raise BadRequest("a streamed completion takes one prompt")
    return replace(request, items=[unicode_text(p, '"prompt"') for p in prompts])


def check_max_tokens(generation: GenerationRequest, most: int | None) -> None:
    """400 for more new tokens than the model's positions allow (`most`; None: no known
    bound), checked before the request is queued: the rule `POST /` applies to
    `max_new_tokens`, worded with the field this client sent."""
    asked = generation.params.get("max_new_tokens")
    if asked is None:
        return
    try:
        check_new_tokens(f'"{generation.max_tokens_field}"', asked, most)
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from None


# --- answers ------------------------------------------------------------------------------


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` before the first stop sequence in it (all of it when there is none)."""
    found = [index for stop in stops if (index := text.find(stop)) >= 0]
    return text[: min(found)] if found else text


def releasable(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """How much of a streamed text may be sent now, and whether a stop sequence was
    reached: text that could be the start of a stop sequence waits for the next token."""
    found = [index for stop in stops if (index := text.find(stop)) >= 0]
    if found:
        return text[: min(found)], True
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return text[: len(text) - held], False


def finish_reason(details: dict[str, Any]) -> str:
    return FINISH_REASONS.get(details.get("finish_reason", ""), "stop")


def usage(outputs: Sequence[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(int(o["details"]["prompt_tokens"]) for o in outputs)
    completion = sum(int(o["details"]["generated_tokens"]) for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Answer:
    """The shape of one route's answers: ids, objects, and where the text goes."""

    def __init__(self, chat: bool, model: str, clock: Callable[[], float] = time.time):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(clock())

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    def whole(self, outputs: Sequence[dict[str, Any]], stops: Sequence[str]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            text = cut_at_stop(output["generated_text"], stops)
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = None
            choice["finish_reason"] = finish_reason(output["details"])
            choices.append(choice)
        return {**self.head(False), "choices": choices, "usage": usage(outputs)}

    def chunk(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return {**self.head(True), "choices": [choice]}

    async def events(
        self, stream: TokenStream, stops: Sequence[str], include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        """OpenAI's chunks for a streamed generation, then `data: [DONE]`."""
        try:
            if self.chat:  # the first chunk says who speaks
                first = self.chunk("")
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield sse(first)
            text = ""  # generated so far (special tokens left out)
            sent = ""
            async for chunk in stream.chunks():
                if chunk.token["special"]:
                    continue
                text += chunk.token["text"]
                ready, _ = releasable(text, stops)
                if len(ready) > len(sent):
                    yield sse(self.chunk(ready[len(sent) :]))
                    sent = ready
            try:
                output = stream.output()
            except HTTPError as error:
                yield sse(openai_error_document(error))
                return
            whole = cut_at_stop(output["generated_text"], stops)
            if whole.startswith(sent) and len(whole) > len(sent):
                yield sse(self.chunk(whole[len(sent) :]))  # what a cut character held back
            yield sse(self.chunk(None, finish_reason(output["details"])))
            if include_usage:
                yield sse({**self.head(True), "choices": [], "usage": usage([output])})
            yield b"data: [DONE]\n\n"
        finally:
            stream.close()

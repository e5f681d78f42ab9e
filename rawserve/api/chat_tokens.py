"""A chat's tokens, as the model would read them: vLLM's `/tokenize` with `messages` and
TGI's `/chat_tokenize`. Clients count a conversation's tokens, or see what the template
made of it, before they send it.

Only the worker renders a chat (it holds the model's chat template, and what rawserve
makes of tools, roles and control tokens): the chat is queued as a generation of no new
tokens (`PROMPT_LISTED`), which runs nothing, and the worker answers the prompt's ids
(and, for TGI's, its text). The chat is read as `/v1/chat/completions` reads it, so
the tokens listed are those a chat completion's prompt would be.

Server process; plain Python.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from rawserve.api.context import RouteContext
from rawserve.api.fields import Body, Field, flag, read_boolean
from rawserve.api.openai_generation import CHAT, CHAT_GENERATION, parse_model_chat
from rawserve.api.outcomes import unwrap
from rawserve.api.routing import Needs, Schema
from rawserve.api.served import ServedModel
from rawserve.api.tokens import (
    AnswerTooLarge,
    ServerTokenizer,
    TokenBound,
    TooManyTokens,
    answer_within,
)
from rawserve.http.errors import BadRequest, PayloadTooLarge, UnprocessableInput
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.tasks.text_generation import (
    CHAT_PARAM,
    PROMPT_LISTED,
    PROMPT_TEXT,
    TOKEN_COUNTS_ONLY,
)

# what the routes need of a model: a chat template to render with, a tokenizer in the
# server (TGI's tokens are the text's; vLLM's strings the vocabulary's)
CHAT_TOKENIZER: Needs = replace(
    CHAT_GENERATION, tokenizer=True, what="a text-generation model with a tokenizer"
)
# the most tokens a chat's listing lists (as vLLM's prompt form and TEI's one text)
MAX_CHAT_TOKENS = 32768
# what of vLLM's chat form of /tokenize is the chat, read as a chat completion reads it:
# vLLM's, and the fields that change the prompt rawserve renders (its description of the
# tools follows tool_choice, parallel_tool_calls and tool_prompt; they were ignored here,
# and the count was not the chat completion's)
VLLM_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tool_choice",
    "parallel_tool_calls",
    "tool_prompt",
    "functions",
    "function_call",
    "reasoning_effort",
)
# a chat listed: rendered and tokenized, nothing run (the details carry its ids)
LISTING = {
    CHAT_PARAM: True,
    PROMPT_LISTED: True,
    "max_new_tokens": 0,
    "return_full_text": False,
    "details": True,
    TOKEN_COUNTS_ONLY: True,
}


def read_special_tokens(name: str, value: Any, context: Any) -> bool:
    if read_boolean(name, value, context):
        raise BadRequest(
            f'"{name}" true is not supported with "messages": the chat template writes the '
            "special tokens the model reads",
            param=name,
        )
    return False


def read_no_template(name: str, value: Any, context: Any) -> None:
    raise BadRequest(
        f'"{name}" is not supported by this server: chats are rendered with the model\'s own '
        "chat template (or the server's --chat-template)",
        param=name,
    )


TOKENIZE_CHAT = Body(
    {
        **{name: CHAT.fields[name] for name in VLLM_CHAT_FIELDS},
        "add_special_tokens": Field(
            {"enum": [False, None]},
            read_special_tokens,
            description="false: the chat template writes them",
        ),
        "return_token_strs": flag(False, "each token's string beside the ids"),
        "chat_template": Field({"type": "null"}, read_no_template),
    },
    ignore_unknown=True,  # (vLLM's clients send its other fields: mm_processor_kwargs...)
    description="vLLM's chat form: the chat's tokens as a chat completion's prompt",
)
SIMPLE_TOKEN: Schema = {
    "type": "object",
    "required": ["id", "text", "start", "stop"],
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "start": {"type": "integer", "description": "the byte in templated_text it starts at"},
        "stop": {"type": "integer"},
    },
}
CHAT_TOKENIZE_RESPONSE: Schema = {
    "type": "object",
    "required": ["tokenize_response", "templated_text"],
    "properties": {
        "tokenize_response": {"type": "array", "items": SIMPLE_TOKEN},
        "templated_text": {"type": "string", "description": "the chat as its template wrote it"},
    },
}


@dataclass(frozen=True)
class ChatRequest:
    """A chat token request's model, that model's tokenizer in the server, and when the
    request must be answered."""

    model: ServedModel
    tokenizer: ServerTokenizer
    deadline: float


async def chat_request(context: RouteContext, request: HttpRequest, name: Any) -> ChatRequest:
    """The model a chat token request names (`name`, the body's "model"), queued for as
    a generation is (503 at once where it is busy)."""
    model = context.model_for(name, CHAT_TOKENIZER, queued_for=request)
    tokenizer = await context.tokenizers.get(model)
    assert tokenizer is not None  # (CHAT_TOKENIZER: a tokenizer in the server)
    return ChatRequest(model, tokenizer, context.deadline(request))


async def listed_details(asked: ChatRequest, chat: dict[str, Any], text: bool) -> Any:
    """`chat` (`{"messages": [...]}`, as parse_chat makes it) listed by the model's
    worker: the details of its answer, `prompt_ids` (and, with `text`, `prompt_text`)."""
    params = {**LISTING, PROMPT_TEXT: True} if text else LISTING
    [result] = await asked.model.run([chat], params, asked.deadline)
    [output] = unwrap(result)
    return output["details"]


def parsed_chat(model: ServedModel, document: Any) -> dict[str, Any]:
    """A chat completion's body as the chat the worker renders (its tools as the chat's)."""
    [chat] = parse_model_chat(model, document).items
    return dict(chat)


def check_count(count: int) -> None:
    if count > MAX_CHAT_TOKENS:
        raise UnprocessableInput(
            f"the chat is {count} tokens, more than the {MAX_CHAT_TOKENS} a listing lists"
        )


async def vllm_chat_tokenized(
    context: RouteContext,
    request: HttpRequest,
    document: dict[str, Any],
    max_model_len: Callable[[ServedModel], int],
) -> HttpResponse:
    """vLLM's /tokenize answer to a body with `messages` (`TOKENIZE_CHAT`); `max_model_len`
    says a model's length as the prompt form does."""
    if document.get("prompt") is not None:
        raise BadRequest('send "prompt" or "messages", not both')
    asked = await chat_request(context, request, document.get("model"))
    fields = TOKENIZE_CHAT.read(document)
    fields.value("add_special_tokens")
    fields.value("chat_template")
    chat = parsed_chat(
        asked.model, {name: document[name] for name in VLLM_CHAT_FIELDS if name in document}
    )
    ids = list((await listed_details(asked, chat, text=False))["prompt_ids"])
    check_count(len(ids))
    asks_strings = fields.value("return_token_strs")
    body = {
        "count": len(ids),
        "max_model_len": max_model_len(asked.model),
        "tokens": ids,
        "token_strs": asked.tokenizer.token_strings(ids) if asks_strings else None,
    }
    return answer_within(body, context.settings.max_answer_bytes)


async def tgi_chat_tokenized(
    context: RouteContext, request: HttpRequest, document: Any
) -> HttpResponse:
    """TGI's /chat_tokenize: a chat completion's body rendered by the chat template, and
    that text's tokens with their byte offsets in it. As TGI lists them, they are the text
    tokenized (no special tokens added: the template wrote them); they differ from the ids
    the model reads only where a message spells out a control token, which the worker
    keeps as text."""
    name = document.get("model") if isinstance(document, dict) else None
    asked = await chat_request(context, request, name)
    chat = parsed_chat(asked.model, document)
    text = str((await listed_details(asked, chat, text=True))["prompt_text"])
    largest = context.settings.max_answer_bytes
    try:
        bound = TokenBound(MAX_CHAT_TOKENS)
        listed = await asked.tokenizer.tokenize([text], False, bound, largest)
    except TooManyTokens:
        raise UnprocessableInput(
            f"the chat is more than {MAX_CHAT_TOKENS} tokens, the most a listing lists"
        ) from None
    except AnswerTooLarge as exc:
        raise PayloadTooLarge(str(exc)) from None
    # TEI's token objects, less the `special` TGI's have not (of a text the template
    # wrote, a special token is a piece of text: none is marked)
    [tokens] = json.loads(listed)
    simple = [
        {name: value for name, value in token.items() if name != "special"} for token in tokens
    ]
    return answer_within({"tokenize_response": simple, "templated_text": text}, largest)

"""A chat's tokens, as the model would read them: vLLM's `/tokenize` with `messages` and
TGI's `/chat_tokenize`. Clients count a conversation's tokens, or see what the template
made of it, before they send it.

Only the worker renders a chat (it holds the model's chat template, and what rawserve
makes of tools, roles and control tokens): the chat is queued as a generation of no new
tokens (`PROMPT_LISTED`), which runs nothing, and the worker answers the prompt's ids and
text. The chat is read as `/v1/chat/completions` reads it, so the tokens listed are those
a chat completion's prompt would be.

Server process; plain Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

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
from rawserve.http.exchange import HttpResponse
from rawserve.tasks.text_generation import CHAT_PARAM, PROMPT_LISTED, TOKEN_COUNTS_ONLY

# what the routes need of a model: a chat template to render with, a tokenizer in the
# server (TGI's tokens are the text's; vLLM's strings the vocabulary's)
CHAT_TOKENIZER: Needs = replace(
    CHAT_GENERATION, tokenizer=True, what="a text-generation model with a tokenizer"
)
# the most tokens a chat's listing lists (as vLLM's prompt form and TEI's one text)
MAX_CHAT_TOKENS = 32768
# what of vLLM's chat form of /tokenize is the chat, read as a chat completion reads it
VLLM_CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)
# a chat listed: rendered and tokenized, nothing run (the details carry the prompt)
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
class RenderedChat:
    """A chat as the worker rendered it: the ids the model would read, and the text the
    chat template wrote."""

    ids: list[int]
    text: str


async def rendered_chat(model: ServedModel, chat: dict[str, Any], deadline: float) -> RenderedChat:
    """`chat` (`{"messages": [...]}`, as parse_chat makes it) rendered by the model's worker."""
    [result] = await model.run([chat], LISTING, deadline)
    [output] = unwrap(result)
    details = output["details"]
    return RenderedChat(list(details["prompt_ids"]), str(details["prompt_text"]))


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
    model: ServedModel,
    tokenizer: ServerTokenizer,
    document: dict[str, Any],
    deadline: float,
    max_model_len: int,
    largest: int,
) -> HttpResponse:
    """vLLM's /tokenize answer to a body with `messages` (`TOKENIZE_CHAT`)."""
    fields = TOKENIZE_CHAT.read(document)
    fields.value("add_special_tokens")
    fields.value("chat_template")
    chat = parsed_chat(
        model, {name: document[name] for name in VLLM_CHAT_FIELDS if name in document}
    )
    rendered = await rendered_chat(model, chat, deadline)
    check_count(len(rendered.ids))
    strings = tokenizer.token_strings(rendered.ids) if fields.value("return_token_strs") else None
    body = {
        "count": len(rendered.ids),
        "max_model_len": max_model_len,
        "tokens": rendered.ids,
        "token_strs": strings,
    }
    return answer_within(body, largest)


async def tgi_chat_tokenized(
    model: ServedModel,
    tokenizer: ServerTokenizer,
    document: Any,
    deadline: float,
    largest: int,
) -> HttpResponse:
    """TGI's /chat_tokenize: a chat completion's body rendered by the chat template, and
    that text's tokens with their byte offsets in it. As TGI lists them, they are the text
    tokenized (no special tokens added: the template wrote them); they differ from the ids
    the model reads only where a message spells out a control token, which the worker
    keeps as text."""
    chat = parsed_chat(model, document)
    rendered = await rendered_chat(model, chat, deadline)
    text = rendered.text
    try:
        listed = await tokenizer.tokenize([text], False, TokenBound(MAX_CHAT_TOKENS), largest)
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

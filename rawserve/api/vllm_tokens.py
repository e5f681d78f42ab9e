"""vLLM's `/tokenize` and `/detokenize`, with the model's tokenizer in the server (as
TEI's `/tokenize` and `/decode`): clients of vLLM count a prompt's tokens, or cut it,
with them.

`POST /tokenize` is TEI's too: a body with `prompt` and no `inputs` is vLLM's, answered
`{"count", "max_model_len", "tokens", "token_strs"}` (the ids; `token_strs`, each
token's string, where `return_token_strs` asks); its chat form (`messages`) is
rawserve.api.chat_tokens'. `POST /detokenize` answers
`{"tokens": [ids]}` with `{"prompt": text}`, special tokens kept, as vLLM decodes them.
Server process; plain Python.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rawserve.api.fields import Body, Field, Fields, flag, read_string
from rawserve.api.routing import DocContext, Schema
from rawserve.api.tei_bodies import MAX_TOKEN_ID
from rawserve.api.tokens import (
    INLINE_LIMIT,
    ServerTokenizer,
    TokenBound,
    TooManyTokens,
    UnknownTokenId,
    answer_within,
)
from rawserve.http.errors import BadRequest, UnprocessableInput
from rawserve.http.exchange import HttpResponse

# the most tokens one prompt lists (as TEI's /tokenize lists one text whole)
MAX_PROMPT_TOKENS = 32768


def read_token_ids(name: str, value: Any, context: DocContext | None) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in value
    ):
        raise BadRequest(f'"{name}" must be a list of token ids', param=name)
    return value


TOKENIZE = Body(
    {
        "prompt": Field({"type": "string"}, read_string, reads_null=True, required=True),
        "add_special_tokens": flag(True),
        "return_token_strs": flag(False, "each token's string beside the ids"),
    },
    ignore_unknown=True,  # (vLLM's clients send its other fields: chat_template...)
)
DETOKENIZE = Body(
    {
        "tokens": Field(
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}},
            read_token_ids,
            reads_null=True,
            required=True,
        )
    },
    ignore_unknown=True,
)
TOKENIZE_RESPONSE: Schema = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
    },
}
DETOKENIZE_RESPONSE: Schema = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


def is_vllms(document: Any) -> bool:
    """Whether a `/tokenize` body is vLLM's (`prompt` or `messages`, no TEI `inputs`)."""
    return (
        isinstance(document, dict)
        and document.get("inputs") is None  # (null, as every field's, is none)
        and ("prompt" in document or "messages" in document)
    )


async def tokenized(
    tokenizer: ServerTokenizer, fields: Fields, max_model_len: int, largest: int
) -> HttpResponse:
    """vLLM's /tokenize answer to a `TOKENIZE` body: a long prompt encoded on a thread
    (the event loop serves others meanwhile)."""
    prompt = fields.value("prompt")
    special = fields.value("add_special_tokens")
    bound = TokenBound(MAX_PROMPT_TOKENS)
    try:
        if len(prompt) <= INLINE_LIMIT:
            encoding, _ = tokenizer.encode(prompt, special, bound)
        else:
            encoding, _ = await asyncio.to_thread(tokenizer.encode, prompt, special, bound)
    except TooManyTokens:
        raise UnprocessableInput(
            f"the prompt has more than {MAX_PROMPT_TOKENS} tokens, the most /tokenize lists"
        ) from None
    ids = list(encoding.ids)
    strings = list(encoding.tokens) if fields.value("return_token_strs") else None
    body = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    return answer_within({**body, "token_strs": strings}, largest)


async def detokenized(tokenizer: ServerTokenizer, fields: Fields, largest: int) -> HttpResponse:
    """vLLM's /detokenize answer to a `DETOKENIZE` body."""
    try:
        [text] = await tokenizer.decode([fields.value("tokens")], skip_special=False)
    except UnknownTokenId as exc:
        raise UnprocessableInput(str(exc)) from None
    return answer_within({"prompt": text}, largest)

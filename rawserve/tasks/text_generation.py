"""text-generation: a prompt in; `[{"generated_text"}]` out, or a stream of tokens.

Its parameters are TGI's (which the Inference API's text-generation takes too): those
rawserve serves, and the rest accepted only unset (TGI's client sends every one).

`"stream": true` sits next to `parameters` (as InferenceClient and TGI send it) and
takes one input. The server gives a streamed request a stream id (in the batch's
`Control`, beside its parameters) so that the worker sends that stream a `TokenChunk`
per new token, and so that it never shares a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rawserve.shared import json_text
from rawserve.shared.token_columns import listed, token_count
from rawserve.tasks.checks import (
    IGNORED,
    boolean,
    checker,
    float_range,
    ignored,
    int_range,
    prompt,
)
from rawserve.tasks.rules import MAX_NEW_TOKENS, Task

# Set by the server's OpenAI chat route, never by a client: each input is a chat
# (`{"messages": [...]}`) that the worker renders with the model's chat template.
CHAT_PARAM = "chat"
# Set by the server's OpenAI completions route (echo with logprobs), never by a client:
# with `decoder_input_details`, the likeliest tokens listed beside each of the prompt's.
PROMPT_TOP_N = "prompt_top_n"
# Set by the server's OpenAI and TGI routes, never by a client: they sample at their own
# default temperature (1) where the request and the model's generation config set none,
# not at the text-generation pipeline's (0.7), which `POST /` keeps.
API_SAMPLING = "api_sampling"
# Set by the server's OpenAI routes, never by a client, where no log probabilities are
# asked: the details hold the counts and the finish reason, not each token (a list that
# grows with the tokens asked, up to the model's positions, and that nothing would read).
TOKEN_COUNTS_ONLY = "token_counts_only"
# Set by the server's chat token routes (vLLM's /tokenize with `messages`, TGI's
# /chat_tokenize), never by a client: with max_new_tokens 0, nothing is run, and the
# details list the prompt's ids (`prompt_ids`), whatever its length (a prompt listed is
# not one the model reads); with PROMPT_TEXT (TGI's), its text as the chat template
# wrote it too (`prompt_text`).
PROMPT_LISTED = "prompt_listed"
PROMPT_TEXT = "prompt_text"
# Set by the server's OpenAI chat route, never by a client, where the operator keeps a
# reasoning model's thinking in the content (--thinking-in-content): an answer a grammar
# holds (tools, response_format) is held from its first token, as vLLM's without a
# reasoning parser, not after a thinking the route would leave in front of the call or JSON.
THINKING_IN_CONTENT = "thinking_in_content"
# Where a reasoning model's thinking ends in an answer. The chat templates of reasoning
# models (Qwen3's, DeepSeek-R1's, QwQ's) keep only what follows it in earlier answers.
REASONING_END = "</think>"
REASONING_START = "<think>"
# Where a reasoning model's thinking opens (its worker's `thinking` detail): in the prompt,
# where its chat template ends it with `<think>`, or in the answer, by the model.
OPENED_IN_PROMPT = "prompt"
OPENED_IN_ANSWER = "answer"
# ...or closed in the prompt (Qwen3's with `enable_thinking` false writes an empty
# thinking there): the answer has none, and is all content, as a grammar holds it
CLOSED_IN_PROMPT = "closed"


def continues_message(chat: Any) -> bool:
    """Whether a chat asks for no generation prompt: its answer goes on from its last
    message's text (`continue_final_message`), whatever that text ends with."""
    opening = chat.get("opening", {}) if isinstance(chat, dict) else {}
    return opening.get("add_generation_prompt") is False


MAX_STOP_SEQUENCES = 16
# the likeliest tokens a new token's details or stream event may list beside it (OpenAI's
# top_logprobs goes to 20; TGI's own server defaults to 5)
MAX_TOP_N_TOKENS = 20
# the fields of TGI's `Details` (an answer's) and `StreamDetails` (a stream's last event)
TGI_DETAILS = (
    "finish_reason",
    "generated_tokens",
    "seed",
    "prefill",
    "tokens",
    "top_tokens",
    "best_of_sequences",  # (the answers not chosen, under TGI's `best_of`)
)
TGI_STREAM_DETAILS = ("finish_reason", "generated_tokens", "input_length", "seed")


def returns_full_text(params: Mapping[str, Any]) -> bool:
    """Whether an answer's text starts with its prompt: by default it does, streamed or
    not (the pipeline's and the Inference API's `return_full_text`); TGI's and OpenAI's
    routes ask for the continuation alone."""
    return bool(params.get("return_full_text", True))


def tgi_output(output: Any, *, streamed: bool = False) -> Any:
    """A worker's `{"generated_text", "details"}` as TGI answers it.

    The worker's details also carry what rawserve's OpenAI routes read (`prompt_tokens`
    for `usage`, `stops_from`); TGI's answers hold TGI's fields only, as the clients typed
    from its OpenAPI document read them: `Details` (a prefill token without `special`), or
    on a stream's last event `StreamDetails`, the prompt's tokens counted as its
    `input_length`. Any other output (a handler's) is answered as it is."""
    if not isinstance(output, Mapping) or not isinstance(output.get("details"), Mapping):
        return output
    details = dict(output["details"])
    if "prompt_tokens" in details:
        details["input_length"] = details["prompt_tokens"]
    if "prefill" in details:
        details["prefill"] = [
            {"id": token["id"], "text": token["text"], "logprob": token["logprob"]}
            for token in details["prefill"]
        ]
    fields = TGI_STREAM_DETAILS if streamed else TGI_DETAILS
    kept = {name: listed(details[name]) for name in fields if name in details}
    if kept.get("finish_reason") == "stop_sequence" and kept.get("tokens"):
        kept["tokens"] = through_stop(kept["tokens"], output["generated_text"])
    return {**output, "details": kept}


def through_stop(tokens: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The tokens of an answer a stop sequence ended, as TGI lists them: the last one's
    text up to where the answer's text ends, with the stop (TGI stops where the text ends
    with it; here the token that completed it may run on past it), so that they add up
    to the text. The worker's own token keeps its whole text (OpenAI's log probabilities
    list the token the model chose)."""
    last = next((i for i in reversed(range(len(tokens))) if not tokens[i]["special"]), None)
    if last is None:
        return tokens
    before = "".join(token["text"] for token in tokens[:last] if not token["special"])
    whole = tokens[last]["text"]
    for keep in range(len(whole), -1, -1):  # (the whole of it, in all but a stop's token)
        if text.endswith(before + whole[:keep]):
            return [*tokens[:last], {**tokens[last], "text": whole[:keep]}, *tokens[last + 1 :]]
    return tokens


def prompt_details_on(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` with `details` on where `decoder_input_details` asks for the prompt's
    tokens, as TGI's does: they are listed in the details, on `/generate` and `POST /`
    alike (`POST /` ignored it without `details`)."""
    if params.get("decoder_input_details"):
        return {**params, "details": True}
    return dict(params)


def listed_tokens(output: Any) -> int:
    """How many tokens (alternatives included) a worker's output lists in its details;
    counted without making them, so the answer's size is known before it is built."""
    if not isinstance(output, Mapping) or not isinstance(output.get("details"), Mapping):
        return 0
    details = output["details"]
    return sum(token_count(details.get(name)) for name in ("prefill", "tokens", "top_tokens"))


@checker(
    {
        "oneOf": [
            {"type": "string", "minLength": 1, "maxLength": 200},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 200},
                "maxItems": MAX_STOP_SEQUENCES,
            },
        ]
    }
)
def stop_sequences(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOP_SEQUENCES
        or not all(isinstance(v, str) and 0 < len(v) <= 200 for v in value)
    ):
        raise ValueError(
            f"must be a non-empty string, or a list of at most {MAX_STOP_SEQUENCES} of them, "
            "of at most 200 characters each"
        )
    if any(REPLACEMENT in v for v in value):
        raise ValueError(REPLACEMENT_IN_STOP)
    return value


# A stop holding U+FFFD: a decoder reads bytes that make no character as it, a byte each,
# and the same bytes cut short read otherwise, so that no cut of the answer would end
# with the stop (answers said "stop" with texts that held none).
REPLACEMENT = "\ufffd"
REPLACEMENT_IN_STOP = (
    "may not hold U+FFFD, the replacement character: a decoder writes it for bytes that "
    "make no character, none the model wrote"
)


def stop_tail(text: str, stops: Sequence[str]) -> str:
    """The end of `text` that a stop sequence ending in a later piece may begin in: one
    character fewer than the longest stop ("" without stops)."""
    keep = max(map(len, stops), default=1) - 1
    return text[len(text) - keep :] if len(text) > keep else text


# how the worker's refusal of a grammar, and a grammar's failure as it holds an answer,
# begin: the API names the field that gave it
GRAMMAR_REFUSED = "the grammar cannot be used: "
GRAMMAR_FAILED = "the grammar failed: "
# the resource (`$id`) a function's parameters are given in a tool call's grammar, and that
# of a response_format beside tools: their references are to their own roots, and a
# grammar's fault in them is said as theirs
TOOL_RESOURCE = "urn:rawserve:tool:"
FORMAT_RESOURCE = "urn:rawserve:response-format"
# how the worker's refusal of a min_new_tokens (OpenAI's min_tokens) that the prompt
# leaves no room for begins: the API answers it 400, naming that field
MIN_TOKENS_PAST_ROOM = "min_tokens asks for more new tokens than the prompt leaves room for: "


def min_tokens_past_room(least: int, prompt: int | None, positions: int) -> str:
    """The refusal of a min_tokens of `least` after a prompt of `prompt` tokens (None:
    not counted) in a model's `positions`: the room it leaves, where counted."""
    if prompt is None:
        return (
            f"{MIN_TOKENS_PAST_ROOM}it is {least}, and a prompt leaves fewer of the model's "
            f"context length of {positions}"
        )
    return (
        f"{MIN_TOKENS_PAST_ROOM}it is {least}, and the prompt is {prompt} tokens of the "
        f"model's context length of {positions}, which leaves room for {positions - prompt} "
        "new tokens"
    )


# how the worker's refusal of a chat for its template begins, and the request's field
# the API names for it (a chat's messages are the Responses API's "input")
CHAT_TEMPLATE_REFUSED = "the chat template refused the messages: "
CHAT_REFUSALS = {
    CHAT_TEMPLATE_REFUSED: "messages",
    # a control token in a name, or one the tokenizer cannot read as text
    "the chat's messages hold ": "messages",
    "the chat's tools hold ": "tools",
    "the chat's template settings hold ": "chat_template_kwargs",
}


def stops_after(params: Mapping[str, Any]) -> int:
    """The first new token whose text a stop sequence may end in: the one after an asked
    `min_new_tokens` (OpenAI's min_tokens), which holds stop sequences back as it holds
    the end of sequence, as vLLM reads it (no stop ending in its tokens' text); the
    model's own generation config does not (`generate` applies it to the end alone)."""
    return int(params.get("min_new_tokens") or 0) + 1


def stop_start(text: str, stop: str, past: int = 0) -> int:
    """Where `stop` first ends past `past` in `text` starts (-1: nowhere); one that ends
    at or before `past` (in the text before `min_tokens`) does not count."""
    return text.find(stop, max(0, past - len(stop) + 1))


def first_stop_end(text: str, stops: Sequence[str], past: int = 0) -> int | None:
    """Where the first stop sequence to end past `past` in `text` ends (None: none does).
    An answer a stop sequence ends runs to there, as TGI's ends with its stop: the rest
    of the token that completed it is not the answer's."""
    starts = ((stop, stop_start(text, stop, past)) for stop in stops)
    return min((at + len(stop) for stop, at in starts if at >= 0), default=None)


GRAMMAR_SCHEMA = {
    "type": "object",
    "description": "what may be generated: a JSON schema, or a regular expression (TGI's)",
    "required": ["type", "value"],
    "properties": {
        "type": {"enum": ["json", "json_object", "json_schema", "regex"]},
        "value": {"type": ["object", "string"]},  # json: a schema, or its text
    },
    "additionalProperties": False,
    "allOf": [
        {
            "if": {"properties": {"type": {"const": "regex"}}},
            "then": {"properties": {"value": {"type": "string", "minLength": 1}}},
        },
        {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {
                "properties": {
                    "value": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"schema": {"type": "object"}},
                    }
                }
            },
        },
    ],
}


TAKES_A_SCHEMA = "of type json takes a JSON schema: an object, or a text of one"


@checker(GRAMMAR_SCHEMA)
def grammar(value: Any) -> dict[str, Any]:
    """TGI's grammar as the worker takes it: `{"type": "json", "value": schema}` (the
    schema an object, or a text of one; "json_object" is TGI's other name for it;
    "json_schema" takes `{"name", "schema"}`, as OpenAI's response_format does), or
    `{"type": "regex", "value": text}`. Whether the
    schema or expression can be followed is the worker's to say, when it compiles it."""
    if not isinstance(value, dict) or set(value) != {"type", "value"}:
        raise ValueError(
            'must be {"type": "json", "json_object", "json_schema" or "regex", "value": ...}'
        )
    kind, given = value["type"], value["value"]
    if kind == "regex":
        if not isinstance(given, str) or not given:
            raise ValueError("of type regex takes a regular expression as its value")
        return {"type": "regex", "value": given}
    if kind == "json_schema":
        if not isinstance(given, dict) or not isinstance(given.get("schema"), dict):
            raise ValueError('of type json_schema takes {"name", "schema": {...}} as its value')
        return {"type": "json", "value": given["schema"]}
    if kind in ("json", "json_object"):  # (TGI's alias, which InferenceClient sends)
        if isinstance(given, str):
            try:
                given = json_text.loads(given, deepest=json_text.MAX_DEPTH)
            except (json_text.NotJsonNumber, json_text.TooDeep) as exc:  # (the cause, too)
                raise ValueError(f"{TAKES_A_SCHEMA}{text_fault(exc)}") from exc
            except (ValueError, RecursionError):  # (a text nested past the parser's limit)
                given = None
        if not isinstance(given, dict):
            raise ValueError(TAKES_A_SCHEMA)
        return {"type": "json", "value": given}
    raise ValueError('type must be "json", "json_object", "json_schema" or "regex"')


def text_fault(exc: BaseException | None) -> str:
    """What a schema given as a text was refused for, where its reading said: a number
    no JSON has, or a nesting deeper than a body's ("" for bad syntax)."""
    if isinstance(exc, json_text.NotJsonNumber):
        return f", and its text holds {exc}"
    if isinstance(exc, json_text.TooDeep):
        return f", and its text is {exc}"
    return ""


# TGI's frequency penalty, as the worker knows it: each token's share of the sequence so
# far (its prompt and new tokens) times the penalty, taken off its score. Not OpenAI's,
# which counts the new tokens only and takes the count (the OpenAI routes send that one)
SEQUENCE_FREQUENCY_PENALTY = "sequence_frequency_penalty"
PENALTY_RANGE = float_range(-2.0, 2.0)
MAX_TRUNCATE = 2**31 - 1  # (TGI's a u32; a model's own max_input_tokens bounds it further)


@checker({"type": "number", "minimum": -2, "maximum": 2})
def frequency_penalty(value: Any) -> float | None:
    """TGI's bounds; 0 (no penalty, which TGI's client may send) left out, so such a
    request batches with those that send none."""
    penalty = PENALTY_RANGE(value)
    return penalty or IGNORED


MAX_BEST_OF = 16  # (TGI's own default is 2; each is a generation of its own)
BEST_OF_RANGE = int_range(1, MAX_BEST_OF)


@checker({"type": "integer", "minimum": 1, "maximum": MAX_BEST_OF})
def best_of(value: Any) -> int | None:
    """1 (one answer, which TGI's client may send) left out, as with none."""
    copies = BEST_OF_RANGE(value)
    return copies if copies > 1 else IGNORED


@checker({"type": "boolean"})
def watermark(value: Any) -> bool | None:
    """TGI's (rawserve.worker.watermark); false (which TGI's client sends) left out, as
    with none."""
    return True if boolean(value) else IGNORED


TASK = Task(
    "text-generation",
    prompt,
    {
        "max_new_tokens": int_range(1, MAX_NEW_TOKENS),  # the positions bound it further
        "do_sample": boolean,
        "temperature": float_range(0.0, 100.0, above_low=True),  # 0: TGI refuses it (422)
        "top_p": float_range(0.0, 1.0, above_low=True),  # 0 keeps no token: TGI refuses it
        # TGI's any positive k (vLLM's bound): the worker keeps the whole vocabulary past it
        # (the classifiers' 1 to 1,000 refused a TGI request the OpenAI routes took)
        "top_k": int_range(1, 2**31 - 1),
        "return_full_text": boolean,
        "seed": int_range(0, 2**64 - 1),  # TGI's (a u64); torch's generators take it
        "stop": stop_sequences,
        "repetition_penalty": float_range(0.0, 100.0, above_low=True),
        # typical decoding (TGI's; 1: off): it samples, as a top_p below 1 does
        "typical_p": float_range(0.0, 1.0, above_low=True),
        "details": boolean,
        "top_n_tokens": int_range(0, MAX_TOP_N_TOKENS),
        # the prompt's tokens with their log probabilities, in the details' `prefill`
        "decoder_input_details": boolean,
        "frequency_penalty": frequency_penalty,
        # TGI's: only the prompt's last `truncate` tokens are read; at most the model's
        # max_input_tokens (the server checks it against the model, as TGI's validation)
        "truncate": int_range(1, MAX_TRUNCATE),
        # TGI's: so many sampled answers, the likeliest given (rawserve.api.best_of)
        "best_of": best_of,
        # TGI's: green tokens raised at each step, so the text can be told as generated
        "watermark": watermark,
        "grammar": grammar,
        # TGI's LoRA adapter, which rawserve does not serve: TGI's client sends it null
        # when unset; anything else is a 422
        "adapter_id": ignored(),
    },
    worker_names={"frequency_penalty": SEQUENCE_FREQUENCY_PENALTY},
    extra_fields=frozenset({"stream"}),
    # the pipeline's shape: [{"generated_text"}] per input (and its details when asked)
    output_schema={
        "type": "array",
        "items": {
            "type": "object",
            "required": ["generated_text"],
            "properties": {"generated_text": {"type": "string"}, "details": {"type": "object"}},
        },
    },
)

"""OpenAI's generation bodies: reading `/v1/chat/completions` and `/v1/completions` bodies
into prompts and worker parameters (their answers are `openai_answers`'). Each body is
declared once (`CHAT`, `COMPLETION`: `fields.Body`), for its checks and its
`/openapi.json` schema.

What OpenAI's API has and rawserve does not serve (`suffix`, `store`,
`service_tier`...; a streamed echo with log probabilities) is taken at its off or default
value and refused with 400 naming it otherwise, never ignored (`reasoning_effort` is
the chat template's variable where the template reads one); OpenAI's bookkeeping
(`user`, `metadata`) is checked, then dropped. Several choices a
prompt (`n`) are each a generation of their own, queued together, streamed as their
tokens come; `logit_bias`, `frequency_penalty` and `presence_penalty` change each step's
scores in the worker; `response_format` and `tools` (or the older `functions`;
`openai_tools`) hold what is generated to a grammar. Log probabilities (chat's `logprobs`
and `top_logprobs`, completions' `logprobs`) are asked of the worker's tokens (TGI's
shape, with `top_tokens` when alternatives are asked for). Completions' `echo` puts the
prompt before the completion, and with `logprobs` lists the prompt's tokens first (the
worker's `prefill`, TGI's `decoder_input_details`); `max_tokens` 0 with it scores the
prompt alone; `best_of` samples that many of a prompt's completions and answers the
`n` likeliest (`best_of.likeliest_choices`). A chat's messages are read by
`openai_messages`. Server process; plain
Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rawserve.api.bodies import check_client_batch
from rawserve.api.fields import (
    Body,
    Field,
    Fields,
    flag,
    item_name,
    one_of,
    read_boolean,
    read_number,
    text,
    unicode_text,
    whole,
)
from rawserve.api.openai_messages import MESSAGE, read_messages
from rawserve.api.openai_tools import (
    FUNCTION_CALL,
    FUNCTIONS,
    TOOL_CHOICE,
    TOOLS,
    Tools,
    chat_tools,
    read_function_call,
    read_functions,
    read_tool_choice,
    read_tools,
)
from rawserve.api.prompt_cuts import TRUNCATE_PROMPT_TOKENS, read_truncation
from rawserve.api.routing import DocContext, Needs, Schema
from rawserve.api.served import ServedModel
from rawserve.http.errors import (
    BadRequest,
    PayloadTooLarge,
    UnprocessableInput,
)
from rawserve.tasks import (
    CHAT_PARAM,
    BlankInput,
    InvalidRequest,
    check_new_tokens,
    text_generation,
)
from rawserve.tasks.checks import not_blank
from rawserve.tasks.rules import MAX_NEW_TOKENS
from rawserve.tasks.text_generation import (
    API_SAMPLING,
    MAX_STOP_SEQUENCES,
    MAX_TOP_N_TOKENS,
    PROMPT_TOP_N,
    TOKEN_COUNTS_ONLY,
)

# chat_template_kwargs (vLLM's): the template's own settings, never the names that
# apply_chat_template, the template's functions or Jinja's own (`range`, `namespace`:
# shadowed, the template failed, a 422 blaming the messages) already take
MAX_TEMPLATE_KWARGS = 32
TEMPLATE_NAME = re.compile("[A-Za-z][A-Za-z0-9_]*")
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize",
        "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
        "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace", "self",
        "conversations",
    }
)  # fmt: skip
# OpenAI's reasoning efforts ("none": the model's own, its template's default)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
MAX_CHOICES = 128  # OpenAI's bound on "n"
MAX_BEST_OF = 20  # OpenAI's bound on completions' "best_of"
GRAMMAR_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
)
REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")  # escaped in a literal text (Rust's regex syntax)
MAX_LOGIT_BIAS = 300  # token ids one request may bias: bounds a step's extra work
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# OpenAI's bounds on "metadata": pairs, and the characters of a key and of a value
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

SEEDS = 2**64  # the seeds the worker takes: 0 to 2**64 - 1, as TGI's


@dataclass(frozen=True)
class GenerationRequest:
    items: list[Any]  # prompts (texts or token ids), or chats ({"messages": [...]})
    params: dict[str, Any]  # the worker's text-generation parameters
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    max_tokens_field: str = "max_tokens"  # the field that set params["max_new_tokens"]
    logprobs: int | None = None  # None: none asked; else how many alternatives a token lists
    echo: bool = False  # completions: the prompt before its completion (and its tokens)
    n: int = 1  # choices per prompt
    best_of: int = 1  # completions: generations per prompt, of which the `n` likeliest answer
    tools: Tools | None = None  # chat: the functions its answer may call
    grammar_field: str | None = None  # the field whose grammar holds the answer, if any

    @property
    def generations(self) -> int:
        """A prompt's generations: its `n` choices, or the `best_of` they are chosen from."""
        return max(self.n, self.best_of)

    def choice_params(self) -> list[dict[str, Any]]:
        """The worker's parameters for each of a prompt's generations: the same, but for a
        seed, which each takes one further on (so that seeded choices differ, and each
        repeats); where the likeliest are chosen, each lists its tokens' log
        probabilities, by which they are."""
        params = self.params
        if self.best_of > self.n:
            params = {name: value for name, value in params.items() if name != TOKEN_COUNTS_ONLY}
        if "seed" not in params:
            return [params] * self.generations
        seed = params["seed"]
        return [{**params, "seed": (seed + j) % SEEDS} for j in range(self.generations)]


GENERATION = Needs(frozenset({"text-generation"}), "a text-generation model")
# chat's and the Responses API's: a model with a chat template first
CHAT_GENERATION = replace(GENERATION, chat=True)


def unserved(schema: Schema, *allowed: Any) -> Field:
    """A field rawserve does not serve: only its "off" values (null, false, 0...) are taken;
    anything else is 400."""
    shown = " or ".join(json.dumps(off) for off in (None, *allowed))

    def read(name: str, value: Any, context: DocContext | None) -> Any:
        # false is not 0 here (Python says it is)
        if not any(
            value == off and isinstance(value, bool) == isinstance(off, bool) for off in allowed
        ):
            raise BadRequest(f'"{name}" is not supported by this server: it takes only {shown}')
        return value

    return Field(schema, read)


def refuse_unserved(fields: Fields, names: Sequence[str]) -> None:
    """400 for any of `names` set to something other than its "off" values."""
    for name in names:
        fields.value(name)


def generation_params(
    fields: Fields, max_tokens_field: str, default: int | None
) -> GenerationRequest:
    """The parameters both routes share."""
    fields.value("user")
    params: dict[str, Any] = {
        "return_full_text": False,
        "details": True,  # (usage and the finish reason)
        TOKEN_COUNTS_ONLY: True,  # unless log probabilities are asked (`with_logprobs`)
        API_SAMPLING: True,
    }
    max_tokens = fields.value(max_tokens_field)
    if max_tokens_field != "max_tokens":
        # chat's older name, checked even where the newer one wins (as OpenAI and vLLM
        # check each field sent): a bad value beside a good one was taken, 200
        older = fields.value("max_tokens")
        if max_tokens is None:
            max_tokens, max_tokens_field = older, "max_tokens"
    if max_tokens is None:
        max_tokens = default
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    temperature = fields.value("temperature")
    if temperature is not None:  # 0: greedy; more: sampling at that temperature
        params["temperature"] = temperature
        params["do_sample"] = temperature > 0
    top_p = fields.value("top_p")
    if top_p is not None:
        params["top_p"] = top_p
    if min_p := fields.value("min_p"):  # 0: none
        params["min_p"] = min_p
    top_k = fields.value("top_k")
    if top_k is not None:  # vLLM's -1 and 0: every token (the model's own default is off)
        params["top_k"] = max(top_k, 0)
    keep = fields.value(TRUNCATE_PROMPT_TOKENS)
    if keep is not None:  # (-1 is made a count once the model is known: `prompt_cut`)
        params["truncate"] = keep
    repetition_penalty = fields.value("repetition_penalty")
    if repetition_penalty is not None:
        params["repetition_penalty"] = repetition_penalty
    if min_tokens := fields.value("min_tokens"):
        if max_tokens is not None and min_tokens > max_tokens:
            message = f'"min_tokens" ({min_tokens}) is more than "{max_tokens_field}"'
            raise BadRequest(message, param="min_tokens")
        params["min_new_tokens"] = min_tokens
    if fields.value("ignore_eos"):
        params["ignore_eos"] = True
    for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
        if value := fields.value(name):  # 0 or {}: none (and the batch key as without)
            params[name] = value
    grammars = [(name, g) for name in GRAMMAR_FIELDS if (g := fields.value(name)) is not None]
    if len(grammars) > 1:
        raise BadRequest(
            f"one of {', '.join(GRAMMAR_FIELDS)} may hold an answer, not several",
            param=grammars[1][0],
        )
    grammar_field = None
    if grammars:
        grammar_field, params["grammar"] = grammars[0]
    seed = fields.value("seed")
    if seed is not None:  # OpenAI's signed 64 bits, as the worker's unsigned ones
        params["seed"] = seed % SEEDS
    stop = fields.value("stop") or []
    if stop:
        params["stop"] = stop
    stream = fields.value("stream")
    if fields.get("stream_options") is not None and not stream:
        raise BadRequest('"stream_options" goes with "stream": true', param="stream_options")
    include_usage = bool(fields.value("stream_options"))
    n = fields.value("n") or 1
    return GenerationRequest(
        [], params, stop, stream, include_usage, max_tokens_field, n=n, grammar_field=grammar_field
    )


def prompt_cut(generation: GenerationRequest, positions: int, scored: bool) -> None:
    """vLLM's `truncate_prompt_tokens` as TGI's `truncate`, the last tokens of a prompt a
    worker reads: -1, as many as the model reads of one and a new token (of one only
    `scored`, which takes no new token, every position); 400 for more."""
    keep = generation.params.get("truncate")
    if keep is None or positions < 1:
        return
    room = 0 if scored else max(1, int(generation.params.get("min_new_tokens") or 0))
    most = positions - room
    if keep == -1:
        generation.params["truncate"] = max(most, 1)
    elif keep > most:
        why = f"its {positions} positions" + (", less room for the new tokens" if room else "")
        raise BadRequest(
            f'"{TRUNCATE_PROMPT_TOKENS}" is {keep}, and this model reads at most {most} '
            f"tokens of a prompt ({why})",
            param=TRUNCATE_PROMPT_TOKENS,
        )


def check_choices(generation: GenerationRequest, most: int, admitted: int | None = None) -> None:
    """413 for more choices (prompts × n, or × best_of) than one request may ask: each is
    a generation, queued as an item of its own, so more than admission ever takes of one
    request (`admitted`: the queue, and the rows of workers that take one item at a time)
    can never be admitted either (a 503 would invite retries that all fail)."""
    choices = len(generation.items) * generation.generations
    prompts = len(generation.items)
    times, noun = (
        ("n", "choices") if generation.best_of <= generation.n else ("best_of", "generations")
    )
    why = f"{choices} {noun} in one request ({prompts} prompt{'s' if prompts > 1 else ''}, "
    why += f"{times} {generation.generations})"
    caps = (
        (most, f"at most {most} are allowed (--max-client-batch-size)"),
        (
            admitted,
            f"this server takes at most {admitted} of one request (--max-queue, and the rows "
            "of workers that take one item at a time)",
        ),
    )
    for cap, says in caps:
        if cap is not None and choices > cap:
            # the field at fault: the prompts where they alone are too many, else n
            field = "prompt" if len(generation.items) > cap else times
            raise PayloadTooLarge(f"{why}: {says}", param=field)


MOST_ID_DIGITS = 19  # a token id is an int64 at most, whatever the vocabulary


def read_logit_bias(name: str, value: Any, context: DocContext | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON's keys are text) to a bias from -100 to 100; the
    model's worker knows which ids it has."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f'"{name}" must be an object of at most {MAX_LOGIT_BIAS} token ids, each to a bias'
        )
    bias = {}
    for token, amount in value.items():
        if not (token.isascii() and token.isdigit()):
            raise BadRequest(f'"{name}" takes token ids as its keys, not {token[:40]!r}')
        digits = token.lstrip("0") or "0"
        if len(digits) > MOST_ID_DIGITS:  # (Python reads 4,300 digits at most: it was a 500)
            raise BadRequest(f'"{name}" has a key past any token id: {digits[:SHOWN_CHARS]}...')
        bias[int(digits)] = read_number(f"{name}[{digits}]", amount, -100, 100)
    return bias


def read_metadata(name: str, value: Any, context: DocContext | None) -> dict[str, str]:
    """OpenAI's tags for its dashboard: checked as OpenAI checks them, then dropped."""
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(
            isinstance(tag, str) and len(key) <= MAX_METADATA_KEY and len(tag) <= MAX_METADATA_VALUE
            for key, tag in value.items()
        )
    ):
        raise BadRequest(
            f'"{name}" must be an object of at most {MAX_METADATA_PAIRS} texts by name (names '
            f"of at most {MAX_METADATA_KEY} characters, texts of at most {MAX_METADATA_VALUE})"
        )
    return value


# the fields of each of response_format's types (json_object's "schema": Together's and
# Fireworks' form)
SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a json_schema's name
SCHEMA_NAME_SCHEMA = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
SHOWN_CHARS = 40  # of a client's value quoted in a refusal (it may be long)
# a json_schema's fields beside its schema, as OpenAI takes them
SCHEMA_DESCRIPTION_KEYS = {"name", "schema", "strict", "description"}
RESPONSE_FORMAT_KEYS = {
    "text": {"type"},
    "json_object": {"type", "schema"},
    "json_schema": {"type", "json_schema"},
}


def read_response_format(
    name: str, value: Any, context: DocContext | None
) -> dict[str, Any] | None:
    """The grammar OpenAI's response_format asks for, as the worker takes it (TGI's shape);
    None for free text. A schema is always held to ("strict" or not). TGI's chat takes its
    own grammars here (`{"type", "value"}`, as its /generate does), and so does rawserve."""
    if isinstance(value, dict) and "value" in value:  # (OpenAI's forms have no "value")
        try:
            return text_generation.grammar(value)
        except ValueError as exc:
            raise BadRequest(f'"{name}" {exc}') from None
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind in RESPONSE_FORMAT_KEYS:  # (a list would be no key)
        # (as OpenAI refuses one: a misspelt "json_schema" was dropped without a word)
        unknown = sorted(set(value) - RESPONSE_FORMAT_KEYS[kind], key=str)
        if unknown:
            raise BadRequest(f'"{name}" of type "{kind}" has an unknown field: "{unknown[0]}"')
    if kind == "text":
        return None
    if kind == "json_object":
        # a schema beside it (Together's and Fireworks' form, which langchain-huggingface's
        # ChatHuggingFace sends for structured output) is held to, never dropped
        if "schema" not in value:
            return {"type": "json", "value": {"type": "object"}}
        try:
            return text_generation.grammar({"type": "json", "value": value["schema"]})
        except ValueError as exc:
            raise BadRequest(f'"{name}.schema" {exc}') from None
    if kind == "json_schema":
        described = value.get("json_schema")
        if isinstance(described, dict):
            where = f"{name}.json_schema"
            unknown = sorted(set(described) - SCHEMA_DESCRIPTION_KEYS, key=str)
            if unknown:  # (dropped without a word, where /v1/responses refused it)
                field = str(unknown[0])[:SHOWN_CHARS]
                raise BadRequest(f'"{where}" has an unknown field: "{field}"', param=where)
            check_schema_description(where, described)
            if not isinstance(described.get("schema"), dict):
                raise BadRequest(
                    f'"{where}.schema" must be a JSON schema: an object', param=f"{where}.schema"
                )
        try:
            return text_generation.grammar({"type": "json_schema", "value": described})
        except ValueError:
            pass
    raise BadRequest(
        f'"{name}" must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
        '"json_schema", "json_schema": {"name": ..., "schema": {...}}} (or TGI\'s {"type": '
        '"json" or "regex", "value": ...})'
    )


# writes NaN and infinity as JSON's readers spell them (orjson writes null: 1e400, read as
# infinity, was said back as null, a value its client never sent)
SHOWING = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def shown(value: Any) -> str:
    """A client's value as JSON, cut short, to quote in a refusal. Written piece by piece
    and stopped once long enough: a value of a megabyte costs no more than a short one."""
    text = ""
    for piece in SHOWING.iterencode(value):
        text += piece
        if len(text) > SHOWN_CHARS:
            return text[:SHOWN_CHARS] + "..."
    return text


def check_schema_description(name: str, described: dict[str, Any]) -> None:
    """What OpenAI holds a json_schema's fields beside its schema to: a name of 1 to 64
    letters, digits, _ or - (vLLM takes any text: a request it answered, OpenAI refused),
    a text for its description, and true or false for "strict"."""
    if not isinstance(described.get("name"), str):
        raise BadRequest(
            f'"{name}.name" must be a text: the name of the schema', param=f"{name}.name"
        )
    if not SCHEMA_NAME.fullmatch(described["name"]):
        said = shown(described["name"])
        raise BadRequest(
            f'"{name}.name" is {said}: it must be 1 to 64 letters, digits, "_" or "-"',
            param=f"{name}.name",
        )
    if described.get("description") is not None and not isinstance(described["description"], str):
        raise BadRequest(f'"{name}.description" must be a text', param=f"{name}.description")
    if described.get("strict") is not None and not isinstance(described["strict"], bool):
        raise BadRequest(f'"{name}.strict" must be true or false', param=f"{name}.strict")


def read_guided_json(name: str, value: Any, context: DocContext | None) -> dict[str, Any]:
    try:
        return text_generation.grammar({"type": "json", "value": value})
    except ValueError as exc:
        why = text_generation.text_fault(exc.__cause__)  # (NaN, 1e400 in a text of one)
        raise BadRequest(
            f'"{name}" must be a JSON schema: an object, or a text of one{why}'
        ) from None


def read_guided_regex(name: str, value: Any, context: DocContext | None) -> dict[str, Any]:
    if not isinstance(value, str) or not value:
        raise BadRequest(f'"{name}" must be a regular expression')
    return {"type": "regex", "value": value}


def read_guided_choice(name: str, value: Any, context: DocContext | None) -> dict[str, Any]:
    """One of the texts, exactly: a regular expression of them, each escaped."""
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f'"{name}" must be a non-empty list of non-empty texts')
    escaped = ("".join("\\" + c if c in REGEX_SPECIAL else c for c in text) for text in value)
    return {"type": "regex", "value": "(" + "|".join(escaped) + ")"}


# vLLM's options beside a structured output that change nothing here: one backend, no
# fallback from it, no whitespace between tokens of JSON, and objects that list their
# properties closed where they leave `additionalProperties` unstated
STRUCTURED_OPTIONS = frozenset(
    {"backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties"}
)


def read_structured_outputs(name: str, value: Any, context: DocContext | None) -> dict[str, Any]:
    """vLLM's form of the guided fields since 0.12: `{"json" | "regex" | "choice": ...}`,
    or `{"json_object": true}` (its other fields taken where null or false, its options
    that change nothing here taken, any other named)."""
    readers = {"json": read_guided_json, "regex": read_guided_regex, "choice": read_guided_choice}
    asked = value if isinstance(value, dict) else {}
    # (false is a kind not asked, or an option's value; `is`: 0 is no false here, nor 1
    # a true, as elsewhere in a body)
    asked = {
        key: given
        for key, given in asked.items()
        if given is not None and (given is not False or key in STRUCTURED_OPTIONS)
    }
    unheld = sorted(set(asked) - STRUCTURED_OPTIONS - {*readers, "json_object"})
    if unheld:
        raise BadRequest(
            f'"{name}" holds {", ".join(map(repr, unheld))}, which this server does not '
            'follow: it holds an answer to "json", "regex", "choice" or "json_object": true'
        )
    for option in STRUCTURED_OPTIONS & asked.keys():  # (as vLLM checks them)
        kind = str if option == "backend" else bool
        if not isinstance(asked[option], kind):
            raise BadRequest(
                f'"{name}.{option}" must be {"a text" if kind is str else "true or false"}'
            )
    asked = {key: given for key, given in asked.items() if key not in STRUCTURED_OPTIONS}
    if len(asked) == 1 and asked.get("json_object") is True:
        return {"type": "json", "value": {"type": "object"}}
    if len(asked) != 1 or next(iter(asked)) not in readers:
        raise BadRequest(
            f'"{name}" must hold one of "json", "regex", "choice" or "json_object": true '
            "(this server follows no other)"
        )
    [(key, given)] = asked.items()
    return readers[key](f"{name}.{key}", given, context)


def read_top_p(name: str, value: Any, context: DocContext | None) -> float:
    top_p = read_number(name, value, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest('"top_p" must be above 0')
    return top_p


def read_repetition_penalty(name: str, value: Any, context: DocContext | None) -> float:
    penalty = read_number(name, value, 0.0, 100.0)
    if penalty == 0:
        raise BadRequest('"repetition_penalty" must be above 0 (1: no penalty)')
    return penalty


def read_stream_options(name: str, value: Any, context: DocContext | None) -> bool:
    """Whether the stream ends with a usage chunk. OpenAI's `include_obfuscation` is taken
    where it is false (or null): no delta is padded, as on the Responses route; so is
    vLLM's `continuous_usage_stats`: usage only in the last chunk."""
    if (
        not isinstance(value, dict)
        or set(value) - {"include_usage", "include_obfuscation", "continuous_usage_stats"}
        or value.get("include_obfuscation") not in (False, None)
        or value.get("continuous_usage_stats") not in (False, None)
    ):
        raise BadRequest(
            '"stream_options" must be {"include_usage": true or false} (and '
            '"include_obfuscation": false, if given: no delta is padded; '
            '"continuous_usage_stats": false, if given: usage comes in the last chunk only)',
            param="stream_options",
        )
    include_usage = value.get("include_usage")
    return False if include_usage is None else read_boolean("include_usage", include_usage, None)


def read_prompt_cache_options(name: str, value: Any, context: DocContext | None) -> Any:
    """OpenAI's prompt caching settings (`mode`, `ttl`): checked, then dropped (no prompt
    is cached here, and caching changes no answer)."""
    if (
        not isinstance(value, dict)
        or set(value) - {"mode", "ttl"}
        or value.get("mode") not in ("implicit", "explicit", None)
        or not isinstance(value.get("ttl", ""), (str, type(None)))
    ):
        raise BadRequest(
            f'"{name}" must be {{"mode": "implicit" or "explicit", "ttl": "30m"}}', param=name
        )
    return value


def read_stop(name: str, value: Any, context: DocContext | None) -> list[str]:
    return stop_sequences(value)


def stop_sequences(value: Any) -> list[str]:
    """OpenAI's "stop": the text-generation task's own rule, worded as OpenAI's field."""
    if value is None:
        return []
    try:
        stops = text_generation.stop_sequences(value)
    except ValueError as exc:
        if str(exc) == text_generation.REPLACEMENT_IN_STOP:
            raise BadRequest(f'"stop" {exc}') from None
        raise BadRequest(
            f'"stop" must be a text or a list of at most {MAX_STOP_SEQUENCES} non-empty texts '
            "of at most 200 characters"
        ) from None
    return [unicode_text(s, '"stop"') for s in stops]


def parse_chat(
    document: Any, one_call: bool = False, reads_effort: bool = False
) -> GenerationRequest:
    """A chat request; `one_call`: the model's template takes one tool call an answer (its
    answer is held to one, `parallel_tool_calls` or not); `reads_effort`: the template
    reads a `reasoning_effort` (`template_effort`)."""
    fields = CHAT.read(document)
    refuse_unserved(fields, CHAT_UNSERVED)
    for name in CHAT_BOOKKEEPING:  # checked, then dropped: they change no answer
        fields.value(name)
    request = generation_params(fields, "max_completion_tokens", None)
    chat: dict[str, Any] = {"messages": fields.value("messages")}
    params = {**request.params, CHAT_PARAM: True}
    tools = requested_tools(fields, one_call)
    effort = template_effort(fields.value("reasoning_effort"), reads_effort, "reasoning_effort")
    # (one the client sets among the template's variables is the one it means)
    if variables := {**effort, **(fields.value("chat_template_kwargs") or {})}:
        chat["template_kwargs"] = variables
    opening = answer_opening(fields)
    if opening:
        chat["opening"] = opening
    tool_prompt = fields.value("tool_prompt")  # (TGI's: told with the tools, so not without)
    if tools is not None:
        if opening.get("continue_final_message"):
            raise BadRequest(
                '"continue_final_message" cannot go with tools: a call opens its answer',
                param="continue_final_message",
            )
        tools = offer_tools(tools, tool_prompt, chat, params)
    if tools is not None and tools.held:  # (a response_format beside them is theirs)
        field = "functions" if tools.older else "tools"  # (OpenAI's older form: its own)
        request = replace(request, grammar_field=field)
    request = json_unstopped(replace(request, items=[chat], params=params, tools=tools))
    top = fields.value("top_logprobs")
    if fields.value("logprobs"):
        return with_logprobs(request, top or 0)
    if top is not None:
        raise BadRequest('"top_logprobs" needs "logprobs": true', param="top_logprobs")
    return request


def parse_model_chat(model: ServedModel, document: Any) -> GenerationRequest:
    """A chat request to `model` (`parse_chat`), read as its chat template takes it (400
    first where it has none)."""
    check_chat_template(model)  # (before its fields: an effort is the template's)
    loaded = model.serving.loaded
    details = loaded.details if loaded else {}
    return parse_chat(
        document,
        bool(details.get("chat_one_call")),
        bool(details.get("chat_reads_reasoning_effort")),
    )


def check_chat_template(model: ServedModel) -> None:
    """400 where the model has no chat template to render messages with."""
    loaded = model.serving.loaded
    if loaded is not None and loaded.details.get("chat_template_invalid"):
        raise BadRequest(
            "this model's own chat template is not valid Jinja (the server's log says "
            "where): start the server with --chat-template FILE, or use /v1/completions"
        )
    if loaded is not None and not loaded.details.get("chat_template"):
        raise BadRequest(
            "this model's tokenizer has no chat template: start the server with "
            "--chat-template FILE (a Jinja template), or use /v1/completions"
        )


def json_unstopped(request: GenerationRequest) -> GenerationRequest:
    """`request` without stop sequences in the worker where its answer is held to JSON (a
    tool call, a JSON response_format, guided_json): the grammar says where it ends, and a
    stop cut it into JSON no client can read (smolagents sends `stop` beside required
    calls; a call's arguments may hold the stop's text). Where the answer may be words
    (tools with "auto": `{"content": "..."}`), the request keeps them for the answer's
    words alone (`Answer.message`): ReAct agents send `stop: ["Observation:"]` beside
    their tools. Matched in the JSON, they cut its opening, a tool's name or an escape."""
    grammar = request.params.get("grammar")
    if not request.stop or grammar is None or grammar["type"] != "json":
        return request
    params = {key: value for key, value in request.params.items() if key != "stop"}
    return replace(request, params=params, stop=request.stop if may_be_words(request) else [])


def may_be_words(request: GenerationRequest) -> bool:
    """Whether a request held to JSON may answer in words (`{"content": "..."}`)."""
    tools = request.tools
    return tools is not None and tools.mode == "auto" and tools.answer_format is None


def requested_tools(fields: Fields, one_call: bool = False) -> Tools | None:
    """The functions a chat's answer may call: OpenAI's tools, or its older functions (not
    both); None for none. `one_call`: a call an answer, as Llama 3.1-3.3's templates take
    an assistant's calls back (`parallel_tool_calls` allows several; one is within it)."""
    parallel = fields.value("parallel_tool_calls") and not one_call
    tools = chat_tools(fields.value("tools"), fields.value("tool_choice"), parallel)
    older = chat_tools(fields.value("functions"), fields.value("function_call"), older=True)
    if tools is not None and older is not None:
        raise BadRequest('"tools" and "functions" cannot be given together', param="functions")
    return tools or older


def offer_tools(
    tools: Tools, tool_prompt: str | None, chat: dict[str, Any], params: dict[str, Any]
) -> Tools:
    """Put `tools` in the chat the template renders, and hold the answer to a call's
    grammar where the tool choice asks for one (in the worker's `params`): with a JSON
    response_format, an answer that does not call follows it (OpenAI's way; where a
    call is required, the format holds nothing, as in vLLM). The tools, as they hold it."""
    chat["tools"] = tools.template_tools()  # the template shows them to the model
    if tools.parallel:  # (where the template leaves tools out, the model is told)
        chat["parallel_tool_calls"] = True
    if tool_prompt:
        chat["tool_prompt"] = unicode_text(tool_prompt, '"tool_prompt"')
    if tools.held:
        answer_format = params.get("grammar")
        if answer_format is not None:
            if answer_format["type"] != "json":
                raise BadRequest(
                    "a regular expression cannot hold an answer that may call tools (a JSON "
                    "schema can)",
                    param="tools",
                )
            tools = replace(tools, answer_format=answer_format["value"])
        params["grammar"] = tools.grammar()
    return tools


def answer_opening(fields: Fields) -> dict[str, bool]:
    """vLLM's add_generation_prompt and continue_final_message, where they are not their
    defaults (the template opens an answer of its own; the last message is not continued)."""
    opening = {}
    if not fields.value("add_generation_prompt"):
        opening["add_generation_prompt"] = False
    if fields.value("continue_final_message"):
        if "add_generation_prompt" not in opening:
            raise BadRequest(
                '"continue_final_message" goes on with the last message: it needs '
                '"add_generation_prompt": false',
                param="continue_final_message",
            )
        opening["continue_final_message"] = True
    return opening


def template_effort(effort: str | None, reads_effort: bool, field: str) -> dict[str, str]:
    """The chat template's variables for OpenAI's reasoning effort: `reasoning_effort`, as
    vLLM sets it (gpt-oss's template reads it), but "none" or null (the template's own
    default); 400 naming `field` where the model's template reads none (an effort asked
    is never dropped without a word)."""
    if effort in (None, "none"):
        return {}
    if not reads_effort:
        raise BadRequest(
            f'"{field}" is not supported by this model: its chat template reads no '
            'reasoning_effort (it takes only "none" or null)',
            param=field,
        )
    return {"reasoning_effort": effort}


def read_template_kwargs(name: str, value: Any, context: DocContext | None) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: variables for the chat template, by name."""
    if (
        not isinstance(value, dict)
        or len(value) > MAX_TEMPLATE_KWARGS
        or not all(TEMPLATE_NAME.fullmatch(key) for key in value)
    ):
        raise BadRequest(
            f'"{name}" must be an object of at most {MAX_TEMPLATE_KWARGS} values by name '
            '(such as {"enable_thinking": false})'
        )
    if taken := sorted(RESERVED_TEMPLATE_NAMES & set(value)):
        raise BadRequest(
            f'"{name}" cannot set {", ".join(taken)}: the server or the template sets it'
        )
    return value


def with_logprobs(request: GenerationRequest, alternatives: int) -> GenerationRequest:
    """The request with its tokens' log probabilities asked for, and `alternatives` of
    the likeliest tokens beside each (the worker's `top_n_tokens`)."""
    params = dict(request.params)
    del params[TOKEN_COUNTS_ONLY]
    if alternatives:
        params["top_n_tokens"] = alternatives
    return replace(request, params=params, logprobs=alternatives)


def parse_completion(document: Any, context: DocContext) -> GenerationRequest:
    fields = COMPLETION.read(document)
    refuse_unserved(fields, COMPLETION_UNSERVED)
    request = json_unstopped(generation_params(fields, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS))
    best_of = fields.value("best_of")
    if best_of is not None:
        if best_of < request.n:  # (as OpenAI and vLLM refuse it)
            message = f'"best_of" ({best_of}) must be at least "n" ({request.n})'
            raise BadRequest(message, param="best_of")
        if best_of > request.n and request.stream:  # (the likeliest are known at the end)
            raise BadRequest('"best_of" above "n" cannot be streamed', param="best_of")
        if request.params.get("do_sample") is not False:  # (greedy: every one the same)
            request = replace(request, best_of=best_of)
    prompts = fields.value("prompt", context)
    for index, prompt in enumerate(prompts):  # as every route: blank text is well-formed,
        where = item_name('"prompt"', index, len(prompts))  # but nothing to go on
        if prompt == []:
            raise UnprocessableInput(f"a prompt of token ids in {where} has none", param="prompt")
        try:
            if isinstance(prompt, str):
                not_blank(prompt, f"a text of {where}")
        except BlankInput as exc:
            raise UnprocessableInput(str(exc), param="prompt") from None
    items = [unicode_text(p, '"prompt"') if isinstance(p, str) else p for p in prompts]
    request = replace(request, items=items)
    echo = bool(fields.value("echo"))
    if request.params.get("max_new_tokens") == 0 and not echo:
        raise BadRequest(
            '"max_tokens" must be at least 1 (0 only with "echo": true)', param="max_tokens"
        )
    if echo and request.stream and fields.value("logprobs") is not None:
        # (the prompt's scores come with the answer's end, after its tokens)
        raise BadRequest(
            '"echo" with "logprobs" is not supported with "stream": true', param="echo"
        )
    alternatives = fields.value("logprobs")
    if alternatives is not None:
        request = with_logprobs(request, alternatives)
    if not echo:
        return request
    params = dict(request.params)
    if alternatives is not None:  # the prompt's tokens scored too, with as many alternatives
        params["decoder_input_details"] = True
        if alternatives:
            params[PROMPT_TOP_N] = alternatives
    return replace(request, params=params, echo=True)


def check_max_tokens(generation: GenerationRequest, most: int | None) -> None:
    """400 for more new tokens (or `min_tokens`) than the model's positions allow
    (`most`; None: unknown, and `check_new_tokens`' ceiling bounds them), checked before
    the request is queued: the rule `POST /` applies to `max_new_tokens`, worded with the
    field this client sent."""
    for name, sent in (
        ("max_new_tokens", generation.max_tokens_field),
        ("min_new_tokens", "min_tokens"),
    ):
        asked = generation.params.get(name)
        if asked is None:
            continue
        try:
            check_new_tokens(f'"{sent}"', asked, most)
        except InvalidRequest as exc:
            raise BadRequest(str(exc), param=sent) from None


def check_token_ids(generation: GenerationRequest, vocabulary: int | None) -> None:
    """422 naming the field (as vLLM names it) for a token id, in a prompt of ids or in
    `logit_bias`, that the model has none for (`vocabulary`: its token count; None, not
    known yet: the worker refuses such an id), checked before the request is queued."""
    refuse_unknown_ids(generation.items, vocabulary, "prompt")
    refuse_unknown_ids([list(generation.params.get("logit_bias") or {})], vocabulary, "logit_bias")


def refuse_unknown_ids(items: Sequence[Any], vocabulary: int | None, param: str) -> None:
    """422 naming `param` for the first token id, in the items that are lists of ids, that
    the model has no embedding for (`vocabulary`: its token count; None, not known yet: the
    worker refuses such an id)."""
    if not vocabulary:
        return
    for index, item in enumerate(items):
        if not isinstance(item, list):
            continue
        unknown = next((token_id for token_id in item if token_id >= vocabulary), None)
        if unknown is not None:
            where = "" if len(items) == 1 else f' of "{param}" at index {index}'
            raise UnprocessableInput(
                f"the token id {unknown}{where} is not in the model's vocabulary (ids run "
                f"from 0 to {vocabulary - 1})",
                param=param,
            )


def read_prompts(name: str, value: Any, context: DocContext | None) -> list[str | list[int]]:
    """A text or a non-empty list of them, or a prompt of token ids or a non-empty list of
    them (OpenAI's four forms), at most the input cap. A blank text, or a prompt of no ids,
    is refused with 422 once the body is read, as a blank input is on every route."""
    if value is None:
        raise BadRequest(f'"{name}" is required')
    many = isinstance(value, list) and bool(value)
    if isinstance(value, str) or (many and is_token_ids(value)):
        prompts = [value]
    elif many and (all(isinstance(p, str) for p in value) or all(map(is_token_ids, value))):
        prompts = value
    else:
        raise BadRequest(
            f'"{name}" must be a text, a list of token ids, or a non-empty list of either '
            "(one form for all)"
        )
    assert context is not None
    check_client_batch(len(prompts), context.max_inputs)
    return prompts


def is_token_ids(value: Any) -> bool:
    """A list of token ids: whole numbers from 0 (the model's worker knows its vocabulary)."""
    return isinstance(value, list) and all(type(i) is int and i >= 0 for i in value)


def prompt_schema(context: DocContext) -> Schema:
    prompt = {"type": "string"}  # a blank one is well-formed: 422, as on every route
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    listed = {"minItems": 1, "maxItems": context.max_inputs}
    return {
        "oneOf": [
            prompt,
            {**ids, "minItems": 1},
            {"type": "array", "items": prompt, **listed},
            {"type": "array", "items": {**ids, "minItems": 1}, **listed},
        ]
    }


# --- the bodies ---------------------------------------------------------------------------

NULLABLE_BOOLEAN: Schema = {"type": ["boolean", "null"]}
STOP: Schema = {
    "anyOf": [
        {"type": "null"},
        {"type": "string", "minLength": 1, "maxLength": 200},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 200},
            "maxItems": 16,
        },
    ]
}
STREAM_OPTIONS: Schema = {
    "type": ["object", "null"],
    "properties": {
        "include_usage": NULLABLE_BOOLEAN,
        "include_obfuscation": {"enum": [False, None]},  # no delta is padded
        "continuous_usage_stats": {"enum": [False, None]},  # usage in the last chunk only
    },
    "additionalProperties": False,
    "description": 'only with "stream": true',
}
TEMPLATE_KWARGS: Schema = {
    "type": ["object", "null"],
    "description": "variables for the chat template, by name (vLLM's)",
    "maxProperties": MAX_TEMPLATE_KWARGS,
    "propertyNames": {
        "pattern": f"^{TEMPLATE_NAME.pattern}$",
        "not": {"enum": sorted(RESERVED_TEMPLATE_NAMES)},
    },
}
MAX_TOKENS = whole(1, MAX_NEW_TOKENS)
PENALTY: Schema = {"type": ["number", "null"], "minimum": -2, "maximum": 2}
GUIDED_CHOICE: Schema = {
    "type": ["array", "null"],
    "items": {"type": "string", "minLength": 1},
    "minItems": 1,
}
STRUCTURED_OUTPUTS: Schema = {
    "type": ["object", "null"],
    "description": 'vLLM\'s: one of {"json": schema}, {"regex": ...}, {"choice": [...]} or '
    '{"json_object": true}',
    "properties": {
        "json": {"type": ["object", "string", "null"]},
        "regex": {"type": ["string", "null"], "minLength": 1},
        "choice": GUIDED_CHOICE,
        "json_object": {"type": ["boolean", "null"]},
    },
}
OPENAI_RESPONSE_FORMAT: Schema = {
    "type": "object",
    "description": 'free text ({"type": "text"}), any JSON object ({"type": "json_object"}) '
    'or JSON that a schema describes ({"type": "json_schema", "json_schema": {"name", '
    '"schema"}})',
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        # beside json_object: the JSON schema the object is held to
        "schema": {"type": ["object", "string"]},
        "json_schema": {
            "type": "object",
            "required": ["name", "schema"],
            "properties": {
                "name": SCHEMA_NAME_SCHEMA,
                "description": {"type": ["string", "null"]},
                "schema": {"type": "object"},
                "strict": {"type": ["boolean", "null"]},
            },
            "additionalProperties": False,  # (SCHEMA_DESCRIPTION_KEYS)
        },
    },
    "additionalProperties": False,
    # each type's own fields alone (RESPONSE_FORMAT_KEYS)
    "allOf": [
        {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["json_schema"], "properties": {"schema": False}},
        },
        {
            "if": {"properties": {"type": {"const": "json_object"}}},
            "then": {"properties": {"json_schema": False}},
        },
        {
            "if": {"properties": {"type": {"const": "text"}}},
            "then": {"properties": {"schema": False, "json_schema": False}},
        },
    ],
}
# OpenAI's forms, or TGI's grammar (`{"type", "value"}`), which TGI's chat takes here
RESPONSE_FORMAT: Schema = {
    "anyOf": [{"type": "null"}, OPENAI_RESPONSE_FORMAT, text_generation.GRAMMAR_SCHEMA]
}
METADATA: Schema = {
    "type": ["object", "null"],
    "maxProperties": MAX_METADATA_PAIRS,
    "propertyNames": {"maxLength": MAX_METADATA_KEY},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
}
LOGIT_BIAS: Schema = {
    "type": ["object", "null"],
    "description": "token ids (as text) to a bias from -100 to 100, added to their scores",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "maxProperties": MAX_LOGIT_BIAS,
}
PROMPT_CACHE_OPTIONS: Schema = {
    "type": ["object", "null"],
    "properties": {"mode": {"enum": ["implicit", "explicit"]}, "ttl": {"type": "string"}},
    "additionalProperties": False,
}
# OpenAI's prompt caching: what to keep for the next request, which changes no answer
# (no prompt is cached here): checked, then dropped
PROMPT_CACHE: dict[str, Field] = {
    "prompt_cache_key": text(),
    "prompt_cache_retention": one_of(("in_memory", "24h"), "in_memory"),
    "prompt_cache_options": Field(PROMPT_CACHE_OPTIONS, read_prompt_cache_options),
}
COMMON: dict[str, Field] = {
    "max_tokens": MAX_TOKENS,
    "temperature": Field(
        {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        lambda name, value, _: read_number(name, value, 0.0, 2.0),
    ),
    "top_p": Field({"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1}, read_top_p),
    # not OpenAI's: TGI's (its client sends it) and vLLM's
    "repetition_penalty": Field(
        {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 100},
        read_repetition_penalty,
    ),
    "stop": Field(STOP, read_stop),
    "seed": whole(-(2**63), 2**63 - 1),  # OpenAI's (and vLLM's) range: a signed 64 bits
    "stream": flag(False),
    "stream_options": Field(STREAM_OPTIONS, read_stream_options),
    "n": whole(1, MAX_CHOICES),  # choices per prompt (each a generation of its own)
    "user": text(),
    "frequency_penalty": Field(PENALTY, lambda name, value, _: read_number(name, value, -2, 2)),
    "presence_penalty": Field(PENALTY, lambda name, value, _: read_number(name, value, -2, 2)),
    "logit_bias": Field(LOGIT_BIAS, read_logit_bias),
    "response_format": Field(RESPONSE_FORMAT, read_response_format),
    # vLLM's: a sampled token is at least min_p times as likely as the likeliest (0: any)
    "min_p": Field(
        {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        lambda name, value, _: read_number(name, value, 0.0, 1.0),
    ),
    # vLLM's: sample from the k likeliest tokens only (-1 or 0: from all of them)
    "top_k": whole(-1, 2**31 - 1),
    # vLLM's: only the prompt's last k tokens are read (-1: as many as the model reads)
    TRUNCATE_PROMPT_TOKENS: Field(
        {"anyOf": [{"type": "integer", "minimum": 1}, {"enum": [-1, None]}]},
        read_truncation,
        description="Read only the prompt's last this many tokens (-1: as many as the model "
        "reads of a prompt); none: a prompt longer than the model reads is refused.",
    ),
    # vLLM's: no end of sequence before min_tokens, or none at all (benchmarks ask for
    # answers of a fixed length)
    "min_tokens": whole(0, MAX_NEW_TOKENS),
    "ignore_eos": flag(False, "an end of sequence does not end the answer"),
    # vLLM's forms of the same (its clients send them in extra_body)
    "guided_json": Field({"type": ["object", "string", "null"]}, read_guided_json),
    "guided_regex": Field({"type": ["string", "null"], "minLength": 1}, read_guided_regex),
    "guided_choice": Field(GUIDED_CHOICE, read_guided_choice),
    "structured_outputs": Field(STRUCTURED_OUTPUTS, read_structured_outputs),
}
# vLLM's that rawserve does not do, taken at their defaults (its clients send them)
VLLM_UNSERVED_FIELDS: dict[str, Field] = {
    "skip_special_tokens": unserved({"enum": [True, None]}, True),
    "spaces_between_special_tokens": unserved({"enum": [True, None]}, True),
    "include_stop_str_in_output": unserved({"enum": [False, None]}, False),
    "stop_token_ids": unserved({"enum": [[], None]}, []),
    "bad_words": unserved({"enum": [[], None]}, []),
    "allowed_token_ids": unserved({"type": "null"}),
    "prompt_logprobs": unserved({"type": "null"}),
    "return_tokens_as_token_ids": unserved({"enum": [False, None]}, False),
    "use_beam_search": unserved({"enum": [False, None]}, False),
    "length_penalty": unserved({"enum": [1, None]}, 1),
    "priority": unserved({"enum": [0, None]}, 0),
    "logits_processors": unserved({"type": "null"}),
    "guided_grammar": unserved({"type": "null"}),
    "guided_whitespace_pattern": unserved({"type": "null"}),
    "guided_decoding_backend": unserved({"type": "null"}),
}
COMMON |= VLLM_UNSERVED_FIELDS
VLLM_UNSERVED = tuple(VLLM_UNSERVED_FIELDS)
CHAT = Body(
    {
        "messages": Field(
            {"type": "array", "items": MESSAGE, "minItems": 1},
            read_messages,
            reads_null=True,
            required=True,
        ),
        **COMMON,
        "max_completion_tokens": MAX_TOKENS,
        "logprobs": flag(False, "each new token's log probability"),
        # OpenAI's bound is 20
        "top_logprobs": whole(0, MAX_TOP_N_TOKENS),
        "tools": Field(TOOLS, read_tools),
        "tool_choice": Field(TOOL_CHOICE, read_tool_choice),
        "parallel_tool_calls": flag(True, "whether an answer may call several tools"),
        "tool_prompt": text(
            "TGI's: a text for the model before the tools, at the end of the last message"
        ),
        # vLLM's: the template's own settings (Qwen3's enable_thinking...)
        "chat_template_kwargs": Field(TEMPLATE_KWARGS, read_template_kwargs),
        "add_generation_prompt": flag(True, "vLLM's: the template opens the answer's turn"),
        "continue_final_message": flag(
            False, "vLLM's: the answer goes on with the last message's text (a prefill)"
        ),
        # OpenAI's older form of tools: one call an answer, read back as "function_call"
        "functions": Field(FUNCTIONS, read_functions),
        "function_call": Field(FUNCTION_CALL, read_function_call),
        # OpenAI's bookkeeping (its dashboard, caches and abuse checks; "user" is one too)
        "metadata": Field(METADATA, read_metadata),
        "safety_identifier": text(),
        **PROMPT_CACHE,
        # what OpenAI's models do and rawserve's do not (stored answers, service tiers, audio,
        # predicted outputs, reasoning, web search): taken at their off or default values
        "store": unserved({"enum": [False, None]}, False),
        "service_tier": unserved({"enum": ["auto", "default", None]}, "auto", "default"),
        "modalities": unserved({"enum": [["text"], None]}, ["text"]),
        "audio": unserved({"type": "null"}),
        "prediction": unserved({"type": "null"}),
        # set as the chat template's `reasoning_effort` where it reads one (gpt-oss's)
        "reasoning_effort": one_of(REASONING_EFFORTS, "none"),
        "verbosity": unserved({"enum": ["medium", None]}, "medium"),
        "web_search_options": unserved({"type": "null"}),
        "moderation": unserved({"type": "null"}),
        # vLLM's: the template adds the special tokens a chat starts with
        "add_special_tokens": unserved({"enum": [False, None]}, False),
        "echo": unserved({"enum": [False, None]}, False),
        "chat_template": unserved({"type": "null"}),
        "documents": unserved({"type": "null"}),
    }
)
CHAT_BOOKKEEPING = ("metadata", "safety_identifier", *PROMPT_CACHE)
CHAT_UNSERVED = (
    "store",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "verbosity",
    "web_search_options",
    "moderation",
    "add_special_tokens",
    "echo",
    "chat_template",
    "documents",
    *VLLM_UNSERVED,
)
COMPLETION_UNSERVED = ("suffix", "add_special_tokens", *VLLM_UNSERVED)
COMPLETION = Body(
    {
        "prompt": Field(prompt_schema, read_prompts, reads_null=True, required=True),
        **COMMON,
        "echo": flag(False, "the prompt before its completion (and its tokens' log probabilities)"),
        "max_tokens": whole(0, MAX_NEW_TOKENS),  # 0 only with echo: the prompt scored
        "suffix": unserved({"type": "null"}),
        "add_special_tokens": unserved({"enum": [True, None]}, True),  # vLLM's: as it does
        # OpenAI's bound is 5; the chat route's 20 is taken here too
        "logprobs": whole(0, MAX_TOP_N_TOKENS),
        # sampled completions a prompt, of which the `n` likeliest answer (OpenAI's)
        "best_of": whole(1, MAX_BEST_OF),
    }
)

"""Generation prompts that cannot fit the model, refused (422) before they are queued; so
are the inputs of the tasks that never cut them (`check_input_lengths`); and prompts as
an echo shows them.

A causal LM reads its prompt and then writes at least one token within its positions, so a
prompt of as many tokens as it has positions cannot be answered at all (text generation
cuts no prompt, unless TGI's `truncate` asks it to); one only scored (`max_tokens` 0 with
`echo`) may fill them. Left to the worker, such a prompt is refused only when it runs;
while it waits it is counted in the queue at its full length (a 900 KB text: hundreds of
thousands of tokens), which made every other client's `Retry-After` and deadline check
see a queue that would take many minutes to drain. Counted here, in the server, with the
model's own tokenizer (`tokens.ServerTokenizer`), a piece at a time and never past the
limit, it is refused in milliseconds and never waits.

A chat is counted by its messages' texts with what its template surely adds, as its
worker measured at load (rawserve.worker.template_costs): the tokens of each message's
turn, and its tools' JSON where the template shows them so. Its texts are counted with a
margin for the tokens their ends may join with the template's, so a chat counted over
the limit is surely over; the rest is the worker's to judge when it renders the template
(a chat of 31,000 empty messages, or of 128 large tools, was once found only there,
after seconds of rendering that stalled the streams beside it). (A reasoning model's
template drops the thinking of earlier answers, everything before their `</think>`: for
such a model, as its worker says, that is not counted.) A prompt of token ids (OpenAI's
completions take them) is counted as it is, and decoded here when its completion echoes
it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rawserve.api.served import ServedModel
from rawserve.api.tokens import (
    INLINE_LIMIT,
    AnswerTooLarge,
    ServerTokenizer,
    ServerTokenizers,
    TokenBound,
    TooManyTokens,
    UnknownTokenId,
)
from rawserve.http.errors import BadRequest, PayloadTooLarge, UnprocessableInput
from rawserve.tasks.text_generation import REASONING_END
from rawserve.tasks.windows import COUNT_MARGIN, TOKENS_PER_CHARACTER

T = TypeVar("T")

# what a refusal of a prompt past the positions ends with: OpenAI's routes cut none, TGI's
# parameters cut one where asked
UNCUT = "text generation does not cut prompts"
CUT_WITH_TRUNCATE = 'send "truncate" to read only its last tokens'
CUT_WITH_TRUNCATE_PROMPT_TOKENS = 'send "truncate_prompt_tokens" to read only its last tokens'


async def check_lengths(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    prompts: Sequence[Any],
    chat: bool,
    scored: bool = False,
    least_new: int = 1,
    truncate: int | None = None,
    remedy: str = UNCUT,
) -> None:
    """422 when a prompt leaves no room for `least_new` new tokens (or, `scored`, when
    nothing is generated after it, has more tokens than the positions); nothing when the
    model or its tokenizer is not known here (the worker still refuses such a prompt). A
    prompt of token ids is counted as it is. With TGI's `truncate` the worker reads only
    that many of a prompt's last tokens: the prompts fit where that many do (TGI refuses
    more than its max_input_tokens, as here). A refusal ends with `remedy`."""
    positions = model.positions
    if positions < 1:
        return
    # the prompt's tokens, and the new tokens after them (none after a prompt only scored)
    most = positions if scored else positions - least_new
    if truncate is not None:
        if truncate > most:
            raise UnprocessableInput(
                f"truncate is {truncate}, and this model reads at most {most} tokens of a "
                "prompt (its max_input_tokens), to leave room for one new token"
            )
        return
    if any(isinstance(prompt, list) and len(prompt) > most for prompt in prompts):
        raise too_long(most, scored, remedy)
    if chat:
        await check_chat_lengths(tokenizers, model, prompts, most, scored, remedy)
        return
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    tokenizer = await tokenizers.get(model) if texts else None
    if tokenizer is None:
        return
    try:
        await by_length(texts, count_within, tokenizer, texts, most, True)
    except TooManyTokens:
        raise too_long(most, scored, remedy) from None


async def check_tgi_lengths(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    prompts: Sequence[Any],
    params: Mapping[str, Any],
) -> None:
    """`check_lengths` for TGI's parameters (`/generate`, `/generate_stream`, a
    text-generation model's `POST /`): its `truncate` taken, and a refusal naming it."""
    truncate = params.get("truncate")
    await check_lengths(
        tokenizers, model, prompts, chat=False, truncate=truncate, remedy=CUT_WITH_TRUNCATE
    )


async def longest_prompt(
    tokenizers: ServerTokenizers, model: ServedModel, prompts: Sequence[Any]
) -> int | None:
    """The tokens of the longest of `prompts` (texts, or token ids counted as they are)
    as the model takes them, none past its positions; None where a text's tokenizer is
    not known here."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    counts = [len(prompt) for prompt in prompts if isinstance(prompt, list)]
    if texts:
        tokenizer = await tokenizers.get(model)
        if tokenizer is None:
            return None
        counts += await by_length(texts, tokenizer.count, texts, model.positions)
    return max(counts, default=None)


async def check_chat_lengths(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    chats: Sequence[Any],
    most: int,
    scored: bool,
    remedy: str = UNCUT,
) -> None:
    """422 when a chat surely has more than `most` tokens once its template renders it
    (`chat_count`): its template's turns alone, counted first, need no tokenizer."""
    loaded = model.serving.loaded
    counts = [chat_count(chat, loaded.details if loaded else {}) for chat in chats]
    if any(count.added > most for count in counts):
        raise too_long(most, scored, remedy)
    tokenizer = await tokenizers.get(model) if any(count.text for count in counts) else None
    if tokenizer is None:
        return
    for count in counts:
        room = most - count.added + count.slack  # for its texts
        try:
            await by_length([count.text], count_within, tokenizer, [count.text], room, False)
        except TooManyTokens:
            raise too_long(most, scored, remedy) from None


@dataclass(frozen=True)
class ChatCount:
    """What the server counts of a chat against the positions: its texts, together; the
    tokens its template surely adds beside them; and how many tokens the texts' own count
    may run past theirs in the rendered prompt (a margin for each: its ends may join the
    template's, or the next text's)."""

    text: str
    added: int
    slack: int


def chat_count(chat: Any, details: Mapping[str, Any]) -> ChatCount:
    """A chat's `ChatCount` (`{"messages": [...], "tools": [...]}`), by what its worker
    reported of the template (its `details`): the tokens of each message's turn but the
    first's (it may stand for a default system prompt) and the last's (it may be left
    open, `continue_final_message`); the tools' functions, as compact JSON, where the
    template shows them as JSON and the chat has a user's message (some templates write
    them into one: Mistral's, Llama 3.1's)."""
    messages = chat.get("messages", ()) if isinstance(chat, dict) else ()
    roles = details.get("chat_counted_roles")
    if isinstance(roles, list):  # the roles whose texts the template writes, wherever
        messages = [m for m in messages if isinstance(m, dict) and m.get("role") in roles]
    texts = message_texts(
        messages,
        bool(details.get("chat_drops_reasoning")),
        bool(details.get("chat_parts_written")),
    )
    tools = chat.get("tools") if isinstance(chat, dict) else None
    if (
        tools
        and details.get("chat_tools_json")
        and any(isinstance(message, dict) and message.get("role") == "user" for message in messages)
    ):
        texts += [tool_json(tool) for tool in tools]
    turns = int(details.get("chat_message_tokens") or 0) * max(len(messages) - 2, 0)
    return ChatCount("\n".join(texts), turns, COUNT_MARGIN * len(texts))


def tool_json(tool: Any) -> str:
    """A tool's function as compact JSON: no template writes it in fewer tokens."""
    function = tool.get("function", tool) if isinstance(tool, dict) else tool
    return json.dumps(function, ensure_ascii=False, separators=(",", ":"))


# The tasks whose pipelines never cut an input (token classification and zero-shot ones
# do): one longer than the model reads is refused.
UNCUT_TASKS = frozenset({"text-classification", "fill-mask"})


async def check_input_lengths(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    inputs: Sequence[Any],
    says: str = "this model reads at most {limit}",
    names: Sequence[str] | None = None,
) -> None:
    """422 when an input of a task that never cuts them (`UNCUT_TASKS`) has more tokens
    than the model reads. Left to the worker, a long text was tokenized whole before it
    was refused, again at each step of the bisection that finds it in its batch, and
    counted at the model's length in the queue: 32 texts of 32 KB took the worker 3 to
    4.6 s for their 422, and clients sending them starved the others. Counted here a
    piece at a time, never past the positions; each text of a pair is counted alone, so
    only one surely over is refused here; token ids are the worker's. The refusal ends as
    the worker's would on that route (`says`); `names` calls each input, where they are
    not the body's one list."""
    positions = model.positions
    if positions < 1:
        return
    longer = [
        (index, text)
        for index, item in enumerate(inputs)
        for text in texts_of(item)
        if TOKENS_PER_CHARACTER * len(text) > positions
    ]
    tokenizer = await tokenizers.get(model) if longer else None
    if tokenizer is None:
        return
    for index, text in longer:
        try:
            await by_length([text], count_within, tokenizer, [text], positions, True)
        except TooManyTokens:
            # of a list, which input it was, in the words of the worker's own refusals
            field = None  # (an OpenAI-shaped answer's `param`: the field at fault)
            if names is not None:
                which = f"{names[index]}: "
                field = names[index].split('"')[1] if names[index].startswith('"') else None
            else:
                which = f"the input at index {index}: " if len(inputs) > 1 else ""
            limit = says.format(limit=positions)
            raise UnprocessableInput(
                f"{which}the input is more than {positions} tokens and {limit}", param=field
            ) from None


def texts_of(item: Any) -> list[str]:
    """The texts of an input: itself, or a pair's two (`{"text", "text_pair"}`, or a list)."""
    if isinstance(item, str):
        return [item]
    if isinstance(item, dict):
        return [text for key in ("text", "text_pair") if isinstance(text := item.get(key), str)]
    if isinstance(item, (list, tuple)):
        return [text for text in item if isinstance(text, str)]
    return []


# about the JSON one listed log probability takes in a completion's answer (`"text":
# -5.6512823,` in `top_logprobs`, with the token's own entries): 4,001 echoed tokens with
# 20 alternatives each made 1.71 MB, 20.4 bytes each
LISTED_BYTES = 20
# the same in a chat's answer (`{"token", "logprob", "bytes", "top_logprobs"}`: 62 to 79
# bytes each, with 20 alternatives and with none) and in TGI's details (`{"id", "text",
# "logprob", "special"}`: about 55)
CHAT_LISTED_BYTES = 60
TGI_LISTED_BYTES = 50


def check_generated_size(
    new_tokens: int, listed: int, copies: int, entry_bytes: int, largest: int, field: str
) -> int:
    """413 naming `field` (the new tokens' field) when `copies` answers of `new_tokens`
    tokens, each token listed with `listed` log probabilities of about `entry_bytes`
    bytes, could make an answer over `largest` bytes; else those bytes. Counted before
    the request is queued, from the tokens it asks for: an answer may run to them, and a
    model's positions let a request ask for hundreds of thousands (with 20 alternatives
    and several choices, gigabytes)."""
    size = new_tokens * listed * copies * entry_bytes
    if size > largest:
        remedy = f'ask for fewer new tokens ("{field}"), log probabilities or answers'
        raise PayloadTooLarge(str(AnswerTooLarge(largest, remedy)), param=field)
    return size


async def check_echo_size(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    prompts: Sequence[Any],
    listed: int,
    copies: int,
    largest: int,
    used: int = 0,
) -> None:
    """413 when the prompts' echoed tokens, each listed with `listed` log probabilities in
    each of `copies` choices, would make an answer over `largest` bytes with the `used`
    bytes counted before them."""
    per_token = listed * copies * LISTED_BYTES
    await check_prompt_tokens_size(tokenizers, model, prompts, per_token, largest, used)


async def check_prompt_tokens_size(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    prompts: Sequence[Any],
    per_token: int,
    largest: int,
    used: int,
    remedy: str | None = None,
    truncate: int | None = None,
) -> None:
    """413 when the prompts' tokens, listed at `per_token` bytes each, would make an answer
    over `largest` bytes with the `used` bytes counted before them; counted with the
    server's tokenizer only where prompts of the model's whole length would not fit (none
    where the model is not known yet: its positions are 0). TGI's `truncate`: no prompt
    lists more than that many."""
    longest = model.positions if truncate is None else min(model.positions, truncate)
    if used + len(prompts) * longest * per_token <= largest:
        return
    counts = [len(prompt) for prompt in prompts if isinstance(prompt, list)]
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    tokenizer = await tokenizers.get(model) if texts else None
    if tokenizer is not None:
        counts += await by_length(texts, tokenizer.count, texts, longest)
    if used + sum(min(count, longest) for count in counts) * per_token > largest:
        too_large = AnswerTooLarge(largest) if remedy is None else AnswerTooLarge(largest, remedy)
        raise PayloadTooLarge(str(too_large))


async def check_details_size(
    tokenizers: ServerTokenizers,
    model: ServedModel,
    prompts: Sequence[Any],
    params: Mapping[str, Any],
    largest: int,
) -> None:
    """413 when the details of answers in TGI's shape, one for each of `prompts`, could
    make an answer over `largest` bytes: `details` lists each new token with its
    `top_n_tokens` alternatives, and with `decoder_input_details` each of the prompt's
    tokens too (its `prefill`, a prompt's whole length: up to the model's positions)."""
    if not params.get("details"):
        return
    truncate = params.get("truncate")  # (TGI's: the most tokens a prompt lists)
    asked = params.get("max_new_tokens")
    used = check_generated_size(
        model.limits.default_new_tokens if asked is None else asked,
        int(params.get("top_n_tokens") or 0) + 1,
        len(prompts),
        TGI_LISTED_BYTES,
        largest,
        "max_new_tokens",
    )
    if params.get("decoder_input_details"):
        remedy = 'send shorter prompts, or ask without "decoder_input_details"'
        await check_prompt_tokens_size(
            tokenizers, model, prompts, TGI_LISTED_BYTES, largest, used, remedy, truncate
        )


async def by_length(texts: Sequence[str], work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, about `texts`: here for short texts, on a thread for long ones (the
    encoder lets go of the GIL: the event loop goes on meanwhile)."""
    if sum(len(text) for text in texts) <= INLINE_LIMIT:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def too_long(most: int, scored: bool = False, remedy: str = UNCUT) -> UnprocessableInput:
    """The refusal of a prompt past the positions. Its words name the model's context
    length, as OpenAI's and vLLM's do: litellm raises ContextWindowExceededError (which
    its Router's `context_window_fallbacks` act on) for a message that does."""
    room = "to be scored" if scored else "to leave room for one new token"
    return UnprocessableInput(
        f"a prompt is longer than the model's context length: it takes at most {most} "
        f"tokens {room} ({remedy})"
    )


async def echoed_texts(
    tokenizers: ServerTokenizers, model: ServedModel, prompts: Sequence[str | list[int]]
) -> list[str]:
    """The prompts as an echo shows them: a text as it came, token ids decoded (their
    special tokens kept: the ids are what the model read)."""
    id_lists = [prompt for prompt in prompts if isinstance(prompt, list)]
    if not id_lists:
        return [str(prompt) for prompt in prompts]
    tokenizer = await tokenizers.get(model)
    if tokenizer is None:
        raise BadRequest(
            '"echo" with a prompt of token ids needs the model\'s tokenizer in the server, '
            "and this model's has no `tokenizers` form: send the prompt as text"
        )
    try:
        decoded = iter(await tokenizer.decode(id_lists, skip_special=False))
    except UnknownTokenId as exc:
        raise UnprocessableInput(str(exc)) from None
    return [prompt if isinstance(prompt, str) else next(decoded) for prompt in prompts]


def count_within(
    tokenizer: ServerTokenizer, texts: Sequence[str], most: int, special: bool
) -> None:
    """TooManyTokens when a text has more than `most` tokens; counted a piece at a time,
    so a huge text costs what its first `most` tokens cost to find it is over."""
    bound = TokenBound(most)
    for text in texts:
        tokenizer.encode(text, special, bound)


def message_texts(
    messages: Any, drops_reasoning: bool = False, parts_written: bool = True
) -> list[str]:
    """The texts of a chat's messages, those not empty (content is a text or OpenAI's list
    of parts, checked before this), as a template surely writes them at the least: each
    without the blanks around it (Llama 3's and Gemma's `| trim` drop them); an answer's
    where it calls no tool (Llama 3.1's writes the call alone), from the end of its
    thinking where the template `drops_reasoning`; the first system (or developer) message
    alone (a template may write no other); lists of parts only where the template writes
    them (`parts_written`: one may write only a text)."""
    parts: list[str] = []
    first_of: set[Any] = set()
    for message in messages:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            if role in first_of:
                continue
            first_of.add(role)
        if role == "assistant" and message.get("tool_calls"):
            continue
        if isinstance(content, str) and drops_reasoning and role == "assistant":
            parts.append(content.rsplit(REASONING_END, 1)[-1])
        elif isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list) and parts_written:
            parts += [p["text"] for p in content if isinstance(p, dict) and "text" in p]
    parts = [part.strip() for part in parts]
    return [part for part in parts if part]

"""OpenAI's log probabilities, from the worker's tokens.

The worker lists each new token as TGI does (`{"id", "text", "logprob", "special"}`, with
`top_tokens` of the same shape where alternatives were asked for); a token's text is what
it adds to the answer's text (a token that ends inside a character adds "" and the next
one the whole character). OpenAI's two shapes of the same figures:

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal"}`;
- completions (the older one): `{"tokens", "token_logprobs", "top_logprobs": [{text:
  logprob}], "text_offset"}`, where each token's alternatives include the chosen token
  (OpenAI: "up to logprobs + 1 elements").

An echoed prompt's tokens (the details' `prefill`) come first, the first of them with no
log probability (nothing comes before it). Every generated token is listed, as usage
counts them (a client slices the list by `completion_tokens`; but where a stop sequence
cut the text, below), a special one (an end of sequence, a `<s>` the model wrote) with
the text it adds to the answer's: none, as the answer leaves its text out, but for an
end of sequence after a run of byte tokens held back until it came (its text, TGI's, is
that text, then its own). A prompt's special
tokens are left out as its echo leaves them out (a prompt's start), but for a prompt sent
as token ids (its client counts the ids it sent: an evaluation harness slices the list by
them) and one a prompt spelled out (its text is in the echo). Tokens past a stop
sequence's start, whose text is cut, are left out.
Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Listed:
    """One new token as OpenAI lists it: its text, log probability and alternatives."""

    text: str
    logprob: float | None  # None: the prompt's first token (nothing before it)
    top: tuple[tuple[str, float], ...]


def listed(token: Mapping[str, Any], top: Sequence[Mapping[str, Any]] | None = None) -> Listed:
    """A worker's token (TGI's shape) with its alternatives (`top`, or its own
    `top_tokens`). Among them the token itself reads as in the answer: an alternative's
    text is decoded alone, which for a token that ends inside a character is a U+FFFD
    where the token adds "" (OpenAI's clients look for the chosen token among them)."""
    alternatives = top if top is not None else token.get("top_tokens") or ()
    logprob = token["logprob"]
    chosen = token.get("id")
    return Listed(
        token["text"],
        None if logprob is None else float(logprob),
        tuple(
            (token["text"] if t.get("id") == chosen else t["text"], float(t["logprob"]))
            for t in alternatives
        ),
    )


def answer_tokens(
    details: dict[str, Any], text_length: int, whole_length: int | None = None
) -> list[Listed]:
    """A whole answer's tokens (its details' `tokens`, and `top_tokens` beside them),
    up to `text_length` characters of text: a stop sequence's cut ends the list. A text
    not cut (`text_length` is the `whole_length` generated) lists every token, those that
    add no text too (an id with no token, the first part of a character), as usage
    counts them."""
    tokens = details.get("tokens") or []
    tops = details.get("top_tokens") or [None] * len(tokens)
    cut = whole_length is None or text_length < whole_length
    end = text_length if whole_length is None else whole_length
    kept = []
    offset = 0
    for index, token in enumerate(tokens):
        if cut and offset >= text_length:
            break
        if token.get("special"):
            token = adding(token, end - offset if index == len(tokens) - 1 else 0)
        kept.append(listed(token, tops[index]))
        offset += len(token["text"])
    return kept


def adding(special: Mapping[str, Any], held: int) -> dict[str, Any]:
    """A special token as the text it adds to the answer: nothing, but for one that ends
    it, the first `held` characters of its text (what a run of byte tokens held back
    until it came; its own text follows, which the answer leaves out)."""
    return {**special, "text": special["text"][: max(held, 0)]}


def prompt_tokens(details: dict[str, Any], special: bool = False, text: str = "") -> list[Listed]:
    """An echoed prompt's tokens (its details' `prefill`), special ones left out unless
    asked for (a prompt sent as token ids lists one entry per id, as its client counts)
    or the echoed `text` holds theirs where they come: a prompt that spelled one out
    ("</s>" written in it) echoes it, one the tokenizer added (a prompt's start) not. A
    space the tokens' decoding stripped from the echo's first word is its token's again,
    so that the tokens add up to the echo and their offsets stay on it."""
    kept = []
    offset = 0
    stripped = False  # the one space a decoding strips at its start, given back
    for token in details.get("prefill") or []:
        if special or not token.get("special") or text.startswith(token["text"], offset):
            if not stripped and not token.get("special") and _lost_space(text, offset, token):
                token, stripped = {**token, "text": " " + token["text"]}, True
            kept.append(listed(token))
            offset += len(token["text"])
    return kept


def _lost_space(text: str, offset: int, token: Mapping[str, Any]) -> bool:
    """Whether the echo has a space at `offset` that the token's text, found right after
    it, lacks: a SentencePiece decoder (Llama's) strips the space that starts its text,
    the one it writes for its own "▁" and one the prompt began with alike (" hello" lists
    "hello"), so the prompt's first word lacks it."""
    own = token["text"]
    return bool(own) and not text.startswith(own, offset) and text.startswith(" " + own, offset)


def listed_entries(outputs: Iterable[Mapping[str, Any]], alternatives: int | None) -> int:
    """About how many entries the answer to `outputs` lists: each token of their details
    (the prompt's too) with its alternatives; 0 where none are asked for (`None`)."""
    if alternatives is None:
        return 0
    details = [output.get("details") or {} for output in outputs]
    tokens = sum(len(d.get("prefill") or ()) + len(d.get("tokens") or ()) for d in details)
    return tokens * (alternatives + 1)


def chat_logprobs(tokens: Iterable[Listed]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": token.text,
                "logprob": token.logprob,
                "bytes": list(token.text.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": list(text.encode())}
                    for text, logprob in token.top
                ],
            }
            for token in tokens
        ],
        "refusal": None,
    }


def by_text(token: Listed) -> dict[str, float]:
    """A token's alternatives and itself by text, as completions list them: tokens that
    read the same (byte tokens all read "\ufffd") keep the likeliest's figure, so that the
    largest is the likeliest token's (lm-eval's `is_greedy` reads it); the last one's, of
    a lower rank, was kept, and the chosen token's over an alternative's."""
    listed: dict[str, float] = {}
    for text, logprob in [*token.top, (token.text, token.logprob)]:
        if logprob is not None and (text not in listed or logprob > listed[text]):
            listed[text] = logprob
    return listed


def completion_logprobs(tokens: Sequence[Listed], offset: int, alternatives: int) -> dict[str, Any]:
    """`offset`: where the first token's text starts in the completion's text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    top = None
    if alternatives:  # (none for the prompt's first token, which has no log probability)
        top = [None if token.logprob is None else by_text(token) for token in tokens]
    return {
        "tokens": [token.text for token in tokens],
        "token_logprobs": [token.logprob for token in tokens],
        "top_logprobs": top,
        "text_offset": offsets,
    }

"""A reasoning model's thinking, apart from its answer: what it writes between `<think>`
and `</think>` goes in a chat answer's `reasoning_content` (vLLM's, SGLang's and
DeepSeek's name) and `reasoning` (newer vLLM's, and the one Hugging Face's client types),
the rest in its `content`, whole or as it is streamed.

A reasoning model is one whose chat template writes `</think>` (Qwen3's, QwQ's,
DeepSeek-R1's): the worker says so, and whether the template opens the thinking in the
prompt itself (QwQ's and DeepSeek-R1's end it with `<think>`: the answer holds only
`...</think>answer`; not where a chat asks for no generation prompt, its answer going on
from its last message) or the model opens it (Qwen3's); and again with each answer, from
the prompt rendered for it (a template's settings, such as DeepSeek-V3.1's `thinking`,
may open it there or not): the answer is split where it says. An answer whose thinking
the model may open and does not (Qwen3's with `enable_thinking` false) is all content;
thinking never closed (`max_tokens` reached inside it) is all reasoning, its content null,
as vLLM answers it. The tags go in neither, even split over tokens; the white space between
the thinking and the answer is left out. An answer held to a grammar is split too: the
worker holds it only after the thinking (`rawserve.worker.grammars.thinking_first`).
Server process; plain Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rawserve.tasks.text_generation import (
    CLOSED_IN_PROMPT,
    OPENED_IN_ANSWER,
    OPENED_IN_PROMPT,
    REASONING_END,
    REASONING_START,
    continues_message,
)

# the delta's (and the message's) key a piece of text goes under (its thinking, under each
# of the names clients read it by)
REASONING = "reasoning_content"
CONTENT = "content"
REASONING_NAMES = (REASONING, "reasoning")

Piece = tuple[str, str]  # (REASONING or CONTENT, its text)


class Thinking:
    """One answer's text split as it comes: reasoning, then content. Text that may be the
    start of a tag is held until the next text (or the end) says what it is."""

    def __init__(self, opened: str) -> None:
        # before a first `<think>`, what the text is if it does not open with one
        self.unopened = REASONING if opened == OPENED_IN_PROMPT else CONTENT
        # then REASONING, "closed" (white space dropped), CONTENT; an answer whose prompt
        # closed the thinking is all content, a `<think>` it writes too
        self.state = CONTENT if opened == CLOSED_IN_PROMPT else "opening"
        self.held = ""
        self.thought = False  # whether the answer opened with thinking

    def add(self, text: str) -> list[Piece]:
        """The pieces that `text` (the answer's next text) makes known."""
        self.held += text
        pieces: list[Piece] = []
        if self.state == "opening":
            opening = self.held.lstrip()
            if opening.startswith(REASONING_START):
                self.held = opening[len(REASONING_START) :]
                self.state = REASONING
            elif REASONING_START.startswith(opening):  # (white space alone too)
                return pieces
            else:
                self.state = self.unopened
            self.thought = self.state == REASONING
        if self.state == REASONING:
            at = self.held.find(REASONING_END)
            if at < 0:  # all of it, but what may start the closing tag
                ready = len(self.held) - _tag_start(self.held, REASONING_END)
                return self._take(REASONING, ready)
            pieces += self._take(REASONING, at)
            self.held = self.held[len(REASONING_END) :]
            self.state = "closed"
        if self.state == "closed":
            self.held = self.held.lstrip()
            if not self.held:
                return pieces
            self.state = CONTENT
        return pieces + self._take(CONTENT, len(self.held))

    def end(self) -> list[Piece]:
        """What was held back, once the answer has ended: reasoning where the thinking
        never closed, else content (the start of a tag that did not come; white space
        alone, or such a start, is what the answer is before a tag: the thinking where the
        prompt opened it)."""
        if self.state == "opening":  # (an empty answer too: thinking opened, and empty)
            self.state = self.unopened
            self.thought = self.state == REASONING
        if not self.held or self.state == "closed":
            return []
        return self._take(REASONING if self.state == REASONING else CONTENT, len(self.held))

    def _take(self, kind: str, size: int) -> list[Piece]:
        text, self.held = self.held[:size], self.held[size:]
        return [(kind, text)] if text else []


def said(kind: str, text: str | None) -> dict[str, str | None]:
    """A piece of an answer under its keys: its thinking under each of its names."""
    return {name: text for name in REASONING_NAMES} if kind == REASONING else {CONTENT: text}


def answers_opening(thinking: str | None, chats: Sequence[Any]) -> str | None:
    """Where the thinking of answers to `chats` opens, for a model whose template opens it
    as `thinking` says: a chat that asks for no generation prompt (one that goes on from
    its last message's text) was given no `<think>` by the template."""
    if thinking != OPENED_IN_PROMPT:
        return thinking
    return OPENED_IN_ANSWER if any(continues_message(chat) for chat in chats) else thinking


def split(text: str, opened: str) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and content (None: none; content None where the thinking
    never closed or nothing followed it), split as its stream is."""
    thinking = Thinking(opened)
    pieces = thinking.add(text) + thinking.end()
    reasoning = "".join(piece for kind, piece in pieces if kind == REASONING)
    content = "".join(piece for kind, piece in pieces if kind == CONTENT)
    if not thinking.thought:
        return None, content
    return reasoning, content or None


def split_answer(
    text: str, details: Mapping[str, Any], thinking: str
) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and content (`split`), its thinking opening where the
    worker's `details` say for this answer, else where the model's (`thinking`) does."""
    return split(text, details.get("thinking") or thinking)


def _tag_start(text: str, tag: str) -> int:
    """How many of `text`'s last characters may be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0

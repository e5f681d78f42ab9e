"""A chat's control tokens, kept the template's own: what a client writes in a chat is
read as text, never as a token that ends a turn or opens another.

transformers' `apply_chat_template(..., sanitize_control_tokens=True)` encodes the control
tokens in the messages, tools and template settings as plain text, and the template's own
as tokens. It leaves three gaps this module closes:

- Which tokens are control tokens: the tokenizer's special tokens and, unless the model
  lists its own (`chat_control_tokens`), the added tokens its template's text holds. A
  template that builds a role's token from pieces (Phi-4-mini's `'<|' + role + '|>'`)
  never holds `<|system|>` whole, so there added tokens of that shape count as well.
- Dict keys are not marked: a tool's parameter names, the argument names of a tool call
  sent back, and the keys in a template setting's value would still reach the model as
  tokens. Such a chat is refused.
- A reasoning template that splits an earlier answer at `</think>` and strips the
  newlines around it (Qwen3's) stops at the marks around the tag, and renders the
  answer with newlines the model never wrote. Such an answer's thinking is split off
  first, as the template would, into the `reasoning_content` it reads.

Worker process only (reads a transformers tokenizer).
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from collections.abc import Iterator
from typing import Any

from rawserve.tasks.text_generation import REASONING_END, REASONING_START
from rawserve.worker.runner import WrittenForClients

log = logging.getLogger("rawserve.worker")

# an added token shaped as the ChatML family shapes a role's (`<|user|>`, `<|end|>`)
ROLE_SHAPED = re.compile(r"<\|[^\s|<>]+\|>")
# a template that builds such a token from pieces: `'<|'` as a string of its own
BUILDS_FROM_PIECES = re.compile(r"""(['"])<\|\1""")
# a template that splits an answer at </think> itself (Qwen3's `content.split('</think>')`)
SPLITS_THINKING = re.compile(r"""split\(\s*(['"])</think>\1\s*\)""")
# the marks transformers puts around a control token a client wrote (private-use
# characters): they may appear in its error messages, never in answers
MARKS = dict.fromkeys(map(ord, "\U000f0000\U000f0001"))
QUOTED_NAME = 80  # characters of a refused name quoted in its refusal


def can_sanitize(tokenizer: Any) -> bool:
    """Whether the tokenizer's transformers keeps a message's control tokens as text
    (5.20 and later; rawserve's floor). An older one, installed past pip's check, takes
    the setting for a template variable and says nothing: a line says it here."""
    named = inspect.signature(tokenizer.apply_chat_template).parameters
    if "sanitize_control_tokens" in named:
        return True
    log.warning(
        "this transformers keeps no chat's control tokens apart from its messages' text "
        "(transformers 5.20 or later does): a message that spells one out reads as the "
        "token, as it would in most servers"
    )
    return False


class ChatControls:
    """A runner's chat control tokens: worked out once for its template and vocabulary
    (again when either changes), and set as the tokenizer's `chat_control_tokens`."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        authored = getattr(tokenizer, "chat_control_tokens", None)
        # the control tokens the model lists itself: taken at its word
        self.authored = None if authored is None else tuple(authored)
        self._seen: tuple[str, int] | None = None
        self._listed: list[str] = []
        self._pattern = re.compile("(?!)")  # never matches

    def declare(self) -> re.Pattern[str]:
        """Set the tokenizer's `chat_control_tokens`; a pattern that finds any control
        token (a tokenizer's thousands of added tokens are walked once, not per chat)."""
        seen = (str(self.tokenizer.chat_template), len(self.tokenizer))
        if seen != self._seen:
            added = tuple(
                (token.content, bool(token.special))
                for token in self.tokenizer.added_tokens_decoder.values()
            )
            self._listed, self._pattern = controls(seen[0], added, self.authored)
            self._seen = seen
        self.tokenizer.chat_control_tokens = self._listed
        return self._pattern


def controls(
    template: str, added: tuple[tuple[str, bool], ...], authored: tuple[str, ...] | None
) -> tuple[list[str], re.Pattern[str]]:
    """The control tokens to list beside the special ones (`added`: each added token's
    text and whether it is special), and a pattern that finds any of them."""
    if authored is not None:
        listed = list(authored)
    else:
        pieces = BUILDS_FROM_PIECES.search(template) is not None
        listed = [
            content
            for content, special in added
            if not special
            and not content.isspace()  # (Gemma's "\n" is text in every template)
            and (content in template or (pieces and ROLE_SHAPED.fullmatch(content)))
        ]
    every = {content for content, special in added if special} | set(listed)
    longest_first = sorted(every, key=len, reverse=True)
    return listed, re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


def named_parts(
    messages: list[dict[str, Any]], tools: list[Any] | None, variables: dict[str, Any]
) -> dict[str, Any]:
    """A chat's parts by the names its refusals open with (CHAT_REFUSALS)."""
    return {"messages": messages, "tools": tools, "template settings": variables}


def check_names(parts: dict[str, Any], pattern: re.Pattern[str]) -> None:
    """Refuse a chat (`named_parts`) whose tools, tool calls or template settings name
    something with a control token (a parameter's or an argument's name, a key in a
    setting's value, as Llama 3.1's `custom_tools`): transformers reads dict keys as the
    template writes them, never as text."""
    for part, value in parts.items():
        for text, is_key in _texts(value):
            if is_key and (found := pattern.search(text)):
                name = text if len(text) <= QUOTED_NAME else text[:QUOTED_NAME] + "..."
                raise WrittenForClients(
                    f"the chat's {part} hold {found[0]!r}, a control token of the chat "
                    f"template, in the name {name!r}"
                )


def holding(token: str, parts: dict[str, Any]) -> str:
    """Which of the chat's `parts` (by name) holds `token` in a text, as transformers
    marks them; "chat" where none is found."""
    for part, value in parts.items():
        if any(token in text for text, is_key in _texts(value) if not is_key):
            return part
    return "chat"


def _texts(value: Any) -> Iterator[tuple[str, bool]]:
    """Every text in a part of a chat, in its dicts and lists, and whether it is a key."""
    if isinstance(value, str):
        yield value, False
    elif isinstance(value, dict):
        for key, each in value.items():
            if isinstance(key, str):
                yield key, True
            yield from _texts(each)
    elif isinstance(value, (list, tuple)):
        for each in value:
            yield from _texts(each)


def unquoted(quoted: str) -> str:
    """A token as transformers quotes it in its words (its repr), unquoted."""
    try:
        token = ast.literal_eval(quoted)
    except (ValueError, SyntaxError):
        return quoted
    return token if isinstance(token, str) else quoted


def thinking_apart(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Each earlier answer whose content holds its thinking (`<think>...</think>answer`,
    as a client without a reasoning parser sends it back) with the thinking split off
    into `reasoning_content`, where the template reads that and splits at `</think>`
    itself: the same split it makes (Qwen3's), which the marks around a client's tag
    would otherwise keep from stripping the newlines beside it."""
    if "reasoning_content" not in template or not SPLITS_THINKING.search(template):
        return messages
    return [_apart(message) for message in messages]


def _apart(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if (
        message.get("role") != "assistant"
        or not isinstance(content, str)
        or REASONING_END not in content
        or message.get("reasoning_content") is not None
    ):
        return message
    before, _, _ = content.partition(REASONING_END)
    thinking = before.rstrip("\n").split(REASONING_START)[-1].lstrip("\n")
    answer = content.split(REASONING_END)[-1].lstrip("\n")
    return {**message, "reasoning_content": thinking, "content": answer}


def unmarked(text: str) -> str:
    """`text` without transformers' marks (an error message that quotes the chat)."""
    return text.translate(MARKS)

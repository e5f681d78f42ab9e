"""An input's token count, estimated without a tokenizer: what the queue weighs an input
by before the worker reads it (scaled by the real counts the worker samples)."""

from __future__ import annotations

from typing import Any

BYTES_PER_TOKEN = 4  # of UTF-8: English runs 4-5 a token, Chinese 3 (a character)


def estimate_tokens(item: Any) -> int:
    """The tokens of one input: a text, a chat's messages, a dict's texts (a question and
    its context), or a prompt of token ids."""
    if isinstance(item, str):
        return 2 + text_tokens(item)
    if isinstance(item, list):  # a prompt of token ids (OpenAI's completions)
        return len(item)
    if isinstance(item, dict) and isinstance(item.get("messages"), list):  # a chat
        return 2 + sum(estimate_tokens(m.get("content", "")) for m in item["messages"])
    if isinstance(item, dict):
        return 2 + sum(text_tokens(v) for v in item.values() if isinstance(v, str))
    return 1


def text_tokens(text: str) -> int:
    """A text's tokens, from its length in UTF-8, which a tokenizer's count follows across
    scripts. Counted in characters, a Chinese, Japanese or Korean text (a token or more
    a character) was estimated at a quarter to a fifth of its tokens, and a strided one
    at as few windows."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return size // BYTES_PER_TOKEN

"""A batch's windows counted before its tokenizer makes them (`tasks.windows`): token
classification's `stride` and question answering's `doc_stride` have the tokenizer make
every window of a text in one call, before the model reads any, and stopping the batch
once nobody waits for it comes too late for that call (a 1 MB text at stride 125 of 128
positions grew the worker by 9 GB). The server refuses such a request before it is
queued where it has the model's tokenizer; this is the check where it has none, and for
batches that join several requests.

Worker process only (reads the model's transformers tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rawserve.tasks.windows import count_past, surely_fit, too_many_windows, windows_fit


def piece_counter(tokenizer: Any) -> Callable[[str], int]:
    """`count(piece)`: a piece's tokens, special ones left out."""

    def piece_tokens(piece: str) -> int:
        # (verbose: no warning that a piece is longer than the model reads; it is counted)
        encoded = tokenizer(piece, add_special_tokens=False, truncation=False, verbose=False)
        return len(encoded["input_ids"])

    return piece_tokens


def token_counter(tokenizer: Any) -> Callable[[str, int], int]:
    """`count(text, most)`: `text`'s tokens, special ones left out, counted a piece at a
    time no further than past `most` (never all of a huge text's tokens at once)."""
    piece_tokens = piece_counter(tokenizer)
    return lambda text, most: count_past(piece_tokens, text, most)


def refuse_dense_windows(
    tokenizer: Any,
    texts: Sequence[tuple[str, int]],
    window: int,
    stride: tuple[str, int],
    text: str = "text",
) -> None:
    """ValueError (the client's 422) when the windows of `texts` (each with the room its
    windows leave it) at `stride` (its parameter's name and value) would hold more
    tokens than the budget together."""
    name, value = stride
    if surely_fit(texts, window, value):
        return
    if not windows_fit(token_counter(tokenizer), texts, window, value):
        raise ValueError(too_many_windows(window, name, value, text))

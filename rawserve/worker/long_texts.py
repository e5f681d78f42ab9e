"""A long text narrowed before its tokenizer truncates it to the model's length.

The tokenizer reads all of a text before it cuts it: a 1 MB text to a model that reads
256 tokens cost a worker 0.75 s of CPU and 150 MB, and a normal request waited behind it.
A text longer than `PIECE_CHARS` characters is counted a piece at a time from the end
that is kept, and only the span holding more than the limit and `COUNT_MARGIN` is handed
to the tokenizer (`windows.span_past`, as the server's /tokenize does): truncated, the
span keeps the tokens the whole text would.

Worker process only (reads the model's transformers tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rawserve.tasks import TRUNCATE_TO
from rawserve.tasks.windows import COUNT_MARGIN, PIECE_CHARS, span_past
from rawserve.worker.window_counts import piece_counter


def narrowed(tokenizer: Any, text: str, limit: int) -> str:
    """`text`, where longer than `PIECE_CHARS`, cut to the span from the end its tokenizer
    keeps (`truncation_side`) that holds more than `limit` tokens and the margin."""
    if len(text) <= PIECE_CHARS:
        return text
    from_end = tokenizer.truncation_side == "left"
    span = span_past(piece_counter(tokenizer), text, limit + COUNT_MARGIN, from_end)
    return text if span is None else text[span[0] : span[1]]


def narrowed_texts(tokenizer: Any, texts: Sequence[Any], limit: int) -> list[Any]:
    """Each text of `texts` `narrowed`; what is not a text (token ids) as it is."""
    return [narrowed(tokenizer, text, limit) if isinstance(text, str) else text for text in texts]


def encode_cut(
    encode: Callable[[list[Any]], Any], texts: Sequence[Any], cut: Sequence[Any], limit: int
) -> Any:
    """`encode(cut)`, where `encode` truncates each of `texts` to `limit` tokens and `cut`
    holds them, or some of them `narrowed`. Where a narrowed text comes out shorter than
    `limit`, its pieces counted more tokens than it holds (a long word cut between two
    pieces, each part an unknown token): the whole texts are encoded, as they were."""
    changed = narrowed_at(texts, cut)
    if not changed:
        return encode(list(texts))
    encoded = encode(list(cut))
    mask = encoded["attention_mask"]
    if all(int(np.asarray(mask[index]).sum()) >= limit for index in changed):
        return encoded
    return encode(list(texts))


def narrowed_at(texts: Sequence[Any], cut: Sequence[Any]) -> list[int]:
    """Where `cut` holds a text narrowed (another object than the text)."""
    return [index for index, (a, b) in enumerate(zip(texts, cut, strict=True)) if a is not b]


def refuse_no_room(tokenizer: Any, limit: int, seconds: list[str | None]) -> None:
    """ValueError (a 422) where a cut to `limit` tokens leaves no room for any of an
    input's text beside the special tokens the tokenizer adds (the tokenizer cut such a
    pair to nothing of either text, or refused it with a log line and kept it whole)."""
    for pair in sorted({second is not None for second in seconds}):
        special = tokenizer.num_special_tokens_to_add(pair=pair)
        if limit <= special + pair:
            texts = "each text of a pair" if pair else "a text"
            raise ValueError(
                f"a cut to {limit} tokens leaves no room for {texts} beside the model's "
                f"{special} special tokens"
            )


def cut_limit(params: dict[str, Any], max_length: Any) -> Any:
    """The most tokens an input is cut to: the model's length (`max_length`; None where
    the model names none), or fewer where the request asks (`TRUNCATE_TO`)."""
    asked = params.get(TRUNCATE_TO)
    if asked is None:
        return max_length
    return asked if max_length is None else min(asked, max_length)

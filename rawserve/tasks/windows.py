"""The bound on a request's windows: token classification's `stride` and question
answering's `doc_stride` read a long text in overlapping windows of the model's length,
and the tokenizer makes every window of a text in one call, before the model reads any.

A stride close to the window starts one every token or two: a 100 KB text at stride 125
of 128 positions made 20,000 windows (2.5 million tokens; the worker grew by 1.5 GB), a
1 MB text 200,000 (killed at 9.3 GB). So the windows one request's texts make together
hold at most `WINDOW_TOKEN_BUDGET` tokens (windows times their length), counted with the
model's tokenizer a piece at a time before any window is made: in the server before the
request is queued, and again in the worker before the tokenizer makes them.

Imported by both processes: nothing here may import torch, transformers or either
process's modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence

# 2**19 tokens: at the several hundred bytes a token the tokenizer's windows cost (600 in
# the 100 KB case above), about 300 MB for one request's windows at most. A normal stride
# on the longest text a body holds fits with room to spare: 1 MB (about 200,000 tokens)
# in windows of 512 at stride 128 is about 530 windows, 271,000 tokens; of 128 positions,
# 4,096 windows.
WINDOW_TOKEN_BUDGET = 2**19
# A tokenizer makes about this many tokens of a character at the most (a byte-level BPE:
# one per UTF-8 byte): where a text this many times shorter than a limit is left to the
# worker, whose tokenizer it then costs next to nothing.
TOKENS_PER_CHARACTER = 4
# ... but where a tokenizer normalizes first (NFKC: XLM-RoBERTa's, DeBERTa-v3's), one
# character can become 18 (U+FDFA), each a token: a text is taken to surely fit the
# windows' budget only at this many tokens a character.
MOST_TOKENS_PER_CHARACTER = 18
# A text longer than this is counted a piece of about this many characters at a time.
PIECE_CHARS = 16384
# Pieces cut at whitespace may count a token or two apart from the whole text: a text is
# kept this many tokens past a limit, so that what differs lies past what is kept.
COUNT_MARGIN = 8


def window_count(tokens: int, room: int, stride: int) -> int:
    """The windows a text of `tokens` tokens is read in: each holds `room` of its tokens
    (the rest of a window are special tokens, or a question), and starts `room -
    stride` tokens after the one before it. One where no window moves (the worker refuses
    that stride in its own words)."""
    step = room - stride
    if tokens <= room or step < 1:
        return 1
    return 1 + math.ceil((tokens - room) / step)


def most_windows(window: int) -> int:
    """The most windows of `window` tokens the budget holds (one at least)."""
    return max(1, WINDOW_TOKEN_BUDGET // max(window, 1))


def most_text_tokens(windows: int, room: int, stride: int) -> int:
    """The longest text, in tokens, that makes no more than `windows` windows."""
    return room + max(windows - 1, 0) * max(room - stride, 1)


def too_many_windows(window: int, stride_name: str, stride: int, text: str = "text") -> str:
    """The words of a refusal: the windows, the bound, and what to change."""
    most = most_windows(window)
    return (
        f"the {text}'s windows of {window} tokens at {stride_name} {stride} would hold more "
        f"than {WINDOW_TOKEN_BUDGET:,} tokens, the most a request's windows may hold "
        f"({most:,} windows of {window}): send a smaller {stride_name} or a shorter {text}"
    )


def windows_fit(
    count: Callable[[str, int], int],
    texts: Sequence[tuple[str, int]],
    window: int,
    stride: int,
) -> bool:
    """Whether the windows of `texts` (each with the `room` its windows leave it) hold
    no more than the budget together; `count(text, most)` counts a text's tokens, no
    further than past `most`."""
    left = most_windows(window)
    for text, room in texts:
        tokens = count(text, most_text_tokens(left, room, stride))
        left -= window_count(tokens, room, stride)
        if left < 0:
            return False
    return True


def context_rooms(
    count: Callable[[str, int], int],
    items: Sequence[Mapping[str, str]],
    window: int,
    special: int,
    stride: int,
) -> list[tuple[str, int]]:
    """Question answering's contexts, each with the room its windows leave it after its
    question's tokens (`count(text, most)`) and the `special` tokens; a question that
    leaves no room past the stride is left out (the tokenizer refuses it, in its words)."""
    rooms = [
        (item["context"], window - special - count(item["question"], window)) for item in items
    ]
    return [(context, room) for context, room in rooms if room - stride >= 1]


def surely_fit(texts: Sequence[tuple[str, int]], window: int, stride: int) -> bool:
    """Whether the windows of `texts` hold no more than the budget even at the most
    tokens their characters could make: then they are not counted."""
    if any(room - stride < 1 for _, room in texts):
        return False
    return windows_fit(lambda text, _: MOST_TOKENS_PER_CHARACTER * len(text), texts, window, stride)


def count_past(count: Callable[[str], int], text: str, most: int) -> int:
    """`text`'s tokens as `count` counts a piece of it, counted a piece at a time and no
    further than past `most`: a huge text costs what its first `most` tokens cost, and
    never the memory of all its tokens at once. (Pieces cut at whitespace may count a
    token or two apart from the whole text: a bound, not an exact length.)"""
    counted = 0
    for start, end in pieces(text, PIECE_CHARS, False):
        counted += count(text[start:end])
        if counted > most:
            break
    return counted


def span_past(
    count: Callable[[str], int], text: str, tokens: int, from_end: bool
) -> tuple[int, int] | None:
    """The span of `text` from its kept end (`from_end`: its end, else its start) that
    holds more than `tokens` tokens as `count` counts a piece, counted a piece at a time;
    None when the whole text holds no more. Truncated to fewer tokens than `tokens` less
    `COUNT_MARGIN`, the span keeps the tokens the whole text would: a long text costs its
    tokenizer what it keeps, not the whole text (a 1 MB one: 0.75 s and 150 MB)."""
    counted = 0
    for start, end in pieces(text, PIECE_CHARS, from_end):
        counted += count(text[start:end])
        if counted > tokens:
            return (start, len(text)) if from_end else (0, end)
    return None


def pieces(text: str, size: int, from_end: bool) -> Iterator[tuple[int, int]]:
    """Spans of about `size` characters that cover `text`, from its start or its end, each
    cut at whitespace where there is some in its second half (a word is not split)."""
    if not from_end:
        start = 0
        while start < len(text):
            end = min(start + size, len(text))
            if end < len(text):
                space = max(text.rfind(c, start + size // 2, end) for c in " \n\t")
                end = space if space > start else end
            yield start, end
            start = end
    else:
        end = len(text)
        while end > 0:
            start = max(end - size, 0)
            if start > 0:
                found = [i for c in " \n\t" if (i := text.find(c, start, end - size // 2)) >= 0]
                start = min(found) if found else start
            yield start, end
            end = start

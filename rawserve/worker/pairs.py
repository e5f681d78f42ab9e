"""Text pairs cut before their tokenizer truncates them.

The tokenizers library truncates a pair by pairing every window of the first text's
overflow with every window of the second's: two texts of 8,000 tokens cut to a model's
128 made 16,509 encodings, 1.8 GB and 1.5 s for one pair, and a 1 MB /rerank of 31
such pairs took a worker past 15 GB until the kernel killed it. Each text of a pair is
first cut, at a token's edge, to twice the limit; the tokenizer then truncates the pair
exactly as it would have the whole texts (`longest_first` keeps at most the limit of
either, and reads only which is longer: that order is kept).

A zero-shot classifier pairs its text with each label's hypothesis and cuts only the
text (`only_first`): a window of the text a pair, but each pair made every window (an
880 KB text and 32 labels: 22 s of the worker's time). The text is cut once, the same
way (`cut_text`).

A text longer than a few pieces is narrowed before its offsets are taken
(`long_texts.narrowed`): the offsets of a 1 MB text cost what its tokenizer took for the
whole of it, where the cut keeps a few hundred tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rawserve.tasks.windows import COUNT_MARGIN
from rawserve.worker.long_texts import narrowed, narrowed_at

SLACK = 2  # a text is cut to this many times the limit: its last word may split otherwise
TRIES = 4  # cuts tried, each a little longer, for the two to compare as the whole texts do


@dataclass(frozen=True)
class Narrowed:
    """Texts (`texts`) as their offsets were taken: `cut`, each the text itself or its
    span narrowed, and the offsets of each."""

    texts: list[str]
    cut: list[str]
    offsets: list[list[tuple[int, int]]]


def cut_pair(tokenizer: Any, first: str, second: str, limit: int) -> tuple[str, str]:
    """`first` and `second` cut so that the tokenizer's `longest_first` truncation of
    them to `limit` tokens keeps the same tokens as of the whole texts, from the end
    its `truncation_side` says."""
    keep = SLACK * limit
    found = _offsets_past(tokenizer, [first, second], keep)
    if found is None:
        return first, second
    (first, second), offsets = found.cut, found.offsets
    counts = _whole_counts(tokenizer, found)
    left = tokenizer.truncation_side == "left"
    # the longer keeps one more: which is longer is all that longest_first reads
    caps = [keep + (counts[0] > counts[1]), keep + (counts[1] > counts[0])]
    for _ in range(TRIES):
        cut = (_cut(first, offsets[0], caps[0], left), _cut(second, offsets[1], caps[1], left))
        # a cut inside a character's tokens keeps the character whole, and a word cut
        # short may take other tokens: counted again
        cut_counts = [len(_offsets(tokenizer, text)) for text in cut]
        short = _lengthen(counts, cut_counts)
        if short is None:
            break
        which, by = short
        caps[which] += by
    return cut


def cut_text(tokenizer: Any, text: str, limit: int) -> str:
    """`text` cut, at a token's edge, to `SLACK` times `limit` tokens from the end its
    tokenizer's `truncation_side` says: truncated to `limit` or fewer, it keeps the same
    tokens as the whole text would."""
    keep = SLACK * limit
    found = _offsets_past(tokenizer, [text], keep)
    if found is None:
        return text
    return _cut(found.cut[0], found.offsets[0], keep, tokenizer.truncation_side == "left")


def _lengthen(counts: list[int], cut_counts: list[int]) -> tuple[int, int] | None:
    """Which cut to make longer, and by how many tokens, for the two cuts to compare as
    the whole texts do (None: they do)."""
    whole, cut = counts[0] - counts[1], cut_counts[0] - cut_counts[1]
    if (whole > 0) == (cut > 0) and (whole < 0) == (cut < 0):
        return None
    if whole > 0 or (whole == 0 and cut < 0):
        return 0, cut_counts[1] - cut_counts[0] + (whole > 0)
    return 1, cut_counts[0] - cut_counts[1] + (whole < 0)


def _offsets_past(tokenizer: Any, texts: list[str], keep: int) -> Narrowed | None:
    """Each text, narrowed where long (`long_texts`: its tokenizer never reads all of a
    huge one), and its token offsets, where one of them has more than `keep` tokens (None:
    none has, or a slow tokenizer, which gives no offsets and makes no such overflow)."""
    # (a token takes a byte at least, but a word's start marker, which may be one)
    if max(len(text.encode()) for text in texts) < keep - 1:
        return None
    cut = [narrowed(tokenizer, text, keep) for text in texts]
    try:
        offsets = [_offsets(tokenizer, text) for text in cut]
    except NotImplementedError:
        return None
    if max(map(len, offsets)) <= keep:
        return None
    return Narrowed(texts, cut, offsets)


def _whole_counts(tokenizer: Any, found: Narrowed) -> list[int]:
    """The whole texts' token counts, as far as `cut_pair` reads them (which is longer):
    a narrowed text has about its span's tokens at least, so it is the longer where the
    other has fewer by more than the margin; else each narrowed text is counted whole."""
    counts = [len(each) for each in found.offsets]
    narrow = narrowed_at(found.texts, found.cut)
    if len(narrow) == 1 and counts[narrow[0]] > counts[1 - narrow[0]] + COUNT_MARGIN:
        return counts
    for index in narrow:
        encoded = tokenizer(found.texts[index], add_special_tokens=False, verbose=False)
        counts[index] = len(encoded["input_ids"])
    return counts


def _offsets(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    # (verbose off: a text past the model's length warned of "indexing errors" once,
    # though it is counted here to be cut, never run whole)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(encoded["offset_mapping"])


def _cut(text: str, offsets: list[tuple[int, int]], cap: int, left: bool) -> str:
    """`text`'s first (`left`: last) `cap` tokens, as characters, where it has more."""
    if len(offsets) <= cap:
        return text
    if left:
        return text[offsets[len(offsets) - cap][0] :]
    return text[: offsets[cap - 1][1]]

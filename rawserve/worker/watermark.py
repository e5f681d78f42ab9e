"""TGI's `watermark` on generated text (Kirchenbauer et al., "A Watermark for Large
Language Models", 2023), and the test that finds it.

At each step the vocabulary is shuffled by a generator seeded with the row's previous
token times a fixed key, and the first half of that order, the step's "green" tokens,
scores `BIAS` higher before a token is chosen: the text holds far more green tokens than
chance would give, and anyone who knows the key can count them (`z_score`) with no model
at all. TGI's key and defaults (its WATERMARK_GAMMA and WATERMARK_DELTA), so that one
test reads text from either server; the order is drawn on the scores' device, as TGI's,
and a CUDA generator's order differs from a CPU's: the test runs on the kind of device
that generated the text.

Worker process only (imports torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

KEY = 15485863  # TGI's (a large prime, so that the seed has bits enough)
GREEN_SHARE = 0.5
BIAS = 2.0
# a z-score past this is watermarked text (the paper's threshold: a false positive about
# once in 30,000 texts of plain text)
MARKED_Z = 4.0


def green_tokens(
    previous: int, vocabulary: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ids that score higher after `previous` (a model's `vocabulary`: the width of its
    scores, its config's vocab_size)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(KEY * previous)
    order = torch.randperm(vocabulary, device=device, generator=generator)
    return order[: int(vocabulary * GREEN_SHARE)]


def mark(scores: torch.Tensor, previous: Sequence[int]) -> None:
    """Rows of scores (rows, vocabulary), in place: each row's green tokens after its
    `previous` token (its sequence's last, the prompt's at the first step) raised."""
    for row, token in zip(scores, previous, strict=True):
        row[green_tokens(token, scores.shape[-1], scores.device)] += BIAS


def z_score(ids: Sequence[int], vocabulary: int, device: torch.device | str = "cpu") -> float:
    """How many standard deviations more of `ids` are green than chance would make green:
    about 0 for text written without the watermark, past `MARKED_Z` for text with it.
    Each id from the second on is read after the one before it (give the prompt's last
    token first, and the answer's first token is read too), each pair of them once: a
    text that repeats itself, as greedy decoding often does, repeats one draw of chance,
    and counted again each time it read 6.9 unmarked. ValueError for fewer than 2."""
    if len(ids) < 2:
        raise ValueError("a watermark is read from at least two tokens")
    pairs = dict.fromkeys(zip(ids, ids[1:], strict=False))
    green = sum(
        bool((green_tokens(previous, vocabulary, device) == token).any())
        for previous, token in pairs
    )
    read = len(pairs)
    expected = GREEN_SHARE * read
    return (green - expected) / math.sqrt(read * GREEN_SHARE * (1 - GREEN_SHARE))

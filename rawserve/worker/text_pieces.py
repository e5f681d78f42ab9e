"""A sequence's text, token by token: each new token's piece of text, decoded from a short
window of the sequence's tokens, for the continuous loop and the static path alike.

Worker process only (imports transformers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import transformers


class TextPieces:
    """Incremental detokenization of one sequence, as TGI does it: each new token's text
    comes from decoding a short window of tokens, so a step costs the same however long
    the text has grown, and a token that ends inside a multi-byte character adds "" until
    the character is whole."""

    def __init__(self, tokenizer: Any):
        self.decode = text_decoder(tokenizer)
        self.prefix_offset = 0
        self.read_offset = 0

    def next_piece(self, ids: Sequence[int]) -> str:
        """The text that the newest of `ids` (the sequence's tokens so far) adds."""
        prefix, read = self.prefix_offset, self.read_offset
        before = self.decode(ids[prefix:read])
        after = self.decode(ids[prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self.prefix_offset, self.read_offset = read, len(ids)
        return after[len(before) :]


def text_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """`decode(ids)` → their text, special tokens left out, as `tokenizer.decode` gives
    it. A fast tokenizer that cleans nothing up after its backend is called directly:
    transformers' own `decode` costs ~2 µs a call around the backend's ~0.6, and a
    decoding step makes two calls a row (at 64 rows, ~180 of the ~320 µs a step spends on
    its new tokens, on a 2-core CPU: on a GPU a replayed step takes ~1.1 ms)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    plain = (
        type(tokenizer).decode is transformers.PreTrainedTokenizerFast.decode
        and type(tokenizer)._decode is transformers.PreTrainedTokenizerFast._decode
    )
    if backend is not None and plain and not _cleans_up(tokenizer, backend):
        return lambda ids: backend.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _cleans_up(tokenizer: Any, backend: Any) -> bool:
    """Whether transformers' `decode` changes the backend's text (its clean-up of spaces
    before punctuation, which it skips for BPE models unless told otherwise)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return type(backend.model).__name__ != "BPE" or bool(getattr(tokenizer, forced, True))

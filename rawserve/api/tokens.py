"""Tokenizing and decoding in the server process, for TEI's `/tokenize` and `/decode`, with
the `tokenizers` library (Rust, torch-free) and the tokenizer a worker loaded (it sends
its JSON form when it is ready).

Why here and not in the workers (bench/tokenize_placement.py, all-MiniLM-L6-v2's tokenizer,
2 cores): one sentence costs 0.16 ms to answer here against a 1.3 ms round trip through an
idle worker, and 400 ms behind a worker busy with model batches; the tokenizer costs the
server 15 MiB and 40 ms at first use. Large inputs are worked on in a thread: the encoder
lets go of the GIL, so a 1 MiB body stalls the event loop for 9 ms instead of 1.2 s.

Offsets are counted in UTF-8 bytes, as TEI gives them (the library counts characters).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import tokenizers

from rawserve.http.encoding import dumps

# Work on more characters (or ids) than this goes to a thread; less is answered inline,
# where a thread's hand-over would cost more than the work (about 2 ms at this size).
INLINE_LIMIT = 4096


class UnknownTokenId(ValueError):
    """An id the tokenizer's vocabulary does not have."""


class ServerTokenizer:
    def __init__(self, tokenizer_json: str):
        self.tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        # a model's tokenizer may pad or cut to its length; an answer lists real tokens
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    async def tokenize(self, texts: Sequence[str], add_special_tokens: bool) -> bytes:
        """TEI's /tokenize answer as JSON: per text, its tokens."""
        if sum(len(text) for text in texts) <= INLINE_LIMIT:
            return self._tokenize(texts, add_special_tokens)
        return await asyncio.to_thread(self._tokenize, texts, add_special_tokens)

    def _tokenize(self, texts: Sequence[str], add_special_tokens: bool) -> bytes:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return dumps([token_objects(e, t) for e, t in zip(encodings, texts, strict=True)])

    async def decode(self, id_lists: Sequence[Sequence[int]], skip_special: bool) -> list[str]:
        """Each list of ids as text; UnknownTokenId for an id outside the vocabulary."""
        for ids in id_lists:
            for token_id in ids:
                if token_id >= self.vocab_size:
                    raise UnknownTokenId(
                        f"the id {token_id} is not in the vocabulary "
                        f"(ids run from 0 to {self.vocab_size - 1})"
                    )
        lists = [list(ids) for ids in id_lists]
        if sum(len(ids) for ids in lists) <= INLINE_LIMIT:
            return list(self.tokenizer.decode_batch(lists, skip_special_tokens=skip_special))
        decoded = await asyncio.to_thread(
            self.tokenizer.decode_batch, lists, skip_special_tokens=skip_special
        )
        return list(decoded)


def token_objects(encoding: Any, text: str) -> list[dict[str, Any]]:
    """TEI's SimpleToken list for one encoding: `{id, text, special, start, stop}`; special
    tokens have their own text and no offsets, the others the piece of `text` they cover."""
    raw = text.encode()
    # where each character starts in `raw` (for ASCII, character offsets are byte offsets)
    byte_at = None if len(raw) == len(text) else utf8_starts(text)
    tokens: list[dict[str, Any]] = []
    for token_id, (start, stop), special, piece in zip(
        encoding.ids, encoding.offsets, encoding.special_tokens_mask, encoding.tokens, strict=True
    ):
        if special:
            tokens.append(
                {"id": token_id, "text": piece, "special": True, "start": None, "stop": None}
            )
            continue
        if byte_at is not None:
            start, stop = byte_at[start], byte_at[stop]
        tokens.append(
            {
                "id": token_id,
                "text": raw[start:stop].decode(errors="replace"),
                "special": False,
                "start": start,
                "stop": stop,
            }
        )
    return tokens


def utf8_starts(text: str) -> list[int]:
    """The UTF-8 byte offset of each character of `text`, and of its end."""
    return list(accumulate((len(char.encode()) for char in text), initial=0))

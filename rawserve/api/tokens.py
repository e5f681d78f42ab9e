"""Tokenizing and decoding in the server process, for TEI's `/tokenize` and `/decode`, with
the `tokenizers` library (Rust, torch-free) and the tokenizer a worker loaded (it sends
its JSON form when it is ready).

Why here and not in the workers (bench/tokenize_placement.py, all-MiniLM-L6-v2's tokenizer,
2 cores): one sentence costs 0.16 ms to answer here against a 1.3 ms round trip through an
idle worker, and 400 ms behind a worker busy with model batches; the tokenizer costs the
server 15 MiB and 40 ms at first use. Large inputs are worked on in a thread: the encoder
lets go of the GIL, so a 1 MiB body stalls the event loop for 9 ms instead of 1.2 s.

What one request may cost is bounded: an input is at most the model's input length in
tokens (longer: `TooManyTokens`, or cut when the request asks), and an answer at most
`max_answer_bytes` (`AnswerTooLarge`). Encoding a whole long text costs about 540 bytes a
token in the library (a 900 KB text: 240 MB), so a long text is first counted a piece at
a time (`PIECE_CHARS`), and only the part that is kept is encoded whole.

Offsets are counted in UTF-8 bytes, as TEI gives them (the library counts characters).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import tokenizers

from rawserve.api.served import ServedModel
from rawserve.http.encoding import dumps
from rawserve.http.errors import PayloadTooLarge
from rawserve.http.exchange import HttpResponse
from rawserve.shared.memory import give_back_free_memory
from rawserve.tasks.windows import COUNT_MARGIN, PIECE_CHARS, count_past, span_past

# Work on more characters (or ids) than this goes to a thread; less is answered inline,
# where a thread's hand-over would cost more than the work (about 2 ms at this size).
INLINE_LIMIT = 4096
# Token objects are made (and written as JSON) this many at a time, so that their Python
# objects, hundreds of bytes each, never pile up for a whole answer.
TOKEN_SLICE = 4096
# After an answer of more tokens than this, the heap's free pages go back to the system.
TRIM_AFTER_TOKENS = 16384


class UnknownTokenId(ValueError):
    """An id the tokenizer's vocabulary does not have."""


class TooManyTokens(ValueError):
    """An input longer than the model takes, and the request did not ask to cut it."""

    def __init__(self, limit: int):
        super().__init__(
            f"an input has more than {limit} tokens, the most this model takes (its max input "
            'length): send shorter text, or "truncate": true to cut it'
        )
        self.limit = limit


class AnswerTooLarge(ValueError):
    """An answer that would hold more bytes than one answer may."""

    def __init__(self, limit: int, remedy: str = "send fewer or shorter inputs"):
        super().__init__(
            f"the answer would be larger than {size_text(limit)}, the most one answer may "
            f"hold: {remedy}"
        )
        self.limit = limit


def answer_within(document: Any, largest: int) -> HttpResponse:
    """200 with `document` as JSON, or 413 where that is over `largest` bytes (an answer
    of the tokenizer's, whose size is known once it is made)."""
    body = dumps(document)
    if len(body) > largest:
        raise PayloadTooLarge(str(AnswerTooLarge(largest)))
    return HttpResponse(200, body, [])


def size_text(size: int) -> str:
    """`size` bytes as a person reads it: whole MiB, or bytes."""
    return f"{size // 2**20} MiB" if size % 2**20 == 0 else f"{size:,} bytes"


@dataclass(frozen=True)
class TokenBound:
    """How many tokens an input may have, and what to do with a longer one."""

    max_tokens: int  # special tokens included
    truncate: bool = False  # cut a longer input to `max_tokens` (else: TooManyTokens)
    direction: str = "right"  # which end is cut: "right" keeps the start


class ServerTokenizer:
    def __init__(self, tokenizer_json: str):
        self.tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        # a model's tokenizer may pad or cut to its length; an answer lists real tokens
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        # The post-processor runs once, after an input is cut, as in the library's own
        # encode: it adds the special tokens and may trim offsets (RoBERTa's take the space
        # out of "Ġword"), which a second run would do again, a letter off each word.
        self.finisher = tokenizers.Tokenizer(tokenizers.models.BPE())
        self.finisher.post_processor = self.tokenizer.post_processor
        self.tokenizer.post_processor = None
        # a vocabulary may skip ids (a token listed twice): its size is then less than its
        # largest id + 1, which /tokenize may answer, and an id it skips is no token
        self.token_ids = frozenset(self.tokenizer.get_vocab(with_added_tokens=True).values())
        self.vocab_size = max(self.token_ids, default=-1) + 1

    async def tokenize(
        self,
        texts: Sequence[str],
        add_special_tokens: bool,
        bound: TokenBound,
        max_answer_bytes: int,
    ) -> bytes:
        """TEI's /tokenize answer as JSON: per text, its tokens. TooManyTokens for an input
        over the bound, AnswerTooLarge for an answer over `max_answer_bytes`."""
        if sum(len(text) for text in texts) <= INLINE_LIMIT:
            return self._tokenize(texts, add_special_tokens, bound, max_answer_bytes)
        try:
            body, tokens = await asyncio.to_thread(
                self._tokenize_counted, texts, add_special_tokens, bound, max_answer_bytes
            )
        except (TooManyTokens, AnswerTooLarge):  # refused, maybe after much was made
            await asyncio.to_thread(give_back_free_memory)
            raise
        if tokens > TRIM_AFTER_TOKENS:  # their objects are gone now: give the pages back
            await asyncio.to_thread(give_back_free_memory)
        return body

    def _tokenize(
        self, texts: Sequence[str], add_special: bool, bound: TokenBound, max_bytes: int
    ) -> bytes:
        return self._tokenize_counted(texts, add_special, bound, max_bytes)[0]

    def _tokenize_counted(
        self, texts: Sequence[str], add_special: bool, bound: TokenBound, max_bytes: int
    ) -> tuple[bytes, int]:
        """The answer, and how many tokens it holds."""
        parts: list[bytes] = []
        size = 2  # the brackets around the list
        tokens = 0
        spans = [self._span(text, add_special, bound) for text in texts]
        # one batch: the library lets go of the GIL as it encodes it, where its encode of
        # one text holds it (32 texts of 3,000 words stalled the event loop 0.2 s a request)
        pieces = [text[start:end] for text, (start, end) in zip(texts, spans, strict=True)]
        encoded = self.tokenizer.encode_batch(pieces, add_special_tokens=False)
        for text, (start, _), piece in zip(texts, spans, encoded, strict=True):
            encoding = self._finished(piece, add_special, bound)
            part = tokens_json(encoding, text, start)
            size += len(part) + bool(parts)  # (a comma before each part but the first)
            if size > max_bytes:
                raise AnswerTooLarge(max_bytes)
            parts.append(part)
            tokens += len(encoding)
        return b"[" + b",".join(parts) + b"]", tokens

    def count(self, texts: Sequence[str], max_tokens: int) -> list[int]:
        """Each text's tokens as the model would take it: special tokens included, at most
        `max_tokens` (a longer text is cut, or refused by the model)."""
        bound = TokenBound(max_tokens, truncate=True)
        return [len(self.encode(text, True, bound)[0]) for text in texts]

    @property
    def pair_special_tokens(self) -> int:
        """The special tokens the model's tokenizer puts around a pair of texts."""
        return int(self.finisher.num_special_tokens_to_add(True))

    def count_past(self, text: str, most: int) -> int:
        """`text`'s tokens, special ones left out, counted a piece at a time and no further
        than past `most` (`windows.count_past`)."""
        return count_past(self._piece_tokens, text, most)

    def _piece_tokens(self, piece: str) -> int:
        return len(self.tokenizer.encode(piece, add_special_tokens=False))

    def encode(
        self, text: str, add_special: bool, bound: TokenBound
    ) -> tuple[tokenizers.Encoding, int]:
        """`text`'s encoding within `bound`, and the character where the encoded part
        starts (0 unless the start was cut). Never encodes much more than it keeps."""
        start, end = self._span(text, add_special, bound)
        # (a batch of one: the library lets go of the GIL as it encodes a batch, where its
        # encode of one text holds it: a 1 MB prompt stalled the event loop 0.46 s)
        [encoding] = self.tokenizer.encode_batch([text[start:end]], add_special_tokens=False)
        return self._finished(encoding, add_special, bound), start

    def _budget(self, add_special: bool, bound: TokenBound) -> int:
        specials = self.finisher.num_special_tokens_to_add(False) if add_special else 0
        return max(bound.max_tokens - specials, 0)

    def _span(self, text: str, add_special: bool, bound: TokenBound) -> tuple[int, int]:
        """The characters of `text` to encode: all, or (a long text over the bound, cut)
        a little more than the bound keeps."""
        if len(text) <= PIECE_CHARS:
            return 0, len(text)
        from_end = bound.direction == "left"
        budget = self._budget(add_special, bound)
        over = span_past(self._piece_tokens, text, budget + COUNT_MARGIN, from_end)
        if over is None:
            return 0, len(text)
        if not bound.truncate:
            raise TooManyTokens(bound.max_tokens)
        return over

    def _finished(
        self, encoding: tokenizers.Encoding, add_special: bool, bound: TokenBound
    ) -> tokenizers.Encoding:
        """An encoding cut to `bound` (TooManyTokens where it may not be), its special
        tokens added."""
        budget = self._budget(add_special, bound)
        if len(encoding) > budget:
            if not bound.truncate:
                raise TooManyTokens(bound.max_tokens)
            encoding.truncate(budget, direction=bound.direction)
        return self.finisher.post_process(encoding, add_special_tokens=add_special)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it ("Ġworld"), as vLLM's `token_strs`."""
        return [self.tokenizer.id_to_token(token_id) or "" for token_id in ids]

    async def decode(self, id_lists: Sequence[Sequence[int]], skip_special: bool) -> list[str]:
        """Each list of ids as text; UnknownTokenId for an id outside the vocabulary."""
        for ids in id_lists:
            # (in C: a loop of Python over 400,000 ids held the event loop 170 ms)
            if unknown := frozenset(ids) - self.token_ids:
                token_id = next(i for i in ids if i in unknown)  # the first, as sent
                why = (
                    "no token has it"  # (an id the vocabulary skips)
                    if token_id < self.vocab_size
                    else f"ids run from 0 to {self.vocab_size - 1}"
                )
                raise UnknownTokenId(f"the id {token_id} is not in the vocabulary ({why})")
        lists = [list(ids) for ids in id_lists]
        if sum(len(ids) for ids in lists) <= INLINE_LIMIT:
            return list(self.tokenizer.decode_batch(lists, skip_special_tokens=skip_special))
        decoded = await asyncio.to_thread(
            self.tokenizer.decode_batch, lists, skip_special_tokens=skip_special
        )
        return list(decoded)


class ServerTokenizers:
    """Each served model's tokenizer in this process, built off the event loop at first use
    (the routes that tokenize, decode or count a prompt share it)."""

    def __init__(self) -> None:
        self._by_model: dict[str, ServerTokenizer] = {}
        self._building: dict[str, asyncio.Future[ServerTokenizer]] = {}

    async def get(self, model: ServedModel) -> ServerTokenizer | None:
        """None while the model is not loaded, or when its tokenizer has no `tokenizers`
        form (a slow one). The requests that come while it is built wait for that one
        build (each built its own: 20 at once, 20 builds, of 40 ms and 15 MiB each for
        MiniLM's)."""
        tokenizer = self._by_model.get(model.name)
        if tokenizer is not None:
            return tokenizer
        loaded = model.serving.loaded
        if loaded is None or loaded.tokenizer is None:
            return None
        building = self._building.get(model.name)
        if building is None:
            building = asyncio.ensure_future(asyncio.to_thread(ServerTokenizer, loaded.tokenizer))
            self._building[model.name] = building
            building.add_done_callback(functools.partial(self._built, model.name))
        return await asyncio.shield(building)  # (a waiter cancelled leaves it to the others)

    def _built(self, name: str, building: asyncio.Future[ServerTokenizer]) -> None:
        del self._building[name]
        if not building.cancelled() and building.exception() is None:  # (else: built anew)
            self._by_model[name] = building.result()


def tokens_json(encoding: Any, text: str, start: int = 0) -> bytes:
    """One input's tokens as a JSON list, made a slice at a time; `start` is the character
    of `text` where the encoded part begins."""
    ids, offsets = encoding.ids, encoding.offsets
    # only the characters the tokens cover are looked at (a cut text may go on far past them)
    piece = text[start : start + max((stop for _, stop in offsets), default=0)]
    base = len(text[:start].encode()) if start else 0
    specials, names = encoding.special_tokens_mask, encoding.tokens
    raw = piece.encode()
    # where each character starts in `raw` (for ASCII, character offsets are byte offsets)
    byte_at = None if len(raw) == len(piece) else utf8_starts(piece)
    parts = []
    for first in range(0, len(ids), TOKEN_SLICE):
        window = slice(first, first + TOKEN_SLICE)
        objects = token_objects(
            ids[window], offsets[window], specials[window], names[window], raw, byte_at, base
        )
        parts.append(dumps(objects)[1:-1])
    return b"[" + b",".join(parts) + b"]"


def token_objects(
    ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    specials: Sequence[int],
    names: Sequence[str],
    raw: bytes,
    byte_at: Sequence[int] | None,
    base: int,
) -> list[dict[str, Any]]:
    """TEI's SimpleToken list: `{id, text, special, start, stop}`; special tokens have
    their own text and no offsets, the others the bytes of `raw` they cover, with their
    offsets moved by `base` bytes."""
    tokens: list[dict[str, Any]] = []
    for token_id, (start, stop), special, piece in zip(ids, offsets, specials, names, strict=True):
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
                "start": base + start,
                "stop": base + stop,
            }
        )
    return tokens


def utf8_starts(text: str) -> list[int]:
    """The UTF-8 byte offset of each character of `text`, and of its end."""
    return list(accumulate((len(char.encode()) for char in text), initial=0))

"""A sequence's text, token by token: each new token's piece of text, decoded from a short
window of the sequence's tokens, for the continuous loop and the static path alike.

Worker process only (imports transformers).
"""

from __future__ import annotations

import codecs
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import transformers

# how many tokens a window whose end a clean-up may yet change may hold: past them it
# slides on past its settled text, where it finds two places to
# (`TextPieces._slide_while_held`)
HELD_WINDOW = 16
# how far back from a prompt's end its last word is looked for (`prompt_context`)
CONTEXT_TOKENS = 8
# a word that a step's alternatives are decoded after (`alternative_text`)
PLAIN_WORD = "a"


class TextPieces:
    """Incremental detokenization of one sequence, as TGI does it: each new token's text
    comes from decoding a short window of tokens, so a step costs the same however long
    the text has grown, and a token that ends inside a multi-byte character adds "" until
    the character is whole.

    A byte-fallback tokenizer's byte tokens (Llama's <0xE2>) add "" until a token of
    another kind follows: its decoder turns a run of them into their text only where the
    whole run is valid UTF-8, and into a U+FFFD a byte otherwise, so a character that
    looked whole may yet turn into U+FFFDs. A special token adds "" too, unless it is the
    last: its text is left out (and it does not end the run: the decoding skips it), so
    what it would release waits for the next token whose text counts. The pieces add up
    to what `tokenizer.decode` gives for the whole sequence (less what the last tokens
    still hold back, until told which token is the last).

    A generated sequence's first pieces are decoded after the end of its prompt (its
    `context`, from `prompt_context`), as TGI's are and as the pipeline's text reads: a
    SentencePiece decoder (Llama's, Mistral's) strips the space that starts a text, so
    the first word decoded alone would lose the space that parts it from the prompt
    ("the movie" then "▁good" is " good"). The pieces then add up to `generated_text`.

    A tokenizer whose `decode` cleans up spaces before punctuation (a WordPiece's or a
    Unigram's, as their configs often say) changes text already decoded once more text
    follows: "the movie " then "." is "the movie.", "do n" then "'" and "t" is "don't".
    The end of the text that a clean-up may yet change is held until the tokens after it
    tell, so that the pieces never take back what they gave; the tokens wait with it, and
    each is then given what its own raw text kept (but where a run of spaces held it for
    more than `HELD_WINDOW` tokens: the window slid on, and the newest takes the text).
    A WordPiece's run of "'" tokens is held whole, its window growing with it: each
    " ' " is taken from the left, overlapping the next, and a window starting between
    two would lose the space (a WordPiece's first word has none) that one starts with.

    Token by token (`next_pieces`), a run of byte tokens' text is shared out among them
    once the run is over, each its own part: what a token lists is what it adds."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()):
        cleans = cleans_up(tokenizer)
        # a tokenizer that cleans up is read in its raw text, and each text cleaned as
        # `decode` cleans it; another's text is its raw text
        self.decode = raw_decoder(tokenizer) if cleans else text_decoder(tokenizer)
        self.clean: Callable[[str], str] = tokenizer.clean_up_tokenization if cleans else str
        self.cleans_up = cleans
        self.held_ids = held_ids(tokenizer)
        self.byte_values = byte_values(tokenizer)
        self.context = list(context)  # decoded before the window while it starts at 0
        self.prefix_offset = 0
        self.read_offset = 0
        # where the window may start next, where the tokenizer cleans up: the end of the
        # last text whose clean-up no later text changes
        self.settled_offset = 0
        self.held = 0  # how much of the window's raw text a clean-up may yet change
        self.let_out = 0  # how many tokens `next_pieces` has given texts to
        self.unlet = ""  # the text `next_piece` gave since then, for the tokens waiting
        # a clean-up's last step that gave out all it read: its window's first token, and
        # the window's raw text and text (`_settled_texts`)
        self.last_window: tuple[int, str, str] = (0, "", "")
        # the texts the tokens last let out add as far as their run of byte tokens reads
        # as UTF-8, where the whole run does not (`_shared_out`): a stop sequence ends in
        # them as the text read token by token had it (TGI's), None where they are the
        # pieces themselves
        self.readable: list[str] | None = None

    def next_piece(self, ids: Sequence[int], last: bool = False) -> str:
        """The text that the newest of `ids` (the sequence's tokens so far) adds; `last`:
        the sequence ends with it, so it adds whatever was held back too (a U+FFFD where
        bytes never made a character)."""
        if ids[-1] in self.held_ids and not last:
            return ""  # wait for the end of the run of byte tokens, or for a word
        if self.cleans_up:
            return self._cleaned_piece(ids, last)
        prefix, read = self.prefix_offset, self.read_offset
        if prefix == 0 and self.context:
            before, after = self._window(ids)
        else:  # (`_window`'s texts decoded here: a call's cost, at every step of every row)
            before, after = self.decode(ids[prefix:read]), self.decode(ids[prefix:])
        if not last and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # wait for the rest of a multi-byte character
        self.prefix_offset, self.read_offset = read, len(ids)
        return after[len(before) :]

    def _cleaned_piece(self, ids: Sequence[int], last: bool) -> str:
        """`next_piece` where the tokenizer cleans up: read in the raw text, each text
        cleaned up as `decode` cleans it, the end a clean-up may yet change held."""
        raw_before, raw_after = self._window(ids)
        prompt_end = self.decode(self.context) if self.prefix_offset == 0 and self.context else ""
        if prompt_end and not self.clean(raw_after).startswith(self.clean(prompt_end)):
            # the new tokens change the prompt's end (a clean-up takes the space before
            # a "."): decoded alone, as `generated_text` then decodes them
            self.context, prompt_end = [], ""
            raw_before, raw_after = self._window(ids)
        before, after, unsettled = self._cleaned(raw_before, raw_after, prompt_end, last)
        if not last and (
            raw_after.endswith("\ufffd") or len(after) <= len(before) and not unsettled
        ):
            return ""  # wait for the rest of a multi-byte character, or for new text
        if not unsettled:  # the window slides on from where no clean-up crosses
            self.last_window = (self.prefix_offset, raw_after, after)
            self.prefix_offset, self.settled_offset = self.settled_offset, len(ids)
        elif len(ids) - self.prefix_offset > HELD_WINDOW:
            self._slide_while_held(ids, raw_after, len(raw_after) - unsettled)
        self.read_offset, self.held = len(ids), unsettled
        return after[len(before) :]

    def _window(self, ids: Sequence[int]) -> tuple[str, str]:
        """The window's raw text before the tokens not read yet, and with them."""
        prefix, read = self.prefix_offset, self.read_offset
        if prefix == 0 and self.context:
            return self.decode([*self.context, *ids[:read]]), self.decode([*self.context, *ids])
        return self.decode(ids[prefix:read]), self.decode(ids[prefix:])

    def _slide_while_held(self, ids: Sequence[int], raw: str, settled: int) -> None:
        """A window whose end has been held for long (a run of spaces, each of which a
        "." may yet take) slides on all the same, to the last two places between its
        tokens that its settled text reaches and no clean-up crosses: decoded whole at
        every step, the run cost each step more as it grew."""
        context = self.context if self.prefix_offset == 0 else []
        _, found = cleaned_up(raw)
        places: list[int] = []
        for end in range(len(ids) - 1, max(self.prefix_offset, len(ids) - HELD_WINDOW), -1):
            so_far = self.decode([*context, *ids[self.prefix_offset : end]])
            if (
                len(so_far) <= settled
                and raw.startswith(so_far)
                and ids[end - 1] not in self.held_ids
                # (nor where one starts: a window starting there loses a WordPiece's space)
                and not any(first <= len(so_far) <= last for first, last in found)
            ):
                places.append(end)
                if len(places) == 2:
                    self.settled_offset, self.prefix_offset = places
                    return

    def _cleaned(
        self, raw_before: str, raw_after: str, prompt_end: str, last: bool
    ) -> tuple[str, str, int]:
        """The window's text given out so far and what may be given now, cleaned up, and
        how much of its raw text a clean-up may yet change (" " before a ".", " n"
        before "'t"): held until the text after it tells (the prompt's end, the raw text
        the window starts with while it starts at the prompt, is given)."""
        settled = len(raw_after) if last else settled_length(raw_after)
        unsettled = len(raw_after) - max(settled, len(prompt_end))
        before = self.clean(raw_before[: len(raw_before) - self.held])
        return before, self.clean(raw_after[: len(raw_after) - unsettled]), unsettled

    def next_pieces(self, ids: Sequence[int], last: bool = False) -> list[str]:
        """The texts that the tokens the newest of `ids` lets out add, oldest first (they
        add up to its `next_piece`): none while a run of byte tokens goes on, whose text
        its end decides, else each token since those let out last. A byte token adds its
        own part of its run's text: the character its byte ends ("!" for <0x21>, "" for
        a character's first bytes) where the run is UTF-8, else a U+FFFD, as the decoder
        reads the run; a special token in the run adds ""."""
        self.readable = None
        if self.cleans_up:
            return self._cleaned_pieces(ids, last)
        waiting = ids[self.let_out :]
        piece = self.next_piece(ids, last)
        if self._run_goes_on(ids, waiting):
            return []
        self.let_out = len(ids)
        if self.read_offset < len(ids):  # nothing released: the newest alone adds ""
            return [""] * len(waiting)
        return self._shared_out(waiting, piece)

    def _cleaned_pieces(self, ids: Sequence[int], last: bool) -> list[str]:
        """`next_pieces` where the tokenizer cleans up: the tokens also wait while the
        text's end is held, and each is given what its own raw text kept."""
        waiting = ids[self.let_out :]
        piece = self.unlet + self.next_piece(ids, last)
        if self.held or self._run_goes_on(ids, waiting):
            self.unlet = piece  # what a clean-up makes of the end waits for the next token
            return []
        self.let_out, self.unlet = len(ids), ""
        if self.read_offset < len(ids):  # nothing released: the newest alone adds ""
            return [""] * len(waiting)
        if len(waiting) > 1 and not self.byte_values.keys() & set(waiting):
            texts = self._settled_texts(ids, len(waiting), piece)
            if texts is not None:
                return texts
        return self._shared_out(waiting, piece)

    def _run_goes_on(self, ids: Sequence[int], waiting: Sequence[int]) -> bool:
        """Whether a run of byte tokens among `waiting` goes on (its bytes may yet turn
        into U+FFFDs): the tokens wait for its end."""
        return self.read_offset < len(ids) and any(i in self.byte_values for i in waiting)

    def rest(self, ids: Sequence[int]) -> list[str]:
        """The texts of the tokens `next_pieces` has not let out yet, as though the newest
        of `ids` were the last (a sequence that a beam's end or a cancel cut short)."""
        return self.next_pieces(ids, last=True) if self.let_out < len(ids) else []

    def _settled_texts(self, ids: Sequence[int], count: int, piece: str) -> list[str] | None:
        """`piece`, which the newest `count` of `ids` add together once a clean-up settled
        their text, as each one's own part: what its raw text kept ("do n" "'" "t" add
        "n", "'", "t" to "don't"; a space token before a "." adds ""), as each would add
        where nothing was held. None where the step's window does not hold them all (it
        slid on in a long hold) or its text does not grow token by token."""
        start, raw, text = self.last_window
        kept = kept_counts(raw, text)
        first = len(ids) - count
        if kept is None or start > first:
            return None
        context = self.context if start == 0 else []
        bounds = []
        for end in range(first, len(ids)):
            so_far = self.decode([*context, *ids[start:end]])
            if not raw.startswith(so_far):
                return None
            bounds.append(kept[len(so_far)])
        bounds.append(len(text))
        if bounds[0] != len(text) - len(piece) or bounds != sorted(bounds):
            return None  # (the piece does not start where their text does)
        return [text[a:b] for a, b in itertools.pairwise(bounds)]

    def _shared_out(self, tokens: Sequence[int], piece: str) -> list[str]:
        """`piece`, which `tokens` add together, as each one's own part: a run of byte
        tokens' text among them byte by byte, what follows the run the newest's. Where the
        tokens are not a run (a word that added nothing inside it, a stripped space at the
        text's start), the newest adds it all, as `next_piece` has it."""
        run = [self.byte_values[i] for i in tokens if i in self.byte_values]
        shares = run_texts(bytes(run))
        others = [i for i in tokens[:-1] if i not in self.byte_values]
        if not run or not piece.startswith("".join(shares)) or not self.held_ids >= set(others):
            return [""] * (len(tokens) - 1) + [piece]
        parts = iter(shares)
        texts = [next(parts) if i in self.byte_values else "" for i in tokens]
        texts[-1] += piece[len("".join(shares)) :]
        if "\ufffd" in shares:  # (the token that ended the run, if not one, is not read)
            in_run = tokens if tokens[-1] in self.byte_values else tokens[:-1]
            self.readable = readable_texts(in_run, self.byte_values)
        return texts


class HeldTokens:
    """One sequence's new tokens in TGI's shape, each held until its text is known
    (`TextPieces.next_pieces`): a byte token's waits for the end of its run, which turns
    into U+FFFDs if it is not UTF-8 as a whole, so that each token lists what it adds
    ("!" for <0x21>), streamed or not, and not the token after the run."""

    def __init__(self) -> None:
        self.held: list[dict[str, Any]] = []

    def add(self, token: dict[str, Any], pieces: Sequence[str]) -> list[dict[str, Any]]:
        """`token`, made with no piece of text ("", or a special token's own), held
        after those before it; `pieces`: the texts `next_pieces` let out with it."""
        self.held.append(token)
        return self.let_out(pieces)

    def let_out(self, pieces: Sequence[str]) -> list[dict[str, Any]]:
        """The oldest held tokens, as many as `pieces`, each with its text before its own
        (a special token's)."""
        out, self.held = self.held[: len(pieces)], self.held[len(pieces) :]
        for token, piece in zip(out, pieces, strict=True):
            token["text"] = piece + token["text"]
        return out


def run_texts(run: bytes) -> list[str]:
    """The text each byte of a run of byte tokens adds, as a byte-fallback decoder reads
    the run: the run as UTF-8, each character at its last byte, where the whole run is
    UTF-8; else a U+FFFD a byte."""
    try:
        run.decode("utf-8")
    except UnicodeDecodeError:
        return ["\ufffd"] * len(run)
    decoder = codecs.getincrementaldecoder("utf-8")()
    return [decoder.decode(bytes([byte])) for byte in run]


def readable_texts(tokens: Sequence[int], byte_values: dict[int, int]) -> list[str]:
    """The texts of `tokens`, a run of byte tokens (and the special tokens in it) that is
    not UTF-8 as a whole, as far as its bytes read as UTF-8 one by one: each character
    at its last byte, up to the byte that cannot go on one (the bytes of a character cut
    short at the run's end add "")."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    texts = []
    for token in tokens:
        if token not in byte_values:
            texts.append("")
            continue
        try:
            texts.append(decoder.decode(bytes([byte_values[token]])))
        except UnicodeDecodeError:
            break
    return texts


def text_before(tokenizer: Any, ids: Sequence[int], count: int, context: Sequence[int] = ()) -> str:
    """The text that the first `count` of a sequence's tokens `ids` add, each its own
    part as `next_pieces` lets them out (a run of byte tokens shared out once it is
    over, as the whole sequence has it): where a stop sequence may start to count."""
    pieces, texts = TextPieces(tokenizer, context), []
    for n in range(len(ids)):
        texts += pieces.next_pieces(ids[: n + 1], n == len(ids) - 1)
        if len(texts) >= count:
            break
    return "".join(texts[:count])


def counted_text(pieces: Sequence[str], made: int, stops_after: int) -> str:
    """The part of `pieces` (the texts of the last of `made` tokens) that a stop sequence
    may end in: the texts of the `stops_after`th token and later (OpenAI's min_tokens)."""
    first = made - len(pieces)  # the first piece's token's index
    return "".join(pieces[max(0, stops_after - 1 - first) :])


def generated_text(tokenizer: Any, ids: Sequence[int], context: Sequence[int] = ()) -> str:
    """The whole text of a generated sequence's tokens, decoded after its prompt's
    `context` as its pieces are (the pipeline's text: the whole sequence decoded, less
    its prompt's text)."""
    if context:
        before = tokenizer.decode(context, skip_special_tokens=True)
        whole = tokenizer.decode([*context, *ids], skip_special_tokens=True)
        if whole.startswith(before):  # (else the tokens changed its text: decoded alone)
            return whole[len(before) :]
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def prompt_context(tokenizer: Any, prompt_ids: Sequence[int]) -> list[int]:
    """The end of a prompt that its generated tokens are decoded after: its last token
    whose text stands alone (not a byte token, whose run the new tokens' bytes could join,
    not a special one, not part of a character); none where the last few have none."""
    held = held_ids(tokenizer)
    for start in range(len(prompt_ids) - 1, max(-1, len(prompt_ids) - 1 - CONTEXT_TOKENS), -1):
        token = prompt_ids[start]
        if token not in held and "\ufffd" not in tokenizer.decode([token]):
            return [token]
    return []


ALTERNATIVES_KEPT = 1 << 18  # texts of (tokenizer, token) pairs: a few vocabularies' worth


@functools.lru_cache(maxsize=ALTERNATIVES_KEPT)
def alternative_text(tokenizer: Any, token_id: int) -> str:
    """A token's own text as a step's alternatives list it: as it reads after a word
    (`PLAIN_WORD`), as the chosen token's piece reads. Decoded alone, a SentencePiece
    decoder (Llama's) strips the space it starts with: "▁good" would be "good" among the
    alternatives and " good" where chosen. A special token's text is its own. Kept once
    made: a prompt scored with 20 alternatives a token lists the same few thousand
    tokens again and again (32 prompts of 256 tokens: 163,840 decodes, 0.47 s)."""
    word = plain_word(tokenizer)
    if word is not None and token_id not in held_ids(tokenizer):
        both = tokenizer.decode([word, token_id])
        if both.startswith(PLAIN_WORD):
            return str(both[len(PLAIN_WORD) :])
    return str(tokenizer.decode([token_id]))


@functools.lru_cache(maxsize=8)
def plain_word(tokenizer: Any) -> int | None:
    """A token that reads `PLAIN_WORD` alone, which alternatives are decoded after (None:
    none)."""
    ids = tokenizer.encode(PLAIN_WORD, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == PLAIN_WORD else None


@functools.lru_cache(maxsize=8)
def held_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens that add "" unless they are the last: byte tokens and special
    tokens."""
    return frozenset(byte_values(tokenizer)) | frozenset(tokenizer.all_special_ids)


@functools.lru_cache(maxsize=8)
def byte_values(tokenizer: Any) -> dict[int, int]:
    """A byte-fallback tokenizer's byte tokens, <0x00> to <0xFF>, by id: the byte each
    stands for (none for another tokenizer: a token so named there decodes to its name)."""
    names = [f"<0x{byte:02X}>" for byte in range(256)]
    ids = tokenizer.convert_tokens_to_ids(names)
    unknown = tokenizer.unk_token_id
    return {
        i: byte
        for byte, (name, i) in enumerate(zip(names, ids, strict=True))
        if i is not None and i != unknown and tokenizer.decode([i]) != name
    }


# what transformers' clean-up of a decoded text (`clean_up_tokenization`) takes spaces out
# of, in its order; and what one cleaned up first makes of a later one: " ' ." keeps its
# " '" (" ." goes first), " n ' t" is "n't" (" ' " makes " n't")
CLEANED_UP = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
MADE_BY_CLEANING = (" ' .", " ' ?", " ' !", " ' ,", " n ' t", "  ' m", "  ' s", "  ' ve", "  ' re")
CLEANUP_PATTERNS = CLEANED_UP + MADE_BY_CLEANING
LONGEST_PATTERN = max(map(len, CLEANUP_PATTERNS))
PATTERN_STARTS = frozenset(p[:n] for p in CLEANUP_PATTERNS for n in range(1, len(p)))


def begun_end(raw: str) -> str:
    """The end of a raw text that begins a pattern of the clean-up, which the text after
    it may make whole (the longest such)."""
    return max((start for start in PATTERN_STARTS if raw.endswith(start)), key=len, default="")


def cleaned_up(raw: str) -> tuple[list[int], list[tuple[int, int]]]:
    """transformers' clean-up done again on a raw text, each character followed: where
    in the raw text each character it keeps was, and where each pattern it took spaces
    out of lay (its first and last character's places). A run of spaces loses the one
    before the "."; of overlapping patterns (" ' ' "), those `str.replace` finds from
    the left."""
    chars = list(range(len(raw)))
    found: list[tuple[int, int]] = []
    for pattern in CLEANED_UP:  # each in turn, on what those before it left
        current = "".join(raw[i] for i in chars)
        left: list[int] = []
        start, at = 0, current.find(pattern)
        while at >= 0:
            places = chars[at : at + len(pattern)]
            found.append((places[0], places[-1]))
            left += chars[start:at] + [i for i, c in zip(places, pattern, strict=True) if c != " "]
            start = at + len(pattern)
            at = current.find(pattern, start)
        chars = left + chars[start:]
    return chars, found


def inside(found: Sequence[tuple[int, int]], place: int) -> int | None:
    """Where the first of the patterns `found` that `place` cuts through starts (None:
    it cuts through none)."""
    starts = [first for first, last in found if first < place <= last]
    return min(starts) if starts else None


def crossing(raw: str, place: int) -> int | None:
    """Where the first pattern of the clean-up that crosses `place` in a raw text, whole
    or begun, starts (None: none does); only the last few spaces before it are looked at."""
    first = None
    start = raw.rfind(" ", max(0, place - LONGEST_PATTERN + 1), place)
    while start >= 0 and start > place - LONGEST_PATTERN:
        for pattern in CLEANUP_PATTERNS:
            seen = raw[start : start + len(pattern)]
            begun = len(seen) < len(pattern) and pattern.startswith(seen)
            if start + len(pattern) > place and (begun or seen == pattern):
                first = start
        start = raw.rfind(" ", 0, start)
    return first


def settled_length(raw: str) -> int:
    """How much of a raw text's start (not cleaned up yet) no text after it changes the
    clean-up of: up to where a pattern the text after it may make whole begins (" "
    before a ".", " n" before "'t", " ' " before a "." that is cleaned up first), and
    not through a pattern it took spaces out of ("a ' b" is "a'b"). Read first as though
    it took every pattern whole in the text (cheap: a few places looked at); where those
    overlap all along (a run of " '", of which it takes every other), as it does."""
    cut = len(raw)
    while (start := crossing(raw, cut)) is not None:
        cut = start
    if len(raw) - cut <= LONGEST_PATTERN:
        return cut
    cut = len(raw) - len(begun_end(raw))
    _, found = cleaned_up(raw)
    while (start := inside(found, cut)) is not None:
        cut = start
    return cut


def kept_counts(raw: str, text: str) -> list[int] | None:
    """For each place in a raw text, how much of its cleaned-up `text` lies before it
    (`cleaned_up`). None where that is not how `text` came of it (a clean-up of the
    tokenizer's own)."""
    chars, _ = cleaned_up(raw)
    if "".join(raw[i] for i in chars) != text:
        return None
    counts, kept = [0], set(chars)
    for place in range(len(raw)):
        counts.append(counts[-1] + (place in kept))
    return counts


def cleans_up(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` cleans up spaces before punctuation (its decoded text
    may lose a space once a "." follows)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend is None or _cleans_up(tokenizer, backend)


def raw_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """`decode(ids)` → their text, special tokens left out, not cleaned up."""
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


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

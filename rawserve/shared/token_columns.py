"""A generation's listed tokens (TGI's details' `prefill`, `tokens`, `top_tokens`) as
columns, the shape they cross the worker's pipe in.

Each token is a dict `{"id", "text", "logprob", "special"}` (with its alternatives under
`"top_tokens"` where asked for). Tens of thousands of them (a long prompt echoed with 20
alternatives a token) pickle as as many dicts, and unpickling them takes the server's event
loop 20-80 ms, during which no other client of that process is heard. As columns (numpy
arrays of ids, log probabilities and flags, the texts joined into one string) they unpickle
in well under a millisecond; the dicts are made again where they are first read, which for
a large answer is the thread that builds it (`rawserve.api.bodies.built_answer`).

`TokenColumns` and `TokenLists` read as the lists they stand for (a `Sequence`); the dicts
are made once, on the first read of an item, and are the same objects after that, as a
list's are. Anything this shape does not hold exactly stays the list it was (`columns`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

KEYS = ("id", "text", "logprob", "special")
KEYS_WITH_TOP = (*KEYS, "top_tokens")


class TokenColumns(Sequence[dict[str, Any]]):
    """A list of tokens in TGI's shape, held as columns."""

    def __init__(
        self,
        ids: np.ndarray,
        logprobs: np.ndarray,
        special: np.ndarray,
        text: str,
        text_ends: np.ndarray,
        top: TokenLists | None = None,
    ):
        self.ids = ids  # int64
        # float64 (each value as it was: a float32's prints the same); NaN: no log
        # probability (a prompt's first token), which JSON writes as null either way
        self.logprobs = logprobs
        self.special = special  # bool
        self.text = text  # the tokens' texts, one after the other
        self.text_ends = text_ends  # where each token's text ends in `text`
        self.top = top  # each token's "top_tokens", where they have them
        self._rows: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, tokens: list[dict[str, Any]]) -> TokenColumns | None:
        """`tokens` as columns, or None where they are not all of the shape held."""
        keys = KEYS_WITH_TOP if tokens and "top_tokens" in tokens[0] else KEYS
        texts, logprobs = [], []
        for token in tokens:
            logprob = token.get("logprob")
            if (
                tuple(token) != keys
                or type(token["id"]) is not int
                or type(token["text"]) is not str
                or type(token["special"]) is not bool
                or not (logprob is None or (type(logprob) is float and not math.isnan(logprob)))
            ):
                return None
            texts.append(token["text"])
            logprobs.append(math.nan if logprob is None else logprob)
        top = None
        if keys is KEYS_WITH_TOP:
            top = TokenLists.of([token["top_tokens"] for token in tokens])
            if top is None:
                return None
        return cls(
            ids=np.array([token["id"] for token in tokens], dtype=np.int64),
            logprobs=np.array(logprobs, dtype=np.float64),
            special=np.array([token["special"] for token in tokens], dtype=bool),
            text="".join(texts),
            text_ends=np.cumsum([len(text) for text in texts], dtype=np.int64),
            top=top,
        )

    def rows(self) -> list[dict[str, Any]]:
        """The tokens as dicts (made on the first call, the same ones after)."""
        if self._rows is None:
            ends = self.text_ends.tolist()
            starts = [0, *ends][:-1]
            text = self.text
            rows = [
                {
                    "id": token_id,
                    "text": text[start:end],
                    "logprob": None if logprob != logprob else logprob,  # NaN: none
                    "special": special,
                }
                for token_id, start, end, logprob, special in zip(
                    self.ids.tolist(),
                    starts,
                    ends,
                    self.logprobs.tolist(),
                    self.special.tolist(),
                    strict=True,
                )
            ]
            if self.top is not None:
                for row, top in zip(rows, self.top, strict=True):
                    row["top_tokens"] = top
            self._rows = rows
        return self._rows

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        return self.rows()[index]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:  # as the list it stands for (so no hash)
        return isinstance(other, Sequence) and list(self) == list(other)

    def __reduce__(self) -> tuple[Any, ...]:  # the columns travel, never the dicts
        return (
            TokenColumns,
            (self.ids, self.logprobs, self.special, self.text, self.text_ends, self.top),
        )


class TokenLists(Sequence[list[dict[str, Any]]]):
    """A list of lists of tokens (each token's alternatives), held as columns: the tokens
    one after the other, and where each list ends among them."""

    def __init__(self, tokens: TokenColumns, ends: np.ndarray):
        self.tokens = tokens
        self.ends = ends  # int64
        self._rows: list[list[dict[str, Any]]] | None = None

    @classmethod
    def of(cls, lists: list[list[dict[str, Any]]]) -> TokenLists | None:
        """`lists` as columns, or None where their tokens are not all of the shape held."""
        flat = [token for tokens in lists for token in tokens]
        if any("top_tokens" in token for token in flat):
            return None
        tokens = TokenColumns.of(flat)
        if tokens is None:
            return None
        return cls(tokens, np.cumsum([len(tokens) for tokens in lists], dtype=np.int64))

    def rows(self) -> list[list[dict[str, Any]]]:
        if self._rows is None:
            flat = self.tokens.rows()
            ends = self.ends.tolist()
            self._rows = [flat[start:end] for start, end in zip([0, *ends][:-1], ends, strict=True)]
        return self._rows

    def __len__(self) -> int:
        return len(self.ends)

    @overload
    def __getitem__(self, index: int) -> list[dict[str, Any]]: ...
    @overload
    def __getitem__(self, index: slice) -> list[list[dict[str, Any]]]: ...
    def __getitem__(self, index: int | slice) -> list[dict[str, Any]] | list[list[dict[str, Any]]]:
        return self.rows()[index]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:  # as the list it stands for (so no hash)
        return isinstance(other, Sequence) and list(self) == list(other)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenLists, (self.tokens, self.ends))


def columns(tokens: list[dict[str, Any]]) -> Sequence[dict[str, Any]]:
    """`tokens` as columns where they fit them, else as they are."""
    return TokenColumns.of(tokens) or tokens


def token_lists(lists: list[list[dict[str, Any]]]) -> Sequence[list[dict[str, Any]]]:
    """Lists of tokens as columns where they fit them, else as they are."""
    return TokenLists.of(lists) or lists


def token_count(tokens: Sequence[Any] | None) -> int:
    """How many tokens a listing holds, alternatives included, without making them."""
    if isinstance(tokens, TokenColumns):
        return len(tokens) + (0 if tokens.top is None else len(tokens.top.tokens))
    if isinstance(tokens, TokenLists):
        return len(tokens.tokens)
    count = 0
    for token in tokens or ():
        if isinstance(token, list):  # a token's alternatives
            count += len(token)
        else:
            count += 1 + len(token.get("top_tokens") or ())
    return count


def listed(tokens: Any) -> Any:
    """Columns as the lists they stand for (what a JSON encoder takes); anything else as
    it is."""
    if isinstance(tokens, TokenColumns):
        return tokens.rows()
    if isinstance(tokens, TokenLists):
        return tokens.rows()
    return tokens


def logprob_sum(tokens: Sequence[dict[str, Any]]) -> float:
    """The tokens' log probabilities added up (a token without one adds nothing), read
    from the column where they are columns: no dict is made."""
    if isinstance(tokens, TokenColumns):
        return float(np.nansum(tokens.logprobs))
    return sum(token["logprob"] for token in tokens if token["logprob"] is not None)

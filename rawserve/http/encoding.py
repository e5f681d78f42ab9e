"""JSON encoding of answers, numpy arrays included, without per-float Python work.

Token-level features are thousands of floats per item. `json.dumps(array.tolist())`
turns each one into a Python float (about 2 ms for a 13x384 array, on the event loop).
orjson writes numpy arrays natively, each float32 in the shortest form that reads back
to the same float32 (about 0.1 ms for 13x384, and a third fewer bytes than 9 fixed
digits). See bench/RESULTS.md, *Output encoding*.

NaN and infinity, which JSON has no words for, are written as null.
"""

from __future__ import annotations

import json
from collections import UserString
from collections.abc import Mapping, Sequence, Set
from datetime import timedelta
from decimal import Decimal
from typing import Any

import numpy as np
import orjson

OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


WHOLE_DIGITS = 18  # a whole Decimal of more digits is written as a float (1E+999999...)


def _default(value: Any) -> Any:
    """What orjson does not write itself: strided arrays and other numpy types, and the
    standard library's values a handler may answer with (a handler's `Decimal`, `deque`,
    namedtuple or `timedelta` failed its request with 500) as FastAPI writes them: a
    whole Decimal as an integer, another as a float (past a float's range, as infinity:
    null), collections as lists or objects, a timedelta as its seconds. Bytes and
    complex numbers have no JSON form."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fiub" and not value.flags.c_contiguous:
            return np.ascontiguousarray(value)
        return value.tolist()
    if isinstance(value, np.floating):  # float128 and the like
        return float(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Decimal):
        if not value.is_finite():  # (a signalling NaN has no float)
            return None
        whole = value.as_tuple().exponent >= 0  # type: ignore[operator]
        return int(value) if whole and value.adjusted() < WHOLE_DIGITS else float(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, UserString):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Set | Sequence) and not isinstance(value, bytes | bytearray | memoryview):
        return list(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(value: Any) -> bytes:
    """Compact JSON of `value` as UTF-8 bytes."""
    try:
        return orjson.dumps(value, default=_default, option=OPTIONS)
    except TypeError as exc:  # (orjson.JSONEncodeError is one)
        if not any(refusal in str(exc) for refusal in MENDED):
            raise
    return orjson.dumps(_mended(value), default=_default, option=OPTIONS)


# What orjson refuses that JSON and Python's json write (each was a handler's 500): an
# integer past 64 bits (2**70), as a value or a key, and a text holding a lone surrogate
# (bytes decoded with "surrogateescape"), which Python's json writes escaped ("\udcff")
MENDED = ("64-bit range", "surrogates not allowed")
_SMALLEST, _LARGEST = -(2**63), 2**64 - 1  # what orjson writes itself


def _too_big(value: Any) -> bool:
    return isinstance(value, int) and not _SMALLEST <= value <= _LARGEST


def _mended(value: Any) -> Any:
    """`value` with each integer and text orjson cannot write written as Python's json
    writes it, in whatever `_default` writes as a list or an object too (a set, a deque)."""
    if _too_big(value):
        return orjson.Fragment(str(int(value)).encode())
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return orjson.Fragment(json.dumps(value).encode()) if _lone_surrogates(value) else value
    if isinstance(value, dict):
        if any(isinstance(key, str) and _lone_surrogates(key) for key in value):
            return _object_written(value)  # (orjson writes no key as a fragment)
        return {str(int(key)) if _too_big(key) else key: _mended(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mended(item) for item in value]
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return value  # (no text in it)
    try:
        written = _default(value)
    except TypeError:
        return value  # (orjson says what it cannot write)
    return _mended(written)


def _object_written(value: dict[Any, Any]) -> orjson.Fragment:
    """A dict with a key of lone surrogates, written whole: each key as Python's json
    writes it (two such keys made one, mended alike), or as orjson writes it."""
    members = []
    for key, item in value.items():
        if isinstance(key, str) or _too_big(key):
            named = json.dumps(str(key)).encode()
        else:  # (an int's or a date's, as orjson writes it as a key)
            named = orjson.dumps({key: None}, option=OPTIONS)[1:-6]
        members.append(named + b":" + dumps(item))
    return orjson.Fragment(b"{" + b",".join(members) + b"}")


def _lone_surrogates(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def dumps_in_pieces(value: Any) -> bytes:
    """`dumps(value)`, the same bytes, written an item of a list (a row of an array) at a
    time. One orjson call holds the GIL throughout, some 60 ms for 20 MB of token vectors;
    a thread that encodes a large answer this way lets the event loop's thread run between
    pieces. Objects are written whole."""
    if isinstance(value, list | tuple) or (
        isinstance(value, np.ndarray) and value.ndim > 1 and value.dtype.kind in "fiub"
    ):
        return b"[" + b",".join(dumps_in_pieces(item) for item in value) + b"]"
    return dumps(value)

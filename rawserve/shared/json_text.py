"""JSON as RFC 8259 writes it: Python's json reads `NaN`, `Infinity` and `-Infinity`,
which no other JSON reader takes, and a number past a float's range (`1e400`) as an
infinity; orjson writes each back as `null` (a schema's `{"const": NaN}` became an answer
of `null`). And how deep a text nests, read before it is parsed: a document nested
hundreds deep is read, but pickling it to a worker failed (RecursionError)."""

from __future__ import annotations

import json
import math
from array import array
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64  # levels of nested arrays and objects a client's JSON may hold


class NotJsonNumber(ValueError):
    """`NaN`, `Infinity` or `-Infinity`: no number JSON has."""


class PastFloatRange(NotJsonNumber):
    """A number no float holds (`1e400`), which Python reads as an infinity."""


class TooDeep(ValueError):
    """A text that nests arrays and objects past the levels asked."""


def _refuse(constant: str) -> Any:
    raise NotJsonNumber(f"{constant}: NaN and Infinity are not JSON numbers")


def _finite(written: str) -> float:
    # (a Python call a float: 100,000 of them read in 25 ms, not 19)
    value = float(written)
    if math.isinf(value):
        shown = written if len(written) <= 24 else f"{written[:20]}..."
        raise PastFloatRange(f"a number past a float's range: {shown}")
    return value


def loads(text: str | bytes, deepest: int | None = None) -> Any:
    """`text` read as JSON; NotJsonNumber for `NaN`, `Infinity` or `-Infinity`, or a
    number no float holds; TooDeep where it nests more than `deepest` levels (ValueError,
    json.JSONDecodeError, for bad syntax)."""
    document = json.loads(text, parse_constant=_refuse, parse_float=_finite)
    if deepest is not None:  # (read once valid: the depth is read from valid JSON)
        written = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        if nested_deeper_than(written, deepest):
            raise TooDeep(f"nested more than {deepest} levels deep")
    return document


_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")  # valid JSON nests them properly: one kind will do
_AS_STEPS = bytes.maketrans(b"[]", b"\x01\xff")  # +1 and -1, as signed bytes
QUICK_PASSES = 4


def nested_deeper_than(body: bytes, limit: int) -> bool:
    """Whether the valid JSON `body` nests arrays and objects more than `limit` levels
    deep, read from its brackets outside strings, in C: a few passes of `bytes.replace`
    each take the innermost level away (pairs one makes are not matched in it), which
    ends a flood of shallow lists at once; what is left is measured in one pass, each
    bracket a step up or down (63 passes over 7,900 lists 63 deep took 130 ms). Fewer
    brackets than the limit cannot nest past it: not looked at further."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = outside_strings(body).translate(_AS_SQUARE, _NOT_BRACKETS)
    quick = min(limit, QUICK_PASSES)
    for _ in range(quick):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    if not brackets or quick == limit:
        return bool(brackets)
    return max(accumulate(array("b", brackets.translate(_AS_STEPS)))) > limit - quick


def outside_strings(body: bytes) -> bytes:
    """The valid JSON `body` less its strings, in C: escaped backslashes and quotes go
    (backslashes pair from the left, as JSON reads them), and every other part between
    the quotes left is a string. A regular expression matching the strings held the
    loop 0.2-0.3 s on a 1 KB gzipped body of escapes or of empty strings."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(unescaped.split(b'"')[::2])

"""JSON encoding of outputs, numpy arrays included, without per-float Python work.

Token-level features are thousands of floats per item. `json.dumps(array.tolist())`
formats each one through a Python float (about 2.8 ms for a 13x384 array, on the event
loop). Here a float32 array is formatted by numpy in whole-array operations instead:
each number becomes a fixed-width ` d.dddddddde±XX` (9 significant digits: enough for
a float32 to read back exactly; a space where a positive number has no minus sign).
The rest of the document goes through the C `json` encoder, with each array replaced
by a placeholder that is then swapped for the array's bytes. See bench/RESULTS.md.

Arrays of other dtypes, and arrays holding NaN or infinity, take the `tolist()` path.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import numpy as np

DIGITS = 9  # significant digits that identify a float32 exactly
FAST_DTYPES = (np.float32, np.float16)


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(value: Any) -> bytes:
    """Compact JSON of `value`; float32 arrays (at any depth) are formatted by numpy."""
    arrays: list[np.ndarray] = []
    marker = f"\x00array-{secrets.token_hex(6)}-"

    def default(item: Any) -> Any:
        if isinstance(item, np.ndarray) and _fast(item):
            arrays.append(item)
            return f"{marker}{len(arrays) - 1}"
        return _default(item)

    text = json.dumps(value, default=default, separators=(",", ":"))
    if not arrays:
        return text.encode()
    # json escapes the NUL that starts each placeholder: it cannot come from the data
    quoted = json.dumps(marker)[:-1]  # '"\u0000array-...-'
    pieces = text.split(quoted)
    out = [pieces[0].encode()]
    for piece in pieces[1:]:
        index, rest = piece.split('"', 1)
        out.append(encode_array(arrays[int(index)]))
        out.append(rest.encode())
    return b"".join(out)


def _fast(array: np.ndarray) -> bool:
    return array.dtype in FAST_DTYPES and array.size > 0 and bool(np.isfinite(array).all())


def encode_array(array: np.ndarray) -> bytes:
    """The JSON of a finite float array of any shape (nested lists), as numpy formats it."""
    if array.ndim == 0:
        return format_floats(array.reshape(1)).rstrip(b",")
    rows = array.reshape(-1, array.shape[-1]) if array.shape[-1] else None
    if rows is None:  # a trailing dimension of 0: nested empty lists
        return json.dumps(array.tolist(), separators=(",", ":")).encode()
    flat = format_floats(rows.ravel())
    # every number ends with ","; rows are cut at their last comma
    row_length = rows.shape[1]
    ends = np.flatnonzero(np.frombuffer(flat, dtype=np.uint8) == ord(","))[
        row_length - 1 :: row_length
    ]
    starts = np.concatenate(([0], ends[:-1] + 1))
    inner = [b"[" + flat[s:e] + b"]" for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    # wrap the rows in the brackets of the outer dimensions
    for size in reversed(array.shape[:-1]):
        inner = [b"[" + b",".join(inner[i : i + size]) + b"]" for i in range(0, len(inner), size)]
    return inner[0]


def format_floats(values: np.ndarray) -> bytes:
    """`values` (1-D, finite) as "x,y,...," in scientific notation, by whole-array steps."""
    x = values.astype(np.float64)
    negative = x < 0
    magnitude = np.abs(x)
    nonzero = magnitude > 0
    exponent = np.zeros(x.shape, dtype=np.int64)
    exponent[nonzero] = np.floor(np.log10(magnitude[nonzero])).astype(np.int64)
    scale = 10.0 ** (DIGITS - 1)
    mantissa = np.rint(magnitude / np.power(10.0, exponent) * scale).astype(np.int64)
    # log10 can be off by one next to powers of ten, and rounding can carry to 10^9
    low = nonzero & (mantissa < 10 ** (DIGITS - 1))
    if low.any():
        exponent[low] -= 1
        mantissa[low] = np.rint(magnitude[low] / np.power(10.0, exponent[low]) * scale)
    high = mantissa >= 10**DIGITS
    if high.any():
        exponent[high] += 1
        mantissa[high] //= 10
    # the nine digits, three at a time through a table of "000".."999"
    mantissa = mantissa.astype(np.int32)  # below 10^9
    high_six = mantissa // 1000
    low_three = mantissa - high_six * 1000
    top_three = high_six // 1000
    middle_three = high_six - top_three * 1000
    record = np.empty((x.size, DIGITS + 7), dtype=np.uint8)  # "-d.dddddddde-XX,"
    top = _digits(top_three)
    record[:, 1] = top[:, 0]
    record[:, 2] = ord(".")
    record[:, 3:5] = top[:, 1:]
    record[:, 5:8] = _digits(middle_three)
    record[:, 8:11] = _digits(low_three)
    record[:, 11] = ord("e")
    record[:, 12] = np.where(exponent < 0, ord("-"), ord("+"))
    record[:, 13:15] = _digits(np.abs(exponent))[:, 1:]
    record[:, 15] = ord(",")
    # a positive number keeps a space where the minus sign would be: JSON allows
    # whitespace between values, and squeezing it out costs more than all of the above
    record[:, 0] = np.where(negative, ord("-"), ord(" "))
    return record.tobytes()


# "000 " .. "999 " as one 4-byte word each: a 1-D table lookup is fast, rows of bytes are not
_THREE_DIGITS = np.frombuffer("".join(f"{i:03d} " for i in range(1000)).encode(), dtype=np.uint32)


def _digits(groups: np.ndarray) -> np.ndarray:
    """Numbers 0..999 → their three ASCII digits, one row each."""
    return _THREE_DIGITS[groups].view(np.uint8).reshape(-1, 4)[:, :3]

"""JSON encoding of answers, numpy arrays included, without per-float Python work.

Token-level features are thousands of floats per item. `json.dumps(array.tolist())`
turns each one into a Python float (about 2 ms for a 13x384 array, on the event loop).
orjson writes numpy arrays natively, each float32 in the shortest form that reads back
to the same float32 (about 0.1 ms for 13x384, and a third fewer bytes than 9 fixed
digits). See bench/RESULTS.md, *Output encoding*.

NaN and infinity, which JSON has no words for, are written as null.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _default(value: Any) -> Any:
    """What orjson does not write itself: strided arrays and other numpy types."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "fiub" and not value.flags.c_contiguous:
            return np.ascontiguousarray(value)
        return value.tolist()
    if isinstance(value, np.floating):  # float128 and the like
        return float(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(value: Any) -> bytes:
    """Compact JSON of `value` as UTF-8 bytes."""
    return orjson.dumps(value, default=_default, option=OPTIONS)

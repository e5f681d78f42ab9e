"""JSON as RFC 8259 writes it: Python's json reads `NaN`, `Infinity` and `-Infinity`,
which no other JSON reader takes, and a number past a float's range (`1e400`) as an
infinity; orjson writes each back as `null` (a schema's `{"const": NaN}` became an answer
of `null`)."""

from __future__ import annotations

import json
import math
from typing import Any


class NotJsonNumber(ValueError):
    """`NaN`, `Infinity` or `-Infinity`: no number JSON has."""


class PastFloatRange(NotJsonNumber):
    """A number no float holds (`1e400`), which Python reads as an infinity."""


def _refuse(constant: str) -> Any:
    raise NotJsonNumber(f"{constant}: NaN and Infinity are not JSON numbers")


def _finite(written: str) -> float:
    # (a Python call a float: 100,000 of them read in 25 ms, not 19)
    value = float(written)
    if math.isinf(value):
        shown = written if len(written) <= 24 else f"{written[:20]}..."
        raise PastFloatRange(f"a number past a float's range: {shown}")
    return value


def loads(text: str | bytes) -> Any:
    """`text` read as JSON; NotJsonNumber for `NaN`, `Infinity` or `-Infinity`, or a
    number no float holds (ValueError, json.JSONDecodeError, for bad syntax)."""
    return json.loads(text, parse_constant=_refuse, parse_float=_finite)

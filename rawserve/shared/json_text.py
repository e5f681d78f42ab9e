"""JSON as RFC 8259 writes it: Python's json reads `NaN`, `Infinity` and `-Infinity`,
which no other JSON reader takes, and orjson writes them back as `null` (a schema's
`{"const": NaN}` became an answer of `null`)."""

from __future__ import annotations

import json
from typing import Any

NOT_JSON_NUMBERS = "NaN and Infinity are not JSON numbers"


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant}: {NOT_JSON_NUMBERS}")


def loads(text: str | bytes) -> Any:
    """`text` read as JSON; ValueError (json.JSONDecodeError for bad syntax) for `NaN`,
    `Infinity` or `-Infinity`."""
    return json.loads(text, parse_constant=_refuse)

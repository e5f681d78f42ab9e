"""Numbers read from request headers, in HTTP's grammar rather than Python's.

`float()` takes `1_0`, ` 1`, `1e1`, `inf`, `nan` and `+1`; HTTP's numbers (`delay-seconds`,
`qvalue`, `Content-Length`) are ASCII digits with at most one dot. A header that a proxy
or a log reader would see as something else must not mean a number here. Plain functions;
no I/O.
"""

from __future__ import annotations

import re

_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)


def header_decimal(value: str) -> float | None:
    """`value` as a number (`10`, `0.5`, `.5`, `2.`), or None where it is not one: no
    sign, exponent, underscore, surrounding space, or word such as `inf` or `nan`."""
    if not _DECIMAL.fullmatch(value):
        return None
    return float(value)

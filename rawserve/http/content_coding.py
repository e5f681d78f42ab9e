"""A request body's content coding (RFC 9110 section 8.4): gzip and deflate are undone,
within the body limit, before anything reads the body; any other coding is refused with
415 naming the ones taken (`Accept-Encoding`, section 15.5.16), never read as if the
body had none.

Server process; standard library only.
"""

from __future__ import annotations

import zlib

from rawserve.http.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

ACCEPTED = "gzip, deflate"
WINDOW_BITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,  # the zlib format, as RFC 9110 names it
}


def codings(field: str | None) -> list[str]:
    """The codings a `Content-Encoding` value lists, in the order they were applied;
    UnsupportedMediaType for one this server cannot undo."""
    listed = [name.strip().lower() for name in (field or "").split(",")]
    listed = [name for name in listed if name and name != "identity"]
    for name in listed:
        if name not in WINDOW_BITS:
            raise UnsupportedMediaType(
                f"the body's content coding {name!r} is not one this server reads "
                f"(it reads {ACCEPTED})",
                headers=[("Accept-Encoding", ACCEPTED)],
            )
    return listed


def decoded(body: bytes, applied: list[str], limit: int) -> bytes:
    """`body` with `applied` codings undone, last first; PayloadTooLarge once it grows
    past `limit` bytes (a small bomb must not become gigabytes), BadRequest when it is
    not what its coding says."""
    for name in reversed(applied):
        inflater = zlib.decompressobj(WINDOW_BITS[name])
        try:
            plain = inflater.decompress(body, limit + 1)
        except zlib.error:
            raise BadRequest(f"the body is not valid {name} data") from None
        if len(plain) > limit:
            raise PayloadTooLarge(f"the body decoded is over the limit of {limit} bytes")
        if not inflater.eof:
            raise BadRequest(f"the body's {name} data ends early")
        body = plain
    return body

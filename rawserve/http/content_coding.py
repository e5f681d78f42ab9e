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
PIECE_BYTES = 1024  # how much of a coded body zlib is given at once
MAX_MEMBERS = 64  # gzip members in one body: each costs a pass of Python, tiny ones too
# Codings applied one over another: each layer is a pass of Python over up to the whole
# limit, and 2,900 gzip layers in a 15 KB head held the event loop for 4.5 s. No client
# stacks more than two.
MAX_CODINGS = 2


def codings(field: str | None) -> list[str]:
    """The codings a `Content-Encoding` value lists, in the order they were applied;
    UnsupportedMediaType for one this server cannot undo."""
    listed = [name.strip().lower() for name in (field or "").split(",")]
    listed = [name for name in listed if name and name != "identity"]
    if len(listed) > MAX_CODINGS:
        raise UnsupportedMediaType(
            f"the body has {len(listed)} content codings, one over another: this server "
            f"reads at most {MAX_CODINGS}",
            headers=[("Accept-Encoding", ACCEPTED)],
        )
    for name in listed:
        if name not in WINDOW_BITS:
            # the header's bytes (read as Latin-1) shown as sent, those past ASCII escaped
            shown = name.encode("latin-1", "replace").decode("ascii", "backslashreplace")
            raise UnsupportedMediaType(
                f"the body's content coding '{shown}' is not one this server reads "
                f"(it reads {ACCEPTED})",
                headers=[("Accept-Encoding", ACCEPTED)],
            )
    return listed


def decoded(body: bytes, applied: list[str], limit: int) -> bytes:
    """`body` with `applied` codings undone, last first; PayloadTooLarge once it grows
    past `limit` bytes (a small bomb must not become gigabytes), BadRequest when it is
    not what its coding says."""
    for name in reversed(applied):
        body = _inflated(body, name, limit)
    return body


def _inflated(body: bytes, name: str, limit: int) -> bytes:
    """`body` with coding `name` undone. Gzip data may be several members, read one after
    the other (RFC 1952 section 2.2, as gzip reads them); anything else after the data is
    refused, as are more than `MAX_MEMBERS` members. The body is fed a piece at a time,
    so what zlib copies of the rest after each member stays small."""
    view = memoryview(body)
    parts: list[bytes] = []  # joined once at the end
    size = start = 0
    members = 1
    inflater = zlib.decompressobj(WINDOW_BITS[name])
    while start < len(view):
        if inflater.eof:  # a member ended and more follows
            if name == "deflate":  # the zlib format holds one stream
                raise BadRequest("the body has data after the deflate stream")
            members += 1
            if members > MAX_MEMBERS:
                raise BadRequest(f"the body's {name} data has over {MAX_MEMBERS} members")
            inflater = zlib.decompressobj(WINDOW_BITS[name])
        piece = view[start : start + PIECE_BYTES]
        try:
            parts.append(inflater.decompress(piece, limit + 1 - size))
        except zlib.error:
            raise BadRequest(f"the body is not valid {name} data") from None
        size += len(parts[-1])
        if size > limit:
            raise PayloadTooLarge(
                f"the body decoded is over the limit of {limit} bytes (the server's "
                "--max-body-bytes)"
            )
        start += len(piece) - len(inflater.unused_data)  # below the limit: all else was read
    if not inflater.eof:
        raise BadRequest(f"the body's {name} data ends early")
    return b"".join(parts)

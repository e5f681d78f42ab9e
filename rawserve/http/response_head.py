"""The head of every answer: its fields, in one order, and their bytes.

The protocol writes every answer through one writer (`HttpProtocol._send`), which frames
it with h11 where h11 knows the request and the connection ends, and by hand where h11
does not know it (an error before any head was parsed) or need not (`render_kept`).
Both take their fields from here, so an answer carries the same headers however it is
framed:

    Server, Content-Type, the response's own headers (CORS included), Content-Length,
    Connection: close, then Date, X-Request-Id and Server-Timing (the per-request part).

The first part depends only on the server's own values, so by hand its bytes are made
once per distinct answer (`render_fixed`). On a connection that stays open, an answer to
a request h11 read whole is written by hand too (`render_kept`): writing it through h11
cost a fifth of the server's time per request, and what h11 writes there is the head's
fields as given and the body. Its status line, Server and Content-Type are made once;
each of the response's own fields is checked against the grammar h11 checks, and where
one is outside it (or h11 would rewrite it), h11 frames the answer. A streamed body's
pieces are framed by hand as well (`body_framing`), as the head h11 wrote announced them.
Knows h11's response event; no I/O.
"""

from __future__ import annotations

import email.utils
import functools
import re
import time
from collections.abc import Callable
from http import HTTPStatus

import h11

from rawserve.http.exchange import HttpResponse

SERVER_HEADER = ("Server", "rawserve")
# Headers of the app's that h11 would rewrite or move: an answer with one goes through h11.
_REWRITTEN_BY_H11 = frozenset({"content-length", "transfer-encoding", "connection", "host"})
# RFC 9110's grammar for a field, without obs-text: a token for the name, and visible
# ASCII runs joined by spaces or tabs for the value (h11 checks the same, obs-text aside).
_FIELD_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE = re.compile(r"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?")
# Statuses whose body h11 frames otherwise (none at all, whatever Content-Length says).
_NO_BODY = (204, 304)

Fields = tuple[tuple[str, str], ...]


def content_length(status: int, size: int) -> int | None:
    """The Content-Length of an answer of `size` bytes: None for 204 and 304, which have
    no body (a 204 must not say one: RFC 9110 section 8.6)."""
    return None if status in _NO_BODY else size


def fixed_fields(content_type: str, headers: Fields, length: int | None, close: bool) -> Fields:
    """The fields that do not change from one request to the next for the same answer.
    `length`: None for a body sent piece by piece (h11 frames it)."""
    fields = [SERVER_HEADER]
    if content_type:
        fields.append(("Content-Type", content_type))
    fields += headers
    if length is not None:
        fields.append(("Content-Length", str(length)))
    if close:
        fields.append(("Connection", "close"))
    return tuple(fields)


def request_fields(response: HttpResponse, request_id: str, started: float) -> Fields:
    """The date, the request's id, and its time in the server (unless the app timed it
    itself)."""
    fields = (("Date", http_date()), ("X-Request-Id", request_id))
    if _timed(response):
        return fields
    elapsed_ms = 1000 * (time.perf_counter() - started)
    return (*fields, ("Server-Timing", f"total;dur={elapsed_ms:.2f}"))


def http_date() -> str:
    """Now, as a Date field has it (RFC 9110 6.6.1: an origin server with a clock sends
    one), made once a second: formatting it costs more than the rest of a head."""
    return _date_of_second(int(time.time()))


@functools.lru_cache(maxsize=1)
def _date_of_second(second: int) -> str:
    return email.utils.formatdate(second, usegmt=True)


def h11_head(status: int, fields: Fields) -> h11.Response:
    return h11.Response(status_code=status, headers=list(fields), reason=reason(status))


def body_framing(head: bytes) -> Callable[[bytes], bytes]:
    """How a streamed body's pieces go out after `head`, as h11 wrote it: in chunks where
    it announced chunked transfer-coding (to HTTP/1.1), as they are otherwise (HTTP/1.0:
    the body ends with the connection). By hand: through h11 a piece took 2.7 µs of the
    protocol's Python against 0.9 (a streamed token costs the server ~30 µs in all, most
    of it the write). h11 keeps no count of chunked data: it still ends the body."""
    if b"\r\ntransfer-encoding: chunked\r\n" in head.lower():
        return chunk
    return lambda piece: piece


def chunk(piece: bytes) -> bytes:
    """One chunk of a chunked body (RFC 9112 7.1), as h11 writes it."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


@functools.lru_cache(maxsize=64)
def render_fixed(
    status: int, content_type: str, headers: Fields, length: int, close: bool
) -> bytes:
    """The status line and `fixed_fields` as h11 would write them (their values are the
    server's own, an allowed origin included, never a client's: few distinct heads)."""
    fields = fixed_fields(content_type, headers, length, close)
    lines = [f"HTTP/1.1 {status} {reason(status)}", *(f"{n}: {v}" for n, v in fields)]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


def render_kept(status: int, content_type: str, headers: Fields, length: int) -> bytes | None:
    """The head up to `request_fields`, as h11 writes it on a connection that stays open
    (an HTTP/1.1 request, read whole, no Connection: close, not HEAD), or None where h11
    might write it otherwise or refuse it: then h11 frames the answer, as before."""
    start = kept_start(status, content_type)
    own = plain_fields(headers)
    if start is None or own is None:
        return None
    return b"%s%sContent-Length: %d\r\n" % (start, own, length)


@functools.lru_cache(maxsize=64)
def kept_start(status: int, content_type: str) -> bytes | None:
    """The status line, Server and Content-Type (made once per status and type)."""
    if status < 200 or status in _NO_BODY:
        return None  # not a final answer (h11 refuses it), or one h11 frames without a body
    fields = plain_fields(fixed_fields(content_type, (), None, False))
    if fields is None:
        return None
    return b"HTTP/1.1 %d %s\r\n%s" % (status, reason(status).encode("ascii"), fields)


def plain_fields(fields: Fields) -> bytes | None:
    """Each `plain_field`, or None if one is not."""
    lines = []
    for name, value in fields:
        line = plain_field(name, value)
        if line is None:
            return None
        lines.append(line)
    return b"".join(lines)


def plain_field(name: str, value: str) -> bytes | None:
    """`name: value` as h11 writes it, or None where h11 might not write it as given: a
    field it rewrites, or one outside the plain grammar it checks against (it refuses
    some of those; and it writes text as ASCII only)."""
    if name.lower() in _REWRITTEN_BY_H11:
        return None
    if _FIELD_NAME.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
        return None
    return b"%s: %s\r\n" % (name.encode("ascii"), value.encode("ascii"))


def render_request_fields(response: HttpResponse, request_id: str, started: float) -> bytes:
    """`request_fields` and the head's blank line, as bytes (the id is visible ASCII)."""
    date = http_date().encode("ascii")
    if _timed(response):
        return b"Date: %s\r\nX-Request-Id: %s\r\n\r\n" % (date, request_id.encode())
    elapsed_ms = 1000 * (time.perf_counter() - started)
    return b"Date: %s\r\nX-Request-Id: %s\r\nServer-Timing: total;dur=%.2f\r\n\r\n" % (
        date,
        request_id.encode(),
        elapsed_ms,
    )


# RFC 9110's names where Python 3.11's `http` still has RFC 7231's
RFC_9110_PHRASES = {
    413: "Content Too Large",
    416: "Range Not Satisfiable",
    422: "Unprocessable Content",
}


def reason(status: int) -> str:
    if status in RFC_9110_PHRASES:
        return RFC_9110_PHRASES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _timed(response: HttpResponse) -> bool:
    return any(name.lower() == "server-timing" for name, _ in response.headers)

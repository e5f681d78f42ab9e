"""The head of every answer: its fields, in one order, and their bytes.

The protocol writes every answer through one writer (`HttpProtocol._send`), which frames
it with h11 where h11 knows the request, and by hand where it does not (an error before
any head was parsed) or need not (a refusal decided from the head, the cheap way under
overload). Both take their fields from here, so an answer carries the same headers
however it is framed:

    Server, Content-Type, the response's own headers (CORS included), Content-Length,
    Connection: close, then X-Request-Id and Server-Timing (the per-request part).

The first part depends only on the server's own values, so by hand its bytes are made
once per distinct answer (`render_fixed`). Knows h11's response event; no I/O.
"""

from __future__ import annotations

import functools
import time
from http import HTTPStatus

import h11

from rawserve.http.exchange import HttpResponse

SERVER_HEADER = ("Server", "rawserve")

Fields = tuple[tuple[str, str], ...]


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
    """The request's id, and its time in the server (unless the app timed it itself)."""
    if _timed(response):
        return (("X-Request-Id", request_id),)
    elapsed_ms = 1000 * (time.perf_counter() - started)
    return (("X-Request-Id", request_id), ("Server-Timing", f"total;dur={elapsed_ms:.2f}"))


def h11_head(status: int, fields: Fields) -> h11.Response:
    return h11.Response(status_code=status, headers=list(fields), reason=reason(status))


@functools.lru_cache(maxsize=64)
def render_fixed(
    status: int, content_type: str, headers: Fields, length: int, close: bool
) -> bytes:
    """The status line and `fixed_fields` as h11 would write them (their values are the
    server's own, an allowed origin included, never a client's: few distinct heads)."""
    fields = fixed_fields(content_type, headers, length, close)
    lines = [f"HTTP/1.1 {status} {reason(status)}", *(f"{n}: {v}" for n, v in fields)]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


def render_request_fields(response: HttpResponse, request_id: str, started: float) -> bytes:
    """`request_fields` and the head's blank line, as bytes (the id is visible ASCII)."""
    if _timed(response):
        return b"X-Request-Id: %s\r\n\r\n" % request_id.encode()
    elapsed_ms = 1000 * (time.perf_counter() - started)
    return b"X-Request-Id: %s\r\nServer-Timing: total;dur=%.2f\r\n\r\n" % (
        request_id.encode(),
        elapsed_ms,
    )


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _timed(response: HttpResponse) -> bool:
    return any(name.lower() == "server-timing" for name, _ in response.headers)

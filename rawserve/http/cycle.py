"""One request/response exchange on a connection (`Cycle`), and what is read from its head.

A connection (`rawserve.protocol.HttpProtocol`) holds at most one cycle at a time: from
its request's head (or from an error answered before any head could be parsed) until
its one answer is written. Knows h11's request event, nothing of sockets or of the app.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from urllib.parse import unquote

import h11

from rawserve.http.access_log import is_probe as is_probe_path
from rawserve.http.chunked import ChunkedMeter
from rawserve.http.exchange import HttpRequest, HttpResponse


class Cycle:
    """One request/response exchange. `request` is None for an error answered before a
    request head could be parsed (malformed, head timeout, connection refused)."""

    def __init__(self, request: h11.Request | None, request_id: str, origin: str | None = None):
        self.request = request
        self.request_id = request_id
        self.origin = origin  # the head's Origin: CORS headers on every answer to it
        self.body: list[bytes] = []
        self.body_size = 0
        self.started = time.perf_counter()
        self.task: asyncio.Task[None] | None = None
        self.response_started = False
        self.chunks: ChunkedMeter | None = None  # a chunked body's size on the wire
        self.head: HttpRequest | None = None  # the request as the app sees it; body last
        self.early: HttpResponse | None = None  # the answer decided from the head
        self.keep_alive = False  # HTTP/1.1 without Connection: close (from the head)
        self.codings: list[str] = []  # the body's content codings, undone once it is read
        self.retry = 0  # the client's retry this is, by its own count (`access_log`)
        # its body's time is bounded by the request's deadline (not --body-timeout): 504
        self.body_due = False

    @property
    def is_head(self) -> bool:
        return self.request is not None and self.request.method == b"HEAD"


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header `name` (lower-case), or None."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def has_content(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's framing says a body follows (h11 has checked the framing)."""
    length = header(headers, b"content-length")
    return header(headers, b"transfer-encoding") is not None or int(length or 0) > 0


def header_list(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """Every value of list-valued header `name` (lower-case), joined as one list (RFC 9110
    section 5.3: several fields are one list, in order), or None."""
    values = [value.decode("latin-1") for key, value in headers if key == name]
    return ", ".join(values) if values else None


def keeps_alive(event: h11.Request, fields: list[tuple[bytes, bytes]]) -> bool:
    """HTTP/1.1 without `Connection: close`, read from the head: at most what h11 decides
    (a value holding "close" anywhere, `x-closeable` say, takes the slower path, where
    h11 weighs whole tokens)."""
    if event.http_version != b"1.1":
        return False
    return not any(name == b"connection" and b"close" in value.lower() for name, value in fields)


def head_request(
    event: h11.Request, fields: list[tuple[bytes, bytes]], request_id: str
) -> HttpRequest:
    """The request as the app sees it, from its head (the body is filled in once read)."""
    return _request(event.method, event.target, event.http_version, fields, request_id)


def line_request(line: bytes, request_id: str) -> HttpRequest | None:
    """The request a request line names, its fields unread (a head refused before h11
    parsed it is answered in its route's shape); None for what is no request line."""
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return None
    return _request(parts[0], parts[1], parts[2].removeprefix(b"HTTP/"), [], request_id)


def _request(
    method: bytes, target: bytes, version: bytes, fields: list[tuple[bytes, bytes]], request_id: str
) -> HttpRequest:
    path, _, query = target.decode("ascii", "replace").partition("?")
    return HttpRequest(
        method=method.decode("ascii", "replace"),
        path=routed_path(path),
        query=query,
        headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in fields],
        body=b"",
        request_id=request_id,
        http_version=version.decode("ascii", "replace"),
    )


def routed_path(path: str) -> str:
    """The path as the routes name it. The absolute form (`http://host/health`, which a
    server must accept: RFC 9112 section 3.2.2, and which proxies send) loses its scheme
    and authority; percent-encoded characters are decoded (`/models/org%2Fname` is
    `/models/org/name`: clients encode the names of models and handlers)."""
    if path[:1] != "/" and "://" in path:
        path = "/" + path.partition("://")[2].partition("/")[2]
    if "%" in path:
        path = unquote(path, errors="replace")
    return path


def is_probe(event: h11.Request) -> bool:
    """A liveness or readiness probe, in any form of its target that the routes take (a
    connection past --max-connections is taken for one, then closed)."""
    return is_probe_target(event.method, event.target)


def is_probe_target(method: bytes, target: bytes) -> bool:
    """Whether a request of `method` for `target` (as sent) is a probe's."""
    if method not in (b"GET", b"HEAD"):
        return False
    path = routed_path(target.partition(b"?")[0].decode("latin-1"))
    return is_probe_path(method.decode("ascii"), path)


def request_line_size(event: h11.Request) -> int:
    return len(event.method) + len(event.target) + len(b"  HTTP/1.1\r\n")


def head_size(event: h11.Request, fields: list[tuple[bytes, bytes]]) -> int:
    """The head's size as sent (near enough: h11 has dropped the optional spaces)."""
    headers = sum(len(name) + len(value) + 4 for name, value in fields)
    return request_line_size(event) + headers + 2

"""The request and response values that pass between the protocol and the app."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field


@dataclass
class HttpRequest:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]  # names lower-cased
    body: bytes
    request_id: str
    http_version: str = "1.1"
    # when its head was read (time.monotonic, as the scheduler's deadlines): its deadline
    # counts from it
    received_at: float = field(default_factory=time.monotonic)

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass
class HttpResponse:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "application/json"
    # A body produced piece by piece (sent chunked); `body` is ignored when set. The
    # protocol closes it (`aclose`) when the client leaves, which stops the producer.
    stream: AsyncGenerator[bytes, None] | None = None
    # Called once the stream is closed, however it ended: an async generator closed before
    # its first step runs none of its code (a `finally` in it never runs), as where the
    # client left between the answer's making and its sending.
    on_stream_close: Callable[[], None] | None = None
    # Given, as the stream starts, what says how many of its bytes the client has taken
    # so far: the producer tells a client reading slowly (the writer waiting for room
    # meanwhile) from one reading nothing.
    on_stream_start: Callable[[Callable[[], int]], None] | None = None

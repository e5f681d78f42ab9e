"""A fake asyncio transport, a loop with a hand-driven timer, and an h11 client that
reads what the server wrote."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import re
from collections.abc import Callable
from typing import Any

import h11


class FakeApp:
    """The protocol's Application at its simplest: nothing is answered without a task,
    and the server is not draining. Test apps add `handle`."""

    draining = False
    cors = None

    def answer_now(self, request: Any) -> Any:
        return None

    def deadline_seconds(self, request: Any) -> Any:
        return None  # no deadline of its own: --body-timeout bounds the body

    def refusal_renderer(self, request: Any) -> Any:
        return None  # rawserve's shape


class FakeTransport:
    """The transport calls the protocol makes, recorded. Deliberately no `asyncio.Transport`
    (uvloop's transports are not either): the protocol needs only these methods."""

    def __init__(self):
        self.written = bytearray()
        self.closed = False
        self.eof_written = False
        self.reading = True
        self.aborted = False  # closed without writing what waits
        self.buffered = 0  # bytes written that the peer has not taken yet

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        assert not self.eof_written, "write after write_eof"
        self.written += data

    def writelines(self, pieces) -> None:
        for piece in pieces:
            self.write(piece)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return self.buffered

    @property
    def finished(self) -> bool:
        """The server is done with this connection (closed, or lingering after its FIN)."""
        return self.closed or self.eof_written

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name, default=None):
        # as the loop's: a closed transport's socket has no peer left to name
        return ("127.0.0.1", 50000) if name == "peername" and not self.closed else default


class FakeTimer:
    def __init__(self, when: float, callback: Callable[..., Any], args: tuple):
        self.when, self.callback, self.args = when, callback, args
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled


class FakeTimerLoop:
    """The running loop for tasks, but `call_later`/`call_at` timers fire only on `advance()`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.now = 0.0
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._order = itertools.count()

    def create_task(self, coro, **kwargs) -> asyncio.Task:
        return self._loop.create_task(coro, **kwargs)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> asyncio.Handle:
        return self._loop.call_soon(callback, *args)  # the next pass: no timer

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> FakeTimer:
        return self.call_at(self.now + delay, callback, *args)

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> FakeTimer:
        timer = FakeTimer(when, callback, args)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    def pending(self) -> list[FakeTimer]:
        return [timer for _, _, timer in self._timers if not timer.cancelled()]

    def advance(self, seconds: float) -> None:
        """Move time on, firing every timer that falls due, in order."""
        until = self.now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, timer = heapq.heappop(self._timers)
            self.now = when
            if not timer.cancelled():
                timer.callback(*timer.args)
        self.now = until


def read_responses(
    data: bytes, requests: list[bytes] | None = None
) -> list[tuple[h11.Response, bytes]]:
    """Parse every response in `data` with an h11 client connection.

    `requests` are the requests the answers belong to (for HEAD and the like); by
    default, as many GETs as there are answers. 1xx interim responses are skipped.
    """
    client = h11.Connection(h11.CLIENT)
    responses = []
    for request in requests or [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"] * 64:
        # the client must have "sent" a request to parse the matching response
        client_request = h11.Connection(h11.SERVER)
        client_request.receive_data(request)
        event = client_request.next_event()
        if not isinstance(event, h11.Request):
            break
        headers = [
            (k, v) for k, v in event.headers if k not in (b"content-length", b"transfer-encoding")
        ]
        if not any(k == b"host" for k, _ in headers):  # an HTTP/1.0 request may lack one
            headers.append((b"host", b"x"))
        client.send(h11.Request(method=event.method, target=event.target, headers=headers))
        client.send(h11.EndOfMessage())
        if data:  # (an empty receive_data would mean the server closed)
            client.receive_data(bytes(data))
            data = b""
        head, body = None, bytearray()
        while True:
            got = client.next_event()
            if got is h11.NEED_DATA or isinstance(got, h11.ConnectionClosed):
                return responses
            if isinstance(got, h11.Response):
                head = got
            elif isinstance(got, h11.Data):
                body += got.data
            elif isinstance(got, h11.EndOfMessage):
                responses.append((head, bytes(body)))
                break
        if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
            return responses
        client.start_next_cycle()
    return responses


def count_responses(data: bytes) -> int:
    """How many final (non-1xx) response heads `data` holds; bodies must not quote one."""
    return len(re.findall(rb"HTTP/1\.1 [2-5]\d\d ", bytes(data)))

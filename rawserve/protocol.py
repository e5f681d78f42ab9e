"""HTTP/1.1 over asyncio: an `asyncio.Protocol` driving an `h11.Connection`.

Bytes in (`data_received` → `h11.Connection.receive_data`), events out (`next_event`),
one request at a time per connection: while a response is pending the protocol stops
reading, so pipelined requests are answered in order and never pile up in memory.
The protocol turns errors into responses through `errors.error_response` and hands
complete requests to the app. It never blocks and never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus

import h11

from rawserve.errors import (
    BadRequest,
    HeadersTooLarge,
    HTTPError,
    PayloadTooLarge,
    error_response,
)
from rawserve.http import HttpRequest, HttpResponse

log = logging.getLogger("rawserve.protocol")
access_log = logging.getLogger("rawserve.access")

SERVER_HEADER = ("Server", "rawserve")
PIPELINE_BUFFER_LIMIT = 64 * 1024  # bytes read ahead while a response is pending
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


@dataclass(frozen=True)
class ProtocolSettings:
    max_body_bytes: int = 1024 * 1024
    max_head_bytes: int = 16 * 1024
    keepalive_timeout: float = 5.0


@dataclass
class ServerState:
    """Shared by every connection of one server."""

    connections: set[HttpProtocol] = field(default_factory=set)


class _Cycle:
    """One request/response exchange on a connection."""

    def __init__(self, request: h11.Request, request_id: str):
        self.request = request
        self.request_id = request_id
        self.body: list[bytes] = []
        self.body_size = 0
        self.started = time.perf_counter()
        self.task: asyncio.Task | None = None


class HttpProtocol(asyncio.Protocol):
    def __init__(
        self,
        app,
        settings: ProtocolSettings = ProtocolSettings(),
        state: ServerState | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.app = app
        self.settings = settings
        self.state = state or ServerState()
        self.loop = loop or asyncio.get_event_loop()
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=settings.max_head_bytes)
        self.transport: asyncio.Transport | None = None
        self.cycle: _Cycle | None = None
        self.closed = False
        self.reading_paused = False
        self.writing_paused = False
        self.keepalive_timer: asyncio.TimerHandle | None = None
        self.pipelined_bytes = 0  # received while a response is pending
        self.writable = asyncio.Event()  # cleared while the transport's buffer is full
        self.writable.set()

    # --- asyncio.Protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state.connections.add(self)
        self._arm_keepalive()

    def data_received(self, data: bytes) -> None:
        self._cancel_keepalive()
        self.conn.receive_data(data)
        if self._responding():
            # Pipelined bytes wait in h11's buffer; keep reading (to notice a
            # disconnect) until too much piles up.
            self.pipelined_bytes += len(data)
            if self.pipelined_bytes > PIPELINE_BUFFER_LIMIT:
                self._pause_reading()
            return
        self.handle_events()

    def eof_received(self) -> bool | None:
        if self._responding():
            return None  # the client left before its answer: close, which withdraws it
        self.conn.receive_data(b"")
        self.handle_events()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.state.connections.discard(self)
        self._cancel_keepalive()
        self.writable.set()  # a streaming response waiting to write must see the close
        if self.cycle is not None and self.cycle.task is not None:
            self.cycle.task.cancel()  # the client is gone: withdraw its work

    def pause_writing(self) -> None:
        self.writing_paused = True
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writing_paused = False
        self.writable.set()
        if self.cycle is None:
            self.handle_events()

    # --- reading ----------------------------------------------------------------------

    def handle_events(self) -> None:
        """Process what h11 has buffered until it needs data or a request is pending."""
        while not self.closed and (self.cycle is None or self._reading_body()):
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._reject_malformed(exc)
                return
            if event is h11.NEED_DATA:
                self._resume_reading()
                return
            if event is h11.PAUSED:
                self._pause_reading()
                return
            if isinstance(event, h11.Request):
                self._on_request(event)
            elif isinstance(event, h11.Data):
                self._on_body(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._on_request_complete()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return

    def _reading_body(self) -> bool:
        return self.cycle is not None and self.cycle.task is None

    def _responding(self) -> bool:
        return self.cycle is not None and self.cycle.task is not None

    def _on_request(self, event: h11.Request) -> None:
        given_id = _header(event.headers, b"x-request-id")
        request_id = given_id if given_id and _REQUEST_ID.match(given_id) else uuid.uuid4().hex
        self.cycle = _Cycle(event, request_id)
        length = _header(event.headers, b"content-length")
        if length is not None and int(length) > self.settings.max_body_bytes:
            self._send_error(self._too_large(), close=True)
            return
        if self.conn.they_are_waiting_for_100_continue:
            self._write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[])))

    def _on_body(self, data: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.task is not None:
            return
        cycle.body_size += len(data)
        if cycle.body_size > self.settings.max_body_bytes:
            self._send_error(self._too_large(), close=True)
            return
        cycle.body.append(data)

    def _on_request_complete(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.task is not None:
            return
        event = cycle.request
        target = event.target.decode("ascii", "replace")
        path, _, query = target.partition("?")
        request = HttpRequest(
            method=event.method.decode("ascii", "replace"),
            path=path,
            query=query,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers],
            body=b"".join(cycle.body),
            request_id=cycle.request_id,
            http_version=event.http_version.decode("ascii", "replace"),
        )
        cycle.task = self.loop.create_task(self._respond(request))

    async def _respond(self, request: HttpRequest) -> None:
        try:
            response = await self.app.handle(request)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - error_response logs what is unexpected
            rendered = error_response(exc)
            response = HttpResponse(rendered.status, rendered.body, rendered.headers, "")
        if self.closed:
            return
        if response.stream is not None:
            await self._send_stream(response)
        else:
            self._send(response)

    # --- writing ----------------------------------------------------------------------

    def _send(self, response: HttpResponse, close: bool = False) -> None:
        cycle = self.cycle
        assert cycle is not None
        close = close or response.status >= 500
        headers = [SERVER_HEADER, ("X-Request-Id", cycle.request_id)]
        if response.content_type:
            headers.append(("Content-Type", response.content_type))
        headers += [*response.headers, ("Content-Length", str(len(response.body)))]
        if close:
            headers.append(("Connection", "close"))
        try:
            self._write(self.conn.send(_response_head(response.status, headers)))
            if cycle.request.method != b"HEAD":
                self._write(self.conn.send(h11.Data(data=response.body)))
            self._write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            log.exception("could not send a response")
            self._close()
            return
        self._log_access(cycle, response.status, len(response.body))
        self._finish_cycle()

    async def _send_stream(self, response: HttpResponse) -> None:
        """Send a body produced piece by piece (chunked), waiting while the peer is slow.

        Once the head is out, an error can only close the connection.
        """
        cycle = self.cycle
        assert cycle is not None and response.stream is not None
        headers = [SERVER_HEADER, ("X-Request-Id", cycle.request_id), *response.headers]
        if response.content_type:
            headers.append(("Content-Type", response.content_type))
        sent = 0
        try:
            self._write(self.conn.send(_response_head(response.status, headers)))
            async for chunk in response.stream:
                if self.closed:
                    return
                if chunk:
                    self._write(self.conn.send(h11.Data(data=chunk)))
                    sent += len(chunk)
                await self.writable.wait()
            self._write(self.conn.send(h11.EndOfMessage()))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the head is out: all we can do is close
            log.exception("a streamed response failed")
            self._close()
            return
        finally:
            aclose = getattr(response.stream, "aclose", None)
            if aclose is not None:
                await aclose()  # stops the producer (e.g. generation) when the client left
        self._log_access(cycle, response.status, sent)
        self._finish_cycle()

    def _send_error(self, error: HTTPError, close: bool = False) -> None:
        rendered = error_response(error)
        self._send(HttpResponse(rendered.status, rendered.body, rendered.headers, ""), close)

    def _finish_cycle(self) -> None:
        """Keep the connection for the next request, or close it (one place decides)."""
        self.cycle = None
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is not h11.DONE:
            self._close()
            return
        self.conn.start_next_cycle()
        self.pipelined_bytes = 0
        self._arm_keepalive()
        if not self.writing_paused:
            self._resume_reading()
            self.handle_events()

    def _reject_malformed(self, exc: h11.RemoteProtocolError) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self._close()  # a response has started: all we can do is close
            return
        status = exc.error_status_hint
        error: HTTPError
        if status == 431:
            error = HeadersTooLarge("request headers too large")
        else:
            error = BadRequest("malformed HTTP request")
        if self.cycle is None:
            self.cycle = _Cycle(
                h11.Request(method="GET", target="/", headers=[("Host", "-")]), uuid.uuid4().hex
            )
        rendered = error_response(error)
        body = rendered.body
        headers = [
            SERVER_HEADER,
            ("X-Request-Id", self.cycle.request_id),
            *rendered.headers,
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ]
        try:
            self._write(self.conn.send(_response_head(error.status, headers)))
            self._write(self.conn.send(h11.Data(data=body)))
            self._write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass
        self._log_access(self.cycle, error.status, len(body))
        self.cycle = None
        self._close()

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the body is over the limit of {self.settings.max_body_bytes} bytes"
        )

    def _write(self, data: bytes | None) -> None:
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def _close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    # --- flow control and timers ------------------------------------------------------

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    def _arm_keepalive(self) -> None:
        self._cancel_keepalive()
        self.keepalive_timer = self.loop.call_later(
            self.settings.keepalive_timeout, self._on_keepalive_timeout
        )

    def _cancel_keepalive(self) -> None:
        if self.keepalive_timer is not None:
            self.keepalive_timer.cancel()
            self.keepalive_timer = None

    def _on_keepalive_timeout(self) -> None:
        if self.cycle is None and self.conn.their_state is h11.IDLE:
            self._close()

    def _log_access(self, cycle: _Cycle, status: int, size: int) -> None:
        if access_log.isEnabledFor(logging.INFO):
            request = cycle.request
            access_log.info(
                '%s "%s %s" %d %d %.1fms %s',
                _peer(self.transport),
                request.method.decode("ascii", "replace"),
                request.target.decode("ascii", "replace"),
                status,
                size,
                1000 * (time.perf_counter() - cycle.started),
                cycle.request_id,
            )


def _response_head(status: int, headers: list[tuple[str, str]]) -> h11.Response:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    return h11.Response(status_code=status, headers=headers, reason=reason)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"

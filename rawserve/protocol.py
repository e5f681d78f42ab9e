"""HTTP/1.1 over asyncio: an `asyncio.Protocol` driving an `h11.Connection`.

Bytes in (`data_received` → `h11.Connection.receive_data`), events out (`next_event`),
one request at a time per connection: while a response is pending, pipelined bytes wait
in h11's buffer, so requests are answered in order. It hands complete requests to the
app (an `Application`), never blocks and never imports torch. Every error becomes a
response through `rawserve.http.errors.error_response`, at most one per request: once a
response has started, an error can only close the connection.

What one connection may cost is bounded, whatever its client does:
- input: reading pauses once more than `READ_AHEAD_LIMIT` bytes wait unparsed, and
  resumes only when h11 needs data again, however many requests are pipelined (the rest
  waits in the kernel's buffers and the client's); the head size; the body size as sent
  (a chunked body's announced sizes, extensions and trailers count,
  `rawserve.http.chunked`);
- time: the head, body and keep-alive timeouts, and the write timeout: a client that
  reads none of its answer for `write_timeout` seconds is cut off;
- connections: past `max_connections`, a few more (`PROBE_RESERVE`) are taken for
  probes only (`/health`, `/ready` answered, anything else 503), then refused.

A connection is always in one `Phase`; `_enter` is the one transition, and it arms the
phase's deadline on the connection's single timer (`rawserve.http.timer`):

    IDLE ──first byte──▶ HEAD ──head──▶ BODY ──end of body──▶ RESPONDING ──answer──▶ IDLE
      │ keep-alive:       │ head timeout:  │ body timeout:                        │ or, after
      ▼ quiet close       ▼ 408            ▼ 408                                  ▼ the last one:
    CLOSED ◀──linger over or peer's FIN── LINGER (FIN sent, the peer's bytes drained)

A request answered without waiting (`Application.answer_now`, asked as soon as its head
is read: probes, refusals) has its body read and dropped, and goes from BODY straight
back to IDLE, without a task. LINGER exists so the peer's unread request bytes do not
turn into a reset that destroys our last answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Protocol

import h11

from rawserve.http.access_log import log_access
from rawserve.http.chunked import ChunkedMeter
from rawserve.http.cors import CorsPolicy
from rawserve.http.errors import (
    BadRequest,
    HeadersTooLarge,
    HTTPError,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    error_response,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http.flow_control import FlowControl
from rawserve.http.request_ids import new_request_id, request_id
from rawserve.http.timer import ConnectionTimer

log = logging.getLogger("rawserve.protocol")

SERVER_HEADER = ("Server", "rawserve")
READ_AHEAD_LIMIT = 64 * 1024  # bytes read but not yet parsed, per connection
LINGER_SECONDS = 2.0  # after our last response, how long we drain the peer's bytes
REFUSAL_LOG_INTERVAL = 10.0  # seconds between "too many connections" warnings
# Past --max-connections, this many more connections are taken, each for one probe: a
# liveness probe must not fail (and restart a healthy server) because idle clients hold
# every connection.
PROBE_RESERVE = 32
PROBE_PATHS = (b"/health", b"/ready")
SUPPORTED_VERSIONS = (b"1.0", b"1.1")
# Their states once a request was read whole (an Upgrade we decline by answering ends
# in MIGHT_SWITCH_PROTOCOL, then DONE).
_REQUEST_READ = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)
# A request starts with a method (an RFC 9110 token); anything else (a TLS ClientHello
# starts with 0x16, binary garbage) is refused at the first byte instead of waiting for
# a line end that may never come.
_TOKEN_BYTES = frozenset(
    b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


class Application(Protocol):
    """What the protocol needs from the app it serves (rawserve.api.app.App)."""

    @property
    def draining(self) -> bool:
        """The server is shutting down: every 5xx closes its connection."""
        ...

    @property
    def cors(self) -> CorsPolicy | None:
        """The origins whose pages may read the answers (None: no CORS); the protocol's
        own refusals to a parsed head follow it too."""
        ...

    def answer_now(self, request: HttpRequest) -> HttpResponse | None:
        """The response if it needs no waiting (a probe, a refusal), else None. Asked as
        soon as the request's head is read: its body is not there yet (and, if answered
        here, never kept). May raise HTTPError."""
        ...

    async def handle(self, request: HttpRequest) -> HttpResponse:
        """The response to any request; may raise HTTPError."""
        ...


class RequestObserver(Protocol):
    """Counts responses by route and status (rawserve.ops.metrics.Metrics)."""

    def observe_request(self, path: str, method: str, status: int, seconds: float) -> None: ...


class Phase(enum.Enum):
    IDLE = "idle"  # between requests; deadline: keep-alive, then a quiet close
    HEAD = "head"  # a request's first byte arrived; deadline: its head (408)
    BODY = "body"  # the head is accepted; deadline: its body (408)
    RESPONDING = "responding"  # the app has the request; no read deadline
    LINGER = "linger"  # our FIN is sent; deadline: the close
    CLOSED = "closed"


@dataclass(frozen=True)
class ProtocolSettings:
    max_body_bytes: int = 1024 * 1024
    max_head_bytes: int = 16 * 1024
    keepalive_timeout: float = 5.0  # idle between requests; expiry closes quietly
    head_timeout: float = 10.0  # from a request's first byte to the end of its head
    body_timeout: float = 30.0  # from the end of the head to the end of the body
    max_connections: int = 1000  # open connections; past it new ones get 503 (0: no cap)
    write_timeout: float = 30.0  # a client that reads nothing of its answer this long: cut off

    @functools.cached_property
    def deadlines(self) -> dict[Phase, float]:
        """Each phase's deadline, in seconds from entering it (none: no deadline)."""
        return {
            Phase.IDLE: self.keepalive_timeout,
            Phase.HEAD: self.head_timeout,
            Phase.BODY: self.body_timeout,
            Phase.LINGER: LINGER_SECONDS,
        }


@dataclass
class ServerState:
    """Shared by every connection of one server."""

    metrics: RequestObserver | None = None
    connections: set[HttpProtocol] = field(default_factory=set)
    probe_connections: set[HttpProtocol] = field(default_factory=set)  # past the cap
    refused: int = 0  # connections refused past `max_connections`
    last_refusal_log: float = float("-inf")

    def busy_tasks(self) -> set[asyncio.Task[None]]:
        """The tasks of requests the app is still working on, on every connection."""
        return {
            connection.cycle.task
            for connection in self.connections
            if connection.cycle is not None
            and connection.cycle.task is not None
            and not connection.cycle.task.done()
        }

    def close_all(self) -> None:
        for connection in [*self.connections, *self.probe_connections]:
            connection.close()


class _Cycle:
    """One request/response exchange. `request` is None for an error answered before a
    request head could be parsed (malformed, head timeout, connection refused)."""

    def __init__(self, request: h11.Request | None, request_id: str, origin: str | None = None):
        self.request = request
        self.request_id = request_id
        self.origin = origin  # the head's Origin (CORS)
        self.body: list[bytes] = []
        self.body_size = 0
        self.started = time.perf_counter()
        self.task: asyncio.Task[None] | None = None
        self.response_started = False
        self.chunks: ChunkedMeter | None = None  # a chunked body's size on the wire
        self.head: HttpRequest | None = None  # the request as the app sees it; body last
        self.early: HttpResponse | None = None  # the answer decided from the head
        self.keep_alive = False  # HTTP/1.1 without Connection: close (from the head)

    @property
    def is_head(self) -> bool:
        return self.request is not None and self.request.method == b"HEAD"


class HttpProtocol(asyncio.Protocol):
    def __init__(
        self,
        app: Application,
        settings: ProtocolSettings = ProtocolSettings(),
        state: ServerState | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        # server-wide
        self.app = app
        self.settings = settings
        self.state = state or ServerState()
        self.loop = loop or asyncio.get_event_loop()
        # per connection
        self.conn = self._new_h11()
        self.transport: asyncio.Transport | None = None
        self.flow: FlowControl | None = None
        self.phase = Phase.IDLE
        self.timer = ConnectionTimer(self.loop, self._on_deadline)
        self.eof_seen = False  # the peer has half-closed
        self.probe_only = False  # taken past the connection cap: one probe, then close
        self.write_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        self.read_ahead = 0  # bytes received since h11 last needed data
        self.handling_events = False  # handle_events is running (guards re-entry)
        # per request
        self.cycle: _Cycle | None = None

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.settings.max_head_bytes)

    # --- phases -----------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        """Move to `phase` and arm its deadline (the one place that does both)."""
        self.phase = phase
        delay = self.settings.deadlines.get(phase)
        if phase is Phase.CLOSED:
            self.timer.stop()
        elif delay is None:
            self.timer.clear()
        else:
            self.timer.set(delay)

    def _on_write_timeout(self) -> None:
        """The client has read nothing of its answer for `write_timeout` seconds: drop
        what waits to be written (closing would wait for it) and the connection."""
        self.write_timer = None
        log.info(
            "closing a connection from %s: it read nothing for %.0f s (--write-timeout)",
            _peer(self.transport),
            self.settings.write_timeout,
        )
        self._enter(Phase.CLOSED)
        if self.transport is not None:
            self.transport.abort()

    def _stop_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _on_deadline(self) -> None:
        """The current phase's deadline passed."""
        if self.phase is Phase.IDLE:
            self.close()  # an idle keep-alive connection: close quietly
        elif self.phase is Phase.HEAD:
            self._fail(RequestTimeout("the request head was not received in time"))
        elif self.phase is Phase.BODY:
            self._fail(RequestTimeout("the request body was not received in time"))
        elif self.phase is Phase.LINGER and self.transport is not None:
            self.transport.close()

    @property
    def _reading(self) -> bool:
        """Whether incoming bytes are parsed now (else they wait, or are drained)."""
        return self.phase in (Phase.IDLE, Phase.HEAD, Phase.BODY)

    # --- asyncio.Protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.flow = FlowControl(transport)
        cap = self.settings.max_connections
        if not cap or len(self.state.connections) < cap:
            self.state.connections.add(self)
        elif len(self.state.probe_connections) < PROBE_RESERVE:
            self.probe_only = True
            self.state.probe_connections.add(self)
        else:
            self._refuse()
            return
        self._enter(Phase.IDLE)

    def data_received(self, data: bytes) -> None:
        if self.phase in (Phase.LINGER, Phase.CLOSED):
            return  # lingering after our last response: drain and drop
        self.read_ahead += len(data)
        if self.phase is Phase.RESPONDING:
            # Pipelined bytes wait in h11's buffer; keep reading (to notice a
            # disconnect) until too much piles up.
            self.conn.receive_data(data)
            if self.read_ahead > READ_AHEAD_LIMIT:
                self._flow.pause_reading()
            return
        if self.phase is Phase.IDLE:
            self._enter(Phase.HEAD)
            if data[0] not in _TOKEN_BYTES:
                self._fail(BadRequest("this port speaks plain HTTP/1.1"))
                return
        elif self.phase is Phase.BODY and not self._measure_chunks(data):
            return
        self.conn.receive_data(data)
        self.handle_events()

    def eof_received(self) -> bool | None:
        self.eof_seen = True
        if not self._reading:
            return None  # done lingering, or the client left before its answer: close
        self.conn.receive_data(b"")
        self.handle_events()
        return None  # the transport closes once what we wrote is flushed

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(Phase.CLOSED)
        self._stop_write_timer()
        self.state.connections.discard(self)
        self.state.probe_connections.discard(self)
        if self.flow is not None:
            self.flow.release()  # a streaming response waiting to write must see the close
        if self.cycle is not None and self.cycle.task is not None:
            self.cycle.task.cancel()  # the client is gone: withdraw its work

    def pause_writing(self) -> None:
        self._flow.pause_writing()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(
                self.settings.write_timeout, self._on_write_timeout
            )

    def resume_writing(self) -> None:
        self._stop_write_timer()
        self._flow.resume_writing()
        if self.cycle is None and self._reading:
            self.handle_events()  # reading resumes once h11 needs data

    # --- reading ----------------------------------------------------------------------

    def handle_events(self) -> None:
        """Process what h11 has buffered until it needs data or a request is pending."""
        if self.handling_events:
            return  # a request answered at once finished its cycle: the running loop goes on
        self.handling_events = True
        try:
            self._handle_events()
        finally:
            self.handling_events = False

    def _handle_events(self) -> None:
        while self._reading:
            if self.cycle is None and self._flow.write_paused:
                self._flow.pause_reading()  # the peer is not reading its answers: wait
                return
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._fail(_protocol_error(exc))
                return
            if event is h11.NEED_DATA:  # what was read ahead is parsed: read on
                self.read_ahead = 0
                self._flow.resume_reading()
                return
            if event is h11.PAUSED:
                self._flow.pause_reading()
                return
            if isinstance(event, h11.Request):
                self._on_request(event)
            elif isinstance(event, h11.Data):
                self._on_body(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._on_request_complete()
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def _on_request(self, event: h11.Request) -> None:
        fields = list(event.headers)  # h11's Headers iterate slowly: one pass, kept
        given_id = _header(fields, b"x-request-id")
        self.cycle = _Cycle(event, request_id(given_id), _header(fields, b"origin"))
        self._enter(Phase.BODY)
        error = self._check_head(event, fields)
        if error is None and self.probe_only and not _is_probe(event):
            error = ServiceUnavailable("too many open connections", retry_after=1)
        if error is not None:
            self._fail(error)
            return
        if _header(fields, b"transfer-encoding") is not None:
            self.cycle.chunks = ChunkedMeter(self.settings.max_body_bytes)
            # what came with the head (copied once per chunked request)
            if not self._measure_chunks(self.conn.trailing_data[0]):
                return
        cycle = self.cycle
        cycle.head = _head_request(event, fields, cycle.request_id)
        cycle.keep_alive = _keeps_alive(event, fields)
        try:
            cycle.early = self.app.answer_now(cycle.head)
        except Exception as exc:  # noqa: BLE001 - error_response logs what is unexpected
            cycle.early = error_response(exc)
        if cycle.early is not None and self.conn.they_are_waiting_for_100_continue:
            # no 100: the client does not send the body, so the connection ends after
            self._enter(Phase.RESPONDING)
            self._send(cycle, cycle.early)
        elif self.conn.they_are_waiting_for_100_continue:
            # Only now that the head is accepted: a refused request never sees a 100.
            self._write(
                self.conn.send(
                    h11.InformationalResponse(status_code=100, headers=[], reason="Continue")
                )
            )

    def _check_head(
        self, event: h11.Request, fields: list[tuple[bytes, bytes]]
    ) -> HTTPError | None:
        """Refuse what h11 lets through but a hardened origin server must not."""
        if event.http_version not in SUPPORTED_VERSIONS:
            return BadRequest("only HTTP/1.0 and HTTP/1.1 are supported")
        if _head_size(event, fields) > self.settings.max_head_bytes:
            # h11 bounds only a head still incomplete; one that came whole is checked here.
            return HeadersTooLarge("request headers too large")
        if event.method == b"CONNECT":
            return BadRequest("CONNECT is not supported")  # a 2xx would switch protocols
        length = _header(fields, b"content-length")
        chunked = _header(fields, b"transfer-encoding") is not None
        if chunked and (length is not None or event.http_version == b"1.0"):
            # Two framings (or chunked on HTTP/1.0) is how requests get smuggled.
            return BadRequest("conflicting Content-Length and Transfer-Encoding")
        if length is not None and int(length) > self.settings.max_body_bytes:
            return self._too_large()
        return None

    def _measure_chunks(self, data: bytes) -> bool:
        """Count a chunked body's bytes as sent (announced sizes, extensions, trailers);
        False once over the body limit (answered 413)."""
        chunks = self.cycle.chunks if self.cycle is not None else None
        if chunks is None or chunks.done:
            return True
        chunks.feed(data)
        if chunks.over:
            self._fail(self._too_large())
            return False
        return True

    def _on_body(self, data: bytes) -> None:
        cycle = self.cycle
        assert cycle is not None
        cycle.body_size += len(data)
        if cycle.body_size > self.settings.max_body_bytes:
            self._fail(self._too_large())
            return
        if cycle.early is None:  # else it is answered already: its body is not needed
            cycle.body.append(data)

    def _on_request_complete(self) -> None:
        cycle = self.cycle
        assert cycle is not None and cycle.head is not None
        self._enter(Phase.RESPONDING)
        if cycle.early is not None:  # answered from its head (a probe, a refusal): no task
            self._send(cycle, cycle.early)
            return
        request = cycle.head
        request.body = b"".join(cycle.body)
        cycle.body = []
        cycle.task = self.loop.create_task(self._respond(cycle, request))

    async def _respond(self, cycle: _Cycle, request: HttpRequest) -> None:
        try:
            response = await self.app.handle(request)
        except asyncio.CancelledError:
            return  # the client left: its work is withdrawn, nobody to answer
        except Exception as exc:  # noqa: BLE001 - error_response logs what is unexpected
            response = error_response(exc)
        if self.cycle is not cycle or self.phase is not Phase.RESPONDING:
            await _close_stream(response)
            return
        if response.stream is not None:
            await self._send_stream(cycle, response)
        else:
            self._send(cycle, response)

    # --- writing ----------------------------------------------------------------------

    def _send(self, cycle: _Cycle, response: HttpResponse, close: bool = False) -> None:
        """Send a whole response, then keep the connection or close it."""
        if not close and self._refused_in_this_pass(cycle, response):
            self._send_refusal(cycle, response)
            return
        if not self._start_response(cycle):
            return
        # A 503 (queue full, loading) keeps the connection unless the server is draining:
        # under overload, closing would make every refused client pay a new connection.
        failed = response.status >= 500 and (response.status != 503 or self.app.draining)
        close = close or failed or self.probe_only or self.conn.their_state not in _REQUEST_READ
        headers = self._response_headers(cycle, response)
        headers.append(("Content-Length", str(len(response.body))))
        if close:
            headers.append(("Connection", "close"))
        try:
            pieces = [self.conn.send(_response_head(response.status, headers))]
            if not cycle.is_head and response.body:
                pieces.append(self.conn.send(h11.Data(data=response.body)))
            pieces.append(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            log.exception("could not send a response")
            self.close()
            return
        self._write_all(pieces)  # one send for the whole response
        self._log_access(cycle, response.status, len(response.body))
        self._finish_cycle(close)

    async def _send_stream(self, cycle: _Cycle, response: HttpResponse) -> None:
        """Send a body produced piece by piece (chunked), waiting while the peer is slow.

        Once the head is out, an error can only close the connection.
        """
        assert response.stream is not None
        if not self._start_response(cycle):
            await _close_stream(response)
            return
        close = response.status >= 500
        headers = self._response_headers(cycle, response)
        if close:
            headers.append(("Connection", "close"))
        sent = 0
        try:
            self._write(self.conn.send(_response_head(response.status, headers)))
            if not cycle.is_head:
                async for chunk in response.stream:
                    if self.phase is not Phase.RESPONDING:
                        return
                    if chunk:
                        self._write(self.conn.send(h11.Data(data=chunk)))
                        sent += len(chunk)
                    await self._flow.drain()
            if self.phase is not Phase.RESPONDING:
                return
            self._write(self.conn.send(h11.EndOfMessage()))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the head is out: all we can do is close
            log.exception("a streamed response failed")
            self.close()
            return
        finally:
            await _close_stream(response)  # stops the producer (e.g. generation) if we left
        self._log_access(cycle, response.status, sent)
        self._finish_cycle(close)

    def _start_response(self, cycle: _Cycle) -> bool:
        """Mark the one response of `cycle` as started; False (and close) if it already was."""
        if self.phase in (Phase.LINGER, Phase.CLOSED):
            return False
        if cycle.response_started or cycle is not self.cycle:
            log.error("refusing a second response for request %s", cycle.request_id)
            self.close()
            return False
        cycle.response_started = True
        return True

    def _response_headers(self, cycle: _Cycle, response: HttpResponse) -> list[tuple[str, str]]:
        headers = [SERVER_HEADER, ("X-Request-Id", cycle.request_id)]
        if response.content_type:
            headers.append(("Content-Type", response.content_type))
        headers += response.headers
        headers += self._cors_headers(cycle, response)
        if not any(name.lower() == "server-timing" for name, _ in response.headers):
            elapsed_ms = 1000 * (time.perf_counter() - cycle.started)
            headers.append(("Server-Timing", f"total;dur={elapsed_ms:.2f}"))
        return headers

    def _cors_headers(self, cycle: _Cycle, response: HttpResponse) -> list[tuple[str, str]]:
        """What lets the page of an allowed origin read this answer, where the app did
        not add it (the protocol's own refusals)."""
        cors = self.app.cors
        if cors is None or cycle.origin is None:
            return []
        return cors.headers_for(cycle.origin, response.headers)

    def _refused_in_this_pass(self, cycle: _Cycle, response: HttpResponse) -> bool:
        """A 503 decided from the request's head (the queue is full, the model loading),
        on a connection that stays open: written by hand, the cheap way."""
        return (
            response.status == 503
            and response is cycle.early
            and not cycle.is_head
            and not self.app.draining
            and not self.probe_only
            and cycle.keep_alive
            and self.conn.their_state is h11.DONE
            and self.conn.our_state is h11.SEND_RESPONSE
        )

    def _send_refusal(self, cycle: _Cycle, response: HttpResponse) -> None:
        """Under overload most answers are these refusals, so they skip h11's writer (a
        third of a refusal's cost): their bytes are made once per distinct refusal, and
        h11 starts afresh for the next request with what it had read ahead."""
        if not self._start_response(cycle):
            return
        elapsed_ms = 1000 * (time.perf_counter() - cycle.started)
        fixed = (*response.headers, *self._cors_headers(cycle, response))
        prefix = _response_prefix(response.status, response.content_type, fixed, len(response.body))
        self._write_all(
            [
                prefix,
                b"X-Request-Id: %s\r\nServer-Timing: total;dur=%.2f\r\n\r\n"
                % (cycle.request_id.encode(), elapsed_ms),
                response.body,
            ]
        )
        self._log_access(cycle, response.status, len(response.body))
        unread, closed = self.conn.trailing_data
        self.conn = self._new_h11()
        if unread:
            self.conn.receive_data(unread)
        if closed:
            self.conn.receive_data(b"")
        self._finish_cycle(close=False, started=True, unread=bool(unread))

    def _finish_cycle(self, close: bool, *, started: bool = False, unread: bool = False) -> None:
        """Keep the connection for the next request, or close it (one place decides).
        `started`: h11 was started afresh (with `unread` bytes) instead of recycled."""
        self.cycle = None
        if not started:
            if (
                close
                or self.conn.our_state is h11.MUST_CLOSE
                or self.conn.their_state is not h11.DONE
            ):
                self._close_gracefully()
                return
            self.conn.start_next_cycle()
            unread = bool(self.conn.trailing_data[0])
        # the next request may be (partly) here already
        self._enter(Phase.HEAD if unread else Phase.IDLE)
        if not self._flow.write_paused:  # else resume_writing carries on
            self.handle_events()  # reading resumes once h11 needs data

    def _fail(self, error: HTTPError) -> None:
        """Answer a connection-level error (malformed, too large, too slow), then close."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.close()  # a response has started: all we can do is close
            return
        if self.conn.our_state is h11.SEND_RESPONSE or self.conn.their_state is h11.ERROR:
            # h11 can frame the answer (it knows the request, or lets us answer its error).
            if cycle is None:
                cycle = self.cycle = _Cycle(None, new_request_id())
            self._send(cycle, error_response(error), close=True)
            return
        self._send_raw_and_close(_Cycle(None, new_request_id()), error)

    def _send_raw_and_close(self, cycle: _Cycle, error: HTTPError) -> None:
        """Answer when h11 has no request to answer (a head timeout, a refused connection)."""
        rendered = error_response(error)
        headers = [
            SERVER_HEADER,
            ("X-Request-Id", cycle.request_id),
            ("Content-Type", rendered.content_type),
            *rendered.headers,
            ("Server-Timing", "total;dur=0.00"),
            ("Content-Length", str(len(rendered.body))),
            ("Connection", "close"),
        ]
        head = f"HTTP/1.1 {rendered.status} {_reason(rendered.status)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
        self._write(head.encode("latin-1") + rendered.body)
        self._log_access(cycle, rendered.status, len(rendered.body))
        self._close_gracefully()

    def _refuse(self) -> None:
        self.state.refused += 1
        now = time.monotonic()
        if now - self.state.last_refusal_log >= REFUSAL_LOG_INTERVAL:
            self.state.last_refusal_log = now
            log.warning(
                "refusing connections: %d open (--max-connections); %d refused so far",
                len(self.state.connections),
                self.state.refused,
            )
        error = ServiceUnavailable("too many open connections", retry_after=1)
        self._send_raw_and_close(_Cycle(None, new_request_id()), error)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the body is over the limit of {self.settings.max_body_bytes} bytes"
        )

    def _write(self, data: bytes | None) -> None:
        if data:
            self._write_all([data])

    def _write_all(self, pieces: Iterable[bytes | None]) -> None:
        """Write, unless our side is done writing (after our FIN, or the close)."""
        transport = self.transport
        if transport is not None and self.phase not in (Phase.LINGER, Phase.CLOSED):
            transport.writelines([piece for piece in pieces if piece])

    def close(self) -> None:
        """Close at once (the peer left, went idle, an answer broke off, or shutdown)."""
        self._enter(Phase.CLOSED)
        if self.transport is not None:
            self.transport.close()

    def _close_gracefully(self) -> None:
        """After our last response: FIN, then drain the peer's bytes until its FIN or
        `LINGER_SECONDS`, so unread request bytes do not reset the connection (a reset
        can destroy the answer before the client reads it)."""
        if self.phase in (Phase.LINGER, Phase.CLOSED):
            return
        assert self.transport is not None
        if self.eof_seen or not self.transport.can_write_eof():
            self.close()
            return
        self._enter(Phase.LINGER)
        self.transport.write_eof()
        self._flow.resume_reading()

    @property
    def _flow(self) -> FlowControl:
        assert self.flow is not None, "connection_made comes first"
        return self.flow

    # --- logging ----------------------------------------------------------------------

    def _log_access(self, cycle: _Cycle, status: int, size: int) -> None:
        request = cycle.request
        seconds = time.perf_counter() - cycle.started
        method = request.method.decode("ascii", "replace") if request else "-"
        target = request.target.decode("ascii", "replace") if request else "-"
        if self.state.metrics is not None:
            self.state.metrics.observe_request(target.partition("?")[0], method, status, seconds)
        log_access(_peer(self.transport), method, target, status, size, seconds, cycle.request_id)


def _keeps_alive(event: h11.Request, fields: list[tuple[bytes, bytes]]) -> bool:
    """HTTP/1.1 without `Connection: close` (what h11 decides, read from the head)."""
    if event.http_version != b"1.1":
        return False
    return not any(name == b"connection" and b"close" in value.lower() for name, value in fields)


@functools.lru_cache(maxsize=64)
def _response_prefix(
    status: int, content_type: str, headers: tuple[tuple[str, str], ...], length: int
) -> bytes:
    """A response's status line and fixed headers, as h11 would write them (the values
    are the server's own, never a client's)."""
    lines = [f"HTTP/1.1 {status} {_reason(status)}", f"{SERVER_HEADER[0]}: {SERVER_HEADER[1]}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


def _head_request(
    event: h11.Request, fields: list[tuple[bytes, bytes]], request_id: str
) -> HttpRequest:
    """The request as the app sees it, from its head (the body is filled in once read)."""
    target = event.target.decode("ascii", "replace")
    path, _, query = target.partition("?")
    return HttpRequest(
        method=event.method.decode("ascii", "replace"),
        path=path,
        query=query,
        headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in fields],
        body=b"",
        request_id=request_id,
        http_version=event.http_version.decode("ascii", "replace"),
    )


def _is_probe(event: h11.Request) -> bool:
    return event.method in (b"GET", b"HEAD") and event.target.partition(b"?")[0] in PROBE_PATHS


def _head_size(event: h11.Request, fields: list[tuple[bytes, bytes]]) -> int:
    request_line = len(event.method) + len(event.target) + len(b"  HTTP/1.1\r\n")
    return request_line + sum(len(name) + len(value) + 4 for name, value in fields) + 2


def _protocol_error(exc: h11.RemoteProtocolError) -> HTTPError:
    """What h11 could not parse, as a typed error (details go to the debug log only)."""
    log.debug("malformed request: %s", exc)
    if exc.error_status_hint == 431:
        return HeadersTooLarge("request headers too large")
    return BadRequest("malformed HTTP request")


async def _close_stream(response: HttpResponse) -> None:
    if response.stream is not None:
        await response.stream.aclose()


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _response_head(status: int, headers: list[tuple[str, str]]) -> h11.Response:
    return h11.Response(status_code=status, headers=headers, reason=_reason(status))


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _peer(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"

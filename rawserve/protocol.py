"""HTTP/1.1 over asyncio: an `asyncio.Protocol` driving an `h11.Connection`.

Bytes in (`data_received` → `h11.Connection.receive_data`), events out (`next_event`),
one request at a time per connection: while a response is pending, pipelined bytes wait
in h11's buffer, so requests are answered in order. It hands complete requests to the
app (an `Application`), never blocks and never imports torch. Every error becomes a
response, in its route's shape (`Application.refusal_renderer`, else
`rawserve.http.errors.error_response`), at most one per request: once a response has
started, an error can only close the connection.

Beside it, by job: the request cycle (`rawserve.http.cycle`), the refusals it makes on
its own (`rawserve.http.refusals`), and the head of every answer
(`rawserve.http.response_head`). One writer (`_send`) writes every whole answer, however
it is framed; once an answer is written the connection reads its next request on a
fresh h11 (`_restart_h11`, the head written by hand), or `_finish_cycle` keeps or closes
it (a connection also closes where an answer cannot be finished or a deadline passes
between requests).

What one connection may cost is bounded whatever its client does (the limits, and the
phases with their deadlines: `rawserve.http.limits`).

A connection is always in one `Phase`; `_enter` is the one transition, and it arms the
phase's deadline on the connection's single timer (`rawserve.http.timer`). Over TLS it
starts in HANDSHAKE, holding its seat from the TCP accept (`rawserve.http.handshake`):

    HANDSHAKE ──done──▶ IDLE (as below); failed or timed out: CLOSED

    IDLE ──first byte──▶ HEAD ──head──▶ BODY ──end of body──▶ RESPONDING ──answer──▶ IDLE
      │ keep-alive:       │ head timeout:  │ body timeout:                        │ or, after
      ▼ quiet close       ▼ 408            ▼ 408                                  ▼ the last one:
    CLOSED ◀──linger over or peer's FIN── LINGER (FIN sent, the peer's bytes drained)

A request answered without waiting (`Application.answer_now`, asked as soon as its head
is read: probes, refusals) has its body read and dropped, without a task: it goes from
BODY to RESPONDING and on as any answer does (to LINGER, where it refused an `Expect`).
LINGER exists so the peer's unread request bytes do not turn into a reset that destroys
our last answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Iterable
from typing import Protocol, cast

import h11

from rawserve.http import refusals
from rawserve.http.access_log import RETRY_HEADER, log_access, retry_count
from rawserve.http.chunked import ChunkedMeter
from rawserve.http.content_coding import codings, decoded
from rawserve.http.cors import CorsPolicy
from rawserve.http.cycle import (
    Cycle,
    has_content,
    head_request,
    header,
    header_list,
    is_probe,
    keeps_alive,
    line_request,
    routed_path,
)
from rawserve.http.errors import (
    ErrorRenderer,
    HTTPError,
    InternalError,
    as_http_error,
    error_response,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http.flow_control import (
    ANSWER_UNSENT_BYTES,
    STREAM_UNSENT_BYTES,
    FlowControl,
    Transport,
    bound_unsent,
    has_failed,
    reset_on_close,
    tls_write_buffer,
    unsent_in_kernel,
)
from rawserve.http.handshake import begun_now
from rawserve.http.head_lines import HeadLines
from rawserve.http.limits import (
    LINGER_SECONDS,
    PROBE_RESERVE,
    PROBE_SEATS,
    READ_AHEAD_LIMIT,
    RESET_LOOK_SECONDS,
    Phase,
    ProtocolSettings,
    Seats,
    ServerState,
    refusals_bound,
)
from rawserve.http.probe_peek import Waiting, what_waits
from rawserve.http.request_ids import new_request_id, request_id
from rawserve.http.response_head import (
    Fields,
    body_framing,
    content_length,
    fixed_fields,
    h11_head,
    render_fixed,
    render_kept,
    render_request_fields,
    request_fields,
)
from rawserve.http.timer import ConnectionTimer
from rawserve.shared.logs import REQUEST_ID

log = logging.getLogger("rawserve.protocol")

CAP_LOG_INTERVAL = 10.0  # seconds between two warnings that the connection cap is reached
# the access line of a request whose client left before its answer began (as nginx logs it)
CLIENT_CLOSED = 499
# pipelined requests one connection has read in a pass of the event loop, at most
REQUESTS_PER_PASS = 32
# seconds between looks at an answer still being written once the idle or head deadline
# has come (`HttpProtocol._restart_deadline`): that time starts within this of its end,
# and a client that takes none of it between looks is timed by --write-timeout
ANSWER_GOING_CHECK = 0.5
# TLS: the most of an answer written to the transport at once (`_write_all`), and how
# often a closing connection looks whether its answers are written (`_close_once_written`)
TLS_WRITE_SLICE = 64 * 1024
WRITTEN_CHECK = 0.05
# Their states once a request was read whole (an Upgrade we decline by answering ends
# in MIGHT_SWITCH_PROTOCOL, then DONE).
_REQUEST_READ = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)
# A request starts with a method (an RFC 9110 token); anything else (a TLS ClientHello
# starts with 0x16, binary garbage) is refused at the first byte instead of waiting for
# a line end that may never come.
_TOKEN_BYTES = frozenset(
    b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
# Empty lines before a request line are skipped (RFC 9112 section 2.2: some clients send
# a CRLF after a POST body); h11 refuses them.
_EMPTY_LINE = b"\r\n"


class Application(Protocol):
    """What the protocol needs from the app it serves (rawserve.api.app.App)."""

    @property
    def draining(self) -> bool:
        """The server is shutting down: every answer closes its connection."""
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

    def deadline_seconds(self, request: HttpRequest) -> float | None:
        """Seconds the request may take from its head (None: no deadline of its own): its
        body is not waited for past them."""
        ...

    def refusal_renderer(self, request: HttpRequest) -> ErrorRenderer | None:
        """How the protocol's own refusals of a request (its framing, size, coding) are
        shaped where its route's clients read only a shape of their own (OpenAI's object
        on /v1/...), else None: rawserve's shape."""
        ...

    async def handle(self, request: HttpRequest) -> HttpResponse:
        """The response to any request; may raise HTTPError."""
        ...


class HttpProtocol(asyncio.Protocol):
    def __init__(
        self,
        app: Application,
        settings: ProtocolSettings | None = None,
        state: ServerState | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        # server-wide
        self.app = app
        self.settings = settings or ProtocolSettings()
        self.state = state or ServerState()
        self.loop = loop or asyncio.get_event_loop()
        self.tls = tls  # each connection upgrades itself, once it has its seat
        # per connection
        self.conn = self._new_h11()
        self.transport: Transport | None = None
        # the client's address, read as it connects: once it is gone, none is to be read
        self.peername: object = None
        self.flow: FlowControl | None = None
        self.phase = Phase.IDLE
        # since when a deadline's looks have found an answer still being written and
        # none of it taken (None: none found), and how much of it waited at the last look
        self.answer_going: float | None = None
        self.unsent_at_look = 0
        self.timer = ConnectionTimer(self.loop, self._on_deadline)
        self.eof_seen = False  # the peer has half-closed
        self.probe_only = False  # taken past the connection cap: one probe, then close
        self.seats = Seats()  # the seats it holds (none yet; one of the state's once taken)
        self.read_ahead = 0  # bytes received since h11 last needed data
        self.reset_look: asyncio.TimerHandle | None = None  # (`_look_for_a_reset`)
        # the answer written last, and the bytes a write timeout left unsent: its line
        # names that answer, and a stream cut there logs what it sent
        self.last_request_id = "-"
        self.unsent = 0
        self.handling_events = False  # handle_events is running (guards re-entry)
        self.handshake: asyncio.Future[None] | None = None
        # under a TLS connection's transport, once upgraded: the socket's, which holds
        # what TLS has encrypted and the socket has not yet taken
        self.socket_transport: Transport | None = None
        # what the client sent between the handshake's end and our seeing it end
        self.handshake_data: list[bytes] = []
        # per request
        self.cycle: Cycle | None = None
        self.head_started = 0.0  # when the head now being read began to come
        self.head_lines = HeadLines()  # its lines so far, counted before h11 parses them

    def _new_h11(self) -> h11.Connection:
        return h11.Connection(h11.SERVER, max_incomplete_event_size=self.settings.max_head_bytes)

    # --- phases -----------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        """Move to `phase` and arm its deadline (the one place that does both)."""
        self.phase = phase
        self.answer_going = None
        if phase is Phase.HEAD:  # (a pipelined head too: its reading starts now)
            self.head_started = time.perf_counter()
            self.head_lines = HeadLines()
        # an idle one gives way past the cap, as one silent in its TLS handshake does
        waiting = phase in (Phase.IDLE, Phase.HANDSHAKE)
        self.seats.mark(self, self.loop.time() if waiting else None)
        delay = self.settings.deadlines.get(phase)
        if phase is Phase.CLOSED:
            self.timer.stop()
        elif delay is None:
            self.timer.clear()
        else:
            self.timer.set(delay)

    def _on_write_timeout(self) -> None:
        """The answers found no room to be written for `write_timeout` seconds (the client
        reads slower than they come, or not at all): drop what waits to be written
        (closing would wait for it, or leave the kernel holding it) and the connection.
        The line says how much of the answers was never sent, the kernel's part too
        (their access lines, written as they were queued, give their whole size) and
        names the last one."""
        unsent = self._unsent()
        self.unsent = unsent
        log.info(
            "closing a connection from %s: its answers waited %.0f s for room to be written "
            "(--write-timeout: it reads slower than they come, or not at all); "
            "%d bytes of its answers were not sent (the last: request %s)",
            _peer(self.peername),
            self.settings.write_timeout,
            unsent,
            self.last_request_id,
            extra={"request_id": self.last_request_id},
        )
        self._enter(Phase.CLOSED)
        self._flow.release()  # its own timer too: one cut, one line, whichever saw it first
        self.reset()

    def _on_deadline(self) -> None:
        """The current phase's deadline passed."""
        watched = self.phase in (Phase.IDLE, Phase.HEAD, Phase.LINGER)
        unsent = self._unsent() if watched else 0
        if unsent:  # (a last answer too: closed, the kernel would keep it for minutes)
            self._watch_answer_going(unsent)  # not the client's time yet
        elif self.answer_going is not None and self.phase is not Phase.LINGER:
            self._restart_deadline()  # gone since the last look: its time starts now
        elif self.phase is Phase.IDLE:
            self.close()  # an idle keep-alive connection: close quietly
        elif self.phase is Phase.HEAD:
            self._fail(refusals.too_slow("head"))
        elif self.phase is Phase.BODY and self.cycle is not None and self.cycle.early is not None:
            # answered from its head already (503 loading, a 404): that answer, now, not a
            # 408 for a body it would never read (the client waited --body-timeout for it)
            self._send(self.cycle, self.cycle.early, close=True)
        elif self.phase is Phase.BODY:
            due = self.cycle is not None and self.cycle.body_due
            self._fail(refusals.deadline_passed_in_body() if due else refusals.too_slow("body"))
        elif self.phase is Phase.LINGER:
            self._close_transport()

    def _watch_answer_going(self, unsent: int) -> None:
        """The idle or head deadline found the last answer still being written
        (`_restart_deadline`): look again soon, for as long as its client takes some of
        it between looks; one that takes none for --write-timeout is cut off, as a
        stalled write is. Timed from the first look alone, a client reading a 1.4 MB
        answer steadily was closed under its next request; and one the kernel's send
        buffer took whole was closed normally, the socket kept with it for minutes."""
        now = self.loop.time()
        if self.answer_going is None or unsent < self.unsent_at_look:
            self.answer_going = now  # some taken since the last look: timed anew
        self.unsent_at_look = unsent
        if now - self.answer_going >= self.settings.write_timeout:
            self._on_write_timeout()
        else:
            self.timer.set(ANSWER_GOING_CHECK)

    def _restart_deadline(self) -> None:
        """Count the idle or head deadline anew: the last answer is still being written
        to a client that reads it slowly (--write-timeout bounds that). Counted from the
        answer's queueing, a 1.8 MB answer read in 11 s left the connection closed under
        the client's next request, and pipelined heads the server held unread while it
        could not write were refused 408 "not received in time". The idle time starts
        once the answer has gone, as nginx's keepalive_timeout does."""
        self.answer_going = None
        if self.phase in (Phase.IDLE, Phase.HEAD):
            self.timer.set(self.settings.deadlines[self.phase])

    @property
    def _reading(self) -> bool:
        """Whether incoming bytes are parsed now (else they wait, or are drained)."""
        return self.phase in (Phase.IDLE, Phase.HEAD, Phase.BODY)

    # --- asyncio.Protocol callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Any transport with the methods `Transport` names (uvloop's are no asyncio.Transport).
        self.transport = cast(Transport, transport)
        self.peername = transport.get_extra_info("peername")
        self.flow = self._flow_control()
        connections, cap = self.state.connections, self.settings.max_connections
        full = bool(cap) and len(connections) >= cap  # a seat only in place of an idle one
        now = self.loop.time()
        if connections.take(self, cap, now):
            self.seats = connections
            if full:
                self._warn_at_cap("idle", "closing the connection idle longest for each new one")
        elif not self._seated_for_a_probe(transport, now):
            self._refuse()
            return
        bound_unsent(self.transport, ANSWER_UNSENT_BYTES)
        if self.tls is None:
            self._enter(Phase.IDLE)
        else:
            self._enter(Phase.HANDSHAKE)
            self.handshake = begun_now(self._handshake(self.transport, self.tls), self.loop)

    def _seated_for_a_probe(self, transport: asyncio.BaseTransport, now: float) -> bool:
        """Past the cap: seated for one probe, in the probes' reserve; where a flood of
        new connections holds it, a probe's whole head already waiting may take a seat
        past it (up to PROBE_SEATS: looked at only then). Anything else on such a seat is
        read and refused in its route's shape (over TLS the bytes tell nothing)."""
        seats = self.state.probe_connections
        if not seats.take(self, PROBE_RESERVE, now) and (
            self.tls is not None
            or what_waits(transport) is not Waiting.PROBE
            or not seats.take(self, PROBE_SEATS, now)
        ):
            return False
        self.probe_only = True
        self.seats = seats
        self._warn_at_cap("probe", "taking new connections for one probe each; anything else: 503")
        return True

    async def _handshake(self, transport: Transport, context: ssl.SSLContext) -> None:
        """Upgrade to TLS within --head-timeout (a client that never finishes its hello is
        let go as a slow head is); failed, the connection ends and frees its seat."""
        try:
            secure = await self.loop.start_tls(
                cast(asyncio.WriteTransport, transport),
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self.settings.head_timeout,
                # how long a close waits for the client's close_notify, once our answers
                # are written (`_close_once_written`): a pooled client sends none until
                # it next reads, and the transport's own 30 s held the seat meanwhile
                ssl_shutdown_timeout=LINGER_SECONDS,
            )
        except OSError as exc:  # timed out, reset, not TLS: the client's doing, as a bad head
            log.debug("TLS handshake with %s failed: %r", _peer(self.peername), exc)
            secure = None
        if secure is None or self.phase is not Phase.HANDSHAKE:  # failed, or closed meanwhile
            if secure is not None:
                secure.close()
            self.connection_lost(None)  # the loop says so of some failed handshakes, not all
            return
        self.transport, self.socket_transport = cast(Transport, secure), transport
        tls_write_buffer(secure)
        self.flow = self._flow_control()
        self._enter(Phase.IDLE)
        # bytes the client sent right after its hello, passed on before this task ran
        early, self.handshake_data = self.handshake_data, []
        for data in early:
            self.data_received(data)
        if self.eof_seen and self._reading:
            self.eof_received()

    def _flow_control(self) -> FlowControl:
        return FlowControl(
            cast(Transport, self.transport),
            self.loop,
            self.settings.write_timeout,
            self._on_write_timeout,
            self._unsent,
        )

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.HANDSHAKE:
            self.handshake_data.append(data)  # read once `_handshake` goes on
            return
        if self.phase in (Phase.LINGER, Phase.CLOSED):
            return  # lingering after our last response: drain and drop
        self.read_ahead += len(data)
        if self.phase is Phase.RESPONDING:
            # Pipelined bytes wait in h11's buffer; keep reading (to notice a
            # disconnect) until too much piles up.
            self.conn.receive_data(data)
            if self.read_ahead > READ_AHEAD_LIMIT:
                self._flow.pause_reading()
                self._watch_for_a_reset()
            return
        if self.phase is Phase.IDLE:
            data = data.lstrip(_EMPTY_LINE)
            if not data:
                return  # only empty lines: still idle, its deadline running
            self._enter(Phase.HEAD)
            if data[0] not in _TOKEN_BYTES:
                self._fail(refusals.not_plain_http())
                return
        elif self.phase is Phase.BODY and not self._measure_chunks(data):
            return
        if self.phase is Phase.HEAD and self._too_many_lines(data):
            return
        try:
            self.conn.receive_data(data)
            self.handle_events()
        except MemoryError as exc:  # its bytes cannot be held now: an answer, not a reset
            self._fail(as_http_error(exc))

    def _watch_for_a_reset(self) -> None:
        """While reading is paused behind pipelined bytes, a client that leaves is not
        read: its FIN waits behind the bytes it still sends (nothing can see it), but a
        reset has reached the kernel, and is looked for each RESET_LOOK_SECONDS (a reset
        client's generation ran on to its end or its deadline, 120 s, for nobody)."""
        if self.reset_look is None:
            self.reset_look = self.loop.call_later(RESET_LOOK_SECONDS, self._look_for_a_reset)

    def _look_for_a_reset(self) -> None:
        self.reset_look = None
        if self.phase in (Phase.LINGER, Phase.CLOSED) or not self._flow.read_paused:
            return  # (watched again where reading pauses behind a backlog again)
        if has_failed(self.socket_transport or self.transport):
            assert self.transport is not None
            self.transport.abort()  # (its loss withdraws the work, as a read reset does)
            return
        self._watch_for_a_reset()

    def eof_received(self) -> bool | None:
        self.eof_seen = True
        if not self._reading:  # (in HANDSHAKE: `_handshake` reads it once it goes on)
            return None  # done lingering, or the client left before its answer: close
        self.conn.receive_data(b"")
        self.handle_events()
        return None  # the transport closes once what we wrote is flushed

    def connection_lost(self, exc: Exception | None) -> None:
        phase = self.phase
        self._enter(Phase.CLOSED)
        if self.reset_look is not None:
            self.reset_look.cancel()
        self.seats.leave(self)
        self.state.refusals_lingering.leave(self)
        if self.flow is not None:
            self.flow.release()  # a streaming response waiting to write must see the close
        cycle = self.cycle
        if cycle is not None and cycle.task is not None and not cycle.task.done():
            cycle.task.cancel()  # the client is gone: withdraw its work
            if not cycle.response_started:  # an access line says so (nginx's 499)
                self._log_access(cycle, CLIENT_CLOSED, 0)
        elif phase in (Phase.HEAD, Phase.BODY):
            # reset amid its request: the line its FIN would have had (the 400 of a cut
            # head or body, as nginx logs either), not none
            self._log_access(self._cycle_read(phase), 400, 0)

    def pause_writing(self) -> None:
        self._flow.pause_writing()  # and cut off a peer that stays stalled

    def resume_writing(self) -> None:
        self._flow.resume_writing()
        self._restart_deadline()  # (the answer's last bytes are on their way)
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
        requests = 0  # read in this pass
        while self._reading:
            if self.cycle is None and self._flow.write_paused:
                self._flow.pause_reading()  # the peer is not reading its answers: wait
                return
            if self.cycle is None and requests and self._pass_done(requests):
                # pipelined requests answered at once (404s, 401s, probes): the other
                # connections' turn, then on. In one pass, 10,000 of them (260 KB) held
                # the event loop a second for every other client.
                self._flow.pause_reading()
                self.state.read_turns.wait(self.loop, self._read_on)
                return
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                in_body = self.phase is Phase.BODY
                unparsed = self.conn.trailing_data[0]
                self._fail(refusals.protocol_error(exc, in_body, unparsed))
                return
            if event is h11.NEED_DATA:  # what was read ahead is parsed: read on
                self.read_ahead = 0
                self._flow.resume_reading()
                return
            if event is h11.PAUSED:
                self._flow.pause_reading()
                return
            if isinstance(event, h11.Request):
                requests += 1
                self.state.read_turns.count(self.loop)
                self._on_request(event)
            elif isinstance(event, h11.Data):
                self._on_body(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._on_request_complete()
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def _pass_done(self, requests: int) -> bool:
        """Whether this connection has read its share of this pass of the event loop:
        its own cap, or the budget of them all."""
        return requests >= REQUESTS_PER_PASS or self.state.read_turns.spent

    def _read_on(self) -> None:
        """Go on with the pipelined requests after the other connections' turn, reading
        again unless READ_AHEAD_LIMIT bytes wait: a request among them that runs the
        model must see its client leave (with reading paused until all that was read had
        been parsed, one after 32 answered at once ran its whole generation for a client
        that had gone), and a backlog must not grow while it is worked through."""
        if self.phase is Phase.CLOSED:
            return
        if self.read_ahead <= READ_AHEAD_LIMIT:
            self._flow.resume_reading()
        else:
            self._watch_for_a_reset()
        self.handle_events()

    def _on_request(self, event: h11.Request) -> None:
        fields = list(event.headers)  # h11's Headers iterate slowly: one pass, kept
        given_id = header(fields, b"x-request-id")
        self.cycle = Cycle(event, request_id(given_id), header(fields, b"origin"))
        self.cycle.retry = retry_count(header(fields, RETRY_HEADER))
        self._enter(Phase.BODY)
        limits = self.settings
        error = refusals.check_head(event, fields, limits.max_head_bytes, limits.max_body_bytes)
        if error is None and self.probe_only and not is_probe(event):
            error = refusals.too_many_connections()
            self._count_refusal()
        if error is not None:
            self._fail(error)
            return
        if header(fields, b"transfer-encoding") is not None:
            self.cycle.chunks = ChunkedMeter(self.settings.max_body_bytes)
            # what came with the head (copied once per chunked request)
            if not self._measure_chunks(self.conn.trailing_data[0]):
                return
        cycle = self.cycle
        cycle.head = head_request(event, fields, cycle.request_id)
        cycle.keep_alive = keeps_alive(event, fields)
        body_comes = has_content(fields)
        try:
            cycle.early = self.app.answer_now(cycle.head)
            # (a request with no body has nothing to decode, whatever its head says: a GET
            # of /info saying gzip was 400 "the body's gzip data ends early")
            coding = header_list(fields, b"content-encoding") if body_comes else None
            if cycle.early is None and coding:
                cycle.codings = codings(coding)  # refused from the head if none it reads
        except Exception as exc:  # noqa: BLE001 - error_response logs what is unexpected
            cycle.early = self._error(cycle, exc)
        if body_comes:
            self._bound_body_by_deadline(cycle, cycle.head)
        # with no body to come, nothing waits for a 100: the request is answered whole
        waits = self.conn.they_are_waiting_for_100_continue and body_comes
        if cycle.early is not None and waits:
            # no 100: the client does not send the body, so the connection ends after
            self._enter(Phase.RESPONDING)
            self._send(cycle, cycle.early)
        elif waits:
            # Only now that the head is accepted: a refused request never sees a 100.
            self._write(
                self.conn.send(
                    h11.InformationalResponse(status_code=100, headers=[], reason="Continue")
                )
            )

    def _bound_body_by_deadline(self, cycle: Cycle, head: HttpRequest) -> None:
        """A body that comes slower than its request's deadline, where that is shorter
        than --body-timeout (as long, the 408 of a slow body stands), is not waited for
        past it: 504 then, and the connection closed (RFC 9112 9.3 lets an answer go
        before the body ends). Its 504 came once its last byte did, up to --body-timeout
        late."""
        seconds = self.app.deadline_seconds(head)
        body_timeout = self.settings.deadlines.get(Phase.BODY)
        if seconds is None or (body_timeout is not None and seconds >= body_timeout):
            return
        cycle.body_due = True
        self.timer.set(max(head.received_at + seconds - time.monotonic(), 0.0))

    def _measure_chunks(self, data: bytes) -> bool:
        """Count a chunked body's bytes as sent (announced sizes, extensions, trailers,
        tiny chunks at a minimum each); False once over the body limit (answered 413)."""
        chunks = self.cycle.chunks if self.cycle is not None else None
        if chunks is None or chunks.done:
            return True
        chunks.feed(data)
        if chunks.malformed:
            self._fail(refusals.bare_line_feed())
            return False
        if chunks.too_many_chunks:
            self._fail(refusals.too_many_chunks(self.settings.max_body_bytes, chunks.chunks))
            return False
        if chunks.too_many_trailers:
            self._fail(refusals.too_many_trailer_fields())
            return False
        if chunks.over:
            self._fail(refusals.body_too_large(self.settings.max_body_bytes))
            return False
        return True

    def _on_body(self, data: bytes) -> None:
        cycle = self.cycle
        assert cycle is not None
        cycle.body_size += len(data)
        if cycle.body_size > self.settings.max_body_bytes:
            self._fail(refusals.body_too_large(self.settings.max_body_bytes))
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
        if cycle.codings and request.body:  # (an empty chunked body is no gzip either)
            try:
                limit = self.settings.max_body_bytes
                request.body = decoded(request.body, cycle.codings, limit)
            except HTTPError as exc:
                self._send(cycle, self._error(cycle, exc))
                return
        cycle.task = self.loop.create_task(self._respond(cycle, request))

    async def _respond(self, cycle: Cycle, request: HttpRequest) -> None:
        REQUEST_ID.set(cycle.request_id)  # (this task's own context)
        try:
            response = await self.app.handle(request)
        except asyncio.CancelledError:
            return  # the client left: its work is withdrawn, nobody to answer
        except Exception as exc:  # noqa: BLE001 - error_response logs what is unexpected
            response = error_response(exc, cycle.request_id)
        if self.cycle is not cycle or self.phase is not Phase.RESPONDING:
            await _close_stream(response)
            return
        if response.stream is not None:
            await self._send_stream(cycle, response)
        else:
            self._send(cycle, response)

    # --- refusals of the connection itself --------------------------------------------

    def _fail(self, error: HTTPError) -> None:
        """Answer a connection-level error (malformed, too large, too slow), then close."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.close()  # a response has started: all we can do is close
            return
        cycle = self._cycle_read(self.phase)
        self._send(cycle, self._error(cycle, error), close=True)

    def _cycle_read(self, phase: Phase) -> Cycle:
        """The request being read, or where no head was parsed (a head timeout, garbage, a
        head cut off) a cycle of its own, timed from the head's first bytes in `phase` HEAD."""
        if self.cycle is None:
            self.cycle = Cycle(None, new_request_id())
            if phase is Phase.HEAD:
                self.cycle.started = self.head_started
        return self.cycle

    def _error(self, cycle: Cycle, exc: BaseException) -> HttpResponse:
        """The protocol's own error answer to `cycle`, in OpenAI's shape on its routes (a
        body over the limit, a coding not read, refused before any route ran, came in
        rawserve's shape there, which those clients do not read); else rawserve's (TGI's
        and TEI's types are their inputs' validation: a 400 for a framing became a 422)."""
        head = cycle.head
        if head is None and cycle.request is not None:  # refused from its head
            head = head_request(cycle.request, list(cycle.request.headers), cycle.request_id)
        elif head is None:  # refused before h11 parsed a head: its request line's path
            head = line_request(self.head_lines.request_line, cycle.request_id)
        render = self.app.refusal_renderer(head) if head is not None else None
        return (render or error_response)(exc, cycle.request_id)

    def _refuse(self) -> None:
        """Past the connection cap and the probes' reserve: 503 before reading anything
        (over TLS, closed before any handshake work: no answer can reach it without)."""
        self.state.refused += 1
        refused = self.state.refused
        self._count_refusal()
        self._warn_at_cap("refused", f"refusing connections, every one busy; {refused} so far")
        if self.tls is not None:
            self.close()
            return
        self.cycle = Cycle(None, new_request_id())
        self._send(self.cycle, error_response(refusals.too_many_connections()), close=True)
        if self.phase is Phase.LINGER:  # bounded: each holds a descriptor while it waits
            limit = refusals_bound(self.settings.max_connections, self.state.open_files)
            self.state.refusals_lingering.add(self, limit)

    def _count_refusal(self) -> None:
        if self.state.metrics is not None:
            self.state.metrics.observe_refused_connection()

    def _warn_at_cap(self, kind: str, what: str) -> None:
        """Tell the operator the cap is reached (each `kind` of line once per
        CAP_LOG_INTERVAL)."""
        now = time.monotonic()
        if now - self.state.last_cap_log.get(kind, float("-inf")) >= CAP_LOG_INTERVAL:
            self.state.last_cap_log[kind] = now
            log.warning(
                "%d connections open (--max-connections): %s", len(self.state.connections), what
            )

    # --- writing ----------------------------------------------------------------------

    def _send(self, cycle: Cycle, response: HttpResponse, close: bool = False) -> None:
        """The one writer of a whole answer: its head from `rawserve.http.response_head`,
        by hand on a connection that stays open (where h11 would write the head as given;
        h11 is restarted after), framed by h11 where the connection ends or h11 would
        write the head its own way, and by hand where h11 has no request to answer (or
        cannot write the app's head: a 500 then); then the connection is kept or closed."""
        if not self._start_response(cycle):
            return
        close = close or self._closes_after(response)
        if not close and self._stays_open_after(cycle):
            kept = self._kept_answer(cycle, response)
            if kept is not None:
                self._write_answer(cycle, response, kept)
                self._restart_h11()
                return
        if self.conn.our_state is h11.SEND_RESPONSE or self.conn.their_state is h11.ERROR:
            try:
                framed = self._h11_answer(cycle, response, close)
            except (h11.LocalProtocolError, UnicodeEncodeError):  # a field h11 cannot write
                log.exception(
                    "could not send the response to request %s",
                    cycle.request_id,
                    extra={"request_id": cycle.request_id},
                )
                # h11 is done with this connection: a 500 of the server's own fields, by hand
                response = error_response(InternalError("the answer could not be written"))
                close = True
            else:
                self._write_answer(cycle, response, framed)
                self._finish_cycle(close)
                return
        self._write_answer(cycle, response, self._fixed_answer(cycle, response, close))
        self._finish_cycle(True)  # written past h11: the connection cannot go on

    def _kept_answer(self, cycle: Cycle, response: HttpResponse) -> list[bytes | None] | None:
        """The answer by hand, on a connection that stays open; None where the app's head
        has a field h11 would write its own way."""
        headers, body = self._answer_parts(cycle, response)
        head = render_kept(response.status, response.content_type, headers, len(response.body))
        if head is None:
            return None
        return [head, render_request_fields(response, cycle.request_id, cycle.started), body]

    def _h11_answer(self, cycle: Cycle, response: HttpResponse, close: bool) -> list[bytes | None]:
        """The answer framed by h11 (which raises for a field it cannot write)."""
        headers, body = self._answer_parts(cycle, response)
        length = content_length(response.status, len(response.body))
        fields = fixed_fields(response.content_type, headers, length, close)
        fields += request_fields(response, cycle.request_id, cycle.started)
        pieces: list[bytes | None] = [self.conn.send(h11_head(response.status, fields))]
        if body:
            pieces.append(self.conn.send(h11.Data(data=body)))
        pieces.append(self.conn.send(h11.EndOfMessage()))
        return pieces

    def _fixed_answer(
        self, cycle: Cycle, response: HttpResponse, close: bool
    ) -> list[bytes | None]:
        """The answer by hand, where h11 has no request to answer."""
        headers, body = self._answer_parts(cycle, response)
        length = len(response.body)
        head = render_fixed(response.status, response.content_type, headers, length, close)
        return [head, render_request_fields(response, cycle.request_id, cycle.started), body]

    def _answer_parts(self, cycle: Cycle, response: HttpResponse) -> tuple[Fields, bytes]:
        """The answer's headers, and the body (none to a HEAD request)."""
        return self._answer_headers(cycle, response), b"" if cycle.is_head else response.body

    def _write_answer(
        self, cycle: Cycle, response: HttpResponse, pieces: list[bytes | None]
    ) -> None:
        if self.transport is None or self.transport.is_closing():
            # its client's FIN closed the connection before this answer was ready (the
            # next of pipelined requests): nothing of it reaches the client, whose access
            # line and count say so, as nginx's 499, not the 200 it was never sent
            self._log_access(cycle, CLIENT_CLOSED, 0)
            return
        self._write_all(pieces)  # one send for the whole answer
        # the body's bytes sent, as nginx logs them: none to a HEAD request
        self._log_access(cycle, response.status, 0 if cycle.is_head else len(response.body))

    async def _send_stream(self, cycle: Cycle, response: HttpResponse) -> None:
        """Send a body produced piece by piece (chunked), waiting while the peer is slow.

        Once the head is out, an error can only close the connection.
        """
        assert response.stream is not None
        if not self._start_response(cycle):
            await _close_stream(response)
            return
        close = self._closes_after(response)
        headers = self._answer_headers(cycle, response)
        fields = fixed_fields(response.content_type, headers, None, close)
        fields += request_fields(response, cycle.request_id, cycle.started)
        sent = 0
        written = 0  # bytes of the answer written, its framing too

        def taken() -> int:
            return written - self._unsent()  # (grows as the client reads, only then)

        if response.on_stream_start is not None:
            response.on_stream_start(taken)
        # what the client leaves unread waits where it counts
        bound_unsent(self.transport, STREAM_UNSENT_BYTES)
        try:
            head = self.conn.send(h11_head(response.status, fields))
            self._write(head)
            written += len(head or b"")
            self.last_request_id = cycle.request_id  # (its access line comes at its end)
            framed = body_framing(head or b"")
            if not cycle.is_head:
                async for chunk in response.stream:
                    if self.phase is not Phase.RESPONDING:
                        return
                    if chunk:
                        data = framed(chunk)
                        self._write(data)
                        written += len(data)
                        sent += len(chunk)
                    await self._flow.drain()
            if self.phase is not Phase.RESPONDING:
                return
            self._write(self.conn.send(h11.EndOfMessage()))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the head is out: all we can do is close
            log.exception(
                "the streamed response to request %s failed",
                cycle.request_id,
                extra={"request_id": cycle.request_id},
            )
            self.close()
            return
        finally:
            # one line however it ended: a stream cut short (the client left, the write
            # timeout: less what it left unsent) says what it sent, as nginx logs it
            self._log_access(cycle, response.status, max(0, sent - self.unsent))
            await _close_stream(response)  # stops the producer (e.g. generation) if we left
            if self.phase is Phase.RESPONDING:  # the connection goes on to other answers
                bound_unsent(self.transport, ANSWER_UNSENT_BYTES)
        # a stream begun before the server began to drain said nothing of a close: its
        # connection closes at its end all the same, before a pooled client sends on it
        # (the drain's end would close it under that request), unless one came already
        drained = self.app.draining and not self.conn.trailing_data[0]
        self._finish_cycle(close or drained)

    def _start_response(self, cycle: Cycle) -> bool:
        """Mark the one response of `cycle` as started; False (and close) if it already was."""
        if self.phase in (Phase.LINGER, Phase.CLOSED):
            return False
        if cycle.response_started or cycle is not self.cycle:
            log.error("refusing a second response for request %s", cycle.request_id)
            self.close()
            return False
        cycle.response_started = True
        return True

    def _closes_after(self, response: HttpResponse) -> bool:
        """Whether this answer ends the connection (said in its head as Connection: close)."""
        # A 503 (queue full, loading) keeps the connection: under overload, closing would
        # make every refused client pay a new connection. While draining every answer
        # closes: the drain ends by closing every connection, and one kept now would be
        # closed later without a word, perhaps as a pooled client sends on it.
        failed = response.status >= 500 and response.status != 503
        if failed or self.app.draining or self.probe_only:
            return True
        return self.conn.their_state not in _REQUEST_READ

    def _answer_headers(self, cycle: Cycle, response: HttpResponse) -> Fields:
        """The app's headers, whole answers and streams alike, with what lets the page of
        an allowed origin read this answer and `Vary: Origin` for any origin, unless the
        app added them to its own answer: the protocol's refusals need them."""
        cors = self.app.cors
        extra = [] if cors is None else cors.headers_for(cycle.origin, response.headers)
        return (*response.headers, *extra)

    def _stays_open_after(self, cycle: Cycle) -> bool:
        """Whether h11 would keep the connection after answering `cycle`, and write the
        answer's head as given: an HTTP/1.1 request without Connection: close, read
        whole, not HEAD (whose answer h11 writes without its body)."""
        return (
            cycle.keep_alive
            and not cycle.is_head
            and self.conn.their_state is h11.DONE
            and self.conn.our_state is h11.SEND_RESPONSE
        )

    def _restart_h11(self) -> None:
        """After an answer written by hand: start h11 afresh with what it had read ahead
        (the request was read whole and the connection stays)."""
        self.cycle = None
        self._read_afresh(*self.conn.trailing_data)

    def _read_afresh(self, unread: bytes, closed: bool) -> None:
        """A new h11 fed what the last one read ahead, less the empty lines before the
        next request line."""
        unread = unread.lstrip(_EMPTY_LINE)
        self.conn = self._new_h11()
        if unread:
            self.conn.receive_data(unread)
        if closed:
            self.conn.receive_data(b"")
        self._next_request(unread)

    def _finish_cycle(self, close: bool) -> None:
        """Keep the connection for the next request, or close it, once an answer is
        written (with what h11 says: an HTTP/1.0 client, a body left unread)."""
        self.cycle = None
        if close or self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is not h11.DONE:
            self._close_gracefully()
            return
        self.conn.start_next_cycle()
        unread, closed = self.conn.trailing_data
        if unread[:1] in (b"\r", b"\n"):  # h11 would refuse the empty line
            self._read_afresh(unread, closed)
            return
        self._next_request(unread)

    def _too_many_lines(self, data: bytes) -> bool:
        """Count the head's lines in `data`; past the limit, refuse it (431) unparsed."""
        self.head_lines.add(data)
        if self.head_lines.too_many:
            self._fail(refusals.too_many_header_lines())
        return self.head_lines.too_many

    def _next_request(self, unread: bytes) -> None:
        self._enter(Phase.HEAD if unread else Phase.IDLE)  # it may be (partly) here already
        if unread and self._too_many_lines(unread):  # (a pipelined head, read ahead)
            return
        if not self._flow.write_paused:  # else resume_writing carries on
            self.handle_events()  # reading resumes once h11 needs data

    def _write(self, data: bytes | None) -> None:
        if data:
            self._write_all([data])

    def _write_all(self, pieces: Iterable[bytes | None]) -> None:
        """Write, unless our side is done writing (after our FIN, or the close). One
        write of the joined pieces (one send): the standard loop's `writelines` never
        pauses writing on Python 3.12 and 3.13, so a client that reads nothing would
        never meet --write-timeout."""
        transport = self.transport
        if transport is None or self.phase in (Phase.LINGER, Phase.CLOSED):
            return
        data = b"".join(piece for piece in pieces if piece)
        if self.socket_transport is None or len(data) <= TLS_WRITE_SLICE:
            if data:
                transport.write(data)
            return
        # TLS passes each write on to the socket's transport whole, where writing does
        # not pause for it: in slices, the rest waits above, where it does
        for start in range(0, len(data), TLS_WRITE_SLICE):
            transport.write(data[start : start + TLS_WRITE_SLICE])

    def _unsent(self) -> int:
        """Bytes of our answers their client has not yet taken: in the transport (for TLS,
        in either) and in the kernel, whose send buffer can hold a whole answer."""
        waiting = sum(
            transport.get_write_buffer_size()
            for transport in (self.transport, self.socket_transport)
            if transport is not None
        )
        return waiting + unsent_in_kernel(self.socket_transport or self.transport)

    def refuse_unread(self) -> None:
        """The server stops: a request whose body is still coming is answered 503 (and
        the connection closes after it)."""
        if self.phase is Phase.BODY:
            self._fail(refusals.stopped_before_the_body())

    @property
    def reading_body(self) -> bool:
        """Its request's head is read and its body is still coming: it is answered once
        the body is in."""
        return self.phase is Phase.BODY

    @property
    def sending(self) -> bool:
        """Some of an answer is not yet taken by its client, in the transport or in the
        kernel (past the cap, it keeps its seat: closed, the kernel would keep its socket
        for as long as the client does not read)."""
        return self._unsent() > 0

    def close(self) -> None:
        """Close at once (the peer left, went idle, an answer broke off, or shutdown)."""
        self._enter(Phase.CLOSED)
        self._close_transport()

    def reset(self) -> None:
        """Close at once with a reset: nothing more is read or written."""
        self._enter(Phase.CLOSED)
        if self.transport is not None:
            reset_on_close(self.transport)
            self.transport.abort()

    def _close_transport(self) -> None:
        """Close once what waits in the transport is written, within --write-timeout
        however little waits (the transport would wait for a peer that never reads)."""
        if self.transport is None:
            return
        if self.sending:
            self._flow.closing()
        if self.socket_transport is not None:
            self._close_once_written()
        else:
            self.transport.close()

    def _close_once_written(self) -> None:
        """Close a TLS connection once its client has taken its answers (its close then
        waits LINGER_SECONDS at most for the client's close_notify, which would cut them
        short)."""
        transport = cast(Transport, self.transport)
        if transport.is_closing():
            return  # cut off meanwhile (--write-timeout)
        if self.sending:
            self.loop.call_later(WRITTEN_CHECK, self._close_once_written)
        else:
            transport.close()

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

    def _log_access(self, cycle: Cycle, status: int, size: int) -> None:
        self.last_request_id = cycle.request_id
        request = cycle.request
        seconds = time.perf_counter() - cycle.started
        method = request.method.decode("ascii", "replace") if request else "-"
        target = request.target.decode("ascii", "replace") if request else "-"
        # by the path the routes see (an absolute-form or %-encoded target as routed, one
        # refused from its head too: counted under "other", not its route)
        path = cycle.head.path if cycle.head is not None else routed_path(target.partition("?")[0])
        if self.state.metrics is not None:
            self.state.metrics.observe_request(path, method, status, seconds)
        peer = functools.partial(_peer, self.peername)
        request_id, retry = cycle.request_id, cycle.retry
        log_access(peer, method, target, status, size, seconds, request_id, retry, path)


async def _close_stream(response: HttpResponse) -> None:
    try:
        if response.stream is not None:
            await response.stream.aclose()
    finally:
        if response.on_stream_close is not None:
            response.on_stream_close()


def _peer(peer: object) -> str:
    """A peer's address as a log line names it: an IPv6 host in brackets (`[::1]:55436`,
    as nginx's and a URL's; `::1:55436` left the port unclear)."""
    if not isinstance(peer, tuple) or len(peer) < 2:
        return "-"
    host = f"[{peer[0]}]" if ":" in str(peer[0]) else peer[0]
    return f"{host}:{peer[1]}"

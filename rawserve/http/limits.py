"""What one connection may cost, and the phases whose deadlines bound it.

`ProtocolSettings` holds the limits of every connection (`rawserve.protocol.HttpProtocol`);
they hold whatever its client does:
- input: reading pauses once more than `READ_AHEAD_LIMIT` bytes wait unparsed, and
  resumes only when h11 needs data again, however many requests are pipelined (the rest
  waits in the kernel's buffers and the client's); the head size; the body size as sent
  (a chunked body's announced sizes, extensions and trailers count,
  `rawserve.http.chunked`);
- time: the head, body and keep-alive timeouts, and the write timeout: a client that
  reads none of its answer for `write_timeout` seconds is cut off;
- connections: past `max_connections`, a new connection takes the place of the one
  idle longest between requests, once idle `GIVE_WAY_AFTER` (closed quietly, as at
  keep-alive expiry); where none is, a few more (`PROBE_RESERVE`) are taken for probes
  only (`/health`, `/ready` answered, anything else 503), their idle ones giving way
  alike; then it is refused, unless what it has already sent is a probe's whole head
  (`rawserve.http.probe_peek`), which may take a seat past the reserve (`PROBE_SEATS`
  in all). Over TLS a connection is counted from its TCP accept, its
  handshake included (one still in its handshake gives way as an idle one does), and
  one refused is closed before any handshake work.

A connection is always in one `Phase`, and each phase but RESPONDING has a deadline
(HANDSHAKE's is the TLS handshake's own, `loop.start_tls`'s timeout).
`ServerState` is what every connection of one server shares: the open connections the
cap counts (`Seats`), the refusals, the metrics. Plain values; no I/O.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import resource
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from rawserve.http.cycle import Cycle

READ_AHEAD_LIMIT = 64 * 1024  # bytes read but not yet parsed, per connection
# How often a connection whose reading paused behind READ_AHEAD_LIMIT pipelined bytes is
# looked at for a reset by its client, which no read reports while paused
RESET_LOOK_SECONDS = 1.0
LINGER_SECONDS = 2.0  # after our last response, how long we drain the peer's bytes
# Past --max-connections, this many more connections are taken, each for one probe: a
# liveness probe must not fail (and restart a healthy server) because busy clients hold
# every connection.
PROBE_RESERVE = 32
# Probe seats of both kinds together: a connection seen to hold a probe's whole head
# (`rawserve.http.probe_peek`) may take one past the reserve, where the undecided
# connections of a flood hold it; bounded, so such heads cannot open connections without
# end (each past the cap is one more descriptor).
PROBE_SEATS = 2 * PROBE_RESERVE
# Connections refused at the cap that may wait for their clients' close together, at
# least (`LingeringRefusals`; else as many as --max-connections seats in the process),
# where the open files limit leaves room for them (`refusals_bound`)
REFUSALS_LINGERING = PROBE_SEATS
OWN_FILES = 64  # descriptors a process holds besides its connections: pipes, the listener
# Past --max-connections, a connection idle this long gives way to a new one; one idle
# less may be a new connection whose request is on its way (a burst past the cap would
# close each other's before reading them, where the cap's 503 tells a client to retry).
GIVE_WAY_AFTER = 1.0
# pipelined requests all connections together read in one pass of the event loop
# (`ReadTurns`): a pass of 64 quick answers takes ~3 ms
REQUESTS_PER_LOOP_PASS = 64


class Phase(enum.Enum):
    # TLS: accepted, its handshake under way; deadline: --head-timeout, start_tls's own
    HANDSHAKE = "handshake"
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
    max_connections: int = 1000  # open connections; past it, idle ones give way (0: no cap)
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


class OpenConnection(Protocol):
    """A connection as the server sees it (rawserve.protocol.HttpProtocol)."""

    cycle: Cycle | None  # the exchange under way

    @property
    def reading_body(self) -> bool:
        """Its request's head is read and its body is still coming."""
        ...

    @property
    def sending(self) -> bool:
        """Some of its last answer is not yet taken by its client, in the transport (a
        close would wait for it) or in the kernel (which would keep the socket for it)."""
        ...

    def close(self) -> None: ...

    def refuse_unread(self) -> None:
        """Answer a request whose body is still coming 503 and close (the server stops)."""
        ...

    def reset(self) -> None:
        """Close at once with a reset, whatever waits to be read or written."""
        ...


class LingeringRefusals:
    """The connections refused at the cap whose 503 is written and that wait for their
    clients' close (LINGER_SECONDS at most), longest waiting first. Each holds a file
    descriptor: a flood of clients that never close took every one the process may open,
    and then nothing was accepted at all, a liveness probe included. Past the limit the
    one waiting longest is reset: it has had the longest to read its 503."""

    def __init__(self) -> None:
        self.waiting: dict[OpenConnection, None] = {}  # (a dict keeps its order)

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, connection: OpenConnection, limit: int) -> None:
        self.waiting[connection] = None
        while len(self.waiting) > limit:
            longest = next(iter(self.waiting))
            self.leave(longest)
            longest.reset()

    def leave(self, connection: OpenConnection) -> None:
        self.waiting.pop(connection, None)


def refusals_bound(cap: int, open_files: int | None) -> int:
    """How many refused connections may wait for their clients' close at once in a
    process of `cap` seats (`LingeringRefusals`): as many as the cap, at least
    REFUSALS_LINGERING, within what the open files limit (None: none) leaves past the
    seats, the probes' and the process's own. Where it leaves none, each is reset at once:
    better a 503 lost than the probes (with a cap of 300 under `ulimit -n` 512, 300 waiting
    took the descriptors the probes needed: 29 of 119 answered)."""
    wanted = max(cap, REFUSALS_LINGERING)
    if open_files is None:
        return wanted
    return max(0, min(wanted, open_files - cap - PROBE_SEATS - OWN_FILES))


def soft_open_files_limit() -> int | None:
    """This process's soft `ulimit -n` (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


class RequestObserver(Protocol):
    """Counts responses by route and status, and the connections refused at the cap
    (rawserve.ops.metrics.Metrics)."""

    def observe_request(self, path: str, method: str, status: int, seconds: float) -> None: ...

    def observe_refused_connection(self) -> None: ...


class Seats:
    """The open connections of one kind, and those of them between requests in the order
    they went idle, so that the one idle longest is found without a scan."""

    def __init__(self) -> None:
        self.open: set[OpenConnection] = set()
        # since when each is idle, longest idle first (a dict keeps its order)
        self.idle: dict[OpenConnection, float] = {}

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self) -> Iterator[OpenConnection]:
        return iter(self.open)

    def take(self, connection: OpenConnection, limit: int, now: float) -> bool:
        """Seat `connection` if fewer than `limit` are open (0: no limit), else in place of
        the one idle longest, closed quietly (nginx's reusable connections), if it has
        been idle `GIVE_WAY_AFTER` and its client has taken all of its last answer; False
        where not: one mid-request, answering or closing is never closed for this.
        (Closed with an answer still to send, even one the kernel holds whole, it would
        hold its socket, no longer counted, for as long as its client does not read.)"""
        if limit and len(self.open) >= limit:
            longest = next(iter(self.idle), None)
            if longest is None or self.idle[longest] > now - GIVE_WAY_AFTER or longest.sending:
                return False
            self.leave(longest)
            longest.close()
        self.open.add(connection)
        return True

    def mark(self, connection: OpenConnection, idle_since: float | None) -> None:
        """`connection` is between requests (or in its TLS handshake) since `idle_since`
        (last in line to be closed), or (None) no longer."""
        self.idle.pop(connection, None)
        if idle_since is not None and connection in self.open:
            self.idle[connection] = idle_since

    def leave(self, connection: OpenConnection) -> None:
        self.open.discard(connection)
        self.idle.pop(connection, None)


class ReadTurns:
    """Connections with pipelined requests left to read take turns, round and round,
    `budget` requests a pass of the event loop among them all. Each connection's own cap
    (32 a pass) alone let 300 flooding connections answer 9,600 requests a pass, and a
    new connection waited seconds for its first read (under uvloop, whose libuv accepts
    one connection a pass, 27 s). A connection whose bytes just arrived reads one
    request whatever the budget: a new client is answered in the pass that reads it."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.read = 0  # in this pass, by every connection
        self.waiting: deque[Callable[[], None]] = deque()  # each a connection's go-on
        self._next_pass_due = False

    @property
    def spent(self) -> bool:
        return self.read >= self.budget

    def count(self, loop: asyncio.AbstractEventLoop) -> None:
        """One request read: the budget is renewed in the next pass."""
        self.read += 1
        self._next_pass(loop)

    def wait(self, loop: asyncio.AbstractEventLoop, go_on: Callable[[], None]) -> None:
        """Call `go_on` at this connection's next turn, after those waiting before it."""
        self.waiting.append(go_on)
        self._next_pass(loop)

    def _next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._next_pass_due:
            self._next_pass_due = True
            loop.call_soon(self._take_turns)

    def _take_turns(self) -> None:
        self._next_pass_due = False
        self.read = 0
        for _ in range(len(self.waiting)):  # one that waits again is in the next round
            if self.spent:
                return
            self.waiting.popleft()()


@dataclass
class ServerState:
    """Shared by every connection of one server."""

    metrics: RequestObserver | None = None
    connections: Seats = field(default_factory=Seats)
    probe_connections: Seats = field(default_factory=Seats)  # past the cap
    refused: int = 0  # connections refused past `max_connections`
    refusals_lingering: LingeringRefusals = field(default_factory=LingeringRefusals)
    open_files: int | None = field(default_factory=soft_open_files_limit)  # as it starts
    read_turns: ReadTurns = field(default_factory=lambda: ReadTurns(REQUESTS_PER_LOOP_PASS))
    # when each kind of line about the cap was last logged (each its own interval: a
    # milder one must not silence the refusals that follow it)
    last_cap_log: dict[str, float] = field(default_factory=dict)

    def busy_tasks(self) -> set[asyncio.Task[None]]:
        """The tasks of requests the app is still working on, on every connection."""
        return {
            cycle.task
            for cycle in (connection.cycle for connection in self.connections)
            if cycle is not None and cycle.task is not None and not cycle.task.done()
        }

    def reading_bodies(self) -> bool:
        """Whether a connection reads the body of a request whose head it has read: that
        request is answered once its body is in (503 while draining)."""
        return any(connection.reading_body for connection in self.connections)

    def close_all(self) -> None:
        """Close every connection; one whose request's body is still coming is answered
        503 first (closed, its client got nothing, where the README says what is left
        at the end of a drain gets 503)."""
        for connection in [*self.connections, *self.probe_connections]:
            if connection.reading_body:
                connection.refuse_unread()
            connection.close()

"""The serving process's side of the HTTP processes' channels (`--http-processes` N > 1).

Each HTTP process holds a `Serving` client per model (rawserve.http_process.remote) and
sends plain-data messages; the bridge carries each out on the real serving side and
sends back the answer:

    ("run", rid, model, inputs, params, deadline, control, request_id)
                                  → ("done", rid, results), ("refused", rid, refusal), or
                                    ("failed", rid) (an error of the serving side: a 500)
    ("cancel", rid)               the client left: its items are withdrawn
    ("close_stream", stream)      a token stream is over (its tokens: ("token", stream, chunk))
    ("statuses", rid)             /info: every model's status now → ("statuses", rid, list)
    ("scrape", rid)               /metrics: every process's families, merged
                                  → ("scraped", rid, families)
    ("samples", token, families)  an HTTP process's own metrics, asked for by ("collect", token)
    ("alive",)                    its event loop turns (every half second: `Peer.silent_looks`)
    ("listening", pid)            it has bound its sockets and takes connections
    ("drained",)                  told to drain, it has answered every request it holds
    ("pong", token)               it read every message sent before ("ping", token)

It publishes each model's queue state on the `Board` (read by the HTTP processes on
every request, without a message) and sends ("status", model, snapshot, loaded),
("processes", list) and ("facts", model, facts: what /info says of it) when they
change, and ("drain", grace) when the server stops. An HTTP process that is gone has
its requests cancelled (their items withdrawn) and its streams closed. Deadlines are the
`time.monotonic()` clock's, which every process on the machine shares.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rawserve.serving.driver import Backend, RunningRequest
from rawserve.serving.face import (
    Control,
    ItemResult,
    Refused,
    ServingStatus,
    TokenChunk,
    WorkerReady,
    WorkerState,
)
from rawserve.serving.handles import PartAnswered
from rawserve.serving.service import ModelService
from rawserve.shared.board import Board
from rawserve.shared.channel import Channel
from rawserve.shared.logs import REQUEST_ID, requests_named
from rawserve.shared.messages import BatchResult, ModelLimits

log = logging.getLogger("rawserve")

# The board is published as soon as a queue changes (items admitted, dispatched,
# withdrawn or expired); this pass is the backstop, and when statuses are compared.
PUBLISH_SECONDS = 0.005
# The HTTP processes are told a queue is full once less than this share of its bound is
# free: what they sent while the board still said there was room (their channels hold
# what the serving process has not read yet) then finds room, where it was refused with
# a round trip through a serving process as busy as the overload makes it (503s took
# 26 ms at p99 on an H200, the target 10); the serving process still takes any request
# that fits, to the bound itself.
FRONT_HEADROOM = 1 / 16
STATUS_EVERY = 1  # board passes between two status checks
DRAIN_LOOK_SECONDS = 0.05  # how often a drain looks whether every request is answered
# an HTTP process that has said nothing this long (it says "alive" every half second) is
# stopped or stuck: a drain does not wait for its "drained" (it held the drain for the
# whole grace period, where it had nothing under way)
DRAIN_SILENCE_SECONDS = 2.0
COLLECT_SECONDS = 1.0  # how long a scrape waits for the HTTP processes' metrics
# An HTTP process that dies leaves its counters as it last gave them: asked this often
# besides the scrapes, what it counted after is lost for a second at most, not since the
# last scrape (a crash under load lost 40-75 % of the requests counted meanwhile)
KEEP_METRICS_EVERY = round(1.0 / PUBLISH_SECONDS)  # board passes

# A metric family as plain data: (name, type, documentation, unit, samples), a sample
# being (name, labels, value).
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]


@dataclass
class BridgedModel:
    serving: ModelService
    retry_after: Callable[[], float]  # what a full queue's Retry-After says now
    facts: Mapping[str, Any] = field(default_factory=dict)  # what /info says of it
    last_status: ServingStatus | None = None
    last_loaded: WorkerReady | None = None
    last_lasting: ServingStatus | None = None  # the last status, less what each batch moves


@dataclass
class Peer:
    """One HTTP process's channel and what it has under way."""

    index: int
    pid: int
    channel: Channel
    runs: dict[int, RunningRequest] = field(default_factory=dict)
    request_ids: dict[int, str] = field(default_factory=dict)  # each run's, for the log
    streams: dict[int, tuple[ModelService, int]] = field(default_factory=dict)
    listening: asyncio.Event = field(default_factory=asyncio.Event)  # its socket is open
    silent_looks: int = 0  # the fleet's looks since it last said it is alive
    drained: bool = False  # told to drain, it answered every request it held
    heard_at: float = field(default_factory=time.monotonic)  # when it last said "alive"
    families: list[Family] = field(default_factory=list)  # its metrics, as last given


class Bridge:
    def __init__(
        self,
        models: Sequence[BridgedModel],
        board: Board,
        own_families: Callable[[], list[Family]],
        merge: Callable[[list[list[Family]]], list[Family]],
        serving_pid: int,
    ):
        self.models = list(models)
        self.board = board
        self.own_families = own_families
        self.merge = merge
        self.serving_pid = serving_pid
        self.peers: dict[int, Peer] = {}  # by HTTP process index
        self._ids = itertools.count(1)
        # each scrape's: done once every HTTP process asked has given its metrics
        self._collecting: dict[int, tuple[asyncio.Future[None], set[int]]] = {}
        # the counters of the HTTP processes gone, as they last gave them: a scrape's
        # sums go on from them (a process killed taking its counts would read, to
        # Prometheus, as every counter of the server reset)
        self._gone_counts: list[Family] = []
        self._publisher: asyncio.Task[None] | None = None
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._publish_due = False
        # its event loop, once started (asking for the running loop makes a system call)
        self._loop: asyncio.AbstractEventLoop | None = None
        # the grace period of the drain under way: an HTTP process attached after it
        # began (a replacement started a moment before) is told too
        self._draining: float | None = None

    # --- peers --------------------------------------------------------------------------

    async def attach(self, index: int, pid: int, sock: socket.socket) -> Peer:
        """Serve the HTTP process `index` over `sock` (the serving process's end)."""
        peer: Peer | None = None

        def on_messages(messages: list[Any]) -> None:
            assert peer is not None
            for message in messages:
                self._receive(peer, message)

        def on_closed() -> None:
            if peer is not None:
                self.detach(peer)

        channel = await Channel.over(sock, on_messages, on_closed)
        peer = Peer(index, pid, channel)
        self.peers[index] = peer
        self._send_statuses(peer)
        self._send_facts(peer)
        if self._draining is not None:
            channel.send(("drain", self._draining))
        return peer

    def detach(self, peer: Peer) -> None:
        """The HTTP process is gone: withdraw what it asked for."""
        if self.peers.get(peer.index) is peer:
            del self.peers[peer.index]
        self._gone_counts = self.merge([self._gone_counts, _counts(peer.families)])
        for running in peer.runs.values():
            running.cancel()
        if peer.runs:
            self.publish_soon()  # what they had queued has left the queue
            withdrawn = [peer.request_ids.get(rid, "") for rid in peer.runs]
            log.warning(
                "HTTP process %d is gone: %d request(s) under way withdrawn%s",
                peer.index,
                len(peer.runs),
                requests_named(withdrawn),
            )
        peer.request_ids.clear()
        for serving, stream in peer.streams.values():
            serving.close_stream(stream)
        peer.runs.clear()
        peer.streams.clear()
        self._announce_processes()

    def processes(self) -> list[dict[str, Any]]:
        """Every process of the server, for /info: an HTTP process once it accepts
        connections (a replacement is attached a moment before it listens)."""
        return [
            {"role": "serving", "pid": self.serving_pid},
            *(
                {"role": "http", "index": peer.index, "pid": peer.pid}
                for peer in sorted(self.peers.values(), key=lambda peer: peer.index)
                if peer.listening.is_set()
            ),
        ]

    async def announce(self) -> None:
        """Publish every model's state now and wait until each HTTP process has read it
        (before the log says the server is ready: a client that reads that line and
        sends a request at once finds every HTTP process knowing it)."""
        self.publish()
        self._send_statuses()
        loop = asyncio.get_running_loop()
        waits = []
        for peer in self.peers.values():
            token = next(self._ids)
            future: asyncio.Future[None] = loop.create_future()
            self._pings[token] = future
            waits.append(future)
            peer.channel.send(("ping", token))
        if waits:
            await asyncio.wait(waits, timeout=COLLECT_SECONDS)

    async def requests_answered(self, timeout: float) -> bool:
        """Wait until no HTTP process has a request under way (or `timeout` passes): the
        server's drain is done when every process's is. Each listening one says so
        ("drained"): a request whose body was still coming as the drain began is its own
        until its body is in (seen by its runs here alone, the drain ended at once and
        the HTTP processes were closed under it)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self._any_under_way(time.monotonic()):
            if loop.time() >= until:
                return False
            await asyncio.sleep(DRAIN_LOOK_SECONDS)
        return True

    def _any_under_way(self, now: float) -> bool:
        """Whether an HTTP process has a request under way: one handed here, or one of
        its own (a body coming) where it listens, has not said "drained", and still
        speaks."""
        return any(
            peer.runs
            or peer.streams
            or (
                peer.listening.is_set()
                and not peer.drained
                and now - peer.heard_at < DRAIN_SILENCE_SECONDS
            )
            for peer in self.peers.values()
        )

    def drain(self, grace: float) -> None:
        """Tell every HTTP process to stop accepting and finish what it has."""
        self._draining = grace
        for peer in self.peers.values():
            peer.channel.send(("drain", grace))

    # --- messages -----------------------------------------------------------------------

    def _receive(self, peer: Peer, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "run":
            _, rid, model, inputs, params, deadline, control, request_id = message
            named = REQUEST_ID.set(request_id)  # what its items' log lines in a worker name
            try:
                serving = self.models[model].serving
                self._begin(peer, rid, serving, inputs, params, deadline, control)
            finally:
                REQUEST_ID.reset(named)
            self.publish_soon()  # its items admitted (or refused)
        elif kind == "cancel":
            peer.request_ids.pop(message[1], None)
            running = peer.runs.pop(message[1], None)
            if running is not None:
                running.cancel()
                self.publish_soon()  # what was still queued has left the queue
        elif kind == "close_stream":
            opened = peer.streams.pop(message[1], None)
            if opened is not None:
                opened[0].close_stream(opened[1])
        elif kind == "statuses":  # /info: every model's status now
            statuses = [(self._status(model), model.serving.loaded) for model in self.models]
            peer.channel.send(("statuses", message[1], statuses))
        elif kind == "scrape":
            asyncio.ensure_future(self._scrape(peer, message[1]))
        elif kind == "pong":
            ping = self._pings.pop(message[1], None)
            if ping is not None and not ping.done():
                ping.set_result(None)
        elif kind == "listening":
            peer.listening.set()
            self._announce_processes()
        elif kind == "samples":
            _, token, families = message
            peer.families = families
            collecting = self._collecting.get(token)
            if collecting is not None:
                done, waiting = collecting
                waiting.discard(peer.index)
                if not waiting and not done.done():
                    done.set_result(None)
        elif kind == "alive":
            peer.silent_looks = 0
            peer.heard_at = time.monotonic()
        elif kind == "drained":
            peer.drained = True

    def _begin(
        self,
        peer: Peer,
        rid: int,
        serving: ModelService,
        inputs: Any,
        params: Any,
        deadline: float,
        control: Any,
    ) -> None:
        """Carry out one request of an HTTP process; its answer goes back when it ends
        (none if the request is cancelled: its client left, or its HTTP process did)."""
        if control.stream_id is not None:  # the HTTP process's stream id: open one here
            local = control.stream_id

            def on_token(chunk: TokenChunk) -> None:
                peer.channel.send(("token", local, chunk))

            stream = serving.open_stream(on_token)
            peer.streams[local] = (serving, stream)
            control = replace(control, stream_id=stream)

        def on_end(results: list[ItemResult] | None, error: BaseException | None) -> None:
            peer.runs.pop(rid, None)
            peer.request_ids.pop(rid, None)
            self.publish_soon()  # what was still queued has left the queue
            self._answer(peer, rid, results, error)

        peer.request_ids[rid] = REQUEST_ID.get()
        try:
            peer.runs[rid] = serving.begin(inputs, params, deadline, control, on_end)
        except Exception as exc:  # noqa: BLE001 - refused at admission, or a bug: answered
            peer.request_ids.pop(rid, None)
            self._answer(peer, rid, None, exc)

    def _answer(
        self, peer: Peer, rid: int, results: list[ItemResult] | None, error: BaseException | None
    ) -> None:
        if error is None:
            peer.channel.send(("done", rid, results))
        elif isinstance(error, Refused):
            peer.channel.send(("refused", rid, error.refusal))
        else:
            log.error("a request from HTTP process %d failed", peer.index, exc_info=error)
            peer.channel.send(("failed", rid))

    async def _scrape(self, peer: Peer, rid: int) -> None:
        token = next(self._ids)
        done = asyncio.get_running_loop().create_future()
        # (one still starting has no metrics yet, and would answer once it has imported)
        others = [other for other in self.peers.values() if other.listening.is_set()]
        waiting = {other.index for other in others}
        self._collecting[token] = (done, waiting)
        for other in others:
            other.channel.send(("collect", token))
        try:
            if others:
                await asyncio.wait_for(done, COLLECT_SECONDS)
        except TimeoutError:
            log.warning("/metrics: not every HTTP process gave its metrics in time")
        finally:
            del self._collecting[token]
        # every process there now (one gone meanwhile is in `_gone_counts`); one that
        # did not answer in time by its counters as last given (its gauges are stale)
        families = [
            _counts(other.families) if index in waiting else other.families
            for index, other in self.peers.items()
        ]
        merged = self.merge([self.own_families(), self._gone_counts, *families])
        peer.channel.send(("scraped", rid, merged))

    # --- publishing ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.publish()
        self._publisher = asyncio.ensure_future(self._publish_loop())

    async def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)

    async def _publish_loop(self) -> None:
        for turn in itertools.count():
            await asyncio.sleep(PUBLISH_SECONDS)
            self.publish()
            if turn % STATUS_EVERY == 0:
                self._send_statuses()
            if turn % KEEP_METRICS_EVERY == 0:
                self._keep_metrics()

    def _keep_metrics(self) -> None:
        """Ask every HTTP process listening for its metrics, no scrape waiting: each keeps
        them (`Peer.families`) for when it dies."""
        token = next(self._ids)
        for peer in self.peers.values():
            if peer.listening.is_set():
                peer.channel.send(("collect", token))

    def publish_soon(self) -> None:
        """Publish at the end of this event-loop pass (once, however often asked)."""
        if not self._publish_due:
            self._publish_due = True
            (self._loop or asyncio.get_running_loop()).call_soon(self.publish)

    def publish(self) -> None:
        """Bring the board up to date with every model's queue."""
        self._publish_due = False
        for index, model in enumerate(self.models):
            serving = model.serving
            # (a queue at its bound has no headroom)
            full, ready = serving.headroom < FRONT_HEADROOM, serving.ready
            # the wait a refusal asks for: a restart's while none serves (its queue, full
            # of what waits for it, would ask its drain's second), else a full queue's
            retry_after = serving.back_in if not ready else model.retry_after() if full else None
            self.board.publish(
                index,
                ready=ready,
                healthy=model.last_status.healthy if model.last_status else True,
                full=full,
                retry_after=retry_after,
            )

    def _status(self, model: BridgedModel) -> ServingStatus:
        snapshot = model.serving.snapshot()
        if snapshot.loading_seconds is not None:  # tenths: not a message every pass
            snapshot = replace(snapshot, loading_seconds=round(snapshot.loading_seconds, 1))
        return snapshot

    def _send_statuses(self, peer: Peer | None = None) -> None:
        """Each model's status to `peer` (a new one), or to every peer where it changed
        more than a worker turning busy or idle (see `_lasting`)."""
        for index, model in enumerate(self.models):
            status, loaded = self._status(model), model.serving.loaded
            lasting = _lasting(status)
            changed = lasting != model.last_lasting or loaded is not model.last_loaded
            model.last_status, model.last_loaded = status, loaded
            model.last_lasting = lasting
            if changed:
                for each in self.peers.values():
                    each.channel.send(("status", index, status, loaded))
            elif peer is not None:
                peer.channel.send(("status", index, status, loaded))

    def send_facts(self) -> None:
        """Every model's facts to every HTTP process (they changed: a layout trial)."""
        for peer in self.peers.values():
            self._send_facts(peer)

    def _send_facts(self, peer: Peer) -> None:
        for index, model in enumerate(self.models):
            peer.channel.send(("facts", index, dict(model.facts)))

    def _announce_processes(self) -> None:
        processes = self.processes()
        for peer in self.peers.values():
            peer.channel.send(("processes", processes))


def _counts(families: list[Family]) -> list[Family]:
    """`families` less the gauges: what a process counted, which stays true of it once it
    is gone or silent (a gauge says how it is now)."""
    return [family for family in families if family[1] != "gauge"]


def _lasting(status: ServingStatus) -> ServingStatus:
    """`status` less what moves with every batch under load (a worker busy or idle, the
    sequences it runs now). Sent on each such change, a status crossed to every HTTP
    process at every pass (~5 ms) under load, pickled with its enums; what the HTTP
    processes read of it (a model loading, warming, restarting) is kept, and /info asks
    for a fresh one."""
    if not any(worker.state is WorkerState.BUSY or worker.running for worker in status.workers):
        return status
    settled = tuple(
        replace(worker, running=0, state=_settled(worker.state)) for worker in status.workers
    )
    return replace(status, workers=settled)


def _settled(state: WorkerState) -> WorkerState:
    return WorkerState.IDLE if state is WorkerState.BUSY else state


class PublishingBackend:
    """A scheduler's backend that has the board published whenever a batch leaves the
    queue, so that no HTTP process reads "full" of a queue that has room."""

    def __init__(self, backend: Backend, published: Callable[[], None]):
        self.backend = backend
        self.published = published

    def idle_workers(self) -> int:
        return self.backend.idle_workers()

    def empty_workers(self) -> int:
        return self.backend.empty_workers()

    def batch_cap(self) -> int | None:
        return self.backend.batch_cap()

    @property
    def limits(self) -> ModelLimits:
        return self.backend.limits

    def concurrency(self) -> int:
        return self.backend.concurrency()

    def rows_when_ready(self) -> int:
        return self.backend.rows_when_ready()

    def abandon(
        self, future: asyncio.Future[BatchResult], items: Collection[int] | None = None
    ) -> None:
        self.backend.abandon(future, items)

    def submit(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        control: Control,
        request_ids: Sequence[str] = (),
        admitted: Sequence[float] = (),
        on_part: PartAnswered | None = None,
    ) -> asyncio.Future[BatchResult]:
        self.published()
        return self.backend.submit(inputs, params, control, request_ids, admitted, on_part)

    def serving_again_at(self) -> float | None:
        return self.backend.serving_again_at()

    def died_with(self, future: asyncio.Future[BatchResult], place: int) -> int:
        return self.backend.died_with(future, place)

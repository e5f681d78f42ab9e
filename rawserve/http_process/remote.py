"""The `Serving` face of each model inside an HTTP process: a client of the channel to
the serving process (rawserve.serving.bridge), so that the API side does not change.

`Link` is the process's end of that channel: requests by id, their answers, the token
streams' listeners, the latest status of each model and the list of processes.
A request that the serving process leaves unanswered past its deadline is answered here
(`LateWatch`).
`RemoteServing` is one model's face over it. What a request needs at once (is the queue
full, is a worker ready) is read from the `Board` the serving process publishes,
without a message; `snapshot` and `loaded` are the latest the serving process sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from rawserve.serving.face import (
    NO_CONTROL,
    Control,
    ItemResult,
    LoadState,
    Reason,
    Refusal,
    Refused,
    ServingStatus,
    TokenChunk,
    WorkerReady,
    deadline_passed,
    shutting_down,
)
from rawserve.shared.board import FULL, HEALTHY, READY, Board
from rawserve.shared.channel import Channel
from rawserve.shared.late_watch import LateWatch
from rawserve.shared.logs import REQUEST_ID

log = logging.getLogger("rawserve")

# An answer later than this past its deadline means the serving process is stuck: the
# request is answered 504 here (the serving process answers on time while it runs).
LATE_SECONDS = 1.0
SCRAPE_SECONDS = 5.0  # how long /metrics waits for the serving process's merged families
# The serving process writes the board every 5 ms; this long without a write, it is
# stopped or stuck, and `/health` answers 503 so that an orchestrator restarts the server
# (its own passes take milliseconds; a liveness probe acts after several failures)
SERVING_SILENT_SECONDS = 10.0
# This long without a write, `/ready` is 503 ("stalled") so that a load balancer sends
# new work elsewhere: what is sent here waits for the serving process to go on
SERVING_STALLED_SECONDS = 2.0
# the serving side's text for a full queue (rawserve.serving.driver), said here at once
QUEUE_FULL_MESSAGE = "server busy: queue full"
NOT_LOADED = ServingStatus(
    ready=False,
    healthy=True,
    full=False,
    max_batch_size=0,
    load_state=LoadState.LOADING,
    loading_seconds=None,
    workers=(),
)

Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]


class Rejections(Protocol):
    """What a model's face counts (rawserve.ops.metrics.ModelMetrics)."""

    def drop(self, reason: str, count: int = 1) -> None: ...


class Link:
    """The HTTP process's end of its channel to the serving process."""

    def __init__(
        self,
        board: Board,
        families: Callable[[], list[Family]],
        on_drain: Callable[[float], None],
        on_lost: Callable[[], None],
    ):
        self.board = board
        self.families = families  # this process's own metrics, when a scrape asks
        self.on_drain = on_drain
        self.on_lost = on_lost
        self.channel: Channel | None = None
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.streams: dict[int, Callable[[TokenChunk], None]] = {}
        self.statuses: dict[int, tuple[ServingStatus, WorkerReady | None]] = {}
        self.processes: list[dict[str, Any]] = []
        self.facts: list[dict[str, Any]] = []  # each model's for /info, as last sent
        self.late = LateWatch(self.on_late)
        self._ids = itertools.count(1)

    async def connect(self, sock: socket.socket) -> None:
        self.channel = await Channel.over(sock, self.receive, self.lost)

    def send(self, message: tuple[Any, ...]) -> None:
        assert self.channel is not None, "connect() first"
        self.channel.send(message)

    def next_id(self) -> int:
        return next(self._ids)

    def ask(self, message: tuple[Any, ...]) -> asyncio.Future[Any]:
        """Send `message` (its second field: a new id) and a future of its answer: a
        refusal where the serving process is gone (`lost` failed those pending then; one
        asked after it was sent nowhere, and its client's connection closed unanswered
        as this process exited)."""
        future = asyncio.get_running_loop().create_future()
        if self.channel is not None and self.channel.closed:
            future.set_exception(shutting_down())
            return future
        self.pending[message[1]] = future
        self.send(message)
        return future

    async def scrape(self) -> list[Family] | None:
        """Every process's metric families, merged by the serving process; None (said in
        a warning) when it does not answer: this process's alone hold a part of every
        counter, and a sum that fell reads, to Prometheus's rate(), as a reset."""
        rid = self.next_id()
        try:
            families: list[Family] = await asyncio.wait_for(
                self.ask(("scrape", rid)), SCRAPE_SECONDS
            )
            return families
        except (TimeoutError, Refused):
            log.warning("/metrics: the serving process did not answer; no metrics this time")
            return None
        finally:
            self.pending.pop(rid, None)

    async def refresh(self) -> None:
        """Every model's status as the serving process sees it now (for /info)."""
        rid = self.next_id()
        try:
            statuses = await asyncio.wait_for(self.ask(("statuses", rid)), SCRAPE_SECONDS)
        except (TimeoutError, Refused):
            return  # the last ones sent stand
        finally:
            self.pending.pop(rid, None)
        for index, status in enumerate(statuses):
            self.statuses[index] = status

    def receive(self, messages: list[Any]) -> None:
        for message in messages:
            kind = message[0]
            if kind in ("done", "scraped", "statuses"):
                future = self.pending.pop(message[1], None)
                if future is not None and not future.done():
                    future.set_result(message[2])
            elif kind == "token":
                listener = self.streams.get(message[1])
                if listener is not None:
                    listener(message[2])
            elif kind == "refused" or kind == "failed":
                future = self.pending.pop(message[1], None)
                if future is not None and not future.done():
                    if kind == "refused":
                        future.set_exception(Refused(message[2]))
                    else:
                        future.set_exception(RuntimeError("the serving process failed it"))
            elif kind == "status":
                self.statuses[message[1]] = (message[2], message[3])
            elif kind == "processes":
                self.processes = message[1]
            elif kind == "facts" and message[1] < len(self.facts):
                facts = self.facts[message[1]]  # the served model's own: /info reads it
                facts.clear()
                facts.update(message[2])
            elif kind == "ping":  # read up to here: what was sent before is known
                self.send(("pong", message[1]))
            elif kind == "collect":
                self.send(("samples", message[1], self.families()))
            elif kind == "drain":
                self.on_drain(message[1])

    def on_late(self, rid: int) -> None:
        """The run `rid` is late: the serving process is stuck, or lost its answer."""
        future = self.pending.pop(rid, None)
        if future is not None and not future.done():
            self.send(("cancel", rid))
            future.set_exception(deadline_passed())

    def lost(self) -> None:
        """The serving process is gone: nothing pending will be answered."""
        self.refuse_pending()
        self.on_lost()

    def refuse_pending(self) -> None:
        """Answer what is pending as a server stopping does (503), the serving process
        gone, or silent past a drain's end."""
        gone = shutting_down()
        for future in self.pending.values():
            if not future.done():
                future.set_exception(gone)
        self.pending.clear()


class RemoteServing:
    """One model's `Serving` face (rawserve.serving.face) in an HTTP process."""

    def __init__(self, link: Link, index: int, metrics: Rejections | None = None):
        self.link = link
        self.index = index
        self.board = link.board
        self.metrics = metrics

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        link = self.link
        rid = link.next_id()
        request_id = REQUEST_ID.get()  # the request this task answers (set by the protocol)
        message = (
            "run",
            rid,
            self.index,
            list(inputs),
            dict(params),
            deadline,
            control,
            request_id,
        )
        future = link.ask(message)
        # answered with Refused when late (a deadline already passed: LATE_SECONDS from now)
        link.late.watch(rid, max(deadline, time.monotonic()) + LATE_SECONDS)
        try:
            results: list[ItemResult] = await future
            return results
        except asyncio.CancelledError:
            # (awaiting it, the future was cancelled with the task, unless answered)
            if future.cancelled() or not future.done():
                link.send(("cancel", rid))  # the client left: its items are withdrawn
            raise
        finally:
            link.pending.pop(rid, None)
            link.late.forget(rid)

    def admission(self, deadline: float | None = None) -> Refusal | None:
        # (the board says only whether the queue is full: a deadline is the serving
        # process's to judge, with the request)
        if not self.board.flag(self.index, FULL):
            return None
        self.count_refusal()
        return Refusal(Reason.QUEUE_FULL, QUEUE_FULL_MESSAGE, self.board.retry_after(self.index))

    def count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.drop("rejected")

    @property
    def ready(self) -> bool:
        return self.board.flag(self.index, READY) and self.loaded is not None

    @property
    def full(self) -> bool:
        return self.board.flag(self.index, FULL)

    @property
    def most_admitted(self) -> int | None:
        status = self.link.statuses.get(self.index)
        return status[0].most_admitted if status else None

    @property
    def back_in(self) -> float | None:
        # a model not ready has its restart's wait where a full queue has its own
        return None if self.ready else self.board.retry_after(self.index)

    @property
    def loaded(self) -> WorkerReady | None:
        status = self.link.statuses.get(self.index)
        return status[1] if status else None

    def snapshot(self) -> ServingStatus:
        status = self.link.statuses.get(self.index)
        snapshot = status[0] if status else NOT_LOADED
        silent = self.board.age(self.index)
        ready = self.ready
        load_state, loading_seconds = snapshot.load_state, snapshot.loading_seconds
        if not ready and snapshot.ready:
            # the board tells of a worker's death before the status that says so: a model
            # that served is restarting, not loading, to the clients it refuses meanwhile
            load_state = LoadState.RESTARTING
        stalled = silent >= SERVING_STALLED_SECONDS
        if stalled:  # (loading or not: its last word's elapsed time would stand still)
            load_state, loading_seconds = LoadState.STALLED, silent
        return replace(
            snapshot,
            ready=ready and not stalled,
            full=self.full,
            full_retry_after=self.board.retry_after(self.index) if self.full else None,
            # one stopped or stuck writes nothing, and `/health` must say so, as it would
            # if this process were that one
            healthy=self.board.flag(self.index, HEALTHY) and silent < SERVING_SILENT_SECONDS,
            load_state=load_state,
            loading_seconds=loading_seconds,
        )

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int:
        stream = self.link.next_id()
        self.link.streams[stream] = on_token
        return stream

    def close_stream(self, stream_id: int) -> None:
        if self.link.streams.pop(stream_id, None) is not None:
            self.link.send(("close_stream", stream_id))

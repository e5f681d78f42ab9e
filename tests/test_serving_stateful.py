"""A model-based test of the serving side: the scheduler's driver over the real worker pool,
the worker processes faked, on an event loop whose clock only the test moves.

Hypothesis drives random interleavings of what happens to a served model: requests arrive
(one input or several, with one of two batch keys, generations, streamed generations;
deadlines near and far), clients leave, the clock moves (the loop's timers fire at their
times: deadlines, batch delays, batch timeouts, restart backoffs), workers load, answer
their batches (in order, or a continuous worker's in any order; some inputs failing),
stream tokens, crash mid-batch and come back, and the server shuts down. After every step
the serving side is checked against a plain record of the requests: a request admitted
ends exactly once and by its deadline (unless its client left first, and then it is never
heard), each answer is its own input's, no input is sent to a worker once its request
has ended, no item waits queued beside an idle worker, the queue, the batches in flight
and the dropped-item counts agree with the record, and after the shutdown nothing is
left behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from rawserve.serving import pool as pool_module
from rawserve.serving.core import SchedulerCore
from rawserve.serving.driver import Scheduler
from rawserve.serving.handles import WorkerHandle
from rawserve.serving.pool import WorkerPool
from rawserve.serving.refusals import Reason, Refused
from rawserve.serving.status import WorkerState
from rawserve.serving.supervision import (
    CRASHED_ALONE,
    CRASHED_MID_STREAM,
    REFUSED_POISON,
    STOPPED_MID_STREAM,
    TIMED_OUT,
    PoisonMemory,
)
from rawserve.shared.messages import (
    NO_CONTROL,
    Batch,
    BatchResult,
    Cancel,
    Control,
    FailureKind,
    ItemFailure,
    Shutdown,
    TokenChunk,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
)

# Times are multiples of 1/64 s: their sums and differences are exact, so a timer set for
# a deadline fires at the deadline itself.
TICK = 1 / 64
TIMEOUTS = [4 * TICK, 0.5, 2.0, 8.0]
KINDS = {  # a request's parameters, and how many inputs it may have
    "plain": ({}, [1, 1, 2, 3, 12]),
    "other key": ({"top_k": 1}, [1, 2]),
    "generation": ({"max_new_tokens": 8}, [1, 2]),
    "stream": ({"max_new_tokens": 8}, [1]),
}
BATCH_TIMEOUT = 4.0
# what supervision answers for an input in place of the model
SUPERVISION_OUTPUTS = (CRASHED_ALONE, CRASHED_MID_STREAM, STOPPED_MID_STREAM, TIMED_OUT)
ADMISSION_REASONS = {Reason.QUEUE_FULL, Reason.DEADLINE_UNREACHABLE, Reason.NEVER_ADMISSIBLE}
TOKEN = {"id": 1, "text": "a", "logprob": 0.0, "special": False}


class TestClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is the test's: a timer fires once the test moves the clock
    to it, never by waiting. The fake workers' replies are handed to the pool directly,
    so there is nothing to read."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def add_reader(self, fd: Any, callback: Any, *args: Any) -> None:
        pass

    def remove_reader(self, fd: Any) -> bool:
        return False

    # (what is ready and what is scheduled are read from the loop's own lists: asyncio has
    # no public way to ask)
    def next_timer(self) -> float | None:
        return min((h.when() for h in self._scheduled if not h.cancelled()), default=None)

    def run_ready(self) -> None:
        """Run callbacks until none is ready and no timer is due (a bound catches a spin)."""
        for _ in range(10_000):
            self.call_soon(self.stop)
            self.run_forever()
            due = self.next_timer()
            if not self._ready and (due is None or due > self.now):
                return
        raise AssertionError("the event loop never settles: something spins")


class FakeProcess:
    pids = itertools.count(1000)

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.exitcode: int | None = None
        self.reaped = False

    def kill(self) -> None:
        if self.exitcode is None:
            self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        pass


class FakeConn:
    """A worker process's batch pipe: what it was sent, and which batches it answered."""

    def __init__(self, process: FakeProcess, on_batch) -> None:
        self.process = process
        self.on_batch = on_batch
        self.batches: list[Batch] = []
        self.answered: set[int] = set()
        self.cancelled: set[int] = set()

    def send(self, message: Any) -> None:
        if isinstance(message, Batch):
            # a worker told that nobody waits for a batch stops any batch of that id
            assert message.batch_id not in self.cancelled, "a batch under a cancelled id"
            assert all(b.batch_id != message.batch_id for b in self.batches), "an id sent twice"
            self.on_batch(message)
            self.batches.append(message)
        elif isinstance(message, Cancel):
            self.cancelled.add(message.batch_id)
        elif isinstance(message, Shutdown) and self.process.exitcode is None:
            self.process.exitcode = 0

    def unanswered(self) -> list[Batch]:
        return [b for b in self.batches if b.batch_id not in self.answered]


class NoReplies:
    """A reply pipe with never anything to read (the replies are handed to the pool)."""

    closed = True

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        pass


class Counts:
    """The scheduler's and the pool's metrics."""

    def __init__(self) -> None:
        self.dropped: Counter[str] = Counter()
        self.calls: list[int] = []  # the sizes of the model calls observed

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] += count

    def observe_batch(self, size: int, compute_seconds: float) -> None:
        assert size > 0
        self.calls.append(size)

    def observe_queue(self, waits) -> None:
        assert waits and min(waits) >= 0


@dataclass(eq=False)
class Request:
    """What the test knows of a request: the reference the serving side is checked by."""

    number: int
    inputs: list[str]
    params: dict[str, Any]
    deadline: float
    stream_id: int | None = None
    running: Any = None
    admitted: bool = False
    too_long: bool = False  # refused 413: more items than could ever be queued
    cancelled: bool = False
    ends: list[tuple[float, list | None, BaseException | None]] = field(default_factory=list)
    unsent_at_end: int = 0  # its inputs never sent to a worker when it ended or was withdrawn
    tokens: int = 0

    @property
    def live(self) -> bool:
        return self.admitted and not self.cancelled and not self.ends

    @property
    def outcome(self) -> Reason | str | None:
        if not self.ends:
            return None
        _, results, error = self.ends[0]
        return "results" if results is not None else error.refusal.reason  # type: ignore[union-attr]


class Serving:
    """One model's scheduler and worker pool on a `TestClockLoop`, their worker processes
    faked: the test plays the clients, the clock and the workers."""

    def __init__(
        self,
        *,
        workers: int = 1,
        kind: str = "whole",
        max_batch_size: int = 4,
        max_queue: int = 16,
        delay: float = 0.0,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        self.loop = TestClockLoop()
        self.errors: list[dict] = []
        self.loop.set_exception_handler(lambda _, context: self.errors.append(context))
        self.requests: list[Request] = []
        self.owner: dict[str, Request] = {}
        self.sent: set[str] = set()  # inputs sent to a worker, once or more
        self.computed: set[str] = set()  # inputs a worker answered
        self.calls: list[int] = []  # the sizes of the batches a worker answered
        self.sent_after_end: list[str] = []
        self.conns: dict[int, FakeConn] = {}  # by pid
        self.sequences = 3 if kind == "continuous" else 0
        self.delay = delay
        self.stopped = False
        self.counts = Counts()
        monkeypatch.setattr(pool_module, "start_process", self.start_process)
        self.pool = WorkerPool(
            WorkerConfig(model="fake"),
            ["cpu"] * workers,
            batch_timeout=BATCH_TIMEOUT,
            overlap=kind == "overlap",
            metrics=self.counts,
            loop=self.loop,
            clock=self.loop.time,
        )
        core = SchedulerCore(
            max_queue=max_queue, max_batch_size=max_batch_size, max_batch_delay=delay
        )
        self.scheduler = Scheduler(
            core, self.pool, clock=self.loop.time, loop=self.loop, metrics=self.counts
        )
        self.pool.on_idle = self.scheduler.wake
        self.act(self.scheduler.start)
        self.act(self.pool.start)

    def start_process(self, context: Any, worker: WorkerHandle) -> tuple[Any, Any]:
        process = FakeProcess()
        conn = FakeConn(process, self.on_batch)
        self.conns[process.pid] = conn
        worker.process, worker.conn = process, conn  # type: ignore[assignment]
        worker.cancelled_stream = type("Shared", (), {"value": 0})()
        return process, NoReplies()

    def act(self, action, *args) -> None:
        """Run `action` on the loop, and everything it sets off that is due now."""
        self.loop.call_soon(action, *args)
        self.loop.run_ready()

    def close(self) -> None:
        self.loop.close()

    # --- the clients -----------------------------------------------------------------

    def arrive(
        self, inputs: list[str], params: dict, timeout: float, stream=False, awaited=False
    ) -> Request:
        """A request begun (`Scheduler.begin`, as behind HTTP processes), or `awaited` by
        a task (`Scheduler.run`)."""
        request = Request(len(self.requests), inputs, dict(params), self.loop.now + timeout)
        self.requests.append(request)
        self.owner.update(dict.fromkeys(inputs, request))
        control = NO_CONTROL
        if stream:
            request.stream_id = self.pool.open_stream(lambda chunk: self.on_token(request))
            control = Control(stream_id=request.stream_id)

        def begin() -> None:
            try:
                request.running = self.scheduler.begin(
                    inputs,
                    request.params,
                    request.deadline,
                    control,
                    lambda results, error: self.on_end(request, results, error),
                )
            except Refused as refused:
                assert refused.refusal.reason in ADMISSION_REASONS
                self.refused(request, refused)
                return
            request.admitted = True

        def run() -> None:
            request.admitted = True  # (unless the task is refused at once)
            task = self.loop.create_task(
                self.scheduler.run(inputs, request.params, request.deadline, control)
            )
            request.running = task
            task.add_done_callback(lambda task: self.on_done(request, task))

        self.act(run if awaited else begin)
        return request

    def on_done(self, request: Request, task: asyncio.Task) -> None:
        if task.cancelled():  # its client left
            return
        error = task.exception()
        if isinstance(error, Refused) and error.refusal.reason in ADMISSION_REASONS:
            self.refused(request, error)
            return
        self.on_end(request, None if error else task.result(), error)

    def refused(self, request: Request, refused: Refused) -> None:
        request.admitted = False
        request.too_long = refused.refusal.reason is Reason.NEVER_ADMISSIBLE
        self.end_stream(request)

    def on_end(self, request: Request, results, error) -> None:
        assert not request.cancelled, "heard after its client left"
        request.ends.append((self.loop.now, results, error))
        request.unsent_at_end = sum(value not in self.sent for value in request.inputs)
        self.end_stream(request)

    def end_stream(self, request: Request) -> None:
        if request.stream_id is not None:
            self.pool.close_stream(request.stream_id)

    def on_token(self, request: Request) -> None:
        assert request.live, "a token for a request that has ended"
        request.tokens += 1

    def leave(self, request: Request) -> None:
        def cancel() -> None:
            request.cancelled = True
            request.unsent_at_end = sum(value not in self.sent for value in request.inputs)
            request.running.cancel()
            self.end_stream(request)

        self.act(cancel)

    # --- the clock -------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the clock, stopping at every timer on the way (each fires at its time)."""
        target = self.loop.now + seconds
        while (due := self.loop.next_timer()) is not None and due <= target:
            self.loop.now = max(self.loop.now, due)
            self.loop.run_ready()
        self.loop.now = target
        self.loop.run_ready()

    # --- the workers -----------------------------------------------------------------

    def on_batch(self, batch: Batch) -> None:
        assert 1 <= len(batch.inputs) <= self.scheduler.core.max_batch_size
        for value in batch.inputs:
            request = self.owner[value]
            assert batch.params == request.params, "inputs of two batch keys in one batch"
            if not request.live:
                self.sent_after_end.append(value)
            self.sent.add(value)

    def alive(self) -> list[tuple[WorkerHandle, FakeConn]]:
        """Each worker with a process (running, or dead and not yet reaped)."""
        return [
            (w, self.conns[w.process.pid])
            for w in self.pool.workers
            if w.process is not None and not w.process.reaped  # type: ignore[attr-defined]
        ]

    def answerable(self) -> list[tuple[WorkerHandle, FakeConn, Batch]]:
        """The batches a worker may answer next: the first it holds, a continuous
        worker's any."""
        found = []
        for worker, conn in self.alive():
            waiting = conn.unanswered()
            found += [(worker, conn, batch) for batch in waiting[: None if self.sequences else 1]]
        return found

    def answer(self, worker: WorkerHandle, conn: FakeConn, batch: Batch, failing=()) -> None:
        outputs = tuple(
            ItemFailure(FailureKind.INPUT, f"bad {value}") if value in failing else ("out", value)
            for value in batch.inputs
        )
        conn.answered.add(batch.batch_id)
        if conn.process.exitcode is None:  # (a killed worker's answer is not read)
            self.computed.update(batch.inputs)
            self.calls.append(len(batch.inputs))
        self.act(self.pool._on_message, worker, BatchResult(batch.batch_id, outputs, 2 * TICK))

    def stream_a_token(self, worker: WorkerHandle, batch: Batch) -> None:
        assert batch.control.stream_id is not None
        self.act(self.pool._on_message, worker, TokenChunk(batch.control.stream_id, 0, TOKEN))

    def loading(self) -> list[WorkerHandle]:
        return [
            w
            for w, conn in self.alive()
            if w.state is WorkerState.LOADING and conn.process.exitcode is None
        ]

    def load(self, worker: WorkerHandle) -> None:
        assert worker.process is not None
        ready = WorkerReady(
            worker.process.pid, "text-generation", "cpu", "float32", 0.1, sequences=self.sequences
        )
        self.act(self.pool._on_message, worker, ready)

    def crash(self, worker: WorkerHandle) -> None:
        """The worker's process dies (mid-batch or not), and its pipe's end is read."""
        worker.process.kill()  # type: ignore[union-attr]
        self.reap(worker)

    def reap(self, worker: WorkerHandle) -> None:
        process = worker.process
        process.reaped = True  # type: ignore[union-attr]
        self.act(self.pool._on_exit, worker, process)

    def reap_the_killed(self) -> None:
        """The workers the pool killed (a batch ran over its timeout) are seen to exit."""
        for worker, conn in self.alive():
            if conn.process.exitcode is not None:
                self.reap(worker)

    def shut_down(self) -> None:
        """What the server does once its grace is over: the queue answered 503, then the
        workers stopped (those still running killed, their batches answered 503)."""
        self.stopped = True
        self.loop.run_until_complete(self.scheduler.stop())
        self.loop.run_until_complete(self.pool.shutdown(wait=True))
        self.reap_the_killed()
        self.loop.run_ready()

    # --- the checks ------------------------------------------------------------------

    def check(self) -> None:
        assert self.errors == [], self.errors
        assert self.sent_after_end == [], "computed for a request that had ended"
        for request in self.requests:
            self.check_request(request)
        self.check_books()

    def check_request(self, request: Request) -> None:
        assert len(request.ends) <= 1, request.ends
        if request.admitted and not request.cancelled and self.loop.now >= request.deadline:
            assert request.ends, f"request {request.number} outlived its deadline"
        for when, results, error in request.ends:
            if results is None:
                assert isinstance(error, Refused), error
                if error.refusal.reason is Reason.DEADLINE_PASSED:
                    assert when >= request.deadline
                else:
                    assert error.refusal.reason is Reason.SHUTTING_DOWN, error
                continue
            assert when < request.deadline, "answered past its deadline"
            assert len(results) == len(request.inputs)
            for value, result in zip(request.inputs, results, strict=True):
                own = (("out", value), ItemFailure(FailureKind.INPUT, f"bad {value}"))
                assert result.output in own or result.output in SUPERVISION_OUTPUTS, (
                    value,
                    result.output,
                )

    def check_books(self) -> None:
        scheduler, core = self.scheduler, self.scheduler.core
        queued = [item for queue in core._queues.values() for item in queue]
        # (and as many more as one-item workers' free rows took at once: a batch each)
        rows = core.workers if core.max_batch_size == 1 else 0
        assert len(core) == len(queued) <= core.max_queue + rows
        assert core.queued_tokens() == sum(item.cost for item in queued)
        for item in queued:
            assert item.queued and self.owner[item.input].live, "a withdrawn item left queued"
        assert len(scheduler._runs) == sum(r.live for r in self.requests)
        assert scheduler.in_flight == sum(len(batch) for batch in scheduler._sent.values())
        assert len(core._in_flight) == len(scheduler._sent)
        if not self.stopped and self.delay == 0 and self.pool.idle_workers():
            ready = [item for item in queued if core._can_finish(item, self.loop.now)]
            assert ready == [], "queued beside a free worker"
        # every item answered without a model call is counted once, by why
        # (a 413 is the client's to fix: no load was shed)
        refused = [r for r in self.requests if not r.admitted and not r.too_long]
        assert self.counts.dropped["rejected"] == sum(len(r.inputs) for r in refused)
        # every model call in the batch metrics, once, a run again alone after a crash too
        assert sorted(self.counts.calls) == sorted(self.calls)
        # (and those a worker lost, if the pool does not run them again: as many as were
        # sent and never computed, at most)
        for reason, ended in (
            ("disconnected", [r for r in self.requests if r.cancelled]),
            ("expired", [r for r in self.requests if r.outcome is Reason.DEADLINE_PASSED]),
        ):
            unsent = sum(r.unsent_at_end for r in ended)
            lost = sum(v in self.sent and v not in self.computed for r in ended for v in r.inputs)
            assert unsent <= self.counts.dropped[reason] <= unsent + lost, reason

    def check_nothing_is_left(self) -> None:
        """After the shutdown: every request admitted ended, and nothing is held."""
        for request in self.requests:
            if request.admitted and not request.cancelled:
                assert len(request.ends) == 1, f"request {request.number} never ended"
        assert len(self.scheduler.core) == 0 and self.scheduler.in_flight == 0
        assert self.scheduler.core._in_flight == {} and self.scheduler._sent == {}
        assert self.scheduler._runs == {}
        assert not self.pool._retries and not self.pool._tasks
        assert self.pool.streams._listeners == {}
        assert self.errors == [], self.errors


# --- what the model-based test found, each on its own ------------------------------------


@pytest.fixture
def loaded(monkeypatch):
    """Makes a `Serving` whose one worker has loaded (closed after the test)."""
    made: list[Serving] = []

    def make(**options) -> Serving:
        made.append(Serving(monkeypatch=monkeypatch, **options))
        made[-1].load(made[-1].pool.workers[0])
        return made[-1]

    yield make
    for serving in made:
        serving.close()


@pytest.fixture
def serving(loaded):
    return loaded()


def sent(serving: Serving) -> list[tuple[str, ...]]:
    return [batch.inputs for conn in serving.conns.values() for batch in conn.batches]


@pytest.mark.parametrize("ended", ["before the crash", "after it"])
def test_an_input_whose_request_ended_is_not_run_again_after_a_crash(serving, ended):
    """A batch lost in a crash runs again an item at a time, ahead of the queue: an item
    whose request has ended (504 at its deadline, or its client left) ran for nobody,
    while the queue waited behind it."""
    worker = serving.pool.workers[0]
    busy = serving.arrive(["busy"], {}, timeout=8.0)
    short = serving.arrive(["short"], {}, timeout=0.5)
    long = serving.arrive(["long"], {}, timeout=8.0)
    serving.answer(*serving.answerable()[0])
    assert sent(serving) == [("busy",), ("short", "long")] and busy.outcome == "results"
    if ended == "before the crash":
        serving.advance(1.0)
    serving.crash(worker)
    serving.advance(1.0)  # the short deadline has passed before the worker is back
    assert short.outcome is Reason.DEADLINE_PASSED
    serving.load(worker)
    assert sent(serving)[2:] == [("long",)]  # only the input someone waits for
    serving.answer(*serving.answerable()[0])
    assert long.outcome == "results" and long.ends[0][1][0].output == ("out", "long")
    # timed by its own call, alone, not by the batch of two lost with the worker
    timed = long.ends[0][1][0]
    assert (timed.batch_size, timed.compute_seconds) == (1, 2 * TICK)
    arrived = long.deadline - 8.0
    assert timed.queue_seconds == pytest.approx(serving.loop.now - 2 * TICK - arrived)
    # dropped as its deadline passed, though a worker had held it (it counted as none)
    assert serving.counts.dropped == {"expired": 1}
    # the model calls: "busy", then "long" alone (the lost one is none; its run alone was
    # left out of the batch metrics)
    assert serving.counts.calls == [1, 1]
    serving.check()


@pytest.mark.parametrize("kind", ["whole", "overlap"])
def test_a_batch_nobody_waits_for_is_not_run_again_after_a_crash(loaded, kind):
    """Nor is the batch a worker held behind the one it ran, once nobody waits for it."""
    serving = loaded(kind=kind, max_batch_size=1)
    worker = serving.pool.workers[0]
    late = [serving.arrive([value], {}, timeout=0.5) for value in ("late", "later")]
    held = [("late",), ("later",)] if kind == "overlap" else [("late",)]
    assert sent(serving) == held
    serving.advance(1.0)  # their deadline passes while their batches are held
    assert [request.outcome for request in late] == [Reason.DEADLINE_PASSED] * 2
    serving.crash(worker)
    serving.advance(1.0)
    serving.load(worker)
    fresh = serving.arrive(["fresh"], {}, timeout=8.0)
    assert sent(serving) == [*held, ("fresh",)]  # not run again, nor waited for
    serving.answer(*serving.answerable()[0])
    assert fresh.outcome == "results"
    serving.check()


def test_an_input_quarantined_as_the_restart_outlasts_its_deadline_gets_its_verdict(loaded):
    """An input that crashes the worker alone a second time is quarantined: its request is
    answered with that failure (500), not with the 503 "restarting" that the requests
    still waiting get as the worker dies with a restart that would outlast them (told in
    the same breath; once a client retried to get the 500). The innocent input of its
    batch, run again alone meanwhile, is answered as that run ends: it waited for the
    poison input's verdict, two restarts later (a tester's, with 4 s loads and 12 s
    deadlines: every batch-mate answered 504)."""
    serving = loaded(max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    worker = serving.pool.workers[0]
    serving.arrive(["busy"], {}, timeout=8.0)
    mate = serving.arrive(["mate"], {}, timeout=1.5)
    poison = serving.arrive(["poison"], {}, timeout=1.5)
    serving.answer(*serving.answerable()[0])
    serving.crash(worker)  # holding ("mate", "poison"): each runs again alone
    serving.advance(0.5)
    serving.load(worker)
    serving.answer(*serving.answerable()[0])  # the mate
    assert mate.outcome == "results" and poison.outcome is None
    serving.check()
    serving.crash(worker)  # the poison alone, once
    serving.advance(0.5)
    serving.load(worker)
    queued = serving.arrive(["queued"], {}, timeout=0.5)
    assert sent(serving)[1:] == [("mate", "poison"), ("mate",), ("poison",), ("poison",)]
    serving.crash(worker)  # twice: quarantined; the next restart is 1 s away
    assert queued.outcome is Reason.LOADING  # (503: it waits for the restart)
    assert poison.outcome == mate.outcome == "results"
    assert poison.ends[0][1][0].output == CRASHED_ALONE
    assert mate.ends[0][1][0].output == ("out", "mate")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_input_not_run_again_after_its_crash_still_counts_toward_quarantine(loaded, workers):
    """A request sent alone whose worker died with it, not run again before its deadline,
    is answered 500 at once, where another worker serves too (it waits for its own
    worker's restart: on the other, it would take that one down too; it waited for its
    504 while the other idled). That crash counts toward its input's quarantine as a
    crash of its run again would, the first one remembered only, as a first crash alone
    is where it runs again: three crashes quarantine it, and two outside kills (the OOM
    killer) do not (they did in the first version). Counted only where it ran again, a
    poison input sent with deadlines shorter than a restart took a worker down at every
    request and was never refused."""
    serving = loaded(workers=workers, max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    serving.pool.on_pinned = serving.scheduler.answer_pinned
    for worker in serving.pool.workers[1:]:
        serving.load(worker)
    for crash in range(3):
        poison = serving.arrive(["poison"], {}, timeout=0.3)
        ((crashed, _, _),) = serving.answerable()
        serving.crash(crashed)
        if crash < 2:
            assert poison.outcome is Reason.MODEL_FAILED  # (500, at once)
        else:  # quarantined as it crashes: its verdict (500 too)
            assert poison.outcome == "results"
            assert poison.ends[0][1][0].output == CRASHED_ALONE
        serving.advance(2.5)  # the restart's backoff
        serving.load(crashed)
        if crash == 1:  # two crashes (two outside kills alike): not quarantined
            assert not serving.pool.supervisor.is_poison("poison", {})
    refused = serving.arrive(["poison"], {}, timeout=0.3)
    assert refused.outcome == "results" and refused.ends[0][1][0].output == REFUSED_POISON
    other = serving.arrive(["other"], {}, timeout=0.3)
    assert sent(serving) == [("poison",)] * 3 + [("other",)]  # refused, not run
    serving.answer(*serving.answerable()[0])
    assert other.outcome == "results"


@pytest.mark.parametrize("ended", ["deadline", "client"])
def test_a_lone_input_whose_request_ended_before_its_crash_still_counts_toward_quarantine(
    loaded, ended, caplog
):
    """A lone input that crashes its worker after its request ended (its deadline passed
    as it ran, or its client left) counts as one that is not run again does: an input
    that segfaults a second into its run, sent with a shorter timeout, took the worker
    down at every request and was never refused (the review: 7 deaths)."""
    serving = loaded(max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    worker = serving.pool.workers[0]
    caplog.set_level(logging.WARNING, "rawserve")
    for backoff in (0.5, 1.0, 2.0):
        poison = serving.arrive(["poison"], {}, timeout=0.3)
        if ended == "deadline":
            serving.advance(0.4)
            assert poison.outcome is Reason.DEADLINE_PASSED
        else:
            serving.leave(poison)
        serving.crash(worker)
        serving.advance(backoff)
        serving.load(worker)
    said = [r.getMessage() for r in caplog.records if "refused for the next" in r.getMessage()]
    assert len(said) == 1 and "crashed the worker 3 times on its own" in said[0], said
    # the second said too, which no run again says where none runs (the last review)
    counted = [r.getMessage() for r in caplog.records if "times now" in r.getMessage()]
    assert len(counted) == 1 and "(2 times now; quarantined at 3)" in counted[0], counted
    refused = serving.arrive(["poison"], {}, timeout=0.3)
    assert refused.outcome == "results" and refused.ends[0][1][0].output == REFUSED_POISON
    assert sent(serving) == [("poison",)] * 3  # refused, not run


def test_an_input_of_a_crashed_batch_not_run_again_runs_alone_when_it_comes_again(loaded):
    """The inputs of a batch of several that crashed its worker, not run again alone
    (nobody waited for them any more), run alone when they come again, before what the
    scheduler sends next: a crash of one then counts as a first run's crash alone does
    (the batch's counts for none: three crashes alone quarantine it, and two outside
    kills never do), and one answered alone is forgotten, batched again after. Batched
    beside others every time, a poison input sent with deadlines shorter than a restart
    took a worker down at every batch and was never refused (a list of it and another
    input: 5 sends, 4 deaths, none refused)."""
    serving = loaded(max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    worker = serving.pool.workers[0]
    key = PoisonMemory.key("poison", {})

    def crash_and_restart() -> None:
        serving.crash(worker)
        serving.advance(5.0)  # deadlines passed, the backoff over
        serving.load(worker)

    serving.arrive(["busy"], {}, timeout=8.0)
    serving.arrive(["mate", "poison"], {}, timeout=0.3)
    serving.answer(*serving.answerable()[0])  # "busy": the worker takes the next
    assert sent(serving)[-1] == ("mate", "poison")
    crash_and_restart()  # suspects both, counted for neither
    assert serving.pool.poison.times(key) == 0
    # as they come again (beside a newcomer): each alone, the newcomer in a batch
    mixed = serving.arrive(["new", "mate", "poison"], {}, timeout=0.3)
    assert sent(serving)[-1] == ("new",)
    serving.answer(*serving.answerable()[0])
    assert sent(serving)[-1] == ("mate",)
    serving.answer(*serving.answerable()[0])
    assert not serving.pool.poison.holds(PoisonMemory.key("mate", {}))  # answered alone
    assert sent(serving)[-1] == ("poison",)
    crash_and_restart()  # its first crash alone: remembered
    assert mixed.ends and serving.pool.poison.times(key) == 1
    # the mate answered alone is forgotten: batched again; the poison alone
    serving.arrive(["mate", "poison"], {}, timeout=0.3)
    assert sent(serving)[-1] == ("mate",)
    serving.answer(*serving.answerable()[0])
    assert sent(serving)[-1] == ("poison",)
    crash_and_restart()  # its second: counted (two outside kills alike: not refused)
    assert not serving.pool.supervisor.is_poison("poison", {})
    serving.arrive(["poison"], {}, timeout=0.3)
    assert sent(serving)[-1] == ("poison",)
    crash_and_restart()  # its third: quarantined
    refused = serving.arrive(["other", "poison"], {}, timeout=0.3)
    assert sent(serving)[-1] == ("other",)
    serving.answer(*serving.answerable()[0])
    assert refused.outcome == "results"
    assert [end.output for end in refused.ends[0][1]] == [("out", "other"), REFUSED_POISON]


def test_of_inputs_run_apart_only_the_one_its_worker_died_running_is_answered_500(loaded):
    """A scheduler's batch whose inputs run alone (each one a worker died running before)
    is answered item by item as its worker dies with one of them: 500 for the request
    the worker ran, 503 for those that never ran (the pool said what the worker ran as
    it died for the batch as a whole: the last one answered got the 500, the poison
    input's request a 503 that a proxy retried elsewhere)."""
    serving = loaded(max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    worker = serving.pool.workers[0]
    for value in ("poison", "i2", "i3"):
        serving.pool.poison.suspect(PoisonMemory.key(value, {}))
    serving.arrive(["busy"], {}, timeout=8.0)
    requests = [serving.arrive([value], {}, timeout=0.3) for value in ("poison", "i2", "i3")]
    serving.answer(*serving.answerable()[0])
    assert sent(serving)[-1] == ("poison",)
    serving.crash(worker)  # its restart outlasts every deadline
    outcomes = [request.outcome for request in requests]
    assert outcomes == [Reason.MODEL_FAILED, Reason.LOADING, Reason.LOADING], outcomes


def test_copies_of_an_input_quarantined_as_they_wait_are_refused_not_run(loaded):
    """A list of one poison input three times: its copies run again alone after their
    batch crashed, and once one copy's crashes quarantine it, the copies still waiting
    are refused at once, without running (each took the worker down again: five deaths,
    not three), nor waiting for the worker's restart (their 422 came with it, or a 503 at
    their deadline)."""
    serving = loaded(max_batch_size=4)
    worker = serving.pool.workers[0]
    copies = serving.arrive(["poison"] * 3, {}, timeout=600.0)
    for backoff in (0.5, 1.0):
        serving.crash(worker)
        serving.advance(backoff)
        serving.load(worker)
    serving.crash(worker)  # quarantined: the copies waiting are answered with it
    assert sent(serving) == [("poison",) * 3, ("poison",), ("poison",)]  # three deaths
    assert copies.outcome == "results"
    serving.advance(2.0)
    serving.load(worker)
    assert not serving.answerable()
    outputs = [end.output for end in copies.ends[0][1]]
    assert sorted(map(str, outputs)) == sorted(map(str, [CRASHED_ALONE, *[REFUSED_POISON] * 2]))


def test_an_input_answered_when_run_again_after_an_outside_kill_is_forgotten(loaded):
    """An input whose one crash alone is remembered (a kill -9 as it ran), answered when
    run again alone, is forgotten: kept, three such kills an hour apart from each other's
    answers quarantined an innocent input."""
    serving = loaded(max_batch_size=4)
    worker = serving.pool.workers[0]
    for send in range(3):
        innocent = serving.arrive(["innocent"], {}, timeout=600.0)
        serving.crash(worker)  # a kill -9 as it runs alone
        serving.advance(5.0)
        serving.load(worker)
        ((_, conn, batch),) = serving.answerable()
        assert batch.inputs == ("innocent",)
        serving.answer(worker, conn, batch)
        assert innocent.outcome == "results", send
        assert innocent.ends[0][1][0].output == ("out", "innocent")
        assert serving.pool.poison.times(PoisonMemory.key("innocent", {})) == 0


def test_the_batch_mates_of_a_hang_nobody_waits_for_run_alone_when_they_come_again(loaded):
    """A batch of several killed as hung, its deadlines past: its inputs are suspects, run
    alone when they come again, where the one that hangs is counted (each send of it in a
    batch hung the worker, counted for nothing, until /health said 503)."""
    serving = loaded(max_batch_size=4)
    worker = serving.pool.workers[0]
    serving.arrive(["hang", "mate"], {}, timeout=1.0)
    serving.advance(2 * BATCH_TIMEOUT)  # killed as hung, nobody waiting any more
    serving.reap(worker)
    serving.advance(1.0)
    serving.load(worker)
    serving.arrive(["hang", "mate"], {}, timeout=600.0)
    assert sent(serving) == [("hang", "mate"), ("hang",)]  # alone, each in turn


def test_a_crashed_batch_s_inputs_run_alone_only_where_the_worker_serves_no_rows(loaded):
    """A continuous worker would take no new sequence until it ran each such input alone,
    idle: there, they are sent as any other (an innocent prompt a kill -9 met held a
    worker's whole queue for an hour)."""
    serving = loaded(kind="continuous", max_batch_size=4)
    serving.pool.poison.suspect(PoisonMemory.key("mate", {}))
    for value in ("running", "mate", "new"):
        serving.arrive([value], {}, timeout=8.0)
    assert sent(serving) == [("running",), ("mate",), ("new",)]  # side by side


def test_a_prompt_in_two_crashes_of_a_continuous_worker_runs_alone_once_its_rows_are_done(
    loaded,
):
    """A poison prompt batched beside a long sequence, with a deadline shorter than a
    restart, is not run again: one such crash suspects it (and its batch-mate), and it
    runs beside others as any prompt does; in a second, it runs alone when it comes again,
    once the worker's other rows are done (nothing new joins meanwhile), where its crash
    counts. Never run alone, it took the worker down at every send."""
    serving = loaded(kind="continuous", max_batch_size=4)
    worker = serving.pool.workers[0]
    key = PoisonMemory.key("poison", {})
    long = serving.arrive(["long"], {}, timeout=600.0)
    for crash in range(2):
        serving.arrive(["poison"], {}, timeout=0.5)
        assert sorted(batch.inputs for _, _, batch in serving.answerable()) == [
            ("long",),
            ("poison",),
        ], crash
        serving.crash(worker)
        serving.advance(5.0)  # its deadline passed, the backoff over
        serving.load(worker)
        assert serving.pool.poison.times(key) == 0  # a batch's crash counts for none
    assert serving.pool.poison.runs_alone_anywhere(key)
    assert not serving.pool.poison.runs_alone_anywhere(PoisonMemory.key("long", {}))
    third = serving.arrive(["poison"], {}, timeout=60.0)
    new = serving.arrive(["new"], {}, timeout=60.0)
    ((_, conn, batch),) = serving.answerable()  # "long" alone: nothing joins it
    assert batch.inputs == ("long",)
    serving.answer(worker, conn, batch)
    assert long.outcome == "results"
    ((_, conn, batch),) = serving.answerable()  # then the poison, alone
    assert batch.inputs == ("poison",) and new.outcome is None
    serving.crash(worker)
    assert serving.pool.poison.times(key) == 1  # its first crash alone
    serving.check()  # (not once "poison" is answered: the record counts an input once)
    serving.advance(5.0)
    serving.load(worker)
    ((_, conn, batch),) = serving.answerable()  # run again alone, where it crashed
    assert batch.inputs == ("poison",)
    serving.answer(worker, conn, batch)
    ((_, conn, batch),) = serving.answerable()  # then what waited for it
    assert batch.inputs == ("new",)
    serving.answer(worker, conn, batch)
    assert third.outcome == new.outcome == "results"


def test_a_prompt_run_alone_holds_back_one_continuous_worker_the_other_serving(loaded):
    """Waiting for any worker's rows to be done, a prompt to run alone held every new
    request back on every worker (a reviewer: 504 at 3 s beside 62 free rows, where it
    was 200 in 0.16 s): it waits for one worker's, and the other serves meanwhile."""
    serving = loaded(kind="continuous", max_batch_size=4, workers=2)
    first, second = serving.pool.workers
    serving.load(second)
    for _ in range(2):  # in two crashed batches
        serving.pool.poison.suspect(PoisonMemory.key("poison", {}))
    for name in ("long 1", "long 2"):
        serving.arrive([name], {}, timeout=600.0)
    assert {w.running.rows for w in serving.pool.workers} == {1}
    alone = serving.arrive(["poison"], {}, timeout=60.0)
    fresh = serving.arrive(["fresh"], {}, timeout=60.0)

    def running() -> dict[int, list]:
        found = serving.answerable()
        return {
            worker.index: sorted(batch.inputs for w, _, batch in found if w is worker)
            for worker in serving.pool.workers
        }

    assert sorted(running().values()) == [[("fresh",), ("long 2",)], [("long 1",)]], running()
    held = first if running()[first.index] == [("long 1",)] else second
    [(_, conn, batch)] = [found for found in serving.answerable() if found[0] is held]
    serving.answer(held, conn, batch)  # its rows done: the prompt runs alone on it
    assert running()[held.index] == [("poison",)] and held.room() == 0
    assert alone.outcome is None and fresh.outcome is None
    serving.check()


def test_a_crashed_batch_due_before_its_workers_restart_is_answered_beside_an_idle_worker(
    loaded,
):
    """The items of a batch whose worker died wait to run again alone on it, once it is
    back (on the other, what killed it would take that one down too): those due before
    its restart are answered at once, 503 with the wait (a proxy retries them on another
    replica), where they waited for their 504s while the other worker sat idle (a
    tester: 6 of 6 batch-mates); those with time enough wait and are served; new
    requests go to the other worker."""
    serving = loaded(workers=2, max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    serving.pool.on_pinned = serving.scheduler.answer_pinned
    serving.load(serving.pool.workers[1])
    busy = [serving.arrive([name], {}, timeout=30.0) for name in ("busy", "busier")]
    hurried = [serving.arrive([name], {}, timeout=0.3) for name in ("a", "b")]
    patient = serving.arrive(["c"], {}, timeout=30.0)
    (first, second) = serving.answerable()
    serving.answer(*first)  # its worker takes the three queued together
    [(crashed, _, batch)] = [held for held in serving.answerable() if held[0] is first[0]]
    assert batch.inputs == ("a", "b", "c")
    serving.answer(*second)  # the other worker is idle
    assert [request.outcome for request in busy] == ["results"] * 2
    serving.crash(crashed)
    assert [request.outcome for request in hurried] == [Reason.LOADING] * 2  # 503, at once
    assert patient.outcome is None
    fresh = serving.arrive(["fresh"], {}, timeout=0.3)
    ((worker, conn, batch),) = serving.answerable()  # the other, with the new one only
    assert worker is not crashed and batch.inputs == ("fresh",)
    serving.answer(worker, conn, batch)
    assert fresh.outcome == "results"
    serving.advance(0.6)
    serving.load(crashed)
    ((worker, conn, batch),) = serving.answerable()
    assert worker is crashed and batch.inputs == ("c",)  # alone, where it crashed
    serving.answer(worker, conn, batch)
    assert patient.outcome == "results"


def test_a_lone_crash_due_between_two_workers_restarts_is_answered_at_once(loaded):
    """Two workers, the other one restarting, back soon; this one dies running an input
    alone, its own restart later: the input waits for its own worker, and a deadline
    between the two restarts was left to its 504 (the first was compared, the other
    worker back and idle meanwhile: a review). It is answered at once, 500."""
    serving = loaded(workers=2, max_batch_size=4)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    serving.pool.on_pinned = serving.scheduler.answer_pinned
    first, other = serving.pool.workers
    serving.load(other)
    for backoff in (0.5, 1.0, 2.0):  # killed idle from outside: its backoff grows to 4 s
        serving.crash(first)
        serving.advance(backoff)
        serving.load(first)
    serving.crash(other)  # idle: back in 0.5 s and its start
    poison = serving.arrive(["poison"], {}, timeout=2.5)
    ((crashed, _, _),) = serving.answerable()
    assert crashed is first
    serving.crash(first)  # back in 4 s: past the deadline, the other long before it
    assert poison.outcome is Reason.MODEL_FAILED  # (500, at once)


def test_an_item_run_again_after_a_crash_is_not_stopped_as_its_batch_mate_ends(loaded):
    """Each item of a lost batch runs again alone; they shared the batch's id, so the
    cancel of the first (its deadline passed, or its client left) stopped the second as
    the worker took it: a generation answered 200 with its first token (a tester)."""
    serving = loaded(max_batch_size=4)
    worker = serving.pool.workers[0]
    serving.arrive(["busy"], {}, timeout=30.0)
    first = serving.arrive(["a"], {}, timeout=3.0)
    second = serving.arrive(["b"], {}, timeout=30.0)
    serving.answer(*serving.answerable()[0])
    serving.crash(worker)  # holding ("a", "b"): each runs again alone
    serving.advance(0.6)
    serving.load(worker)
    serving.advance(2.5)  # the first's deadline passes as it runs: its worker is told
    conn = serving.conns[worker.process.pid]
    assert conn.cancelled == {conn.batches[0].batch_id}
    serving.answer(worker, conn, conn.batches[0])
    (retried,) = conn.batches[1:]  # the second, under an id of its own (asserted on send)
    assert retried.inputs == ("b",)
    serving.answer(worker, conn, retried)
    assert first.outcome is Reason.DEADLINE_PASSED and second.outcome == "results"
    serving.check()


def test_a_batch_run_again_after_a_crash_teaches_no_speed(loaded):
    """Its time is the worker's restart as much as the model's: learned from the first
    batch (nothing to compare it with), an 8 s restart was the model's speed, and short
    deadlines waited for their 504s beside an idle worker (a tester)."""
    serving = loaded(max_batch_size=4)
    worker = serving.pool.workers[0]
    first = serving.arrive(["a", "b"], {}, timeout=30.0)
    serving.advance(0.01)
    serving.crash(worker)
    serving.advance(8.0)  # the restart and the model's load
    serving.load(worker)
    while serving.answerable():
        serving.answer(*serving.answerable()[0])
    assert first.outcome == "results"
    assert serving.scheduler.core.cost_model.calls == 0
    for index in range(3):  # the model's own speed, then
        serving.arrive([f"c{index}"], {}, timeout=30.0)
        serving.advance(0.01)
        serving.answer(*serving.answerable()[0])
    short = serving.arrive(["d"], {}, timeout=2.0)
    assert serving.answerable()  # sent at once
    serving.answer(*serving.answerable()[0])
    assert short.outcome == "results"
    serving.check()


def test_inputs_run_again_after_a_crash_wait_for_their_worker_while_the_other_serves(loaded):
    """Run alone on the other worker, the input that crashed the first took it down too:
    every worker restarting at once (a handler's poison input, two workers: 41 of 60
    requests answered 503 for 11 s). They run on the worker that crashed, once it is
    back; the other serves new requests meanwhile."""
    serving = loaded(workers=2, max_batch_size=4)
    serving.load(serving.pool.workers[1])
    lost = serving.arrive(["x", "poison"], {}, timeout=30.0)
    ((crashed, _, batch),) = serving.answerable()
    assert batch.inputs == ("x", "poison")
    (other,) = [w for w in serving.pool.workers if w is not crashed]
    serving.crash(crashed)
    fresh = serving.arrive(["fresh"], {}, timeout=30.0)
    ((worker, conn, batch),) = serving.answerable()  # the other, with the new request only
    assert worker is other and batch.inputs == ("fresh",)
    serving.answer(worker, conn, batch)
    assert fresh.outcome == "results"
    serving.advance(0.6)
    serving.load(crashed)
    for expected in (("x",), ("poison",)):  # alone, one after the other, where it crashed
        ((worker, conn, batch),) = serving.answerable()
        assert worker is crashed and batch.inputs == expected
        serving.answer(worker, conn, batch)
    assert lost.outcome == "results"
    serving.check()


def test_inputs_lost_with_a_worker_stopped_from_outside_run_on_the_other_at_once(loaded):
    """A worker stopped from outside (SIGSTOP, a debugger) and killed for it was no
    input's doing: what it held runs on the idle worker, not after its restart (a lone
    item waited 4 s for it beside the idle one, and a drain restarted it to run that)."""
    serving = loaded(workers=2, max_batch_size=4)
    serving.load(serving.pool.workers[1])
    lost = serving.arrive(["x", "y"], {}, timeout=30.0)
    ((stopped, _, _),) = serving.answerable()
    (other,) = [w for w in serving.pool.workers if w is not stopped]
    stopped.stopped = True  # (as the batch timeout's look at /proc found it)
    serving.crash(stopped)
    ran = []
    while serving.answerable():
        ((worker, conn, batch),) = serving.answerable()
        assert worker is other, "waited for the stopped worker's restart"
        ran.append(batch.inputs)
        serving.answer(worker, conn, batch)
    assert sorted(ran) == [("x",), ("y",)] and lost.outcome == "results"
    serving.check()


@pytest.mark.parametrize("said", [False, True])
def test_inputs_waiting_for_a_worker_that_fails_to_restart_run_on_another(loaded, said):
    """They waited for it out to their deadlines (504 at 15 s), the other worker idle.
    From its word (`said`), not only its exit: the process that said so exited seconds
    later, and an input due before then waited out its deadline beside the idle worker."""
    serving = loaded(workers=2, max_batch_size=4)
    serving.load(serving.pool.workers[1])
    lost = serving.arrive(["x", "y"], {}, timeout=30.0)
    ((crashed, _, _),) = serving.answerable()
    (other,) = [w for w in serving.pool.workers if w is not crashed]
    serving.crash(crashed)
    serving.advance(0.6)  # restarting
    assert crashed in serving.loading()
    if said:  # (its process has not exited yet)
        serving.act(serving.pool._on_message, crashed, WorkerLoadFailed("the folder is gone"))
    else:
        serving.crash(crashed)  # dies as it loads: a failed restart
    for _ in range(2):
        ((worker, conn, batch),) = serving.answerable()
        assert worker is other and len(batch.inputs) == 1
        serving.answer(worker, conn, batch)
    assert lost.outcome == "results"
    if said:
        serving.crash(crashed)
    serving.check()


def test_a_continuous_workers_lost_sequences_run_again_together_then_alone(loaded):
    """Run again each alone, one after another, they held the queue back for all of them
    together (15 sequences: 23 s with nothing new served, where side by side they took
    0.9 s; a tester). At the worker's first death they run again side by side; should it
    die with them again, each runs alone, so that a poison input is still named."""
    serving = loaded(kind="continuous", max_batch_size=1)
    worker = serving.pool.workers[0]
    lost = [serving.arrive([name], {}, timeout=30.0) for name in ("a", "b", "c")]
    assert len(serving.answerable()) == 3  # three rows
    serving.crash(worker)
    serving.advance(0.6)
    serving.load(worker)
    assert sorted(batch.inputs for _, _, batch in serving.answerable()) == [("a",), ("b",), ("c",)]
    serving.crash(worker)  # again, with all three: now each alone
    serving.advance(1.2)
    serving.load(worker)
    for _ in range(3):
        ((_, conn, batch),) = serving.answerable()  # one at a time
        serving.answer(worker, conn, batch)
    assert [request.outcome for request in lost] == ["results"] * 3
    fresh = serving.arrive(["fresh"], {}, timeout=30.0)
    ((_, conn, batch),) = serving.answerable()
    serving.answer(worker, conn, batch)
    assert fresh.outcome == "results"
    serving.check()


def test_a_hung_continuous_worker_is_killed_with_one_line_for_all_its_sequences(loaded, caplog):
    """Each sequence has a watchdog, and as the worker hangs all of them fire: the kill
    was logged once a sequence, the same line over, each saying "a batch of 1" (testers).
    One line says how many were running."""
    serving = loaded(kind="continuous", max_batch_size=1)
    hung = [serving.arrive([name], {}, timeout=60.0) for name in ("a", "b", "c")]
    assert len(serving.answerable()) == 3
    with caplog.at_level(logging.ERROR, "rawserve"):
        serving.advance(2 * BATCH_TIMEOUT)  # no decoding step ends
    [line] = [r.getMessage() for r in caplog.records if "killing process" in r.getMessage()]
    assert "no decoding step ended for 4 s, with 3 sequence(s) running" in line
    assert all(request.outcome is None for request in hung)  # decided once it has exited


def test_a_hung_continuous_workers_sequences_run_again_as_a_crashed_ones_do(loaded):
    """Killed as hung (SIGSTOP, or a decoding step that never ends), a continuous worker
    failed each of its sequences 500 with most of their deadlines left (a tester: 6 of
    6), where killed by a signal it ran them again. Now as after a crash: side by side
    once it is back, then, hung with them again, each alone; one that hangs alone fails
    (500, the batch timeout's), and a stream that sent tokens fails mid-stream."""
    serving = loaded(kind="continuous", max_batch_size=1)
    worker = serving.pool.workers[0]
    hung = [serving.arrive([name], {}, timeout=600.0) for name in ("a", "b", "c")]
    assert len(serving.answerable()) == 3
    serving.advance(2 * BATCH_TIMEOUT)  # no decoding step ends: killed
    serving.reap(worker)
    serving.advance(0.6)
    serving.load(worker)
    assert sorted(batch.inputs for _, _, batch in serving.answerable()) == [("a",), ("b",), ("c",)]
    serving.advance(2 * BATCH_TIMEOUT)  # hung with them again: now each alone
    serving.reap(worker)
    serving.advance(1.2)
    serving.load(worker)
    ((_, conn, batch),) = serving.answerable()  # one at a time
    assert batch.inputs == ("a",)
    serving.answer(worker, conn, batch)
    ((_, conn, batch),) = serving.answerable()
    serving.advance(2 * BATCH_TIMEOUT)  # "b" hangs alone: it fails, not run again
    serving.reap(worker)
    serving.advance(2.4)
    serving.load(worker)
    ((_, conn, batch),) = serving.answerable()
    serving.answer(worker, conn, batch)
    assert [request.outcome for request in hung] == ["results"] * 3
    outputs = {request.inputs[0]: request.ends[0][1][0].output for request in hung}
    assert outputs["b"] == TIMED_OUT
    assert outputs["a"] != TIMED_OUT and outputs["c"] != TIMED_OUT
    serving.check()


def test_a_continuous_worker_that_died_frees_no_rows_for_a_burst(loaded):
    """The queue's bound counts a continuous worker's free rows (they take as many at the
    next look): those it had when it died counted until the next look, and a burst
    filled the queue past --max-queue (12 of 9; the model-based test's)."""
    serving = loaded(kind="continuous", max_batch_size=2, max_queue=9)
    serving.crash(serving.pool.workers[0])
    burst = serving.arrive([f"a{k}" for k in range(12)], {}, timeout=8.0)
    assert not burst.admitted and not burst.too_long  # 503: the queue is full, for now
    assert len(serving.scheduler.core) == 0
    serving.check()


def test_a_sequence_that_died_beside_a_stream_is_503_once_its_restart_would_be_too_late(loaded):
    """A continuous worker dies running a stream (its error answered at once) and a plain
    sequence; its restarts die as they load, until none would be back before the plain
    one's deadline: it is answered 503 (a batch-mate of what died, retried elsewhere),
    not 500 as if it had run alone: by then the stream's batch was answered, and the
    plain one looked alone (a tester: 500 after 22.8 s)."""
    serving = loaded(kind="continuous", max_batch_size=1)
    serving.pool.on_down = serving.scheduler.answer_unreachable  # as the server wires it
    worker = serving.pool.workers[0]
    streamed = serving.arrive(["s"], {"max_new_tokens": 8}, timeout=300.0, stream=True)
    plain = serving.arrive(["p"], {}, timeout=20.0)
    [batch] = [batch for _, _, batch in serving.answerable() if batch.control.stream_id]
    serving.stream_a_token(worker, batch)
    serving.crash(worker)
    assert streamed.outcome == "results" and plain.outcome is None  # it waits
    for _ in range(1000):  # each restart dies as it loads, its backoff longer each time
        if plain.outcome is not None:
            break
        serving.advance(0.1)
        if worker in serving.loading():
            serving.crash(worker)
    assert plain.outcome is Reason.LOADING  # 503
    assert serving.loop.now < plain.deadline


@pytest.mark.parametrize("death", ["crashed", "hung", "stopped"])
def test_a_continuous_workers_streamed_sequence_is_not_run_again_beside_the_others(loaded, death):
    """Of the sequences a worker dies with, a stream whose tokens reached its client fails
    mid-stream (run again, its client would get its first tokens twice), even where the
    others run again side by side; killed as hung, with the batch timeout's error; killed
    as stopped from outside (SIGSTOP), saying so, not that the worker crashed."""
    serving = loaded(kind="continuous", max_batch_size=1)
    worker = serving.pool.workers[0]
    streamed = serving.arrive(["s"], {"max_new_tokens": 8}, timeout=300.0, stream=True)
    lost = [serving.arrive([name], {}, timeout=300.0) for name in ("a", "b")]
    [batch] = [batch for _, _, batch in serving.answerable() if batch.control.stream_id]
    serving.stream_a_token(worker, batch)
    if death == "crashed":
        serving.crash(worker)
    elif death == "stopped":
        worker.stopped = True  # (as the batch timeout's look at /proc found it)
        serving.crash(worker)
    else:
        serving.advance(2 * BATCH_TIMEOUT)  # no decoding step ends: killed
        serving.reap(worker)
    serving.advance(0.6)
    serving.load(worker)
    assert sorted(batch.inputs for _, _, batch in serving.answerable()) == [("a",), ("b",)]
    assert streamed.outcome == "results"
    failure = {"crashed": CRASHED_MID_STREAM, "stopped": STOPPED_MID_STREAM}.get(death, TIMED_OUT)
    assert streamed.ends[0][1][0].output == failure
    while serving.answerable():
        serving.answer(*serving.answerable()[0])
    assert [request.outcome for request in lost] == ["results"] * 2
    serving.check()


@pytest.mark.parametrize("kind", ["whole", "continuous"])
def test_a_prompt_that_crashes_its_worker_as_it_streams_is_refused_at_the_third_death(loaded, kind):
    """A stream that crashes its worker alone after its first tokens is not run again
    (its client would get them twice), but its crash counts toward its prompt's
    quarantine as a lone input's does where it is not run again: three deaths, then 422.
    Counted for none, a poison prompt sent streamed took its worker down at every send
    and was never refused."""
    serving = loaded(kind=kind, max_batch_size=4)
    worker = serving.pool.workers[0]
    for death in range(3):
        stream = serving.arrive(["poison"], {}, timeout=60.0, stream=True)
        ((_, _, batch),) = serving.answerable()
        serving.stream_a_token(worker, batch)
        serving.crash(worker)
        assert stream.outcome == "results" and stream.tokens == 1
        # quarantined as it crashes the third time: its verdict
        assert stream.ends[0][1][0].output == (CRASHED_ALONE if death == 2 else CRASHED_MID_STREAM)
        serving.advance(10.0)  # past the restart's backoff
        serving.load(worker)
    serving.check()
    refused = serving.arrive(["poison"], {}, timeout=60.0, stream=True)
    assert refused.outcome == "results" and refused.ends[0][1][0].output == REFUSED_POISON
    assert sent(serving) == [("poison",)] * 3  # refused, not run


def test_streams_that_crash_their_continuous_worker_together_are_suspects(loaded):
    """Streams a continuous worker dies with, after their first tokens, are suspects as
    the inputs of a crashed batch nobody waits for are: after two such deaths each runs
    alone, where the innocent one is answered and forgotten and the poison one counted,
    refused after five deaths in all (as a poison prompt batched with others is)."""
    serving = loaded(kind="continuous", max_batch_size=4)
    worker = serving.pool.workers[0]
    key = PoisonMemory.key("poison", {})
    for death in range(5):
        streams = [
            serving.arrive([value], {}, timeout=60.0, stream=True) for value in ("mate", "poison")
        ]
        while [batch.inputs for _, _, batch in serving.answerable()] == [("mate",)]:
            serving.answer(*serving.answerable()[0])  # run alone, the mate is answered
        for _, _, batch in serving.answerable():
            serving.stream_a_token(worker, batch)
        running = sorted(batch.inputs for _, _, batch in serving.answerable())
        assert running == ([("mate",), ("poison",)] if death < 2 else [("poison",)]), death
        serving.crash(worker)
        assert all(stream.outcome == "results" for stream in streams), death
        serving.advance(10.0)  # past the restart's backoff
        serving.load(worker)
        if death < 4:
            assert not serving.pool.supervisor.is_poison("poison", {}), death
    assert serving.pool.poison.times(key) == 3
    assert not serving.pool.poison.holds(PoisonMemory.key("mate", {}))
    serving.check()
    refused = serving.arrive(["poison"], {}, timeout=60.0, stream=True)
    assert refused.ends[0][1][0].output == REFUSED_POISON


def test_a_lone_sequence_that_crashes_its_continuous_worker_is_named_at_the_third_death(loaded):
    """Side by side with nobody, a lone lost sequence runs again alone from the first:
    each death with it counts toward naming it as a poison input, at the third, as a
    batching worker's lone input is (else a fourth death before it is named)."""
    serving = loaded(kind="continuous", max_batch_size=1)
    worker = serving.pool.workers[0]
    lone = serving.arrive(["x"], {}, timeout=60.0)
    for death in range(3):
        assert [batch.inputs for _, _, batch in serving.answerable()] == [("x",)], death
        serving.crash(worker)
        serving.advance(10.0)  # past the restart's backoff
        serving.load(worker)
    assert lone.outcome == "results" and lone.ends[0][1][0].output == CRASHED_ALONE
    serving.check()


def test_a_worker_holding_two_batches_takes_the_second_at_once_until_one_is_timed(loaded):
    """Until a batch has been timed, a worker that holds two batches takes its second as
    the first starts: what is queued goes behind it then, not once the first is answered."""
    serving = loaded(kind="overlap", max_batch_size=1)
    serving.arrive(["a", "b"], {}, timeout=8.0)
    assert sent(serving) == [("a",), ("b",)]
    serving.check()


def test_a_model_whose_worker_restarts_still_says_what_it_serves(serving):
    """While its only worker loads again after a crash, the model is not ready, but what
    the worker said of it still holds: a restart loads the same model. Of several served
    models, a route that names none goes to the first that fits it by this report: were
    it gone, a restarting model of another task would take (and refuse with 503) the
    requests of the model that serves the route."""
    worker = serving.pool.workers[0]
    before = serving.pool.loaded
    assert before is not None and before.task == "text-generation"
    serving.crash(worker)
    serving.advance(10.0)  # past the restart's backoff: a new process is loading
    assert worker.state is WorkerState.LOADING and not serving.pool.ready
    assert serving.pool.loaded == before
    serving.load(worker)
    assert serving.pool.ready and serving.pool.loaded == worker.ready
    serving.check()


# --- the model-based test ----------------------------------------------------------------


class ServingMachine(RuleBasedStateMachine):
    """The clients, the clock and the workers of one served model, at random."""

    serving: Serving

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.monkeypatch = monkeypatch

    @initialize(
        workers=st.integers(1, 2),
        kind=st.sampled_from(["whole", "overlap", "continuous"]),
        max_batch_size=st.integers(1, 4),
        max_queue=st.integers(2, 16),
        delay=st.sampled_from([0.0, 2 * TICK]),
        loaded=st.sampled_from([True, True, True, False]),
    )
    def start(self, workers, kind, max_batch_size, max_queue, delay, loaded) -> None:
        self.serving = Serving(
            workers=workers,
            kind=kind,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            delay=delay,
            monkeypatch=self.monkeypatch,
        )
        if loaded:  # (else they load as a step)
            for worker in self.serving.pool.workers:
                self.serving.load(worker)

    # --- the clients -----------------------------------------------------------------

    @precondition(lambda self: not self.serving.stopped)
    @rule(
        kind=st.sampled_from(sorted(KINDS)),
        size=st.integers(0, 4),
        timeout=st.sampled_from(TIMEOUTS),
        length=st.integers(1, 40),
        awaited=st.booleans(),
    )
    def arrive(self, kind, size, timeout, length, awaited) -> None:
        params, sizes = KINDS[kind]
        number = len(self.serving.requests)
        count = sizes[size % len(sizes)]
        inputs = [f"r{number}i{k} " + "x" * (length * (k + 1)) for k in range(count)]
        self.serving.arrive(inputs, params, timeout, stream=kind == "stream", awaited=awaited)

    @precondition(lambda self: any(r.live for r in self.serving.requests))
    @rule(data=st.data(), batches=st.integers(1, 2))
    def suspect(self, data, batches) -> None:
        """An input of a request is a suspect of one or two crashed batches, as if it had
        come again after them: not yet sent, it runs alone (on a continuous worker, after
        two, once the worker's rows are done)."""
        request = data.draw(st.sampled_from([r for r in self.serving.requests if r.live]))
        key = PoisonMemory.key(data.draw(st.sampled_from(request.inputs)), request.params)
        for _ in range(batches):
            self.serving.pool.poison.suspect(key)

    @precondition(lambda self: any(r.live for r in self.serving.requests))
    @rule(data=st.data())
    def leave(self, data) -> None:
        live = [r for r in self.serving.requests if r.live]
        self.serving.leave(data.draw(st.sampled_from(live)))

    @rule(ticks=st.sampled_from([1, 4, 32, 128, 512]))
    def advance(self, ticks) -> None:
        self.serving.advance(ticks * TICK)

    # --- the workers -----------------------------------------------------------------

    @precondition(lambda self: bool(self.serving.answerable()))
    @rule(data=st.data())
    def answer(self, data) -> None:
        worker, conn, batch = data.draw(st.sampled_from(self.serving.answerable()))
        failing = data.draw(st.sets(st.sampled_from(batch.inputs)))
        self.serving.answer(worker, conn, batch, failing)

    @precondition(lambda self: bool(self.serving.answerable()))
    @rule(data=st.data())
    def answer_as_a_timer_fires(self, data) -> None:
        """The answer comes in the loop's pass where the next timer (a deadline, say)
        fires, read before it."""
        worker, conn, batch = data.draw(st.sampled_from(self.serving.answerable()))
        due = self.serving.loop.next_timer()
        if due is not None:
            self.serving.loop.now = max(self.serving.loop.now, due)
        self.serving.answer(worker, conn, batch)

    @precondition(lambda self: bool(self.serving.answerable()))
    @rule()
    def answer_everything(self) -> None:
        while answerable := self.serving.answerable():
            self.serving.answer(*answerable[0])

    @precondition(lambda self: any(b.control.stream_id for _, _, b in self.serving.answerable()))
    @rule(data=st.data())
    def stream_a_token(self, data) -> None:
        streaming = [(w, b) for w, _, b in self.serving.answerable() if b.control.stream_id]
        self.serving.stream_a_token(*data.draw(st.sampled_from(streaming)))

    @precondition(lambda self: bool(self.serving.loading()))
    @rule(data=st.data())
    def load(self, data) -> None:
        self.serving.load(data.draw(st.sampled_from(self.serving.loading())))

    # (a first load that fails stops the server: `wait_ready` raises)
    @precondition(lambda self: self.serving.pool.loaded and self.serving.loading())
    @rule(data=st.data())
    def fail_to_load(self, data) -> None:
        worker = data.draw(st.sampled_from(self.serving.loading()))
        self.serving.act(self.serving.pool._on_message, worker, WorkerLoadFailed("no memory"))
        self.serving.crash(worker)

    @precondition(lambda self: bool(self.serving.alive()))
    @rule(data=st.data())
    def crash(self, data) -> None:
        worker, _ = data.draw(st.sampled_from(self.serving.alive()))
        self.serving.crash(worker)

    @rule()
    def reap_the_killed(self) -> None:
        self.serving.reap_the_killed()

    # (late, else it cuts most runs short)
    @precondition(lambda self: not self.serving.stopped and len(self.serving.requests) > 8)
    @rule()
    def shut_down(self) -> None:
        self.serving.shut_down()

    # --- the checks ------------------------------------------------------------------

    @invariant()
    def holds(self) -> None:
        if hasattr(self, "serving"):
            self.serving.check()

    def teardown(self) -> None:
        if not hasattr(self, "serving"):
            return
        try:
            if not self.serving.stopped:
                self.serving.shut_down()
            self.serving.check()
            self.serving.check_nothing_is_left()
        finally:
            self.serving.close()


def test_the_serving_side_keeps_its_promises_whatever_happens_in_between(monkeypatch):
    run_state_machine_as_test(
        lambda: ServingMachine(monkeypatch),
        settings=settings(
            max_examples=80,  # (tens of thousands, run by hand, found nothing more)
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )

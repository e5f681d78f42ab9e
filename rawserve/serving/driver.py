"""The deadline scheduler's driver: runs the scheduling core against the worker pool.

The decisions (admit, build the next batch, drop what expired, when to look again) are
made by `rawserve.serving.core.SchedulerCore`, synchronously, from a clock. This thin
shell looks at the queue when something can have changed (an arrival, a free worker, a
batch-delay deadline), never polls, hands batches to the pool (a `Backend`), and settles
each request's items. A request it cannot answer with results ends in `Refused` (a
domain refusal: it knows nothing of HTTP, nor of torch).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from rawserve.serving.core import (
    DeadlineUnreachable,
    ItemResult,
    NeverAdmissible,
    QueueFull,
    SchedulerCore,
    WorkItem,
)
from rawserve.serving.handles import PartAnswered
from rawserve.serving.refusals import (
    Reason,
    Refusal,
    Refused,
    crashed_not_back,
    deadline_passed,
    model_failed,
    not_back_in_time,
    shutting_down,
)
from rawserve.serving.supervision import NOT_COMPUTED, NOT_RUN
from rawserve.shared.late_watch import LateWatch
from rawserve.shared.logs import REQUEST_ID
from rawserve.shared.messages import NO_CONTROL, BatchResult, Control, ModelLimits

log = logging.getLogger("rawserve.scheduler")

# a deadline counts from the request's head: reading and checking its body may spend it
PASSED_BEFORE_QUEUED = (
    "the request's deadline passed before it was queued: as its body was read, or while "
    "the server was too busy to take it"
)

# Results handed to their requests per pass of the event loop where each one turns into a
# response (encoding, socket writes): a batch of 32 at once would hold the loop for
# milliseconds while probes, new requests and the other workers' results wait. (Behind
# HTTP processes an answer is a message to one of them: a batch goes in one pass.)
DELIVERY_SLICE = 4


class Backend(Protocol):
    """What the scheduler needs from the worker pool (rawserve.serving.pool.WorkerPool)."""

    def idle_workers(self) -> int:
        """How many batches could start now."""
        ...

    def empty_workers(self) -> int:
        """How many continuous workers run no sequence and take one now."""
        ...

    def batch_cap(self) -> int | None:
        """The most items a batch may carry now (lowered after out-of-memory errors)."""
        ...

    @property
    def limits(self) -> ModelLimits:
        """What the loaded model takes and generates by default (unknown until loaded)."""
        ...

    def concurrency(self) -> int:
        """How many batches the workers run side by side (a continuous worker: its rows)."""
        ...

    def rows_when_ready(self) -> int:
        """`concurrency` once every worker is ready (one loading or restarting counted as
        its peers count)."""
        ...

    def abandon(
        self, future: asyncio.Future[BatchResult], items: Collection[int] | None = None
    ) -> None:
        """Nobody waits for that batch any more, or (`items`) for its items at those
        places: stop it where the worker can, and never run them again."""
        ...

    def submit(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        control: Control,
        request_ids: Sequence[str] = (),
        admitted: Sequence[float] = (),
        on_part: PartAnswered | None = None,
    ) -> asyncio.Future[BatchResult]:
        """Send a batch to a worker; `request_ids`: each input's request's, for its log;
        `admitted`: when each input was admitted (the worker times from there);
        `on_part`: told of the items answered before the batch is (see `Assembly`)."""
        ...

    def serving_again_at(self) -> float | None:
        """While no worker serves: when one should again (math.inf: none is expected);
        None while one serves, or where that is not known."""
        ...

    def died_with(self, future: asyncio.Future[BatchResult], place: int) -> int:
        """How many items the worker that died running the item at `place` of that batch
        ran as it died (0: none died with it, or it was stopped from outside, no input's
        doing)."""
        ...


# How a run begun without a task ends: its results in order, or the error that ended it.
RunEnd = Callable[[list[ItemResult] | None, BaseException | None], None]


class RunningRequest:
    """A request begun with `Scheduler.begin`. It ends once: when its last item is
    answered or its first one fails (`on_end` hears which), or when `cancel` withdraws
    it (then nothing is heard). Either way `end` takes its items out of the queue."""

    def __init__(
        self,
        futures: list[asyncio.Future[ItemResult]],
        end: Callable[[], None],
        on_end: RunEnd,
    ):
        self._futures = futures
        self._end = end
        self._on_end = on_end
        self._unanswered = len(futures)
        self.ended = False
        for future in futures:
            future.add_done_callback(self._on_item)

    def cancel(self) -> None:
        """Withdraw it (its client left)."""
        if not self.ended:
            self.ended = True
            self._end()

    def _on_item(self, future: asyncio.Future[ItemResult]) -> None:
        if future.cancelled():  # only its own end cancels its futures
            return
        error = future.exception()  # read even after the end: an error left unread is logged
        if self.ended:
            return
        if error is None:
            self._unanswered -= 1
            if self._unanswered:
                return
        self.ended = True
        self._end()
        if error is None:
            self._on_end([future.result() for future in self._futures], None)
        else:
            self._on_end(None, error)


class SchedulerMetrics(Protocol):
    """What the scheduler counts (rawserve.ops.metrics.ModelMetrics: a model's own)."""

    def drop(self, reason: str, count: int = 1) -> None: ...

    def observe_batch(self, size: int, compute_seconds: float) -> None: ...

    def observe_queue(self, waits: Sequence[float]) -> None: ...


class Scheduler:
    """Runs a `SchedulerCore` against a worker pool on the event loop.

    `wake()` is called by whoever frees a worker (the pool, given it as its `on_idle`),
    by arrivals and by finished batches: the scheduler then looks at the queue again, once
    at the end of the event loop's pass however often it was woken in it. A look is a
    callback, not a task's step: one pass of the loop for hundreds of arrivals (and a
    look that raises answers the items it had queued 500, logged, and the next wake
    looks afresh: `_fail_queued`).
    """

    def __init__(
        self,
        core: SchedulerCore,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.monotonic,
        loop: asyncio.AbstractEventLoop | None = None,
        metrics: SchedulerMetrics | None = None,
        slice_answers: bool = True,
    ):
        """`slice_answers`: settle a batch's answers `DELIVERY_SLICE` a pass of the event
        loop (they turn into responses in this process), else all in one pass."""
        self.core = core
        self.backend = backend
        self.clock = clock
        self.metrics = metrics
        self.slice_answers = slice_answers
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._look_due = False  # a look is scheduled for the end of this pass
        self._running = False  # between start() and stop()
        self._stopped = False  # stop() was called: nothing more is admitted
        self.in_flight = 0  # items inside model calls
        # each run's items, until it ends or its deadline passes (one timer for them all)
        self._runs: dict[int, list[WorkItem]] = {}
        self._sent: dict[asyncio.Future[BatchResult], list[WorkItem]] = {}  # until answered
        self._run_ids = itertools.count()
        self._late = LateWatch(self._on_late, clock)
        self._not_back_in_time: set[int] = set()  # runs ended by `_answer_not_back`
        # told by `answer_unreachable` that no worker serves: until one does again, a run
        # admitted is checked as the runs waiting then were
        self._down = False

    def start(self) -> None:
        self._loop = self._loop or asyncio.get_running_loop()
        self._running = True
        self.wake()

    def wake(self) -> None:
        """Something may have changed (an arrival, a free worker, a deadline): look at
        the queue at the end of this pass of the event loop."""
        if self._running and not self._look_due:
            self._look_due = True
            self._running_loop.call_soon(self._look)

    async def stop(self) -> None:
        """Stop dispatching, and refuse every item still queued (shutting down), and any
        asked for from now on."""
        self._running = False
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        self._late.close()
        for item in self.core.drop_expired(float("inf")):  # every queued item
            _settle(item, exception=shutting_down())

    @property
    def pending(self) -> int:
        """Items queued or being computed."""
        return len(self.core) + self.in_flight

    @property
    def full(self) -> bool:
        """The queue is at its bound: any new item would be refused."""
        return len(self.core) >= self.core.bound

    def full_retry_after(self) -> float:
        """What a full queue's Retry-After says now (without counting a refusal)."""
        return self.core.retry_after(time.monotonic())

    @property
    def headroom(self) -> float:
        """The share of the queue's bound still free (0.0: full)."""
        return max(0, self.core.bound - len(self.core)) / max(1, self.core.bound)

    @property
    def max_batch_size(self) -> int:
        """Items per model call (--max-batch-size): no more than the queue holds (/info
        said 32 beside --max-queue 5)."""
        return min(self.core.max_batch_size, self.core.bound)

    @property
    def most_admitted(self) -> int:
        """The most items one request may ever be admitted with (`SchedulerCore`'s)."""
        return self.core.most_admitted

    def admission(self, deadline: float | None = None) -> Refusal | None:
        """The refusal any request would get now, whatever it asks (`_busy`; counted as
        rejected), with its Retry-After; None while it may be taken."""
        now = self.clock()
        busy = self._busy(deadline, now)
        if busy is None:
            return None
        return self._refusal(busy(self.core.retry_after(now)), 1).refusal

    def _busy(self, deadline: float | None, now: float) -> type[QueueFull] | None:
        """Why any request due at `deadline` would be refused now, if so: the queue full,
        or a generation's wait for a row past it (`SchedulerCore.refuses_any_sequence`)."""
        if self.full:
            return QueueFull
        if deadline is not None and self.core.refuses_any_sequence(deadline, now):
            return DeadlineUnreachable
        return None

    def count_refusal(self) -> None:
        """A request refused before admission while the workers are down (a restart)."""
        self._count_dropped("rejected")

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        """Queue `inputs`, wait for all of their results, and give them in order.

        Raises `Refused`: never admissible for more inputs than the queue can ever hold
        (a retry cannot help), queue full or deadline unreachable at admission, deadline
        passed at the deadline, and whatever the pool refused or failed. Whatever
        happens, items still queued on the way out are withdrawn.
        """
        run_id, items, futures = self._admit(inputs, params, deadline, control)
        try:
            if len(futures) == 1:  # most requests: no gathering future in between
                return [await futures[0]]
            return list(await asyncio.gather(*futures))
        finally:
            self._end_run(run_id, items, futures, deadline)

    def begin(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control,
        on_end: RunEnd,
    ) -> RunningRequest:
        """`run` without a task: queue `inputs` and call `on_end(results, None)` once all
        are answered, or `on_end(None, error)` at the first error (the refusals `run`
        raises). Admission refusals are raised at once. `cancel()` on what it returns
        withdraws the items (on_end is then never called). The serving process carries
        every HTTP process's requests this way: a task a request was ~8 % of the serving
        process's cost of it (bench/RESULTS.md)."""
        run_id, items, futures = self._admit(inputs, params, deadline, control)
        end = functools.partial(self._end_run, run_id, items, futures, deadline)
        return RunningRequest(futures, end, on_end)

    def _admit(
        self, inputs: Sequence[Any], params: Mapping[str, Any], deadline: float, control: Control
    ) -> tuple[int, list[WorkItem], list[asyncio.Future[ItemResult]]]:
        """Queue the items (or raise `Refused`), each with the future it is settled by,
        under a new run id whose deadline is watched."""
        loop = self._loop or asyncio.get_running_loop()
        if self._stopped:  # a request that passed the gate before the drain, its prompt
            raise shutting_down()  # tokenized after the scheduler stopped: never answered
        now = self.clock()
        if deadline <= now:  # spent on its body (a slow upload), never queued: no load shed
            raise Refused.because(Reason.DEADLINE_PASSED, PASSED_BEFORE_QUEUED)
        if self._down:
            self._refuse_unreachable(deadline, len(inputs), now)
        request_id = REQUEST_ID.get()  # the request this task answers (set by the protocol)
        items = [
            self.core.new_item(value, params, deadline, now, control, request_id)
            for value in inputs
        ]
        futures: list[asyncio.Future[ItemResult]] = []
        for item in items:
            item.future = future = loop.create_future()
            futures.append(future)
        if self.core.max_size == 1 and self.core.free_rows:
            # (the free rows its bound counts are the workers' now: a continuous worker
            # that died since the last look has none, where a burst filled the queue
            # past --max-queue)
            self.core.free_rows = self.backend.idle_workers()
            self.core.empty_workers = self.backend.empty_workers()
        try:
            self.core.admit(items, now)
        except NeverAdmissible as never:  # a 413, the client's to fix: no load was shed
            raise Refused.because(Reason.NEVER_ADMISSIBLE, str(never)) from None
        except QueueFull as refused:
            raise self._refusal(refused, len(items)) from None
        self.wake()
        run_id = next(self._run_ids)
        self._runs[run_id] = items
        self._late.watch(run_id, deadline)  # then `_on_late` fails it with DEADLINE_PASSED
        return run_id, items, futures

    def _end_run(
        self,
        run_id: int,
        items: list[WorkItem],
        futures: list[asyncio.Future[ItemResult]],
        deadline: float,
    ) -> None:
        """A run is over (answered, failed or withdrawn): its items still queued leave the
        queue, and the model stops on the batches it still computes for nobody where it
        can (a batch other runs wait for goes on)."""
        expired = self._runs.pop(run_id, None) is None  # `_on_late` took it
        self._late.forget(run_id)
        if run_id in self._not_back_in_time:  # refused (503), not expired
            self._not_back_in_time.discard(run_id)
            # queued, or sent to a worker that died with them: neither was answered
            self._count_dropped("rejected", sum(not _answered(future) for future in futures))
        else:
            self._count_withdrawn(items, futures, deadline, expired)
        for item, future in zip(items, futures, strict=True):
            self.core.remove(item)
            if not future.done():
                future.cancel()
        # (awaiting a future that times out or is cancelled cancels it: the batch says
        # whether the model still works on it)
        for batch in {item.batch for item in items if item.batch is not None}:
            members = self._sent.get(batch)
            if batch.done() or members is None:
                continue
            gone = [place for place, member in enumerate(members) if not _waits(member)]
            if len(gone) == len(members):
                self.backend.abandon(batch)  # e.g. a continuous worker frees its rows
            else:  # others wait for the batch: only these items are not run again
                self.backend.abandon(batch, gone)

    def _on_late(self, run_id: int) -> None:
        """A run's deadline passed: it ends with DEADLINE_PASSED (through the first of its
        items not answered yet; its other items are withdrawn as it ends)."""
        items = self._runs.pop(run_id, ())
        waiting = next((item.future for item in items if _waits(item)), None)
        if waiting is not None:
            waiting.set_exception(deadline_passed())

    def answer_unreachable(self, serving_again_at: float) -> None:
        """No worker serves, and none should before `serving_again_at` (math.inf: none
        is expected, every worker keeps dying): each run due before then is answered
        now, 503 with the wait for the restart, rather than left to wait out its deadline
        for a 504, which tells a client not to retry where a retry after the restart (or
        at another replica) would be answered. A run whose answer has come meanwhile (its
        batch answered as the worker died: an input of it quarantined, say) gets that."""
        self._down = True
        self._answer_due_before(serving_again_at)

    def answer_pinned(
        self, batches: Collection[asyncio.Future[BatchResult]], back_at: float
    ) -> None:
        """A worker died, and the items of `batches` wait to run again on it alone, once
        it is back at `back_at` (on another, what killed it would take that one down
        too): each run of them due before then is answered now, as `answer_unreachable`
        answers it (500 for a request its worker ran alone, else 503 with the wait), not
        left to its 504 while another worker idles or comes back first."""
        self._answer_due_before(back_at, batches)

    def _answer_due_before(
        self, back_at: float, batches: Collection[asyncio.Future[BatchResult]] | None = None
    ) -> None:
        """Answer each run due before `back_at` that still waits for a worker (of those
        with an item in `batches` alone, where given)."""
        due = [run_id for run_id, at in self._late.late_at.items() if at < back_at]
        retry_after = _restart_wait(back_at, self.clock())
        for run_id in due:
            items = self._runs.get(run_id, ())
            if batches is None or any(item.batch in batches for item in items if _waits(item)):
                self._answer_not_back(run_id, retry_after)

    def _answer_not_back(self, run_id: int, retry_after: float | None) -> None:
        """Answer a run that no worker would compute before its deadline, where it still
        waits for one: 500 where its request was all its dead worker ran (what killed
        it, likely), else 503 with `retry_after`."""
        items = self._runs.get(run_id, ())
        waiting = _waiting_for_a_worker(items)
        if waiting is None:
            return
        del self._runs[run_id]
        self._late.forget(run_id)
        self._not_back_in_time.add(run_id)
        alone = any(self._sent_alone(item) for item in items if _waits(item))
        waiting.set_exception(crashed_not_back() if alone else not_back_in_time(retry_after))

    def _sent_alone(self, item: WorkItem) -> bool:
        """Whether `item`'s request was all its worker ran as it died (that worker is
        down when this is asked): what killed the worker, likely. One beside another
        request's items (a batch-mate, or a continuous worker's sequence beside others on
        its rows) may be a batch-mate of what did: a 503, which a proxy retries
        elsewhere, and one bad input never fails its batch-mates. The pool says what the
        worker ran as it died, item by item: by now the others' batches may be answered
        (a stream's error), and that one looked alone; and the items of a batch may have
        run apart (an item at a time after a crash, or alone as one a worker died running
        before), each a worker that died with it. Those still waiting count: the others'
        runs again have answered them."""
        if item.batch is None:
            return False
        sent = self._sent.get(item.batch, [])
        own = [
            p for p, member in enumerate(sent) if member.request == item.request and _waits(member)
        ]
        died_with = [self.backend.died_with(item.batch, place) for place in own]
        return bool(own) and all(0 < died <= len(own) for died in died_with)

    def _refuse_unreachable(self, deadline: float, items: int, now: float) -> None:
        """While no worker serves, raise for a run due before one should again what the
        runs waiting when that was told got (`answer_unreachable`): admitted a moment
        before (an HTTP process that read the board before it said so, a route that
        tokenized meanwhile), it would otherwise wait out the restart or its deadline."""
        serving_again_at = self.backend.serving_again_at()
        if serving_again_at is None:  # serving again (or no guess): admitted as before
            self._down = False
        elif deadline < serving_again_at:
            self._count_dropped("rejected", items)
            raise not_back_in_time(_restart_wait(serving_again_at, now))

    def _look(self) -> None:
        """One look at the queue: answer what expired, send what is ready, and set the
        timer for the next thing that will be due."""
        self._look_due = False
        if not self._running:
            return
        now = self.clock()
        self.core.batch_cap = self.backend.batch_cap()
        self.core.workers = self.backend.concurrency()
        self.core.rows_when_ready = self.backend.rows_when_ready()
        limits = self.backend.limits
        self.core.max_input_tokens = limits.longest_input
        self.core.default_new_tokens = limits.default_new_tokens
        self.core.default_beams = limits.default_beams
        try:
            decision = self.core.decide(now, self.backend.idle_workers())
        except Exception:  # a defect: it would raise again at every look
            self._fail_queued()
            return
        for item in decision.expired:
            _settle(
                item,
                exception=Refused.because(Reason.DEADLINE_PASSED, "deadline passed while queued"),
            )
        self._count_dropped("expired", len(decision.expired))
        for batch in decision.batches:
            self._dispatch(batch, now)
        self.core.free_rows = self.backend.idle_workers()
        continuous = self.core.max_size == 1 and self.core.free_rows
        self.core.empty_workers = self.backend.empty_workers() if continuous else 0
        self._sleep_until(decision.wake_at)

    def _fail_queued(self) -> None:
        """A scheduling pass raised: every queued request is answered now (500), not
        left to wait for its 504 while each look raises again, and the queue starts
        afresh (what runs goes on). So are the items the pass took for a batch it never
        sent, no longer counted in flight."""
        queued = self.core.drop_expired(math.inf)  # every queued item
        unsent = [
            item
            for items in self._runs.values()
            for item in items
            if not item.queued and item.batch is None and _waits(item)
        ]
        for item in unsent:
            # (a batch's first item's call forgets the batch; the others' do nothing)
            self.core.forget_batch([item], self.clock())
        log.exception(
            "a scheduling pass failed; its %d queued items are answered 500",
            len(queued) + len(unsent),
        )
        failed = Refused.because(Reason.MODEL_FAILED, "the server failed to schedule this input")
        for item in [*queued, *unsent]:
            _settle(item, exception=failed)

    @property
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    def _refusal(self, refused: QueueFull, items: int) -> Refused:
        """The refusal of `items` at admission (counted as rejected)."""
        self._count_dropped("rejected", items)
        reason = (
            Reason.DEADLINE_UNREACHABLE
            if isinstance(refused, DeadlineUnreachable)
            else Reason.QUEUE_FULL
        )
        return Refused.because(reason, f"server busy: {refused.reason}", refused.retry_after)

    def _count_dropped(self, reason: str, count: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.drop(reason, count)

    def _count_withdrawn(
        self,
        items: list[WorkItem],
        futures: list[asyncio.Future[ItemResult]],
        deadline: float,
        expired: bool,
    ) -> None:
        """Count items leaving the queue uncomputed: at their deadline (`expired`: the
        run's deadline was found passed), or their client left. Those a worker holds
        unanswered are told why, to be counted so if the pool never runs them
        (`_count_not_run`), unless the run was answered with an error (the server
        shutting down, say): then nobody left."""
        late = expired or self.clock() >= deadline
        reason = "expired" if late else "disconnected"
        withdrawn = sum(item.queued for item in items)
        if withdrawn:
            self._count_dropped(reason, withdrawn)
        if not late and any(_failed(future) for future in futures):
            return
        for item, future in zip(items, futures, strict=True):
            if item.batch is not None and not _answered(future):
                item.left = reason

    def _count_not_run(self, items: Sequence[WorkItem], outputs: Sequence[Any]) -> None:
        """Count the items of a batch lost in a crash that the pool did not run again, their
        runs having ended (queued for a retry, they were dropped as surely as from the
        queue: 504s at their deadline counted as none)."""
        for item, output in zip(items, outputs, strict=True):
            if output is NOT_RUN and item.left:
                self._count_dropped(item.left)

    def _sleep_until(self, when: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if when is not None:
            delay = max(0.0, when - self.clock())
            self._timer = self._running_loop.call_later(delay, self.wake)

    def _dispatch(self, batch: list[WorkItem], now: float) -> None:
        try:
            lead = batch[0]
            inputs, ids = [item.input for item in batch], [item.request_id for item in batch]
            admitted = [item.arrived for item in batch]
            on_part = functools.partial(self._answer_part, batch, now)
            future = self.backend.submit(inputs, lead.params, lead.control, ids, admitted, on_part)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the loop goes on
            if _no_worker(exc) and not self.backend.idle_workers():
                # taken since the pass looked (an input that must run alone holds a
                # continuous worker's new sequences): the batch waits its turn again
                self.core.requeue(batch, self.clock())
                return
            self.core.forget_batch(batch, self.clock())
            log.error("the worker pool refused a batch of %d: %s", len(batch), exc)
            for item in batch:
                _settle(item, exception=_as_refusal(exc))
            return
        if self.metrics is not None:
            self.metrics.observe_queue([now - at for at in admitted])
        self.in_flight += len(batch)
        self._sent[future] = batch
        for item in batch:
            item.batch = future
        future.add_done_callback(lambda done: self._on_batch_done(batch, now, done))

    def _on_batch_done(self, batch: list[WorkItem], sent: float, done: asyncio.Future) -> None:
        self.in_flight -= len(batch)
        self._sent.pop(done, None)
        self.wake()
        if done.cancelled() or done.exception() is not None:
            self.core.forget_batch(batch, self.clock())
            error = done.exception() if not done.cancelled() else None
            stopped = isinstance(error, Refused) and error.refusal.reason is Reason.SHUTTING_DOWN
            # (the end of the grace is logged once, not once a batch; a batch nobody waits
            # for, as a retry after a crash that was dropped, fails for nobody)
            if not stopped and any(_waits(item) for item in batch):
                log.error("a batch of %d failed in the worker pool: %s", len(batch), error)
            for item in batch:
                _settle(item, exception=_as_refusal(error))
            return
        result: BatchResult = done.result()
        waited = any(_waits(item) for item in batch)
        try:
            self._account(batch, result, waited)
        except Exception:  # (a defect in the accounting must not lose the answers)
            log.exception("the accounting of a batch of %d failed; it is answered", len(batch))
        if not waited:
            return
        answers = [
            (item, _item_result(item, output, sent, batch, result))
            for item, output in zip(batch, result.outputs, strict=True)
        ]
        self._deliver(answers, 0)

    def _account(self, batch: list[WorkItem], result: BatchResult, waited: bool) -> None:
        """What a batch's end teaches the scheduler: its time, its tokens, its items."""
        # a model call, whether or not anyone still waits for it (one answered in parts
        # was counted and observed a part, a call, at a time: `_answer_part`)
        if all(item.call is None for item in batch):
            self._count_not_run(batch, result.outputs)
            self._observe_call(result)
        if result.rerun:  # its time is a worker's restart as much as the model's
            self.core.forget_batch(batch, self.clock())
        elif not waited:
            self.core.stopped_batch(batch, self.clock() - result.waited, result.made)
        else:  # its own run: the time it waited in the worker behind another batch left out
            self.core.finish_batch(batch, self.clock() - result.waited, result.made)
        if waited and result.token_counts:
            self.core.calibrate(batch, result.token_counts)

    def _observe_call(self, result: BatchResult) -> None:
        """Observe a model call's size and time: inputs refused as poison (counted as
        dropped), not run again for nobody, or lost with a worker that crashed or hung
        were never computed (a lost call's time is 0)."""
        computed = sum(
            not any(output is lost for lost in NOT_COMPUTED) for output in result.outputs
        )
        if self.metrics is not None and computed:
            self.metrics.observe_batch(computed, result.compute_seconds)

    def _answer_part(
        self, batch: list[WorkItem], sent: float, places: Sequence[int], result: BatchResult
    ) -> None:
        """Items of a batch answered apart (run again alone after a crash, or refused as
        poison): their requests need not wait for the others' verdict, and are timed by
        their own call (its start, size and seconds). The last part is told of after
        its batch is answered, whose answer delivers them so timed."""
        items = [batch[place] for place in places]
        self._count_not_run(items, result.outputs)
        self._observe_call(result)
        started = self.clock() - result.compute_seconds if result.rerun else sent
        for item in items:
            item.call = (started, len(items), result.compute_seconds)
        if items[0].batch is not None and items[0].batch.done():
            return
        for item, output in zip(items, result.outputs, strict=True):
            _settle(item, result=_item_result(item, output, sent, batch, result))

    def _deliver(self, answers: list[tuple[WorkItem, ItemResult]], start: int) -> None:
        """Settle a slice of the answers now and the rest on the loop's next passes."""
        end = start + DELIVERY_SLICE if self.slice_answers else len(answers)
        for item, result in answers[start:end]:
            _settle(item, result=result)
        if end < len(answers):
            self._running_loop.call_soon(self._deliver, answers, end)


def _item_result(
    item: WorkItem, output: Any, sent: float, batch: Sequence[WorkItem], result: BatchResult
) -> ItemResult:
    """An item's answer: its output, how long it queued before its batch was `sent` (or
    its own call began, where its part ran apart)."""
    if item.call is not None:
        started, size, seconds = item.call
        return ItemResult(output, started - item.arrived, size, seconds)
    return ItemResult(output, sent - item.arrived, len(batch), result.compute_seconds)


def _no_worker(error: BaseException) -> bool:
    return isinstance(error, Refused) and error.refusal.reason is Reason.NO_WORKER


def _as_refusal(error: BaseException | None) -> Refused:
    """What a client is told of a batch that failed: the pool's own refusal, else that
    the model failed (nothing internal leaks)."""
    if isinstance(error, Refused):
        return error
    return model_failed()


def _restart_wait(serving_again_at: float, now: float) -> float | None:
    """The Retry-After of a run the restart would outlast: until it should be over, or
    None where none is expected."""
    return None if serving_again_at == math.inf else max(serving_again_at - now, 0.0)


def _waiting_for_a_worker(items: Sequence[WorkItem]) -> asyncio.Future[ItemResult] | None:
    """The future of a run's first item that still waits for a worker to compute it
    (None: each one is answered, or its batch is: the answer is on its way)."""
    waiting = (item for item in items if _waits(item))
    return next((item.future for item in waiting if not _batch_answered(item)), None)


def _batch_answered(item: WorkItem) -> bool:
    return item.batch is not None and item.batch.done()


def _answered(future: asyncio.Future[ItemResult]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _failed(future: asyncio.Future[ItemResult]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


def _waits(item: WorkItem) -> bool:
    """Whether someone still waits for the item's answer."""
    return item.future is not None and not item.future.done()


def _settle(
    item: WorkItem, *, result: ItemResult | None = None, exception: BaseException | None = None
) -> None:
    """Give `item` its result or its error (once; later calls do nothing)."""
    if item.future is None or item.future.done():
        return
    if result is not None:
        item.future.set_result(result)
    else:
        item.future.set_exception(exception or Refused.because(Reason.MODEL_FAILED, "no result"))

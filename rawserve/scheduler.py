"""The deadline scheduler: who is served, when, and with whom.

`SchedulerCore` holds the queue and makes every decision (admit, build the next batch,
drop what expired, when to look again) as plain synchronous functions of `now`, so it
is tested with a fake clock. `Scheduler` is the thin async driver: it sleeps until the
next thing that can happen (an arrival, a free worker, a batch-delay deadline), never
polls, and hands batches to the executor. It knows nothing of HTTP or of torch.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rawserve.errors import GatewayTimeout, InternalError, ServiceUnavailable
from rawserve.messages import BatchResult
from rawserve.tasks import batch_key, estimate_tokens

log = logging.getLogger("rawserve.scheduler")

RATE_SMOOTHING = 0.2  # weight of the newest batch in the service-rate average


@dataclass(eq=False)
class WorkItem:
    """One input waiting for (or inside) a model call."""

    input: Any
    params: Mapping[str, Any]
    key: str
    deadline: float
    arrived: float
    cost: int
    seq: int
    future: asyncio.Future[ItemResult] | None = None
    queued: bool = False

    def sort_key(self) -> tuple[float, int]:
        return (self.deadline, self.seq)


@dataclass(frozen=True)
class ItemResult:
    output: Any  # the task's output, or a messages.ItemFailure
    queue_seconds: float
    batch_size: int
    compute_seconds: float


class QueueFull(Exception):
    def __init__(self, retry_after: float):
        super().__init__("queue full")
        self.retry_after = retry_after


@dataclass
class SchedulerCore:
    """The queue and the batching rules; no I/O, no clock of its own."""

    max_queue: int = 256
    max_batch_size: int = 32
    max_batch_delay: float = 0.0  # seconds a free worker may wait, from the oldest item
    max_batch_tokens: int | None = None
    _queues: dict[str, list[WorkItem]] = field(default_factory=dict)
    _size: int = 0
    _seq: itertools.count = field(default_factory=itertools.count)
    items_per_second: float | None = None  # measured service rate

    def __len__(self) -> int:
        return self._size

    def new_item(self, value: Any, params: Mapping[str, Any], deadline: float, now: float):
        return WorkItem(
            input=value,
            params=params,
            key=batch_key(params),
            deadline=deadline,
            arrived=now,
            cost=estimate_tokens(value),
            seq=next(self._seq),
        )

    def admit(self, items: Sequence[WorkItem]) -> None:
        """Queue all of `items` or none of them (a list request is admitted whole)."""
        if self._size + len(items) > self.max_queue:
            raise QueueFull(self.retry_after())
        for item in items:
            bisect.insort(self._queues.setdefault(item.key, []), item, key=WorkItem.sort_key)
            item.queued = True
        self._size += len(items)

    def remove(self, item: WorkItem) -> None:
        """Take an item out of the queue (withdrawn, expired); harmless if already out."""
        if not item.queued:
            return
        queue = self._queues[item.key]
        queue.pop(bisect.bisect_left(queue, item.sort_key(), key=WorkItem.sort_key))
        if not queue:
            del self._queues[item.key]
        item.queued = False
        self._size -= 1

    def drop_expired(self, now: float) -> list[WorkItem]:
        """Remove and return the queued items whose deadline has passed."""
        expired = [
            item for queue in self._queues.values() for item in queue if item.deadline <= now
        ]
        for item in expired:
            self.remove(item)
        return expired

    def next_batch(self, now: float) -> list[WorkItem] | None:
        """The batch to send to a free worker now, or None to wait.

        Keys are tried in earliest-deadline-first order of their heads; a key's batch
        goes when it is full or when its oldest item has waited `max_batch_delay`.
        """
        heads = sorted(self._queues.values(), key=lambda queue: queue[0].sort_key())
        for queue in heads:
            batch = self._fill(queue)
            oldest = min(item.arrived for item in queue)
            full = len(batch) < len(queue) or len(batch) == self.max_batch_size
            if full or now >= oldest + self.max_batch_delay:
                for item in batch:
                    self.remove(item)
                return batch
        return None

    def _fill(self, queue: list[WorkItem]) -> list[WorkItem]:
        """Take items in deadline order while the size and token bounds hold."""
        batch: list[WorkItem] = []
        longest = 0
        for item in queue[: self.max_batch_size]:
            longest = max(longest, item.cost)
            if (
                batch
                and self.max_batch_tokens
                and longest * (len(batch) + 1) > self.max_batch_tokens
            ):
                break
            batch.append(item)
        return batch

    def next_wakeup(self) -> float | None:
        """When the queue next needs a look: a batch delay running out, or a deadline."""
        times = []
        for queue in self._queues.values():
            times.append(min(item.arrived for item in queue) + self.max_batch_delay)
            times.append(queue[0].deadline)
        return min(times, default=None)

    def record_batch(self, size: int, seconds: float) -> None:
        rate = size / max(seconds, 1e-6)
        if self.items_per_second is None:
            self.items_per_second = rate
        else:
            self.items_per_second += RATE_SMOOTHING * (rate - self.items_per_second)

    def retry_after(self) -> float:
        """Seconds until the current queue has likely drained, at the measured rate."""
        if not self.items_per_second:
            return 1.0
        return max(1.0, self._size / self.items_per_second)


class Backend(Protocol):
    """What the scheduler needs from the executor."""

    on_idle: Callable[[], None] | None

    def idle_workers(self) -> int: ...

    def submit(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> asyncio.Future: ...


class Scheduler:
    """Runs a `SchedulerCore` against an executor on the event loop."""

    def __init__(
        self,
        core: SchedulerCore,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.monotonic,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.core = core
        self.backend = backend
        self.clock = clock
        self._loop = loop
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self.in_flight = 0  # items inside model calls
        backend.on_idle = self._wake.set

    def start(self) -> None:
        self._loop = self._loop or asyncio.get_running_loop()
        self._task = self._loop.create_task(self._dispatch_loop(), name="rawserve-scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def pending(self) -> int:
        """Items queued or being computed."""
        return len(self.core) + self.in_flight

    async def run(
        self, inputs: Sequence[Any], params: Mapping[str, Any], deadline: float
    ) -> list[ItemResult]:
        """Queue `inputs`, wait for all of their results, and give them in order.

        Raises ServiceUnavailable when the queue is full and GatewayTimeout at the
        deadline. Whatever happens, items still queued on the way out are withdrawn.
        """
        loop = self._loop or asyncio.get_running_loop()
        now = self.clock()
        items = [self.core.new_item(value, params, deadline, now) for value in inputs]
        for item in items:
            item.future = loop.create_future()
        try:
            self.core.admit(items)
        except QueueFull as full:
            raise ServiceUnavailable(
                "server busy: queue full", retry_after=full.retry_after
            ) from None
        self._wake.set()
        futures = [item.future for item in items]
        try:
            async with asyncio.timeout(max(0.0, deadline - now)):
                return list(await asyncio.gather(*futures))
        except TimeoutError:
            raise GatewayTimeout("the request's deadline passed before it was answered") from None
        finally:
            for item in items:
                self.core.remove(item)
                if not item.future.done():
                    item.future.cancel()

    async def _dispatch_loop(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock()
            for item in self.core.drop_expired(now):
                _settle(item, exception=GatewayTimeout("deadline passed while queued"))
            while self.backend.idle_workers() > 0:
                batch = self.core.next_batch(now)
                if batch is None:
                    break
                self._dispatch(batch, now)
            self._sleep_until(self.core.next_wakeup())
            await self._wake.wait()

    def _sleep_until(self, when: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if when is not None:
            delay = max(0.0, when - self.clock())
            self._timer = self._loop.call_later(delay, self._wake.set)

    def _dispatch(self, batch: list[WorkItem], now: float) -> None:
        future = self.backend.submit([item.input for item in batch], batch[0].params)
        self.in_flight += len(batch)
        future.add_done_callback(lambda done: self._on_batch_done(batch, now, done))

    def _on_batch_done(self, batch: list[WorkItem], sent: float, done: asyncio.Future) -> None:
        self.in_flight -= len(batch)
        self._wake.set()
        if done.cancelled() or done.exception() is not None:
            error = done.exception() if not done.cancelled() else None
            log.error("a batch of %d failed in the executor: %s", len(batch), error)
            for item in batch:
                _settle(item, exception=_as_http_error(error))
            return
        result: BatchResult = done.result()
        self.core.record_batch(len(batch), result.compute_seconds)
        for item, output in zip(batch, result.outputs, strict=True):
            _settle(
                item,
                result=ItemResult(output, sent - item.arrived, len(batch), result.compute_seconds),
            )


def _as_http_error(error: BaseException | None) -> Exception:
    if isinstance(error, (ServiceUnavailable, GatewayTimeout, InternalError)):
        return error
    return InternalError("the model worker failed while computing this request")


def _settle(item: WorkItem, *, result: ItemResult | None = None, exception=None) -> None:
    if item.future is None or item.future.done():
        return
    if exception is not None:
        item.future.set_exception(exception)
    else:
        item.future.set_result(result)

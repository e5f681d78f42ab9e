"""The scheduler's rules, on a fake clock (the core) and with a fake executor (the driver)."""

from __future__ import annotations

import asyncio

import pytest

from rawserve.errors import GatewayTimeout, ServiceUnavailable
from rawserve.messages import BatchResult
from rawserve.scheduler import QueueFull, Scheduler, SchedulerCore


def queue_items(core: SchedulerCore, values, now=0.0, deadline=30.0, params=None):
    items = [core.new_item(v, params or {}, deadline, now) for v in values]
    core.admit(items)
    return items


# --- the core: pure decisions of `now` ----------------------------------------------


def test_greedy_when_idle_with_zero_delay():
    core = SchedulerCore(max_batch_delay=0.0)
    queue_items(core, ["a"])
    batch = core.next_batch(now=0.0)
    assert [item.input for item in batch] == ["a"]
    assert len(core) == 0


def test_batch_is_bounded_by_max_batch_size():
    core = SchedulerCore(max_batch_size=4)
    queue_items(core, list("abcdefghij"))
    sizes = []
    while batch := core.next_batch(now=0.0):
        sizes.append(len(batch))
    assert sizes == [4, 4, 2]


def test_delay_is_one_deadline_from_the_oldest_item():
    core = SchedulerCore(max_batch_size=8, max_batch_delay=0.200)
    queue_items(core, ["first"], now=0.0)
    assert core.next_batch(now=0.05) is None
    queue_items(core, ["second"], now=0.05)  # a later arrival does not reset the wait
    assert core.next_wakeup() == pytest.approx(0.200)
    assert core.next_batch(now=0.199) is None
    batch = core.next_batch(now=0.200)
    assert [item.input for item in batch] == ["first", "second"]


def test_full_batch_goes_at_once_despite_the_delay():
    core = SchedulerCore(max_batch_size=3, max_batch_delay=10.0)
    queue_items(core, ["a", "b", "c", "d"])
    assert len(core.next_batch(now=0.0)) == 3
    assert core.next_batch(now=0.0) is None  # "d" waits for its delay


def test_queue_bound_refuses_a_whole_list():
    core = SchedulerCore(max_queue=4)
    queue_items(core, ["a", "b", "c"])
    with pytest.raises(QueueFull):
        queue_items(core, ["d", "e"])
    assert len(core) == 3  # nothing of the refused list was queued
    queue_items(core, ["d"])
    assert len(core) == 4


def test_retry_after_follows_the_measured_rate():
    core = SchedulerCore(max_queue=100)
    queue_items(core, [str(i) for i in range(100)])
    core.record_batch(size=10, seconds=1.0)  # 10 items/s, 100 queued → ~10 s
    assert core.retry_after() == pytest.approx(10.0)


def test_earliest_deadline_first_and_expiry():
    core = SchedulerCore(max_batch_size=1)
    late = queue_items(core, ["late"], deadline=10.0)
    soon = queue_items(core, ["soon"], deadline=5.0)
    assert core.next_batch(now=0.0) == soon
    assert core.drop_expired(now=10.0) == late
    assert len(core) == 0 and core.next_batch(now=10.0) is None


def test_different_parameters_never_share_a_batch():
    core = SchedulerCore(max_batch_size=8)
    queue_items(core, ["a", "b"], params={"top_k": 1})
    queue_items(core, ["c"], params={"top_k": 2})
    batches = [core.next_batch(now=0.0), core.next_batch(now=0.0)]
    assert sorted(sorted(item.input for item in b) for b in batches) == [["a", "b"], ["c"]]


def test_token_budget_bounds_the_padded_cost():
    core = SchedulerCore(max_batch_size=32, max_batch_tokens=100)
    queue_items(core, ["x" * 152] * 5)  # ~40 tokens each → 2 fit in 100
    assert len(core.next_batch(now=0.0)) == 2


def test_withdrawn_items_leave_the_queue():
    core = SchedulerCore()
    first, second = queue_items(core, ["a", "b"])
    core.remove(first)
    core.remove(first)  # twice is harmless
    assert core.next_batch(now=0.0) == [second]


# --- the async driver, with a fake executor -------------------------------------------


class FakeBackend:
    def __init__(self, workers: int = 1):
        self.workers = workers
        self.calls: list[tuple[list, dict, asyncio.Future]] = []
        self.on_idle = None

    def idle_workers(self) -> int:
        return self.workers - sum(not f.done() for _, _, f in self.calls)

    def submit(self, inputs, params):
        future = asyncio.get_running_loop().create_future()
        self.calls.append((list(inputs), dict(params), future))
        return future

    def finish(self, index: int, outputs=None) -> None:
        inputs, _, future = self.calls[index]
        outputs = outputs if outputs is not None else [f"out:{x}" for x in inputs]
        future.set_result(BatchResult(index, tuple(outputs), 0.01))


async def until(condition, timeout: float = 2.0) -> None:
    """Yield to the loop until `condition()` holds (driven by events, bounded in time)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


@pytest.fixture
async def driver():
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_batch_size=4, max_queue=8), backend)
    scheduler.start()
    yield scheduler, backend
    await scheduler.stop()


async def test_idle_worker_gets_the_first_item_at_once_then_batches_while_busy(driver):
    scheduler, backend = driver
    first = asyncio.create_task(scheduler.run(["a"], {}, deadline=scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    assert backend.calls[0][0] == ["a"]
    rest = [asyncio.create_task(scheduler.run([x], {}, scheduler.clock() + 5)) for x in "bcdef"]
    await until(lambda: len(scheduler.core) == 5)
    assert len(backend.calls) == 1  # the worker is busy: items accumulate
    backend.finish(0)
    await until(lambda: len(backend.calls) == 2)
    assert backend.calls[1][0] == ["b", "c", "d", "e"]  # one batch, bounded at 4
    backend.finish(1)
    await until(lambda: len(backend.calls) == 3)
    backend.finish(2)
    assert [r.output for r in await first] == ["out:a"]
    assert [(await task)[0].output for task in rest] == [f"out:{x}" for x in "bcdef"]


async def test_full_queue_answers_503_with_retry_after(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    waiting = asyncio.create_task(scheduler.run(list("12345678"), {}, scheduler.clock() + 5))
    await until(lambda: len(scheduler.core) == 8)
    with pytest.raises(ServiceUnavailable) as refused:
        await scheduler.run(["x"], {}, scheduler.clock() + 5)
    assert ("Retry-After", "1") in refused.value.headers
    backend.finish(0)
    await until(lambda: len(backend.calls) == 2)
    backend.finish(1)
    await until(lambda: len(backend.calls) == 3)
    backend.finish(2)
    await busy
    assert len(await waiting) == 8


async def test_deadline_answers_504_and_the_item_is_never_computed(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    with pytest.raises(GatewayTimeout):
        await scheduler.run(["late"], {}, deadline=scheduler.clock() + 0.05)
    assert len(scheduler.core) == 0
    backend.finish(0)
    await busy
    await asyncio.sleep(0.01)
    assert [call[0] for call in backend.calls] == [["a"]]


async def test_a_cancelled_request_is_withdrawn(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    gone = asyncio.create_task(scheduler.run(["gone"], {}, scheduler.clock() + 5))
    await until(lambda: len(scheduler.core) == 1)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert len(scheduler.core) == 0
    backend.finish(0)
    await busy
    await asyncio.sleep(0.01)
    assert len(backend.calls) == 1

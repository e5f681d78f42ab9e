"""A continuous worker as the pool holds it: many batches at once, answered in any order.

Pure: `WorkerHandle.room` (how many batches it takes now) and `RunningBatches` (the
batches it holds, by id and by stream), with no process behind them. The end-to-end
behaviour through a real worker is in tests/test_continuous_serving.py.
"""

from __future__ import annotations

import asyncio

import pytest

from rawserve.serving.handles import Job, RunningBatches, WorkerHandle
from rawserve.serving.pool import WorkerPool
from rawserve.serving.status import WorkerState
from rawserve.serving.supervision import WorkerRecord
from rawserve.shared.messages import NO_CONTROL, Batch, Control, WorkerConfig


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def job(loop, batch_id: int, items: int = 1, stream_id: int | None = None, retry=False) -> Job:
    control = Control(stream_id=stream_id) if stream_id is not None else NO_CONTROL
    return Job(
        tuple(f"prompt {i}" for i in range(items)),
        {},
        control,
        loop.create_future(),
        batch_id,
        poison_key="key" if retry else None,
    )


def handle(sequences: int = 0, state=WorkerState.IDLE, overlap=False) -> WorkerHandle:
    worker = WorkerHandle(0, WorkerConfig(model="m"), WorkerRecord())
    worker.state, worker.sequences, worker.overlap = state, sequences, overlap
    return worker


def test_a_continuous_worker_takes_a_batch_per_free_row(loop):
    worker = handle(sequences=4, state=WorkerState.IDLE)
    assert worker.room() == 4
    worker.running.add(job(loop, 1))
    worker.running.add(job(loop, 2, items=2))
    worker.state = WorkerState.BUSY
    assert worker.room() == 1 and worker.running.rows == 3
    worker.running.add(job(loop, 3))
    assert worker.room() == 0  # every row taken
    worker.running.pop(2)
    assert worker.room() == 2


def test_a_continuous_worker_that_is_not_serving_takes_nothing():
    for state in (WorkerState.LOADING, WorkerState.WARMING, WorkerState.DEAD):
        assert handle(sequences=8, state=state).room() == 0


def test_a_retry_after_a_crash_runs_alone(loop):
    """An input run again after a crash must run alone: a second crash then names it."""
    worker = handle(sequences=8, state=WorkerState.BUSY)
    worker.running.add(job(loop, 1, retry=True))
    assert worker.room() == 0
    worker.running.pop(1)
    assert worker.room() == 8


def test_batches_are_answered_in_any_order(loop):
    running = RunningBatches()
    first, second, third = job(loop, 1), job(loop, 2, stream_id=7), job(loop, 3)
    for each in (first, second, third):
        running.add(each)
    assert running.pop(3) is third and running.pop(1) is first
    assert running.pop(1) is None  # answered already: a stale result
    assert second in running and first not in running
    assert len(running) == 1 and running.rows == 1


def test_a_batch_is_found_by_its_stream_and_by_its_future(loop):
    running = RunningBatches()
    streamed, plain = job(loop, 1, stream_id=7), job(loop, 2)
    running.add(streamed)
    running.add(plain)
    assert running.streaming(7) is streamed and running.streaming(8) is None
    assert running.forget(loop.create_future()) == []
    assert running.forget(plain.future) == [plain] and plain.abandoned
    running.pop(1)
    assert running.streaming(7) is None  # answered: its stream is no longer this worker's


def test_take_all_empties_it_in_the_order_sent(loop):
    running = RunningBatches()
    jobs = [job(loop, i, stream_id=i) for i in (5, 2, 9)]
    for each in jobs:
        running.add(each)
    assert running.take_all() == jobs
    assert not running and running.rows == 0 and running.streaming(2) is None


def test_a_worker_that_runs_batches_whole_keeps_its_room_rules(loop):
    assert handle().room() == 1  # idle
    busy = handle(state=WorkerState.BUSY)
    busy.job = job(loop, 1)
    assert busy.room() == 0
    overlapping = handle(state=WorkerState.BUSY, overlap=True)
    overlapping.job = job(loop, 1)
    assert overlapping.room() == 1  # one behind the running batch
    overlapping.queued = job(loop, 2)
    assert overlapping.room() == 0
    assert overlapping.holds(overlapping.queued) and not overlapping.holds(job(loop, 3))


def test_a_job_learns_which_of_its_items_nobody_waits_for_and_so_do_its_parts(loop):
    """The scheduler says which items of its batch nobody waits for any more (by their
    places in it); a part of the batch (a retry of one item after a crash, the items not
    refused as poison) reads them at its own inputs' places."""
    whole = job(loop, 1, items=4)
    retry = whole.part([2], 2)
    rest = whole.part([1, 3], 3)
    assert retry.inputs == ("prompt 2",) and rest.inputs == ("prompt 1", "prompt 3")
    elsewhere = loop.create_future()
    assert not any(each.forget(elsewhere) for each in (whole, retry, rest))
    assert not whole.forget(whole.future, [0, 3]) and whole.gone == {0, 3}
    assert not rest.forget(whole.future, [0, 3]) and rest.gone == {1}
    assert retry.forget(whole.future, [2]) and retry.gone == {0}
    assert rest.forget(whole.future) and not whole.abandoned  # (each is told on its own)
    assert whole.forget(whole.future, [1, 2]) and whole.abandoned


class Pipe:
    def __init__(self) -> None:
        self.sent: list[Batch] = []

    def send(self, batch: Batch) -> None:
        self.sent.append(batch)


async def test_a_batch_and_each_part_of_it_carry_their_inputs_request_ids():
    """Sent to the worker with the batch, for its log lines about an item; a part of the
    batch (its inputs not refused as poison, a retry of one alone after a crash) carries
    its own inputs' ids."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], loop=loop)
    worker = pool.workers[0]
    worker.state, worker.conn = WorkerState.IDLE, Pipe()
    pool.submit(["a", "b"], {}, NO_CONTROL, ["r1", "r2"])
    whole = worker.job
    assert whole is not None and worker.conn.sent[0].request_ids == ("r1", "r2")
    assert whole.part([1], 5).request_ids == ("r2",)
    assert Batch(1, ("a",)).request_id(0) == "-"  # none given


def test_no_worker_is_offered_while_a_retry_any_worker_may_run_waits(loop):
    """A crashed worker's retries, once its restarts fail, go to any worker, first: the
    scheduler is offered none meanwhile (its batch would be refused 503, "no model worker
    is free", with two workers idle)."""
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu", "cpu"], loop=loop)
    for worker in pool.workers:
        worker.state = WorkerState.IDLE
    assert pool.idle_workers() == 2
    pool.workers[0].record.failed_restarts = 1
    pool._retries.append(Job(("a",), {}, NO_CONTROL, loop.create_future(), 1, home=0, rerun=True))
    assert pool.idle_workers() == 0


@pytest.mark.parametrize("silent_for", [1.0, 100.0])
def test_a_continuous_worker_is_killed_at_the_batch_timeout_only_once_silent(loop, silent_for):
    """A worker running sequences hangs only when no decoding step has ended for the
    batch timeout: one that ended a step a second ago runs a long generation."""
    now = 100.0
    pool = WorkerPool(
        WorkerConfig(model="unused"), ["cpu"], loop=loop, batch_timeout=5.0, clock=lambda: now
    )
    worker = pool.workers[0]
    worker.state, worker.sequences = WorkerState.BUSY, 4
    running = job(loop, 1, stream_id=1)
    worker.running.add(running)
    worker.heard_at = now - silent_for
    pool._on_batch_timeout(worker, running)
    if running.watchdog is not None:
        running.watchdog.cancel()
    assert (worker.state is WorkerState.DEAD) == (silent_for > 5.0)


async def test_a_new_sequence_goes_to_a_worker_that_is_heard_over_a_stalled_one():
    """A continuous worker whose rows have said nothing for STALLED_AFTER (stopped from
    outside, wedged) is given new sequences only where no other worker has room: one
    stopped with a row took half of them, each waiting for its 504. A worker given its
    first row is not stalled for the silence of its idle time before it."""
    from rawserve.serving.pool import STALLED_AFTER

    loop = asyncio.get_running_loop()
    now = [1000.0]
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu", "cpu"], loop=loop, clock=lambda: now[0])
    stalled, heard = pool.workers
    for worker in pool.workers:
        worker.state, worker.sequences, worker.conn = WorkerState.IDLE, 4, Pipe()
    pool.submit(["a"], {})  # its first row: heard from now on, whatever its idle silence
    assert stalled.running.rows == 1 and stalled.heard_at == now[0]
    pool.submit(["b"], {})
    pool.submit(["c"], {})  # (the most room: the first again)
    assert (stalled.running.rows, heard.running.rows) == (2, 1)
    now[0] += STALLED_AFTER + 0.5
    heard.heard_at = now[0]  # (the other ended a step just now)
    for text in "def":  # the stalled one has the most room, and is passed over
        pool.submit([text], {})
    assert (stalled.running.rows, heard.running.rows) == (2, 4)
    pool.submit(["g"], {})  # no other has room: the stalled one may yet go on
    assert stalled.running.rows == 3


@pytest.mark.parametrize(
    ("asked", "reported", "shown"),
    [
        ("cuda:1", "cuda:0", "cuda:1"),  # its worker sees that GPU alone, as its cuda:0
        ("auto", "cpu", "cpu"),  # what its worker chose
        ("cpu", "cpu", "cpu"),
    ],
)
def test_a_workers_device_is_shown_as_named_or_as_chosen(asked, reported, shown):
    """/info and /metrics show a `--device cuda:1` worker as cuda:1, not as the cuda:0
    its worker reports, and an `auto` one as what it chose; before it is ready, as asked."""
    from rawserve.shared.messages import WorkerReady

    worker = WorkerHandle(1, WorkerConfig(model="m", device=asked), WorkerRecord())
    assert worker.device == asked
    worker.ready = WorkerReady(
        pid=1, task="feature-extraction", device=reported, dtype="float32", load_seconds=0.1
    )
    assert worker.device == shown and worker.status().device == shown


def test_the_server_keeps_no_write_end_of_a_workers_replies():
    """The worker holds the only write end of its replies: its exit is the server's end
    of file there. A write end kept here leaked a descriptor at every start and restart,
    and no worker's exit was ever read as one."""
    import multiprocessing
    from types import SimpleNamespace

    from rawserve.serving.processes import start_process

    spawn = multiprocessing.get_context("spawn")

    class NotStarted:  # (never run: the pipes are the subject; it keeps its arguments,
        # as a process object does for as long as the server holds it)
        def __init__(self, args: tuple[object, ...] = (), **_: object):
            self.args = args

        def start(self) -> None:
            pass

    context = SimpleNamespace(Pipe=spawn.Pipe, Value=spawn.Value, Process=NotStarted)
    worker = WorkerHandle(0, WorkerConfig(model="m"), WorkerRecord())
    process, replies = start_process(context, worker)
    try:
        assert isinstance(process, NotStarted)  # (held, as the server holds it)
        with pytest.raises(EOFError):
            replies.recv_bytes()
    finally:
        replies.close()
        worker.conn.close()

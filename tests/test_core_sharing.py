"""How CPU workers split the cores per batch (`share_cores`), without spawning any."""

from __future__ import annotations

from rawserve.serving.cores import CoreShare
from rawserve.serving.pool import WorkerPool
from rawserve.serving.status import WorkerState
from rawserve.shared.messages import WorkerConfig


def executor(devices=("cpu", "cpu"), share_cores=True, cores=4, core_share=None) -> WorkerPool:
    core_share = core_share or CoreShare(cores)  # as if the machine had this many
    shared = WorkerPool(
        WorkerConfig(model="unused"), list(devices), share_cores=share_cores, core_share=core_share
    )
    for worker in shared.workers:
        worker.state = WorkerState.IDLE
    return shared


def start(shared: WorkerPool, index: int, size: int) -> int | None:
    """What `_send` does: the worker is busy, then it asks for its threads."""
    worker = shared.workers[index]
    worker.state = WorkerState.BUSY
    return shared._threads_for(worker, size)


def test_busy_workers_take_an_even_share_of_the_cores():
    shared = executor()
    assert start(shared, 0, size=8) == 2
    assert start(shared, 1, size=8) == 2
    assert shared.idle_workers() == 0


def test_a_lone_item_at_low_load_gets_every_core_and_holds_them():
    shared = executor()
    assert start(shared, 0, size=1) == 4
    assert shared.idle_workers() == 0  # the other worker waits: no oversubscription
    shared.workers[0].state = WorkerState.IDLE  # its answer came back
    assert shared.idle_workers() == 2
    assert start(shared, 1, size=8) == 2  # the hold ended with that batch


def test_a_lone_item_nobody_waits_for_any_more_holds_the_cores_no_longer():
    """Its client had its 504 (or left) while the batch runs on, hung or slow: the other
    worker takes the queue at once instead of idling until it ends or times out."""
    import asyncio

    from rawserve.serving.face import NO_CONTROL
    from rawserve.serving.handles import Job

    async def scenario() -> tuple[int, int, bool]:
        shared = executor()
        woken: list[bool] = []
        shared.on_idle = lambda: woken.append(True)
        future = asyncio.get_running_loop().create_future()
        assert start(shared, 0, size=1) == 4
        shared.workers[0].job = Job(("hang",), {}, NO_CONTROL, future, 0)
        held = shared.idle_workers()
        shared.abandon(future)
        return held, shared.idle_workers(), bool(woken)

    held, after, woken = asyncio.run(scenario())
    assert (held, after) == (0, 1) and woken  # the scheduler is told a worker is free


def test_a_lone_item_holds_the_cores_for_a_bounded_time_then_the_others_take_the_queue(
    monkeypatch,
):
    """A worker stopped from outside (SIGSTOP, a debugger) or hung with its one item kept
    the model's other worker idle until --batch-timeout (120 s), every request meanwhile a
    504 though that worker could answer in milliseconds; a very long lone input likewise.
    The hold ends by itself, and the scheduler is told a worker is free when it does."""
    import asyncio

    from rawserve.serving import pool

    monkeypatch.setattr(pool, "MOST_HOLD_SECONDS", 0.05)

    async def scenario() -> tuple[int, int, bool]:
        shared = executor()
        shared._loop = asyncio.get_running_loop()
        woken: list[bool] = []
        shared.on_idle = lambda: woken.append(True)
        assert start(shared, 0, size=1) == 4
        held = shared.idle_workers()
        await asyncio.sleep(0.1)  # the stopped worker's item is still "running"
        return held, shared.idle_workers(), bool(woken)

    held, after, woken = asyncio.run(scenario())
    assert (held, after) == (0, 1) and woken


def test_a_lone_item_gets_every_core_though_its_own_worker_already_counts_as_busy():
    """A worker is marked busy before it asks for its threads: counted among the busy
    others, every lone item ran on its even share, the low-load latency lost."""
    core_share = CoreShare(4)
    asking = executor(core_share=core_share).workers[0]
    asking.state = WorkerState.BUSY
    assert core_share.threads_for(asking, 1) == (4, True)


def test_a_batch_of_two_takes_the_even_share_not_every_core():
    """Only a lone item takes every core: a batch of two holding them would keep the
    other workers idle while the queue waits."""
    core_share = CoreShare(4)
    asking = executor(core_share=core_share).workers[0]
    assert core_share.threads_for(asking, 2) == (2, False)


def test_a_lone_item_while_another_worker_is_busy_gets_its_share_only():
    shared = executor()
    start(shared, 0, size=8)
    assert start(shared, 1, size=1) == 2


def test_fixed_threads_and_gpu_workers_are_left_alone():
    assert start(executor(share_cores=False), 0, size=1) is None
    assert start(executor(devices=("cuda:0", "cuda:1")), 0, size=1) is None


def test_the_cpu_workers_of_several_models_split_the_cores_and_never_hold_each_other():
    cores = CoreShare(4)
    first, second = executor(("cpu",), core_share=cores), executor(("cpu",), core_share=cores)
    assert start(first, 0, size=8) == 2  # two CPU workers in the server: half the cores each
    assert start(second, 0, size=1) == 2  # a lone item while the other model computes
    first.workers[0].state = second.workers[0].state = WorkerState.IDLE
    assert start(first, 0, size=1) == 4  # alone in the server: every core
    assert second.idle_workers() == 1  # ... but the other model does not wait for it


def test_a_continuous_worker_keeps_its_even_share_and_never_holds_the_cores():
    """Its one-item batches join a running batch: holding the cores would keep every new
    sequence out until all the running ones are done, and every core for a lone item would
    stay with it while the other worker starts (threads outnumbering the cores)."""
    shared = executor()
    for worker in shared.workers:
        worker.sequences = 8
    assert start(shared, 0, size=1) == 2  # alone in the server, still its half
    assert shared.idle_workers() == 8 + 8  # no hold: every free row takes sequences
    assert start(shared, 1, size=1) == 2
    only = executor(devices=("cpu",))
    only.workers[0].sequences = 8
    assert start(only, 0, size=1) == 4  # the only CPU worker: its share is every core


def test_continuous_workers_running_no_sequence_are_counted_empty():
    """What admission reads to take a sequence whatever its time: a worker with rows
    and none running takes one now, alone; one running a row, or batches, is not."""
    shared = executor()
    for worker in shared.workers:
        worker.sequences = 8
    assert shared.empty_workers() == 2
    shared.workers[0].running.rows = 1
    assert shared.empty_workers() == 1 and shared.idle_workers() == 7 + 8
    shared.workers[1].state = WorkerState.LOADING
    assert shared.empty_workers() == 0
    assert executor().empty_workers() == 0  # workers of batches


def test_a_worker_not_ready_counts_as_its_peers_rows_once_all_are_ready():
    """What bounds a request for good: a worker restarting (or still loading) will take
    its rows again; live, it runs none (`concurrency` counts it one batch)."""
    pool = executor()
    first, second = pool.workers
    first.sequences, second.sequences = 2, 0  # the second restarting
    assert pool.concurrency() == 3 and pool.rows_when_ready() == 4
    first.sequences = 0  # none ready: one batch each
    assert pool.rows_when_ready() == 2


def test_a_handlers_lone_item_gets_every_core_but_never_holds_the_other_workers_back():
    """Its time may be its own code's, not torch's threads: a 2 s call kept the other
    worker idle, and a request sent 50 ms after it waited 4 s (a tester); a handler that
    runs torch still gets every core's threads for a lone item."""
    core_share = CoreShare(4)
    shared = WorkerPool(
        WorkerConfig(model="", handler="shout"),
        ["cpu", "cpu"],
        share_cores=True,
        core_share=core_share,
    )
    for worker in shared.workers:
        worker.state = WorkerState.IDLE
    assert start(shared, 0, size=1) == 4
    assert shared.idle_workers() == 1

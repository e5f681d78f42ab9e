"""Two batches in flight per worker: the next one is sent while the current one runs, both
are answered with their own results, and a crash with two in flight loses nothing (the
batch that was running is retried item by item, the one behind it runs again whole).
Real worker processes on the CPU, with the overlap that a GPU worker gets turned on."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rawserve.serving import supervision
from rawserve.serving.core import SchedulerCore
from rawserve.serving.cores import CoreShare
from rawserve.serving.driver import Scheduler
from rawserve.serving.pool import WorkerPool
from rawserve.serving.refusals import Reason, Refused
from rawserve.serving.status import WorkerState
from rawserve.serving.supervision import CRASHED_ALONE, REFUSED_POISON
from rawserve.shared.messages import (
    BatchResult,
    ItemFailure,
    ModelLimits,
    WorkerConfig,
    WorkerReady,
)
from tests.tiny_models import worker_config

FAULTY = "tests.handlers:faulty"


def ready(device: str) -> WorkerReady:
    return WorkerReady(pid=1, task="fill-mask", device=device, dtype="float32", load_seconds=0)


@pytest.mark.parametrize(
    ("overlap", "device", "two"),
    [(None, "cuda:0", True), (None, "cpu", False), (True, "cpu", True), (False, "cuda:0", False)],
)
def test_a_gpu_worker_holds_two_batches_and_a_cpu_worker_one(overlap, device, two):
    pool = WorkerPool(WorkerConfig(model="", handler=FAULTY), ["auto"], overlap=overlap)
    assert pool.overlaps(ready(device)) is two
    worker = pool.workers[0]
    worker.overlap = pool.overlaps(ready(device))
    worker.state = WorkerState.IDLE
    assert pool.idle_workers() == 1
    worker.state = WorkerState.BUSY  # computing a batch: room behind it only if it overlaps
    assert pool.idle_workers() == (1 if two else 0)
    worker.queued = object()  # type: ignore[assignment]
    assert pool.idle_workers() == 0  # two in flight at most


class PipeWithoutMemory:
    """A worker's batch pipe in a server out of memory: a batch of more than one input
    cannot be pickled (nothing is written); a single one goes."""

    def __init__(self):
        self.sent: list[object] = []

    def send(self, batch) -> None:
        if len(batch.inputs) > 1:
            raise MemoryError
        self.sent.append(batch)


async def test_a_batch_the_server_has_no_memory_to_send_is_refused_and_the_worker_stays_free():
    """The batch was once left as the worker's job though it never reached it: the worker
    looked busy with nothing to do until --batch-timeout killed it (every request waiting
    meanwhile), and its items were told that the model failed."""
    pool = WorkerPool(WorkerConfig(model="", handler=FAULTY), ["cpu"])
    pool._loop = asyncio.get_running_loop()
    worker = pool.workers[0]
    worker.state, worker.conn = WorkerState.IDLE, PipeWithoutMemory()
    with pytest.raises(Refused) as refused:
        await pool.submit(["a", "b"], {})
    assert refused.value.refusal.reason is Reason.OUT_OF_MEMORY
    assert worker.state is WorkerState.IDLE and worker.job is None
    pool.submit(["c"], {})  # the next batch goes to the same worker at once
    assert [batch.inputs for batch in worker.conn.sent] == [("c",)]


class ExitedProcess:
    """A worker process that has exited (killed by the kernel's OOM killer, say)."""

    pid, exitcode = 4321, -9

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


async def test_a_dead_worker_no_thread_can_wait_for_is_restarted_all_the_same(monkeypatch, caplog):
    """At the server's memory limit no thread can start: the wait for a dead worker's exit
    raised, and the worker was never restarted; it looked busy for good (every request
    504) while /health and /ready said ok."""
    pool = WorkerPool(WorkerConfig(model="", handler=FAULTY), ["cpu"])
    pool._loop = asyncio.get_running_loop()
    worker = pool.workers[0]
    worker.state, worker.process = WorkerState.BUSY, ExitedProcess()  # type: ignore[assignment]

    async def no_thread(*args):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    monkeypatch.setattr(pool, "_respawn", lambda worker: None)  # no process: its timer only
    await pool._reap(worker, worker.process)
    assert worker.state is WorkerState.DEAD
    assert (
        "process 4321 was killed by SIGKILL (out of memory" in caplog.text
        and "restarting in" in caplog.text
    )
    await pool.shutdown()  # the stop waits for its workers the same way
    assert worker.state is WorkerState.STOPPED


@pytest.fixture
def fast_restarts(monkeypatch):
    monkeypatch.setattr(supervision, "RESTART_BACKOFF_FIRST", 0.05)


@pytest.fixture
async def fill_mask_pool(tiny_model):
    pool = WorkerPool(worker_config(tiny_model("fill-mask"), threads=1), ["cpu"], overlap=True)
    pool.start()
    await asyncio.wait_for(pool.wait_ready(), 120)
    yield pool
    await pool.shutdown()


@pytest.fixture
async def faulty_pool(fast_restarts):
    pool = WorkerPool(WorkerConfig(model="", handler=FAULTY, threads=1), ["cpu"], overlap=True)
    pool.start()
    await asyncio.wait_for(pool.wait_ready(), 120)
    yield pool
    await pool.shutdown(wait=False)


def tokens(result: BatchResult) -> list[list[int]]:
    return [[guess["token"] for guess in output] for output in result.outputs]


@pytest.mark.slow
async def test_two_batches_in_flight_are_both_answered_with_their_own_results(
    fill_mask_pool, tiny_model
):
    from transformers import pipeline

    pipe = pipeline("fill-mask", model=tiny_model("fill-mask"))
    first_texts = ["hello [MASK]", "the [MASK] is good"]
    second_texts = ["a [MASK] day", "[MASK] again", "my [MASK]"]
    worker = fill_mask_pool.workers[0]
    first = fill_mask_pool.submit(first_texts, {"top_k": 2})
    assert fill_mask_pool.idle_workers() == 1  # room behind the running batch
    second = fill_mask_pool.submit(second_texts, {"top_k": 2})
    # both were sent before anything came back: the second waits in the worker
    assert worker.job is not None and worker.queued is not None
    assert fill_mask_pool.idle_workers() == 0
    one, two = await asyncio.wait_for(asyncio.gather(first, second), 60)
    for texts, result in ((first_texts, one), (second_texts, two)):
        expected = [[guess["token"] for guess in pipe(text, top_k=2)] for text in texts]
        assert tokens(result) == expected
    assert one.waited == 0.0 and two.waited >= 0.0
    assert worker.state is WorkerState.IDLE and worker.queued is None


@pytest.mark.slow
async def test_a_killed_worker_with_two_in_flight_loses_nothing(fill_mask_pool):
    worker = fill_mask_pool.workers[0]
    first_pid = worker.pid
    first = fill_mask_pool.submit(["hello [MASK]"] * 4, {})
    second = fill_mask_pool.submit(["the [MASK] is good"] * 3, {})
    os.kill(first_pid, signal.SIGKILL)  # whichever it was running: both come back
    one, two = await asyncio.wait_for(asyncio.gather(first, second), 120)
    assert len(one.outputs) == 4 and len(two.outputs) == 3
    assert not any(isinstance(output, ItemFailure) for output in one.outputs + two.outputs)
    assert worker.pid != first_pid and worker.record.restarts == 1
    assert len(fill_mask_pool.poison) == 0


@pytest.mark.slow
async def test_a_crash_blames_the_running_batch_and_runs_the_one_behind_whole(faulty_pool):
    running = faulty_pool.submit(["a", "crash me", "b"], {})
    behind = faulty_pool.submit(["x", "y"], {})
    one, two = await asyncio.wait_for(asyncio.gather(running, behind), 120)
    a, poison, b = one.outputs
    assert (a["input"], b["input"]) == ("a", "b") and poison == CRASHED_ALONE
    # the batch behind never ran in the dead worker: it ran again as it was sent
    assert [output["batch"] for output in two.outputs] == [["x", "y"], ["x", "y"]]
    assert len(faulty_pool.poison) == 1  # only the culprit is remembered


@pytest.mark.slow
async def test_the_batch_behind_a_crash_runs_again_with_the_poison_memory_read(faulty_pool):
    """A poison input alone, and a batch holding it held behind: run again whole, the
    batch's copy ran batched though the input had crashed the worker alone, and took it
    down once more (four deaths, not three). Sorted as a new batch is, its copy runs
    alone and its batch-mate is answered."""
    worker = faulty_pool.workers[0]
    alone = faulty_pool.submit(["crash me"], {})
    behind = faulty_pool.submit(["crash me", "x"], {})
    one, two = await asyncio.wait_for(asyncio.gather(alone, behind), 120)
    assert worker.record.restarts == 3
    verdicts = {one.outputs[0], two.outputs[0]}  # (one crashed, the other refused)
    assert verdicts == {CRASHED_ALONE, REFUSED_POISON}
    assert two.outputs[1]["input"] == "x" and two.outputs[1]["batch"] == ["x"]


@pytest.mark.slow
async def test_a_crash_in_the_batch_behind_keeps_the_answer_of_the_one_before(faulty_pool):
    worker = faulty_pool.workers[0]
    first_pid = worker.pid
    running = faulty_pool.submit(["a", "b"], {})
    behind = faulty_pool.submit(["c", "crash me"], {})
    one, two = await asyncio.wait_for(asyncio.gather(running, behind), 120)
    # answered by the first process, before the batch behind it took it down
    assert [(output["input"], output["pid"]) for output in one.outputs] == [
        ("a", first_pid),
        ("b", first_pid),
    ]
    c, poison = two.outputs
    assert c["input"] == "c" and poison == CRASHED_ALONE


class OneWorker:
    """A backend that answers each batch at once, saying it waited behind another."""

    def __init__(self, waited: float):
        self.waited = waited

    def idle_workers(self) -> int:
        return 1

    def empty_workers(self) -> int:
        return 0

    def batch_cap(self) -> int | None:
        return None

    limits = ModelLimits()

    def concurrency(self) -> int:
        return 1

    def rows_when_ready(self) -> int:
        return 1

    def abandon(self, future, items=None) -> None:
        pass

    def submit(self, inputs, params, control, request_ids=(), admitted=(), on_part=None):
        future = asyncio.get_running_loop().create_future()
        future.set_result(BatchResult(0, tuple(inputs), 0.01, waited=self.waited))
        return future


async def test_the_scheduler_times_a_batch_without_its_wait_behind_another():
    now = [100.0]
    core = SchedulerCore(max_queue=8)
    scheduler = Scheduler(core, OneWorker(waited=5.0), clock=lambda: now[0])
    scheduler.start()
    observed: list[float] = []
    real_finish = core.finish_batch

    def finish(batch, when, made=None):
        observed.append(when)
        return real_finish(batch, when, made)

    core.finish_batch = finish  # type: ignore[method-assign]
    results = await asyncio.wait_for(scheduler.run(["x"], {}, deadline=200.0), 5)
    await scheduler.stop()
    assert [result.output for result in results] == ["x"]
    assert observed == [95.0]  # the clock less the 5 s it waited in the worker


async def test_the_second_batch_waits_until_the_running_one_is_near_its_end(monkeypatch):
    """Formed as the first one starts, the second batch would take only what was queued
    then, and cost a GPU a whole batch's time: it is taken once the running batch is near
    its end (by its recent batches' time), and at once while no batch has been timed."""
    monkeypatch.setenv("RAWSERVE_TEST_BATCH_MS", "1000")  # the flat_cost handler's batch
    woken: list[tuple[bool, bool]] = []  # at each wake-up: (running, a second one queued)
    pool = WorkerPool(
        WorkerConfig(model="", handler="tests.handlers:flat_cost", threads=1),
        ["cpu"],
        overlap=True,
        on_idle=lambda: woken.append((worker.job is not None, worker.queued is not None)),
    )
    worker = pool.workers[0]
    pool.start()
    try:
        await asyncio.wait_for(pool.wait_ready(), 120)
        first = pool.submit(["a"], {})
        assert pool.idle_workers() == 1  # nothing timed yet: room behind it at once
        second = pool.submit(["b"], {})
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert worker.run_seconds >= 1.0
        third = pool.submit(["c"], {})
        assert pool.idle_workers() == 0  # timed now: no room until it is near its end
        woken.clear()
        while not pool.idle_workers():
            await asyncio.sleep(0.01)
        assert not third.done() and woken[0] == (True, False)  # opened while it ran
        fourth = pool.submit(["d"], {})
        assert worker.queued is not None  # sent before the third ended
        results = await asyncio.wait_for(asyncio.gather(third, fourth), 30)
        assert [result.outputs[0]["batch"] for result in results] == [1, 1]
    finally:
        await pool.shutdown()


async def test_the_batch_behind_another_is_timed_from_when_the_model_was_free_for_it(
    faulty_pool,
):
    """Timed from its arrival, the second batch counted the first one's run as its own:
    the scheduler's cost model learnt batches twice as long as they are."""
    first = faulty_pool.submit(["a"], {"sleep": 1.0})
    second = faulty_pool.submit(["b"], {"sleep": 0.2})
    assert faulty_pool.workers[0].queued is not None  # both in the worker at once
    one, two = await asyncio.wait_for(asyncio.gather(first, second), 60)
    assert one.compute_seconds >= 1.0
    assert 0.2 <= two.compute_seconds < 0.8  # its own run, not the 1.2 s since it came


THREADS_HANDLER = (
    "import torch\n"
    "def make():\n"
    "    return lambda inputs, **params: [torch.get_num_threads() for _ in inputs]\n"
)


async def test_a_batch_runs_on_the_threads_it_is_sent_with(tmp_path, monkeypatch):
    """A lone item at low load is sent with every core's threads (`share_cores`): the
    worker kept its own share, and the item ran on one core of two."""
    name = f"threads_handler_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(THREADS_HANDLER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = WorkerConfig(model="", handler=f"{name}:make", threads=1)
    pool = WorkerPool(config, ["cpu"], share_cores=True, core_share=CoreShare(2))
    pool.start()
    try:
        await asyncio.wait_for(pool.wait_ready(), 120)
        result = await asyncio.wait_for(pool.submit(["a"], {}), 60)
        assert list(result.outputs) == [2]
    finally:
        await pool.shutdown(wait=False)

"""Supervision decided without I/O: restarts and backoff, a crash while alone or in a
batch, quarantine and its expiry, health (and /health turning 503 on it). A fake clock;
no worker process."""

from __future__ import annotations

import asyncio
import errno
import json
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.exchange import HttpRequest
from rawserve.ops.metrics import Metrics
from rawserve.serving import pool as pool_module
from rawserve.serving import supervision
from rawserve.serving.core import SchedulerCore
from rawserve.serving.driver import Scheduler
from rawserve.serving.face import LOADING_RETRY_AFTER
from rawserve.serving.handles import Job
from rawserve.serving.pool import WorkerPool
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState, WorkerState
from rawserve.serving.supervision import (
    NOT_RUN,
    Held,
    LostBatch,
    PoisonMemory,
    Supervisor,
    load_state,
)
from rawserve.shared.messages import NO_CONTROL, Cancel, WorkerConfig, WorkerLoadFailed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def supervisor(workers: int = 1, **limits) -> tuple[Supervisor, Clock]:
    clock = Clock()
    return Supervisor(workers, clock=clock, **limits), clock


def test_restarts_back_off_exponentially_up_to_a_cap_and_reset_once_a_batch_is_answered():
    sup, _ = supervisor()
    waits = [sup.exited(0, while_loading=False, held=None).restart_in for _ in range(10)]
    first = supervision.RESTART_BACKOFF_FIRST
    assert waits[:4] == [first, 2 * first, 4 * first, 8 * first]
    assert max(waits) == supervision.RESTART_BACKOFF_MAX == waits[-1]
    assert sup.records[0].restarts == 10
    sup.answered(0)  # the worker works again: the next crash restarts it soon
    assert sup.exited(0, while_loading=False, held=None).restart_in == first


def test_a_worker_that_died_holding_no_batch_loses_nothing():
    sup, _ = supervisor()
    assert sup.exited(0, while_loading=False, held=None).lost is None


def test_a_crash_in_a_batch_retries_each_item_alone_and_blames_none_of_them():
    sup, _ = supervisor()
    decision = sup.exited(0, while_loading=False, held=Held())
    assert decision.lost is LostBatch.RETRY_ALONE
    assert len(sup.poison) == 0  # a crash in company proves nothing about any item


def test_a_crash_while_alone_runs_it_alone_again_then_quarantines_it():
    sup, _ = supervisor()
    key = PoisonMemory.key("crash me", {})
    assert not sup.is_poison("crash me", {})
    first = sup.exited(0, while_loading=False, held=Held(lone_key=key))
    assert first.lost is LostBatch.RUN_AGAIN_ALONE  # one crash alone is not proof
    assert not sup.is_poison("crash me", {})
    second = sup.exited(0, while_loading=False, held=Held(lone_key=key))
    assert second.lost is LostBatch.QUARANTINED
    assert sup.is_poison("crash me", {})
    assert not sup.is_poison("crash me", {"top_k": 2})  # other parameters: another input


def test_three_crashes_alone_quarantine_an_input_however_its_deadlines_fall():
    """A first run's crash alone is remembered, not counted: where the input runs again,
    its run again's crash is the first counted (two outside kills never make it poison);
    where it is not run again (its deadline passed, its client left), the next send's
    is. Three crashes alone quarantine it either way, and mixed (counted only where it
    ran again, a poison input sent with short deadlines was never refused; the review
    found one short and one long send quarantined at the fourth crash)."""
    key = PoisonMemory.key("crash me", {})
    long, _ = supervisor()  # each run again, its deadline long
    assert long.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert long.lost(Held(lone_key=key)) is LostBatch.RUN_AGAIN_ALONE
    assert long.lost(Held(lone_key=key)) is LostBatch.QUARANTINED
    short, _ = supervisor()  # none run again: each send's first run crashes
    assert short.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert short.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert not short.is_poison("crash me", {})
    assert short.lost(Held(first_key=key)) is LostBatch.QUARANTINED
    assert short.is_poison("crash me", {}) and short.poison.times(key) == 3
    mixed, _ = supervisor()  # one short send, then a long one
    assert mixed.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert mixed.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert mixed.lost(Held(lone_key=key)) is LostBatch.QUARANTINED
    # tokens reached its client: not run again, counted as a crash not run again is
    streamed, _ = supervisor()
    assert streamed.lost(Held(True, first_key=key)) is LostBatch.FAIL_MID_STREAM
    assert streamed.lost(Held(True, first_key=key)) is LostBatch.FAIL_MID_STREAM
    assert not streamed.is_poison("crash me", {})
    assert streamed.lost(Held(True, first_key=key)) is LostBatch.QUARANTINED
    assert streamed.is_poison("crash me", {}) and streamed.poison.times(key) == 3


def test_a_suspect_of_a_crashed_batch_is_held_to_run_alone_and_counts_only_its_crashes_alone():
    """An input of a batch of several that crashed, not run again, is remembered as a
    suspect: held (to run alone), not quarantined, counted for nothing; its first crash
    alone is remembered as a first run's is (two outside kills never make it poison, a
    third crash alone quarantines it), and answered alone it is forgotten, as an input
    whose one crash alone is remembered is (an input counted stays)."""
    sup, _ = supervisor()
    key, mate = PoisonMemory.key("crash me", {}), PoisonMemory.key("mate", {})
    assert sup.remembered(["crash me", "mate"], {}) == [None, None]
    sup.poison.suspect(key)
    sup.poison.suspect(mate)
    assert sup.remembered(["crash me", "mate", "new"], {}) == [key, mate, None]
    assert not sup.is_poison("crash me", {}) and sup.poison.times(key) == 0
    assert sup.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert sup.poison.times(key) == 1 and sup.poison.left(key) == 2  # remembered only
    sup.poison.suspect(key)  # in a crashed batch again: what it had stays
    assert sup.lost(Held(first_key=key)) is LostBatch.RETRY_ALONE
    assert not sup.is_poison("crash me", {}) and sup.poison.times(key) == 2
    sup.poison.cleared(mate)  # answered alone: forgotten
    sup.poison.cleared(key)  # counted: it stays
    assert sup.remembered(["crash me", "mate"], {}) == [key, None]
    assert sup.lost(Held(first_key=key)) is LostBatch.QUARANTINED
    once = PoisonMemory.key("once", {})
    assert sup.lost(Held(first_key=once)) is LostBatch.RETRY_ALONE
    sup.poison.cleared(once)  # one crash alone, then answered alone: forgotten
    assert sup.remembered(["once"], {}) == [None]


def test_an_input_runs_alone_anywhere_once_it_crashed_alone_or_was_in_two_crashed_batches():
    """A continuous worker drains its rows to run an input alone only where one was
    likely to crash it: a suspect of one crashed batch runs beside others there."""
    sup, _ = supervisor()
    key, other = PoisonMemory.key("crash me", {}), PoisonMemory.key("other", {})
    assert not sup.poison.runs_alone_anywhere(key)
    sup.poison.suspect(key)
    assert not sup.poison.runs_alone_anywhere(key)
    sup.poison.suspect(key)
    assert sup.poison.runs_alone_anywhere(key) and sup.poison.times(key) == 0
    sup.poison.cleared(key)  # answered alone: forgotten
    assert not sup.poison.runs_alone_anywhere(key)
    assert sup.lost(Held(first_key=other)) is LostBatch.RETRY_ALONE  # its one crash alone
    assert sup.poison.runs_alone_anywhere(other)
    sup.poison.suspect(other)  # what it had stays
    assert sup.poison.times(other) == 1 and sup.poison.runs_alone_anywhere(other)


def test_a_first_crash_alone_is_forgotten_with_the_memory():
    now = [0.0]
    memory = PoisonMemory(clock=lambda: now[0])
    key = PoisonMemory.key("crash me", {})
    assert not memory.crashed_first(key) and key not in memory and memory.times(key) == 1
    now[0] = supervision.QUARANTINE_SECONDS
    assert memory.times(key) == 0
    assert not memory.crashed_first(key)  # the first again
    assert not memory.crashed_first(key) and key not in memory and memory.left(key) == 1


def test_a_hung_batch_runs_its_items_again_alone_and_a_lone_input_hung_twice_is_quarantined():
    """Killed at --batch-timeout: the innocent partner of an input that hangs is not
    failed with it; one hanging alone fails, and the same one hung again is quarantined
    (each time it held its worker for the whole timeout)."""
    sup, _ = supervisor()
    assert sup.hung(Held(), 2) is LostBatch.RETRY_ALONE
    key = PoisonMemory.key("hang me", {})
    assert sup.hung(Held(lone_key=key), 1) is LostBatch.FAIL
    assert sup.hung(Held(lone_key=key), 1) is LostBatch.QUARANTINED
    assert sup.is_poison("hang me", {})


def test_a_quarantine_expires_with_the_memory_of_the_last_crash():
    sup, clock = supervisor()
    key = PoisonMemory.key("crash me", {})
    sup.exited(0, while_loading=False, held=Held(lone_key=key))
    clock.now = 10.0
    sup.exited(0, while_loading=False, held=Held(lone_key=key))
    clock.now = 10.0 + supervision.QUARANTINE_SECONDS - 1
    assert sup.is_poison("crash me", {})
    clock.now = 10.0 + supervision.QUARANTINE_SECONDS
    assert not sup.is_poison("crash me", {})
    # forgotten: its next lone crash is a first strike again
    decision = sup.exited(0, while_loading=False, held=Held(lone_key=key))
    assert decision.lost is LostBatch.RUN_AGAIN_ALONE


def test_a_crash_that_had_streamed_tokens_fails_the_batch_instead_of_rerunning_it():
    """Streamed, a lone item is not run again (its client would get its tokens twice),
    but its crash counts: a retry alone that streamed, at its first counted crash."""
    sup, _ = supervisor()
    key = PoisonMemory.key("a prompt", {})
    decision = sup.exited(0, while_loading=False, held=Held(streamed=True, lone_key=key))
    assert decision.lost is LostBatch.FAIL_MID_STREAM
    assert sup.poison.times(key) == 1 and sup.poison.left(key) == 1
    decision = sup.exited(0, while_loading=False, held=Held(streamed=True))  # (of several)
    assert decision.lost is LostBatch.FAIL_MID_STREAM


def test_failed_loads_make_the_process_unhealthy_until_one_loads():
    sup, _ = supervisor(max_failed_restarts=2)
    assert sup.healthy
    sup.exited(0, while_loading=True, held=None)
    assert sup.healthy
    sup.exited(0, while_loading=True, held=None)
    assert not sup.healthy  # /health answers 503
    sup.loaded(0, 4.0)
    assert sup.healthy


def test_the_process_is_unhealthy_only_when_every_worker_keeps_dying():
    sup, _ = supervisor(workers=2, max_failed_restarts=2, max_crashes=3)
    for _ in range(3):  # dies on every batch
        sup.exited(0, while_loading=False, held=Held())
    assert sup.healthy  # the other one still serves
    for _ in range(2):  # cannot load
        sup.exited(1, while_loading=True, held=None)
    assert not sup.healthy
    sup.answered(0)  # answered a batch again
    assert sup.healthy


def test_deaths_with_nothing_to_do_never_make_the_process_unhealthy():
    """An operator's kill or the OOM killer, on an idle worker, says nothing of the device
    or the inputs: any number of them leaves /health 200 (ten on an idle server turned
    it 503 while the worker was back and serving). Its restarts still back off, as
    any restart loop's, until it has been ready STABLE_SECONDS before it died."""
    sup, clock = supervisor()
    first = supervision.RESTART_BACKOFF_FIRST
    waits = []
    for _ in range(3 * supervision.MAX_CRASHES):
        sup.loaded(0, 4.0)
        clock.now += 5.0
        waits.append(sup.exited(0, while_loading=False, held=None).restart_in)
    assert sup.healthy
    assert waits[:3] == [first, 2 * first, 4 * first]
    sup.loaded(0, 4.0)
    clock.now += supervision.STABLE_SECONDS
    assert sup.exited(0, while_loading=False, held=None).restart_in == first
    for _ in range(supervision.MAX_CRASHES):  # at work, each time: a broken device
        sup.loaded(0, 4.0)
        sup.exited(0, while_loading=False, held=None, at_work=True)
    assert not sup.healthy


def test_a_model_with_no_worker_serving_is_expected_back_after_a_backoff_and_a_start():
    """A worker is expected to start as fast as its fastest restart so far; before one
    is timed, in a share of its first start (which pays what a restart may not)."""
    sup, clock = supervisor(workers=2)
    dead, loading, idle = WorkerState.DEAD, WorkerState.LOADING, WorkerState.IDLE
    assert sup.serving_again_at([(loading, 0.0), (loading, 0.0)]) is None  # no start seen
    sup.loaded(0, 12.0)
    sup.loaded(1, 8.0)
    clock.now = 100.0
    sup.exited(0, while_loading=False, held=None)
    sup.exited(1, while_loading=False, held=None)
    assert sup.serving_again_at([(idle, 0.0), (dead, 0.0)]) is None  # one still serves
    first, share = supervision.RESTART_BACKOFF_FIRST, supervision.FIRST_START_SHARE
    assert sup.serving_again_at([(dead, 0.0), (dead, 0.0)]) == 100.0 + first + share * 8.0
    sup.loaded(0, 6.0)  # restarts timed: the fastest is expected
    sup.loaded(0, 5.0)
    sup.loaded(0, 7.0)
    sup.exited(0, while_loading=False, held=None)
    # worker 0 restarted at 100.2; worker 1 is stopped (shutting down)
    assert sup.serving_again_at([(loading, 100.2), (WorkerState.STOPPED, 0.0)]) == 105.2
    assert sup.serving_again_at([(WorkerState.STOPPED, 0.0)] * 2) is None  # none on its way
    for _ in range(supervision.MAX_CRASHES):  # both keep dying at work: none is expected
        sup.exited(0, while_loading=False, held=Held())
        sup.exited(1, while_loading=False, held=None, at_work=True)
    assert sup.serving_again_at([(dead, 0.0), (dead, 0.0)]) == math.inf


@pytest.mark.parametrize(
    ("starting", "restarted", "expected"),
    [
        ([(WorkerState.LOADING, 1.0)], False, (LoadState.LOADING, 4.0)),
        ([(WorkerState.WARMING, 2.0), (WorkerState.WARMING, 3.0)], False, (LoadState.WARMING, 3.0)),
        ([(WorkerState.WARMING, 2.0), (WorkerState.LOADING, 4.0)], False, (LoadState.LOADING, 3.0)),
        ([(WorkerState.LOADING, 4.0)], True, (LoadState.RESTARTING, 1.0)),
        ([], True, (LoadState.RESTARTING, None)),
    ],
)
def test_why_no_worker_is_ready_and_for_how_long(starting, restarted, expected):
    assert load_state(starting, restarted, now=5.0) == expected


def test_a_first_load_counts_from_when_the_model_was_first_worked_on():
    """A first start's layout trial loads the model before any worker starts: /ready said
    "loading" without `elapsed_seconds` all through it, then counted from the workers."""
    clock = Clock()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], clock=clock)
    assert pool.load_state() == (LoadState.LOADING, None)  # nothing begun yet
    pool.preparing()  # at 0: the trial begins
    clock.now = 40.0
    assert pool.load_state() == (LoadState.LOADING, 40.0)
    [worker] = pool.workers
    worker.state, worker.started_at = WorkerState.LOADING, 40.0  # the trial is done
    clock.now = 45.0
    assert pool.load_state() == (LoadState.LOADING, 45.0)  # one load, trial included
    pool.last_ready = object()  # type: ignore[assignment] - loaded once: a later load alone
    assert pool.load_state() == (LoadState.LOADING, 5.0)


async def test_workers_not_started_yet_are_waiting_not_dead():
    """A first start's layout trial runs before the workers start (20-65 s): /info said
    each worker "dead" with no pid and /metrics `rawserve_worker_state{state="dead"} 1`,
    which an alert on dead workers took for a crash at every such start. They wait;
    /health, /ready and its Retry-After read as for a first load."""
    clock = Clock()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu", "cpu"], clock=clock)
    scheduler = Scheduler(SchedulerCore(), pool)
    metrics = Metrics()
    metrics.watch("m", scheduler, pool)
    app = App(ServedModels([ServedModel("m", ModelService(scheduler, pool))]), metrics=metrics)
    pool.preparing()  # at 0: the layout trial begins
    clock.now = 30.0

    info = json.loads((await app.handle(HttpRequest("GET", "/info", "", [], b"", "t"))).body)
    assert [(w["state"], w["pid"]) for w in info["workers"]] == [("waiting", None)] * 2
    states = {
        (sample.labels["worker"], sample.labels["state"]): sample.value
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        if family.name == "rawserve_worker_state"
        for sample in family.samples
    }
    assert {key for key, value in states.items() if value} == {("0", "waiting"), ("1", "waiting")}
    assert states[("0", "dead")] == 0
    health = app.answer_now(HttpRequest("GET", "/health", "", [], b"", request_id="t"))
    assert health is not None and health.status == 200
    ready = app.answer_now(HttpRequest("GET", "/ready", "", [], b"", request_id="t"))
    assert ready is not None and ready.status == 503
    assert json.loads(ready.body) == {"status": "loading", "elapsed_seconds": 30.0}
    # a first load: nothing to go by
    assert dict(ready.headers)["Retry-After"] == str(math.ceil(LOADING_RETRY_AFTER))


def test_health_turns_503_once_every_worker_of_a_model_keeps_failing_to_load():
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], max_failed_restarts=2)
    service = ModelService(Scheduler(SchedulerCore(), pool), pool)
    app = App(ServedModels([ServedModel("m", service)]), AppSettings())

    def health() -> tuple[int, dict]:
        response = app.answer_now(HttpRequest("GET", "/health", "", [], b"", request_id="t"))
        assert response is not None  # a probe is answered at once
        return response.status, json.loads(response.body)

    assert health() == (200, {"status": "ok"})
    for _ in range(2):  # no process is started: the supervisor is told of the deaths
        pool.supervisor.exited(0, while_loading=True, held=None)
    assert health() == (503, {"status": "unhealthy"})
    ready = app.answer_now(HttpRequest("GET", "/ready", "", [], b"", request_id="t"))
    assert ready is not None and ready.status == 503  # not "restarting" for good
    assert json.loads(ready.body)["status"] == "unhealthy"


async def test_a_retry_after_a_crash_is_dropped_once_nobody_waits_for_it():
    """Retries run one at a time ahead of the queue: one whose client left (or whose
    deadline passed, or that was answered 503 for the restart) is not run for nobody."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], loop=loop)
    left, waited, running = (loop.create_future() for _ in range(3))
    for batch_id, (value, future) in enumerate([("a", left), ("b", waited), ("c", running)]):
        pool._retry_alone(Job((value,), {}, NO_CONTROL, future, batch_id), home=0)
    worker = pool.workers[0]
    worker.job = pool._retries.pop()  # "c" runs again on the restarted worker
    pool.abandon(left)
    pool.abandon(running)
    assert [job.inputs for job in pool._retries] == [("b",)]  # its client still waits
    assert worker.job.abandoned  # (it runs on, told so: a generation stops early)
    await asyncio.wait_for(asyncio.wait([left]), 5)  # answered, for nobody
    assert left.result().outputs == (NOT_RUN,) and not waited.done()  # never run


class SentMessages(list):
    """A worker's pipe that keeps what the server sends it."""

    def send(self, message: object) -> None:
        self.append(message)


async def test_a_batch_run_whole_is_told_once_nobody_waits_for_any_of_it():
    """A worker of `--generation static` ran a non-streamed batch to its max_tokens
    whatever happened to its requests: one past its deadline (504) held the worker for as
    long again, and every request queued behind it met its own 504. It is now told (its
    feeder thread reads it) once none of its items is waited for, as is a batch sent to
    wait behind it."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], loop=loop)
    worker = pool.workers[0]
    worker.conn = sent = SentMessages()  # type: ignore[assignment] - what reaches the worker
    running, behind = loop.create_future(), loop.create_future()
    worker.job = Job(("a", "b"), {}, NO_CONTROL, running, 1)
    worker.queued = Job(("c",), {}, NO_CONTROL, behind, 2)
    pool.abandon(running, {0})
    assert sent == []  # the other item's request still waits
    pool.abandon(running, {1})
    pool.abandon(behind)
    pool.abandon(running)  # told once
    assert sent == [Cancel(1), Cancel(2)]


async def test_a_restart_that_cannot_start_a_process_says_the_model_is_back_later(monkeypatch):
    """Out of file descriptors as a dead worker restarts: the next try is a backoff away,
    and the requests due before it ends are told so at once."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], loop=loop)
    told: list[float] = []
    pool.on_down = told.append
    worker = pool.workers[0]
    worker.record.first_start = 8.0  # a restart is expected to take 4 s
    worker.state = WorkerState.DEAD

    def out_of_descriptors(context, handle):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(pool_module, "start_process", out_of_descriptors)
    before = pool.clock()
    pool._respawn(worker)
    pool._closing = True  # (its next try, a backoff away, is not made)
    first = supervision.RESTART_BACKOFF_FIRST
    assert len(told) == 1 and before + first + 4.0 <= told[0] <= pool.clock() + first + 4.0


class DyingProcess:
    """A worker process that died before it said anything (an import failing in the
    spawned process, a handler's module that exits as it loads, killed for memory)."""

    pid = 4321

    def __init__(self, exitcode: int):
        self.exitcode = exitcode

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        ("exits", "its worker process exited with code 3, 2 times in a row"),
        ("killed", "its worker process was killed by SIGKILL (out of memory, or a kill -9), 2"),
        ("refused", "could not start its worker process ([Errno 11] no processes left), 2 "),
    ],
)
async def test_workers_that_never_start_fail_the_first_load_saying_why(monkeypatch, fault, cause):
    """A worker whose process dies before it is ready at every start, or that the system
    refuses a process (ulimit -u), fails the first load once every worker has failed
    `max_failed_restarts` times, as a model its worker cannot load does: the server stops
    saying why. It was restarted for good (and a refused first process raised out of
    the server's start), /ready saying "restarting" and the log "still loading"."""
    monkeypatch.setattr(supervision, "RESTART_BACKOFF_FIRST", 0.001)
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu", "cpu"], max_failed_restarts=2)
    starts: list[int] = []

    def spawn(worker) -> None:
        starts.append(worker.index)
        if fault == "refused":
            raise OSError(errno.EAGAIN, "no processes left")
        worker.state = WorkerState.LOADING
        worker.process = DyingProcess(3 if fault == "exits" else -9)
        loop.call_soon(pool._on_exit, worker, worker.process)

    monkeypatch.setattr(pool, "_spawn", spawn)
    pool.start()
    with pytest.raises(RuntimeError) as failed:
        await asyncio.wait_for(pool.wait_ready(), 10)
    assert str(failed.value).startswith(cause)
    assert sorted(starts) == [0, 0, 1, 1]
    await pool.shutdown(wait=False)


async def test_a_worker_that_keeps_failing_to_load_once_served_says_why_once(monkeypatch, caplog):
    """Its model folder removed since the first load, a restarted worker fails to load
    at every start: it is tried again (the model may come back), and the log says once
    that it keeps failing, with the cause its worker gave, beside /health's 503."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], max_failed_restarts=2, loop=loop)
    pool._first_load = loop.create_future()
    pool._first_load.set_result(None)  # it served
    monkeypatch.setattr(pool, "_respawn", lambda worker: None)  # no process: its timer only
    worker = pool.workers[0]
    for _ in range(3):
        worker.state, worker.process = WorkerState.LOADING, DyingProcess(0)
        pool._on_load_failed(worker, WorkerLoadFailed("FileNotFoundError: no such folder"))
        pool._on_exit(worker, worker.process)
    lines = [r.getMessage() for r in caplog.records]
    said = [line for line in lines if line.startswith("worker") and "starts failed" in line]
    assert said == [
        "worker 0: its last 2 starts failed (FileNotFoundError: no such folder); "
        "it keeps being tried again"
    ]
    assert not pool.healthy
    # ... and once that the model is unhealthy, as /health turns 503
    [unhealthy] = [line for line in lines if "is unhealthy" in line]
    assert "(worker 0: its last 2 starts failed)" in unhealthy


async def test_a_worker_that_keeps_failing_to_start_beside_one_loading_is_said_once(
    monkeypatch, caplog
):
    """The first load goes on while another worker may yet load: the one that keeps
    failing is said once (not only once a first load is over: its count is past the
    bound by then), and the first load is not failed for it."""
    loop = asyncio.get_running_loop()
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu", "cpu"], max_failed_restarts=2)
    pool._loop = loop
    pool._first_load = loop.create_future()
    monkeypatch.setattr(pool, "_respawn", lambda worker: None)  # no process: its timer only
    dying, loading = pool.workers
    loading.state = WorkerState.LOADING
    for _ in range(3):
        dying.state, dying.process = WorkerState.LOADING, DyingProcess(3)
        pool._on_exit(dying, dying.process)
    said = [r.getMessage() for r in caplog.records if "starts failed" in r.getMessage()]
    assert said == [
        "worker 0: its last 2 starts failed (its worker process exited with code 3); "
        "it keeps being tried again"
    ]
    assert not pool._first_load.done() and pool.healthy

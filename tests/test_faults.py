"""The worker survives: crashes, poison inputs, out-of-memory, hung batches, several workers.

Real worker processes running the `faulty` test handler (it crashes, hangs or runs out
of memory on purpose), first through the executor alone, then through the real server.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import logging
import os
import queue
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from rawserve.main import SIGNAL_REPEAT_SECONDS
from rawserve.serving import pool, supervision
from rawserve.serving.core import SchedulerCore
from rawserve.serving.driver import Scheduler
from rawserve.serving.pool import WorkerPool
from rawserve.serving.refusals import Reason, Refused
from rawserve.serving.status import WorkerState
from rawserve.serving.supervision import (
    CRASHED_ALONE,
    REFUSED_POISON,
    TIMED_OUT,
    PoisonMemory,
)
from rawserve.shared.messages import FailureKind, ItemFailure, WorkerConfig
from rawserve.worker.batch_runs import BatchCap, run_batch
from tests.handlers import orphans_file
from tests.load import Client
from tests.server import RunningServer, module_server, started_as_used
from tests.test_scheduler import next_batch

FAULTY = "tests.handlers:faulty"


# --- pure parts: the worker's batch cap, the scheduler respecting it ------------------


def test_the_batch_cap_halves_on_out_of_memory_and_comes_back_gradually():
    cap = BatchCap(restore_after=3)
    cap.lower(10)
    assert cap.limit == 5
    cap.lower(5)
    assert cap.limit == 2
    for expected in (2, 2, 4, 4, 4, 8, 8, 8, None):
        cap.on_success()
        assert cap.limit == expected


def test_the_batch_cap_is_lifted_once_it_doubles_back_to_the_batch_that_ran_out():
    """Doubled back to the size of the batch that ran out of memory, the cap is lifted
    ("up to no cap"): kept at that size for another round of batches, it would split
    batches larger than any that failed, for nothing."""
    cap = BatchCap(restore_after=1)
    cap.lower(8)
    assert cap.limit == 4
    cap.on_success()
    assert cap.limit is None


class OutOfMemoryAbove:
    """A runner that runs out of memory on batches larger than `limit`."""

    def __init__(self, limit: int):
        self.limit = limit
        self.calls: list[int] = []

    def run(self, inputs, params, control=None):
        self.calls.append(len(inputs))
        if len(inputs) > self.limit:
            raise MemoryError("out of memory")
        return [x * 10 for x in inputs]

    def describe_failure(self, exc):
        if isinstance(exc, MemoryError):
            return ItemFailure(FailureKind.OUT_OF_MEMORY, "the model ran out of memory")
        return ItemFailure(FailureKind.INTERNAL, "failed")


def test_out_of_memory_splits_the_batch_and_later_batches_run_in_chunks():
    runner, cap = OutOfMemoryAbove(3), BatchCap()
    assert run_batch(runner, list(range(8)), {}, cap) == [x * 10 for x in range(8)]
    assert runner.calls == [8, 4, 2, 2, 4, 2, 2] and cap.limit == 2
    runner.calls.clear()
    assert run_batch(runner, list(range(5)), {}, cap) == [x * 10 for x in range(5)]
    assert runner.calls == [2, 2, 1]


def test_even_one_item_out_of_memory_is_a_failure_not_a_crash():
    runner, cap = OutOfMemoryAbove(0), BatchCap()
    [failure] = run_batch(runner, [1], {}, cap)
    assert failure.kind is FailureKind.OUT_OF_MEMORY


def test_one_input_out_of_memory_alone_leaves_the_batch_cap_unset():
    """One input that runs out of memory alone (one huge request) fails alone: lowering
    the cap to 1 for it would run everyone's next batches one input at a time."""
    runner, cap = OutOfMemoryAbove(0), BatchCap()
    [failure] = run_batch(runner, [1], {}, cap)
    assert failure.kind is FailureKind.OUT_OF_MEMORY
    assert cap.limit is None


def test_the_scheduler_respects_the_batch_cap():
    core = SchedulerCore(max_batch_size=8, max_batch_delay=0.0)
    items = [core.new_item(f"x{i}", {}, deadline=100.0, now=0.0) for i in range(8)]
    core.admit(items)
    core.batch_cap = 3
    assert len(next_batch(core, 0.0)) == 3
    core.batch_cap = None
    assert len(next_batch(core, 0.0)) == 5


def test_poison_memory_is_bounded_and_keyed_by_input_and_parameters():
    memory = PoisonMemory(size=2, strikes=1)
    for text in ("a", "b", "c"):
        memory.crashed(PoisonMemory.key(text, {}))
    assert len(memory) == 2 and PoisonMemory.key("a", {}) not in memory
    assert PoisonMemory.key("c", {}) in memory
    assert PoisonMemory.key("c", {"top_k": 2}) not in memory


def test_an_input_is_quarantined_after_two_lone_crashes_and_forgiven_later():
    now = [0.0]
    memory = PoisonMemory(strikes=2, seconds=60.0, clock=lambda: now[0])
    key = PoisonMemory.key("innocent or not", {})
    assert not memory.crashed(key) and key not in memory  # one crash proves nothing
    now[0] = 30.0
    assert memory.crashed(key) and key in memory  # the second, while remembered: refused
    now[0] = 89.0
    assert key in memory
    now[0] = 90.0  # a minute after its last crash
    assert key not in memory and len(memory) == 0
    now[0] = 100.0
    assert not memory.crashed(key)  # counted afresh


def test_crashes_too_far_apart_do_not_add_up():
    now = [0.0]
    memory = PoisonMemory(strikes=2, seconds=60.0, clock=lambda: now[0])
    key = PoisonMemory.key("x", {})
    memory.crashed(key)
    now[0] = 61.0
    assert not memory.crashed(key)


# --- the executor with a real worker process ------------------------------------------


@pytest.fixture
def fast_restarts(monkeypatch):
    monkeypatch.setattr(supervision, "RESTART_BACKOFF_FIRST", 0.05)


@pytest.fixture
async def faulty_executor(fast_restarts, monkeypatch):
    monkeypatch.setenv("RAWSERVE_TEST_OOM_ABOVE", "4")
    executor = WorkerPool(
        WorkerConfig(model="", handler=FAULTY, threads=1), ["cpu"], batch_timeout=3.0
    )
    executor.start()
    await asyncio.wait_for(executor.wait_ready(), 120)
    yield executor
    await executor.shutdown(wait=False)


class DropCount:
    """The pool's drop counter (rawserve.ops.metrics.ModelMetrics'), counting poison."""

    def __init__(self) -> None:
        self.poison = 0

    def drop(self, reason: str, count: int = 1) -> None:
        assert reason == "poison"
        self.poison += count

    def count_passes(self, passes: object) -> None:
        pass


async def idle(executor: WorkerPool, timeout: float = 120) -> None:
    """Wait until a worker is free (after a restart)."""
    became_idle = asyncio.Event()
    executor.on_idle = became_idle.set
    if not executor.idle_workers():
        await asyncio.wait_for(became_idle.wait(), timeout)


@pytest.mark.slow
async def test_a_poison_item_fails_alone_and_is_refused_afterwards(faulty_executor, caplog):
    worker = faulty_executor.workers[0]
    ids = ["req-a", "req-poison", "req-b"]
    with caplog.at_level(logging.WARNING, logger="rawserve.executor"):
        submitted = faulty_executor.submit(["a", "crash me", "b"], {}, request_ids=ids)
        result = await asyncio.wait_for(submitted, 120)
    a, poison, b = result.outputs
    assert (a["input"], b["input"]) == ("a", "b")
    assert poison == CRASHED_ALONE
    assert worker.record.restarts == 3  # the batch, then the culprit alone, twice
    # each line about the crashes names the requests it held: an operator finds the one
    # whose input took the worker down by the id its client sent
    crashes = [r for r in caplog.records if "crashed the worker" in r.getMessage()]
    assert crashes and all("(request req-poison)" in r.getMessage() for r in crashes)
    assert all(getattr(r, "request_id", None) == "req-poison" for r in crashes)
    said = " ".join(r.getMessage() for r in crashes)  # (it said "1 times now")
    assert "(1 time now; running it alone once more; quarantined at 2)" in said, said
    [first] = [r for r in caplog.records if "holding a batch of 3" in r.getMessage()]
    assert "(request req-a, req-poison, req-b)" in first.getMessage()
    await idle(faulty_executor)
    result = await asyncio.wait_for(faulty_executor.submit(["crash me", "c"], {}), 30)
    refused, c = result.outputs
    assert refused == REFUSED_POISON and refused.kind is FailureKind.INPUT
    assert c["input"] == "c" and worker.record.restarts == 3  # refused without being run


@pytest.mark.slow
async def test_a_worker_that_dies_is_seen_dead_though_a_child_of_its_holds_its_pipe(
    faulty_executor,
):
    """A handler's fork (or `os.system`) holds the worker's pipe after the worker dies: no
    end of file came, every request waited for its deadline, and the dead worker stayed
    "loading" until the child ended (two minutes here)."""
    orphans = Path(orphans_file(os.getpid()))
    orphans.unlink(missing_ok=True)
    try:
        result = await asyncio.wait_for(faulty_executor.submit(["orphan", "fine"], {}), 60)
        assert result.outputs[0] == CRASHED_ALONE and result.outputs[1]["input"] == "fine"
        await idle(faulty_executor, timeout=60)
        children = [int(pid) for pid in orphans.read_text().split()]
        assert children and all(os.path.exists(f"/proc/{pid}") for pid in children)
    finally:
        for pid in orphans.read_text().split() if orphans.exists() else ():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        orphans.unlink(missing_ok=True)


@pytest.mark.slow
async def test_out_of_memory_splits_the_batch_and_lowers_the_cap(faulty_executor):
    inputs = [f"x{i}" for i in range(10)]
    result = await asyncio.wait_for(faulty_executor.submit(inputs, {}), 60)
    assert [output["input"] for output in result.outputs] == inputs
    assert max(len(output["batch"]) for output in result.outputs) <= 4
    assert faulty_executor.batch_cap() == 2
    assert faulty_executor.status()[0].batch_cap == 2
    assert faulty_executor.workers[0].record.restarts == 0  # never took the worker down


@pytest.mark.slow
async def test_a_hung_batch_runs_again_alone_and_an_input_hung_alone_twice_is_refused(
    faulty_executor, caplog
):
    """One input that hangs failed its batch-mates (each answered 500), and the same input
    sent again held its worker for --batch-timeout each time: ten in a row made /health
    503. Its batch-mates now run again alone; an input hung alone twice is refused, and
    counted as poison as one that crashes its worker is. The lines about the hangs name
    the requests (an operator looked up a hang's 500 by its id and found no line)."""
    worker = faulty_executor.workers[0]
    faulty_executor.metrics = dropped = DropCount()
    first_pid = worker.pid
    with caplog.at_level(logging.WARNING, logger="rawserve.executor"):
        submitted = faulty_executor.submit(["hang", "fine"], {}, request_ids=["r-hang", "r-ok"])
        result = await asyncio.wait_for(submitted, 60)
    assert result.outputs[0] is TIMED_OUT  # it hung again alone: answered, not run again
    assert result.outputs[1]["input"] == "fine"
    assert worker.record.restarts == 2
    kills = [r.getMessage() for r in caplog.records if "killing process" in r.getMessage()]
    assert len(kills) == 2 and "(request r-hang, r-ok)" in kills[0], kills
    assert "(request r-hang)" in kills[1]
    assert any(
        "(request r-hang, r-ok)" in r.getMessage()
        for r in caplog.records
        if "run again alone" in r.getMessage()
    )
    await idle(faulty_executor)
    assert worker.pid != first_pid and dropped.poison == 0

    result = await asyncio.wait_for(faulty_executor.submit(["hang"], {}), 60)
    assert result.outputs == (TIMED_OUT,)  # its second hang alone
    assert dropped.poison == 1  # its 500, as a crash quarantined (and each refusal after)
    await idle(faulty_executor)
    # a death at work: ten in a row, a hung device, turn /health 503 (killed with its
    # batch detached, it was counted as one with nothing to do)
    assert worker.record.crashes == 1 and worker.record.restarts == 3
    pid = worker.pid
    result = await asyncio.wait_for(faulty_executor.submit(["hang"], {}), 5)
    assert result.outputs == (REFUSED_POISON,) and worker.pid == pid  # not run
    assert dropped.poison == 2
    result = await asyncio.wait_for(faulty_executor.submit(["after"], {}), 30)
    assert result.outputs[0]["input"] == "after"
    assert worker.record.crashes == 0  # it answered: it works


@pytest.mark.slow
async def test_a_batch_whose_worker_is_stopped_from_outside_runs_again(faulty_executor, caplog):
    """A worker stopped (SIGSTOP, a debugger) past --batch-timeout is not hung at its
    input: a lone batch so held was answered 500 and counted toward its input's
    quarantine (two host stalls refused a monitoring probe's fixed text for an hour).
    It is killed as an operator's kill -9 is, and its batch runs again."""
    worker = faulty_executor.workers[0]
    faulty_executor.metrics = dropped = DropCount()
    for _ in range(2):  # (twice, each stopped again as it runs again: no quarantine)
        submitted = asyncio.ensure_future(faulty_executor.submit(["probe"], {"sleep": 0.5}))
        for _ in range(2):
            pid = worker.pid
            while worker.state is not WorkerState.BUSY or worker.pid != pid:
                await asyncio.sleep(0.01)
                pid = worker.pid
            os.kill(pid, signal.SIGSTOP)
            with caplog.at_level(logging.ERROR, logger="rawserve.executor"):
                while worker.pid == pid:
                    await asyncio.sleep(0.01)
        result = await asyncio.wait_for(submitted, 60)
        assert result.outputs[0]["input"] == "probe"
        await idle(faulty_executor)
    said = [r.getMessage() for r in caplog.records]
    assert sum("is stopped (SIGSTOP, a debugger)" in line for line in said) == 4, said
    assert any("was killed, stopped from outside" in line for line in said), said
    assert dropped.poison == 0


@pytest.mark.slow
async def test_a_hung_batchs_items_run_again_on_any_worker(fast_restarts):
    """They ran again on the hung worker alone, once it was back: behind the one that
    hangs again, the others waited out a second batch timeout and a restart (504s at
    4 s) while the other worker was idle. Now the other worker takes the first
    of them: the one that hangs takes it down, the other runs on the restarted one."""
    pool = WorkerPool(
        WorkerConfig(model="", handler=FAULTY, threads=1), ["cpu", "cpu"], batch_timeout=3.0
    )
    pool.start()
    try:
        await asyncio.wait_for(pool.wait_ready(), 120)
        result = await asyncio.wait_for(pool.submit(["hang", "fine"], {}), 60)
        assert result.outputs[0] is TIMED_OUT and result.outputs[1]["input"] == "fine"
        # each worker was killed once: not the first twice, the second idle meanwhile
        restarts = [worker.record for worker in pool.workers]
        deadline = time.monotonic() + 30
        while sum(record.restarts for record in restarts) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # (the second kill is counted as its exit is seen)
        assert sorted(record.restarts for record in restarts) == [1, 1]
    finally:
        await pool.shutdown(wait=False)


@pytest.mark.slow
async def test_no_batch_goes_to_a_worker_whose_pipe_closed_while_its_exit_is_awaited(
    faulty_executor,
):
    """Between the end of a dead worker's pipe and its exit (a process may take a while
    to let go of its memory) it looked idle: a batch sent to it then went nowhere, was
    lost with it, and ran again item by item after the restart."""
    worker = faulty_executor.workers[0]
    first_pid = worker.pid
    pipe_closed, exit_seen = asyncio.Event(), asyncio.Event()
    reap = faulty_executor._reap

    async def slow_exit(handle, process):
        pipe_closed.set()
        await exit_seen.wait()
        await reap(handle, process)

    faulty_executor._reap = slow_exit
    os.kill(first_pid, signal.SIGKILL)
    await asyncio.wait_for(pipe_closed.wait(), 30)
    assert faulty_executor.idle_workers() == 0  # the scheduler keeps its queue
    with pytest.raises(Refused):
        faulty_executor.submit(["during"], {})
    exit_seen.set()
    await idle(faulty_executor)
    assert worker.pid != first_pid
    result = await asyncio.wait_for(faulty_executor.submit(["after", "both"], {}), 30)
    assert [output["batch"] for output in result.outputs] == [["after", "both"]] * 2


@pytest.mark.slow
async def test_a_restart_that_cannot_start_a_process_is_tried_again(faulty_executor, monkeypatch):
    """Out of file descriptors (clients holding them all) as a dead worker restarts: the
    restart is tried again after its backoff, not given up for good."""
    worker = faulty_executor.workers[0]
    first_pid = worker.pid
    refused = []

    def out_of_descriptors(context, handle):
        refused.append(handle)
        monkeypatch.setattr(pool, "start_process", start_process)  # the next one starts
        raise OSError(errno.EMFILE, "Too many open files")

    start_process = pool.start_process
    monkeypatch.setattr(pool, "start_process", out_of_descriptors)
    restarted = asyncio.Event()
    faulty_executor.on_idle = restarted.set
    os.kill(first_pid, signal.SIGKILL)
    await asyncio.wait_for(restarted.wait(), 30)
    assert refused == [worker] and worker.pid != first_pid
    assert worker.record.restarts == 2  # the death, then the start that failed
    result = await asyncio.wait_for(faulty_executor.submit(["after"], {}), 30)
    assert result.outputs[0]["input"] == "after"


@pytest.mark.slow
async def test_a_request_the_restart_would_outlast_is_answered_at_once(faulty_executor):
    """Wired as the server wires them: a death that leaves no worker serving tells the
    scheduler when one should serve again (a backoff and the start expected), and the
    request the dead worker held, due before then, is answered at once, not 504 at its
    deadline: 500, as it may be what killed the worker (a proxy retries a 503 on another
    replica); one that comes meanwhile, 503 with the restart's wait."""
    scheduler = Scheduler(SchedulerCore(), faulty_executor)
    faulty_executor.on_idle = scheduler.wake
    faulty_executor.on_down = scheduler.answer_unreachable
    scheduler.start()
    worker = faulty_executor.workers[0]
    worker.record.first_start = 60.0  # as a large model's: a restart of some 30 s expected
    held = asyncio.create_task(scheduler.run(["held"], {"sleep": 20.0}, time.monotonic() + 5))
    async with asyncio.timeout(10):
        while worker.job is None:
            await asyncio.sleep(0)
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(held, 10)
    assert refused.value.refusal.reason is Reason.MODEL_FAILED  # 500
    # one handed on a moment later (by an HTTP process that read the board before it
    # said so) is answered the same, at once
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(scheduler.run(["late"], {}, time.monotonic() + 5), 10)
    assert refused.value.refusal.reason is Reason.LOADING
    assert 25 < (refused.value.refusal.retry_after or 0) <= 31
    await scheduler.stop()


async def test_a_restart_stopped_while_loading_is_killed_and_started_again(
    fast_restarts, monkeypatch, caplog
):
    """A worker's restart stopped (SIGSTOP, a stall) before it loaded was never killed:
    the model stayed "restarting" for good, Retry-After 1, while /health said 200 (a
    tester). Past ten times its loads before (at least LOAD_HANG_FLOOR) it is killed,
    its death a failed load, and started again."""
    monkeypatch.setattr(supervision, "LOAD_HANG_FLOOR", 2.0)
    executor = WorkerPool(WorkerConfig(model="", handler=FAULTY, threads=1), ["cpu"])
    spawn, stopped, pids = executor._spawn, [], []

    def spawn_stopped_once(worker):
        spawn(worker)
        if len(stopped) < 1 and worker.process is not None and executor.supervisor.load_limit(0):
            stopped.append(worker.process)
            pids.append(worker.process.pid)
            os.kill(worker.process.pid, signal.SIGSTOP)
            # the restarts after it load in their time (on a busy machine a process's
            # imports took over the 3 s a hung one is given: killed as hung again)
            monkeypatch.setattr(supervision, "LOAD_HANG_FLOOR", 120.0)

    executor._spawn = spawn_stopped_once
    start_failed, causes = executor._start_failed, []
    executor._start_failed = lambda worker, cause: (
        causes.append(cause) or start_failed(worker, cause)
    )
    executor.start()
    try:
        await asyncio.wait_for(executor.wait_ready(), 120)
        assert not stopped  # (a first start is never taken as hung: it takes what it takes)
        os.kill(executor.workers[0].pid, signal.SIGKILL)
        with caplog.at_level(logging.ERROR, logger="rawserve.executor"):
            while not stopped:
                await asyncio.sleep(0.05)
            await idle(executor, timeout=60)  # killed past the limit, started again
        # (its process object is let go of as the restart begins: its pid is what is left)
        assert not os.path.exists(f"/proc/{pids[0]}")  # killed, and reaped
        assert executor.workers[0].process is not stopped[0] and executor.ready
        said = [r.getMessage() for r in caplog.records]
        assert any("taken as hung, killed and restarted" in line for line in said)
        # its death is said as the server's own kill, not as the OOM killer's perhaps
        [death] = [line for line in said if f"process {pids[0]} " in line]
        assert "was killed for hanging while loading" in death and "out of memory" not in death
        # ... and so is its failed start, as five in a row would say it
        assert causes == ["its worker process was killed for hanging while loading"], causes
    finally:
        await executor.shutdown(wait=False)


@pytest.mark.slow
async def test_repeated_failed_restarts_make_the_process_unhealthy(
    fast_restarts, monkeypatch, tmp_path, caplog
):
    """... and one line says so: /health turned 503 with nothing in the log saying why
    (a liveness probe then restarted the pod on the crash lines alone)."""
    caplog.set_level(logging.ERROR, logger="rawserve")
    marker = tmp_path / "loaded"
    monkeypatch.setenv("RAWSERVE_TEST_MARKER", str(marker))
    executor = WorkerPool(
        WorkerConfig(model="", handler="tests.handlers:loads_once", threads=1),
        ["cpu"],
        max_failed_restarts=2,
    )
    exits = asyncio.Queue()
    on_exit = executor._on_exit

    def record_exit(worker, process):
        on_exit(worker, process)
        exits.put_nowait(process.exitcode)

    executor._on_exit = record_exit
    executor.start()
    try:
        await asyncio.wait_for(executor.wait_ready(), 120)
        assert executor.healthy
        os.kill(executor.workers[0].pid, signal.SIGKILL)
        assert await asyncio.wait_for(exits.get(), 30) == -signal.SIGKILL
        assert await asyncio.wait_for(exits.get(), 120) == 4  # the restart died loading
        assert executor.healthy
        assert "is unhealthy" not in caplog.text
        assert await asyncio.wait_for(exits.get(), 120) == 4
        assert not executor.healthy and not executor.ready
        [said] = [r.getMessage() for r in caplog.records if "is unhealthy" in r.getMessage()]
        assert said.startswith(
            "the model is unhealthy: every worker of it keeps dying (worker 0: its last 2 "
            "starts failed)"
        )
        assert "/health answers 503" in said
        marker.unlink()  # the cause goes away: the next restart loads
        await idle(executor)
        assert executor.healthy and executor.ready
    finally:
        await executor.shutdown(wait=False)


# --- the real server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(request):
    """The module's servers its selected tests use, started together."""
    faulty = ["--handler", FAULTY, "--batch-timeout", "3", "--max-batch-size", "16"]
    two_workers = ["--device", "cpu,cpu", "--threads", "1", "--max-batch-size", "1"]
    with started_as_used(
        request,
        {
            "faulty_server": lambda: RunningServer(faulty, env={"RAWSERVE_TEST_OOM_ABOVE": "6"}),
            # their own: their tests stop them
            "draining_server": lambda: RunningServer(
                ["--handler", FAULTY, "--max-batch-size", "2", "--grace", "30"]
            ),
            "two_workers_server": lambda: RunningServer(["--handler", FAULTY, *two_workers]),
        },
    ) as get:
        yield get


faulty_server = module_server("faulty_server")
draining_server = module_server("draining_server")
two_workers_server = module_server("two_workers_server")


async def post(client: Client, text: str, **params) -> tuple[int, dict]:
    document = {"inputs": text, "parameters": params} if params else {"inputs": text}
    return await client.post_json(document)


async def wait_for_log(server: RunningServer, pattern: str, timeout: float = 60):
    return await asyncio.to_thread(server.wait_for_log, re.compile(pattern), timeout)


def skip_logged(server: RunningServer) -> None:
    """Take in the log lines written so far, so `wait_for_next_log` sees only later ones."""
    while True:
        try:
            line = server._new_lines.get_nowait()
        except queue.Empty:
            return
        if line is None:
            raise AssertionError("server exited:\n" + "\n".join(server.lines[-30:]))
        server.lines.append(line)


def wait_for_next_log(server: RunningServer, pattern: str, timeout: float = 120) -> None:
    """Wait for a log line matching `pattern` among those written after `skip_logged`."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            line = server._new_lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise AssertionError("server exited:\n" + "\n".join(server.lines[-30:]))
        server.lines.append(line)
        if re.search(pattern, line):
            return
    raise AssertionError(f"no new log line matched {pattern!r}")


@pytest.mark.slow
def test_out_of_memory_is_split_and_the_lower_cap_shows_in_info(faulty_server):
    async def scenario():
        client = Client(faulty_server.port)
        # one list request: its items are admitted together, so they make one batch
        return await client.post_json({"inputs": [f"oom-{i}" for i in range(12)]})

    status, answers = asyncio.run(scenario())
    assert status == 200 and [answer["input"] for answer in answers] == [
        f"oom-{i}" for i in range(12)
    ]
    assert max(len(answer["batch"]) for answer in answers) <= 6
    faulty_server.wait_for_log(re.compile(r"effective batch cap now \d"), 10)
    status, _, body = faulty_server.request("GET", "/info")
    assert status == 200
    info = json.loads(body)
    assert info["workers"][0]["max_batch_size"] <= 6
    assert info["batching"]["effective_max_batch_size"] <= 6
    assert faulty_server.request("GET", "/health")[0] == 200


@pytest.mark.slow
def test_kill_9_under_load_every_request_is_answered_once(faulty_server):
    """Requests admitted before the kill wait for the restart and are answered once; one
    that arrives while no worker serves is refused at once, 503 "restarting", and the
    client comes back, as a client told to retry does."""
    texts = [f"load-{i}" for i in range(48)]
    refused_while_down: list[dict] = []

    async def scenario():
        client = Client(faulty_server.port)
        gate = asyncio.Semaphore(8)
        answered: list[tuple[int, dict]] = []
        some_answered = asyncio.Event()

        async def one(text):
            async with gate:
                result = await post(client, text, sleep=0.05)
                while result[0] == 503 and "restarting" in result[1].get("error", ""):
                    refused_while_down.append(result[1])
                    await asyncio.sleep(0.1)
                    result = await post(client, text, sleep=0.05)
            answered.append(result)
            if len(answered) >= 5:
                some_answered.set()
            return result

        tasks = [asyncio.create_task(one(text)) for text in texts]
        await some_answered.wait()
        pid = answered[0][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        await wait_for_log(faulty_server, rf"process {pid} was killed by SIGKILL")
        status, body = await client.request("GET", "/ready")
        ready_while_down = status
        await wait_for_log(faulty_server, r"worker 0: .* ready", 120)
        return ready_while_down, await asyncio.gather(*tasks), pid

    ready_while_down, answers, killed = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert ready_while_down == 503
    refused = [(status, body) for status, body in answers if status != 200]
    assert not refused, refused[:3]  # (their bodies say why)
    assert all(body["error_type"] == "unavailable" for body in refused_while_down)
    assert [answer["input"] for _, answer in answers] == texts  # each its own answer, once
    assert {answer["pid"] for _, answer in answers} - {killed}  # served again after the kill
    assert faulty_server.request("GET", "/ready")[0] == 200


def post_into(server: RunningServer, document: dict, answers: queue.Queue) -> None:
    answers.put(server.post_json(document))


@pytest.mark.slow
def test_an_answer_sent_while_the_server_was_stopped_past_the_batch_timeout_is_taken(
    faulty_server,
):
    """The server stopped (SIGSTOP) past --batch-timeout (3 s) while its worker answered
    in 0.5 s: resumed, its loop ran the batch's timer before reading the worker's pipe,
    took the batch for hung, dropped its answer as stale, killed the worker (500), and
    the second time refused the input as poison (422 for an hour)."""
    for attempt in range(2):
        name = f"stalled-{attempt}"
        answers: queue.Queue = queue.Queue()
        body = {"inputs": name, "parameters": {"sleep": 0.5}}
        client = threading.Thread(target=post_into, args=(faulty_server, body, answers))
        client.start()
        faulty_server.wait_for_log(re.compile(re.escape(f"sleeping 0.5 s on ['{name}']")), 30)
        faulty_server.signal(signal.SIGSTOP)
        time.sleep(4)
        faulty_server.signal(signal.SIGCONT)
        client.join(30)
        status, answer = answers.get(timeout=1)
        assert status == 200 and answer["input"] == name, answer
    assert not [line for line in faulty_server.read_log() if "stale" in line or "ran over" in line]


@pytest.mark.slow
def test_a_poison_item_among_concurrent_requests_fails_alone(faulty_server):
    async def scenario():
        client = Client(faulty_server.port)
        await wait_for_log(faulty_server, r"worker 0: .* ready")
        busy = asyncio.create_task(post(client, "busy", sleep=0.5))
        await wait_for_log(faulty_server, r"sleeping 0.5 s on \['busy'\]")
        crowd = [asyncio.create_task(post(client, f"mate-{i}")) for i in range(5)]
        poison = asyncio.create_task(post(client, "please crash now"))
        mates = await asyncio.gather(*crowd)
        # each answered as its own run again ends, not with the poison's verdict, which
        # takes two more crashes and restarts
        assert not poison.done()
        return await busy, mates, await poison

    busy, mates, (status, error) = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert busy[0] == 200 and [status for status, _ in mates] == [200] * 5
    assert status == 500 and error["error"] == "this input crashed the model worker"
    skip_logged(faulty_server)  # the restart after the crash takes at least its backoff
    wait_for_next_log(faulty_server, r"worker 0: .* ready")
    status, refused = faulty_server.post_json({"inputs": "please crash now"})
    assert status == 422 and "crashed the model worker before" in refused["error"]
    status, answer = faulty_server.post_json({"inputs": ["fine", "please crash now"]})
    assert status == 422  # a list answers its first failure; the item alone was refused


@pytest.mark.slow
def test_a_hung_request_gets_500_and_the_queue_moves_on(faulty_server):
    async def scenario():
        client = Client(faulty_server.port)
        hung = asyncio.create_task(post(client, "hang forever"))
        waiting = [asyncio.create_task(post(client, f"next-{i}", sleep=0.0)) for i in range(3)]
        return await hung, await asyncio.gather(*waiting)

    (status, error), waiting = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert status == 500 and "batch timeout" in error["error"]
    assert [status for status, _ in waiting] == [200] * 3
    faulty_server.wait_for_log(re.compile(r"ran over 3 s \(request \w+\); killing process"), 10)
    # its death is said as the server's own kill, not as the OOM killer's hint
    faulty_server.wait_for_log(re.compile(r"process \d+ was killed for hanging"), 10)


@pytest.mark.slow
def test_sigterm_under_load_finishes_in_flight_work_and_exits_0(draining_server):
    with draining_server as server:
        keepalive = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)

        def ready_on_the_open_connection() -> int:
            keepalive.request("GET", "/ready")
            response = keepalive.getresponse()
            response.read()
            return response.status

        async def scenario():
            client = Client(server.port)
            tasks = [asyncio.create_task(post(client, f"drain-{i}", sleep=0.4)) for i in range(8)]
            first = await next(asyncio.as_completed(tasks))
            assert await asyncio.to_thread(ready_on_the_open_connection) == 200
            server.signal(signal.SIGTERM)
            await wait_for_log(server, r"stopped accepting connections")
            with pytest.raises(OSError):  # no new connections
                await client.request("GET", "/ready")
            draining = await asyncio.to_thread(ready_on_the_open_connection)
            return first, await asyncio.gather(*tasks), draining

        first, answers, draining = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert first[0] == 200 and [status for status, _ in answers] == [200] * 8
        assert draining == 503
        assert server.process.wait(60) == 0
        server.wait_for_log(re.compile(r"\bstopped\b$"), 10)


@pytest.mark.slow
def test_two_cpu_workers_share_the_load_and_a_second_signal_exits_at_once(two_workers_server):
    with two_workers_server as server:
        server.wait_for_log(re.compile(r"worker 1: .* ready"), 120)
        server.wait_for_log(re.compile(r"worker 0: .* ready"), 120)

        async def scenario():
            client = Client(server.port)
            return await asyncio.gather(*(post(client, f"two-{i}", sleep=0.3) for i in range(6)))

        answers = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert [status for status, _ in answers] == [200] * 6
        pids = {answer["pid"] for _, answer in answers}
        assert len(pids) == 2

        # a long request holds the drain; a second signal does not wait for it
        async def interrupted():
            client = Client(server.port)
            task = asyncio.create_task(post(client, "long", sleep=60))
            await wait_for_log(server, r"sleeping 60 s on \['long'\]")
            server.signal(signal.SIGTERM)
            await wait_for_log(server, r"stopped accepting connections")
            # a repeat within this window is the same stop delivered twice (make and its
            # process group), not a second one: the pause is what is tested
            await asyncio.sleep(SIGNAL_REPEAT_SECONDS + 0.2)
            server.signal(signal.SIGTERM)
            return await asyncio.gather(task, return_exceptions=True)

        asyncio.run(asyncio.wait_for(interrupted(), 60))
        assert server.process.wait(10) == 1
        assert all(gone(pid) for pid in pids)


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether `pid` has exited within `timeout` (a zombie waiting to be reaped counts)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)  # a process exit has no event to wait on from here
    return False


@pytest.mark.slow
def test_a_worker_whose_server_is_killed_exits_on_its_own():
    """SIGKILL of the server (an OOM kill) left its worker, loading a model, running as an
    orphan until its load ended (36 s of a 40 s load), its memory held while a supervisor
    restarted the server beside it."""
    server = RunningServer(
        ["--handler", "tests.handlers:slow_loading"], env={"RAWSERVE_TEST_LOAD_SECONDS": "60"}
    )
    with server.start(wait_ready=False):
        worker = int(server.wait_for_log(re.compile(r"worker 0: started \(pid (\d+)"), 30)[1])
        server.process.kill()
        server.process.wait(10)
        assert gone(worker, timeout=10)


@pytest.mark.slow
def test_sigterm_while_the_model_loads_exits_0_without_waiting_for_the_load():
    server = RunningServer(
        ["--handler", "tests.handlers:slow_loading"], env={"RAWSERVE_TEST_LOAD_SECONDS": "60"}
    )
    with server.start(wait_ready=False):
        server.wait_for_log(re.compile(r"worker 0: started"), 30)
        status, _, _ = server.request("POST", "/", b"too early")
        assert status == 503
        server.signal(signal.SIGTERM)
        assert server.process.wait(20) == 0  # the loading worker is killed, not awaited

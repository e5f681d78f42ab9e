"""The executor with a real worker process on a tiny model."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rawserve.serving.pool import WorkerPool
from rawserve.serving.processes import join_or_kill, let_go, take_exit_code
from rawserve.shared.messages import FailureKind, ItemFailure, WorkerConfig
from tests.tiny_models import worker_config

pytestmark = pytest.mark.slow


@pytest.fixture
async def fill_mask_executor(tiny_model):
    executor = WorkerPool(worker_config(tiny_model("fill-mask"), threads=1), ["cpu"])
    executor.start()
    await asyncio.wait_for(executor.wait_ready(), 120)
    yield executor
    await executor.shutdown()


async def test_worker_loads_once_and_answers_like_the_pipeline(fill_mask_executor, tiny_model):
    from transformers import pipeline

    assert fill_mask_executor.task == "fill-mask" and fill_mask_executor.idle_workers() == 1
    texts = ["hello [MASK]", "the [MASK] is good"]
    result = await asyncio.wait_for(fill_mask_executor.submit(texts, {"top_k": 3}), 60)
    pipe = pipeline("fill-mask", model=tiny_model("fill-mask"))
    for text, output in zip(texts, result.outputs, strict=True):
        expected = pipe(text, top_k=3)
        assert [o["token"] for o in output] == [e["token"] for e in expected]
        assert [o["score"] for o in output] == pytest.approx(
            [e["score"] for e in expected], abs=1e-5
        )
    # one item: the pipeline answers without the outer list; the runner puts it back
    [single] = (await fill_mask_executor.submit(["hello [MASK]"], {})).outputs
    assert len(single) == 5 and {"score", "token", "token_str", "sequence"} <= set(single[0])


async def test_a_bad_item_fails_alone(fill_mask_executor):
    result = await fill_mask_executor.submit(["hello [MASK]", "no mask", "a [MASK]"], {})
    good, bad, also_good = result.outputs
    assert isinstance(bad, ItemFailure) and bad.kind is FailureKind.INPUT
    assert "/" not in bad.message
    assert not isinstance(good, ItemFailure) and not isinstance(also_good, ItemFailure)


async def test_a_killed_worker_comes_back_and_its_batch_is_retried(fill_mask_executor):
    worker = fill_mask_executor.workers[0]
    first_pid = worker.pid
    future = fill_mask_executor.submit(["hello [MASK]"] * 4, {})
    os.kill(first_pid, signal.SIGKILL)
    result = await asyncio.wait_for(future, 120)
    # each item ran again alone on the restarted worker, none was blamed
    assert len(result.outputs) == 4
    assert not any(isinstance(output, ItemFailure) for output in result.outputs)
    assert worker.pid != first_pid and worker.record.restarts == 1 and fill_mask_executor.ready
    assert len(fill_mask_executor.poison) == 0
    # the OOM killer's first choice, raised once over the server's (not again per restart)
    raised = min(int(Path("/proc/self/oom_score_adj").read_text()) + 500, 1000)
    assert int(Path(f"/proc/{worker.pid}/oom_score_adj").read_text()) == raised


async def test_a_model_that_cannot_load_is_reported(tmp_path):
    config = WorkerConfig(model=str(tmp_path / "missing"), task="fill-mask", threads=1)
    executor = WorkerPool(config, ["cpu"])
    executor.start()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(executor.wait_ready(), 120)
    await executor.shutdown(wait=False)


def test_a_dead_workers_pipe_and_process_are_let_go_as_its_restart_begins():
    """Left to the garbage collector, the last process's batch pipe and exit sentinel
    (a reference cycle held them) stayed open: two descriptors more at each restart of a
    worker, 39 to 77 over 25 restarts, until a full collection ran."""
    context = multiprocessing.get_context("fork")
    process = context.Process(target=time.sleep, args=(0,))
    process.start()
    process.join()
    reading, writing = context.Pipe(duplex=False)
    worker = SimpleNamespace(process=process, conn=writing)
    let_go(worker)  # type: ignore[arg-type]
    assert worker.process is None and worker.conn is None and writing.closed
    with pytest.raises(ValueError, match="closed"):
        process.is_alive()
    take_exit_code(process)  # (its exit, read late by the pidfd's reader: no error)
    reading.close()


def test_a_process_waited_for_twice_at_once_is_never_called_killed():
    """At shutdown an exiting worker is waited for by the shutdown and by the reader that
    saw its pipe close, at once: the one the kernel did not reap for must find the exit
    code, not say the worker "did not exit" and SIGKILL its pid (perhaps another's now)."""
    context = multiprocessing.get_context("fork")  # cheap: the race needs many exits
    for _ in range(20):
        process = context.Process(target=time.sleep, args=(0.01,))
        process.start()
        killed: list[bool] = []

        def wait(process=process, killed=killed):
            killed.append(join_or_kill(process, 30.0))

        waiters = [threading.Thread(target=wait) for _ in range(2)]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join()
        assert killed == [False, False]
        assert process.exitcode == 0

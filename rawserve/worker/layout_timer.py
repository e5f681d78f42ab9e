"""One timer of the CPU layout trial (rawserve.ops.layout_trial): a process that loads
the model as a worker does, runs the warm-up batch once, waits until every timer of its
candidate is ready, then runs the batch for a fixed stretch and reports its median time
and the share of its cores it had meanwhile (other work on the machine takes from it).

Runs only in the timer's process (started with `spawn`): torch is imported inside
`timer_main`, never at module level, because the server imports this module to name the
target.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import statistics
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import NamedTuple

from rawserve.shared.logs import setup_worker_logging
from rawserve.shared.messages import WorkerConfig, WorkerLoadFailed
from rawserve.worker.parent_watch import exit_with_parent
from rawserve.worker.process import load_failed, no_progress_bars, prefer_for_oom_kill

log = logging.getLogger("rawserve.worker")

TIMED_SECONDS = 1.5  # the timed stretch, the same for every timer of a candidate
MIN_ROUNDS = 2  # timed batches, however slow
START_TIMEOUT = 600.0  # seconds for every timer of a candidate to load its model


class Timing(NamedTuple):
    """What a timer measured: its batch's median seconds, and the share of the cores it
    asked for (its threads) that it had while timed: its CPU time over the stretch's
    wall time and its threads."""

    seconds: float
    cpu_share: float


class LoadFailed(Exception):
    """The timer could not load the model; its one line is the argument."""


def timer_main(config: WorkerConfig, size: int, start: Barrier, out: Connection) -> None:
    """The Timing of a batch of `size` example inputs, on `out` (None: there is
    no batch to time, or this timer failed: then the others stop waiting for it; a
    WorkerLoadFailed: the model cannot be loaded, as a worker would report it)."""
    exit_with_parent()  # a model loaded as a worker loads it: freed with the server
    # the server stops its timers itself
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    no_progress_bars()
    # each timer's lines its own: "worker-layout-0" (the process is rawserve-layout-0)
    setup_worker_logging(multiprocessing.current_process().name.removeprefix("rawserve-"))
    # a model loaded a core, beside the server: when memory runs out, a timer killed
    # leaves the rule's layout (the trial cannot tell), the server killed ends the start
    prefer_for_oom_kill()
    median: Timing | WorkerLoadFailed | None
    try:
        median = timed_batch(config, size, start)
    except LoadFailed as failed:  # the workers would fail alike: the server stops on it
        start.abort()
        median = failed.args[0]
    except (Exception, threading.BrokenBarrierError):  # noqa: BLE001 - reported as None
        log.warning("a layout timer failed", exc_info=True)
        start.abort()  # the others stop waiting for this one
        median = None
    try:
        out.send(median)
    except BrokenPipeError:  # the server is gone: nobody to tell
        return
    out.close()


def timed_batch(config: WorkerConfig, size: int, start: Barrier) -> Timing | None:
    # torch and transformers load here, in the timer's process only
    from rawserve.worker.libraries import library_logs_through_ours, tokenize_in_the_calling_thread
    from rawserve.worker.loading import load_runner
    from rawserve.worker.onnx_engine import export_in_this_process
    from rawserve.worker.warmup import example_batch

    library_logs_through_ours()
    export_in_this_process()  # this process ends after its trial: what it loads goes with it
    tokenize_in_the_calling_thread(os.environ)
    try:
        runner = load_runner(config, "cpu")
    except Exception as exc:  # noqa: BLE001 - one line, as a worker reports it
        raise LoadFailed(load_failed(exc)) from exc
    batch = example_batch(runner, size)
    if batch is None:
        start.abort()
        return None
    inputs, params = batch
    runner.run(inputs, params)  # first calls set things up
    start.wait(timeout=START_TIMEOUT)
    laps: list[float] = []
    cpu_began, wall_began = time.process_time(), time.perf_counter()
    ends = wall_began + TIMED_SECONDS
    while len(laps) < MIN_ROUNDS or time.perf_counter() < ends:
        began = time.perf_counter()
        runner.run(inputs, params)
        laps.append(time.perf_counter() - began)
    wall = (time.perf_counter() - wall_began) * max(config.threads or 1, 1)
    return Timing(statistics.median(laps), (time.process_time() - cpu_began) / wall)

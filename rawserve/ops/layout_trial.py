"""The CPU worker layout settled by measurement: one single-threaded worker a core (the
rule of rawserve.ops.layout), or one worker with every core, whichever turns this
machine's cores into more items a second for this model.

The rule was measured on one machine (two AMD cores: about 10 % more items under load
than one worker of two threads, bench/RESULTS.md), and a rule does not hold on every
CPU: two hyperthreads of one core share its units, and some models' batches scale well
across threads. So at a first start with no --device and no --threads, an encoder
model's layout is timed before its workers start: the per-core candidate's workers, a
process each with one thread, run the warm-up batch together for a second or two
(rawserve.worker.layout_timer), then one process with every core runs it alone. More
items a second wins, one worker only by a clear margin (SWITCH_MARGIN), found twice (a
timing that finds it is timed again: a verdict is kept for every later start); a tie
goes to one a core, where a lone request still gets every core (the executor's core
sharing).
A trial during which a timer had less than FULL_SHARE of its cores (its CPU time over
its wall time and threads) ran beside other work: it keeps no verdict, and the rule
serves until a later start measures again.
The server already listens meanwhile (`/health` answers, `/ready` says loading): the
trial runs in a thread of the serving process, and a stop ends it. Each timer loads the
model as a worker does, with the engine trial's verdict for its threads, which the
workers that follow then find kept. The verdict is kept beside the engine trial's,
keyed by the model's files, its settings, the versions and the CPU
(rawserve.worker.engine_trial), so a later start only reads it, before the server
listens; the log and /info's `layout` give the figures.

Serving process; starts the timers and reads their figures, never imports torch.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, NamedTuple

from rawserve.config import ModelConfig, WorkerPlan
from rawserve.models.plan import ModelPlan
from rawserve.ops.layout import container_limits
from rawserve.shared.board import SharedMemoryError
from rawserve.shared.devices import FULL_SHARE, attainable_share, core_count
from rawserve.shared.messages import WorkerConfig, WorkerLoadFailed
from rawserve.tasks import ENCODER_TASKS
from rawserve.worker import engine_trial
from rawserve.worker.layout_timer import START_TIMEOUT, Timing, timer_main

log = logging.getLogger("rawserve")

CACHE_PREFIX = "layout-trial-"
TRIAL_BATCH = 8  # items of the timed batch when the server runs no warm-up
MEASURED_TASKS = ENCODER_TASKS  # a batch is one forward pass: a second or two times it
# one worker with every core must beat one a core by this much to be chosen: one a core
# was measured the faster under load (bench/RESULTS.md), and a trial run while other work
# shares the machine has seen swings of 1.3-2x either way
SWITCH_MARGIN = 1.1
STOP_POLL = 0.25  # seconds between looks at the stop while timers run
FIELDS = ("cores", "workers", "batch", "per_core", "one_worker")
TIMED_TWICE = "timed_twice"  # a kept switch to one worker that a second timing agreed to


class ModelLoadFailed(RuntimeError):
    """A timer could not load the model: the one line a worker would have reported."""


@dataclass(frozen=True)
class LayoutTrial:
    """Items a second of each candidate on `cores` cores."""

    cores: int
    workers: int  # of the per-core candidate (fewer than cores where memory holds fewer)
    batch: int
    per_core: float  # items/s: `workers` single-threaded workers together
    one_worker: float  # items/s: one worker with every core
    cached: bool = False

    @property
    def one_worker_wins(self) -> bool:
        """By a clear margin: a first start on a busy machine times both candidates
        amid other work, and its verdict is kept."""
        return self.one_worker > SWITCH_MARGIN * self.per_core

    def describe(self) -> str:
        """One line for the log and /info's layout."""
        if self.one_worker_wins:
            chosen = f"1 worker x {self.cores} threads"
        else:
            chosen = f"{self.workers} worker(s) x 1 thread"
        source = engine_trial.verdict_source(self.cached, this_start=False)
        return (
            f"{chosen} on {self.cores} core(s), the faster here, {source}: batches of "
            f"{self.batch}, {self.workers} worker(s) x 1 thread {self.per_core:.1f} items/s "
            f"together, 1 worker x {self.cores} threads {self.one_worker:.1f} items/s"
        )


def applies(workers: WorkerPlan, plans: list[ModelPlan], model: ModelConfig) -> bool:
    """Whether the layout is the trial's to settle: the per-core rule chose it (no
    --device, no GPU), the cores are shared (no --threads), one encoder model is served,
    and the rule gave it more than one worker."""
    plan = plans[0] if len(plans) == 1 else None
    task = plan.facts.task if plan is not None and plan.facts is not None else None
    return (
        workers.chosen
        and model.threads is None
        and plan is not None
        and plan.folder is not None
        and task in MEASURED_TASKS
        and len(workers.devices) > 1
    )


def kept(workers: WorkerPlan, config: WorkerConfig, cores: int) -> WorkerPlan | None:
    """The plan of the verdict an earlier start kept for this model and machine; None
    when there is none (the trial is still to run)."""
    trial = recalled(config, cores, len(workers.devices))
    return None if trial is None else planned(workers, trial)


def settle(
    workers: WorkerPlan,
    config: WorkerConfig,
    cores: int,
    stop: threading.Event | None = None,
) -> WorkerPlan:
    """The plan the trial (kept, or run now) finds faster; `workers` as it is when the
    trial cannot tell, or is stopped (`stop` set: the server is stopping). Raises
    ModelLoadFailed when the model cannot be loaded."""
    trial = recalled(config, cores, len(workers.devices)) or measured(
        config, cores, len(workers.devices), stop or threading.Event()
    )
    if trial is None:
        return workers
    return planned(workers, trial)


def planned(workers: WorkerPlan, trial: LayoutTrial) -> WorkerPlan:
    described = trial.describe() + container_limits(core_count())
    if trial.one_worker_wins:
        return replace(workers, devices=("cpu",), threads=trial.cores, layout=described)
    return replace(workers, layout=described)


def recalled(config: WorkerConfig, cores: int, workers: int) -> LayoutTrial | None:
    size = config.warmup_batch or TRIAL_BATCH
    try:
        key = trial_key(config, cores, workers, size)
    except OSError:  # a file the server cannot read: its timers report it, in one line
        return None
    stored = engine_trial.recalled(engine_trial.default_cache_dir(), CACHE_PREFIX, key)
    try:  # the cores, workers and batch are the key's; the figures are checked
        per_core = engine_trial.positive(stored["per_core"])
        one_worker = engine_trial.positive(stored["one_worker"])
    except (KeyError, TypeError, ValueError):
        return None
    trial = LayoutTrial(cores, workers, size, per_core, one_worker, cached=True)
    if trial.one_worker_wins and stored.get(TIMED_TWICE) is not True:
        return None  # kept before a switch was timed twice: timed again
    return trial


def measured(
    config: WorkerConfig, cores: int, workers: int, stop: threading.Event
) -> LayoutTrial | None:
    """The two candidates timed now, and the verdict kept (None: the trial could not
    time the model, or was stopped; the log says which)."""
    size = config.warmup_batch or TRIAL_BATCH
    log.info(
        "layout trial (first start only): %d worker(s) x 1 thread against 1 worker x %d "
        "threads, batches of %d",
        workers,
        cores,
        size,
    )
    started = time.monotonic()
    trial = timed(config, cores, workers, size, stop)
    if trial is not None and trial.one_worker_wins:
        # leaving the rule is kept for every later start: a burst of other work that
        # slowed the per-core stretch (a kept verdict of 542.6 against 426.9 items/s
        # where fourteen later trials found one worker at 0.51-1.06 of one a core's
        # items, bench/RESULTS.md) must not decide it alone
        log.info("layout trial: one worker was the faster, timed again (%s)", trial.describe())
        again = timed(config, cores, workers, size, stop)
        trial = None if again is None else agreed(trial, again)
    if trial is None:
        return None
    found = {name: getattr(trial, name) for name in FIELDS}
    found[TIMED_TWICE] = trial.one_worker_wins
    key = trial_key(config, cores, workers, size)
    cache_dir, named = engine_trial.default_cache_dir(), engine_trial.named(config)
    engine_trial.remember(cache_dir, CACHE_PREFIX, key, found, named)
    log.info("layout trial took %.1f s", time.monotonic() - started)
    return trial


def timed(
    config: WorkerConfig, cores: int, workers: int, size: int, stop: threading.Event
) -> LayoutTrial | None:
    """Both candidates timed once, one after the other (None: the trial could not time
    the model, was stopped, or ran beside other work; the log says which)."""
    per_core = items_per_second(replace(config, threads=1), workers, size, stop)
    one_worker = (
        items_per_second(replace(config, threads=cores), 1, size, stop) if per_core else None
    )
    if stop.is_set():
        log.info("layout trial stopped: the server is stopping")
        return None
    if per_core is None or one_worker is None:
        log.warning("the layout trial could not time the model: one worker a core")
        return None
    trial = LayoutTrial(cores, workers, size, per_core.items, one_worker.items)
    share = min(per_core.cpu_share, one_worker.cpu_share)
    if share < FULL_SHARE * attainable_share(cores):  # timed amid other work: it says little
        log.warning(
            "the layout trial ran while other work shared the machine (a timer had %.0f%% "
            "of the cores it ran on): one worker a core, and no verdict kept, so that a "
            "later start measures again (%s)",
            100 * share,
            trial.describe(),
        )
        return None
    return trial


def agreed(first: LayoutTrial, again: LayoutTrial) -> LayoutTrial:
    """The verdict of a trial whose first timing found one worker the faster: both
    timings' figures together where the second agrees, else the second's (one a core:
    the timings disagree, and the rule stands)."""
    if not again.one_worker_wins:
        log.info("layout trial: timed again, 1 worker was not the faster (%s)", again.describe())
        return again
    per_core, one_worker = (
        (first.per_core + again.per_core) / 2,
        (first.one_worker + again.one_worker) / 2,
    )
    return replace(first, per_core=per_core, one_worker=one_worker)


def trial_key(config: WorkerConfig, cores: int, workers: int, size: int) -> dict[str, Any]:
    """What the verdict depends on: the model's files, its task, engine (and how `auto`
    picks one) and precision, the batch, the candidates, the versions and the CPU."""
    files = engine_trial.fingerprints(
        Path(config.model), (".json", ".safetensors", ".bin", ".onnx")
    )
    versions = {name: engine_trial.installed_version(name) for name in VERSIONED}
    return {
        "files": files,
        "task": config.task,
        "engine": config.engine.value,
        "engine_rule": engine_trial.RULE,
        "dtype": config.dtype,
        "batch": size,
        "cores": cores,
        "workers": workers,
        "versions": versions,
        "machine": engine_trial.machine(),
    }


VERSIONED = ("torch", "transformers", "onnxruntime")


class Candidate(NamedTuple):
    """What a candidate's timers measured together."""

    items: float  # a second, all of them
    cpu_share: float  # the least share of its cores a timer had


def items_per_second(
    config: WorkerConfig, processes: int, size: int, stop: threading.Event
) -> Candidate | None:
    """`processes` timers of `config`, timed together once all are loaded: the items a
    second of all of them, and the least share of its cores a timer had (None: a timer
    had no batch to time, or failed, or could not start, or `stop` was set). Raises
    ModelLoadFailed when a timer could not load the model: its workers, which load it the
    same way, would fail alike, after the trial and each in turn."""
    context = multiprocessing.get_context("spawn")
    try:
        start = context.Barrier(processes)
    except OSError as exc:  # its semaphores live in /dev/shm
        raise SharedMemoryError(exc) from exc
    pipes = [context.Pipe(duplex=False) for _ in range(processes)]
    timers = [
        context.Process(
            target=timer_main,
            args=(config, size, start, sender),
            name=f"rawserve-layout-{index}",
            daemon=True,
        )
        for index, (_, sender) in enumerate(pipes)
    ]
    medians: list[Any] = []
    running: list[BaseProcess] = []
    try:
        try:
            for timer in timers:
                timer.start()
                running.append(timer)
        except OSError as exc:  # no process left for one (ulimit -u): the trial cannot tell
            log.warning("the layout trial could not start a timer (%s)", exc)
            return None
        for _, sender in pipes:
            sender.close()  # a timer that dies is an EOF here
        medians = gathered([reader for reader, _ in pipes], start, stop)
    finally:
        # stopping, the model cannot be loaded, or a timer never started: no wait for
        # the other timers' loads
        cut_short = (
            stop.is_set()
            or len(running) < processes
            or any(isinstance(m, WorkerLoadFailed) for m in medians)
        )
        for process in running:  # (one never started cannot be joined)
            process.join(timeout=0 if cut_short else 5)
            if process.exitcode is None:
                process.kill()
                process.join()
    for median in medians:
        if isinstance(median, WorkerLoadFailed):  # the workers would fail alike
            raise ModelLoadFailed(median.message)
    timings = [m for m in medians if isinstance(m, Timing) and m.seconds > 0]
    if len(timings) < processes:
        return None
    items = sum(size / timing.seconds for timing in timings)
    return Candidate(items, min(timing.cpu_share for timing in timings))


def gathered(readers: list[Connection], start: Barrier, stop: threading.Event) -> list[Any]:
    """Each timer's figure as it comes; a timer that fails or dies (EOF: killed, out of
    memory) breaks the others' wait at once, and so do `stop` and a stretch past
    START_TIMEOUT. A timer that could not load the model ends the wait at once (the
    figures not in yet None): the trial cannot go on."""
    figures: dict[Connection, Any] = {}
    deadline = time.monotonic() + START_TIMEOUT + 60  # the loads, then the timed stretch
    while len(figures) < len(readers):
        left = [reader for reader in readers if reader not in figures]
        ready = wait(left, timeout=min(STOP_POLL, max(0.0, deadline - time.monotonic())))
        if stop.is_set() or (not ready and time.monotonic() >= deadline):
            start.abort()
            return [None] * len(readers)
        for reader in (reader for reader in left if reader in ready):
            try:
                figures[reader] = reader.recv()
            except EOFError:
                figures[reader] = None
            if not isinstance(figures[reader], Timing):
                start.abort()
            if isinstance(figures[reader], WorkerLoadFailed):
                return [figures.get(each) for each in readers]
    return [figures[reader] for reader in readers]

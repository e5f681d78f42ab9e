"""The command line's entry point: build the parts from the configuration and run them.

`python -m rawserve` or `rawserve`. The options are read and checked by rawserve.options
into a frozen `ServerConfig` (rawserve.config); this module only builds the parts from
it, each given what it needs by its constructor: each model's scheduler → executor here,
and the front that speaks HTTP to them (rawserve.fronts: protocol → app, in this process
or in HTTP processes of its own), and runs them until a signal stops them. The server
process never imports torch; the worker processes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import importlib.util
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rawserve import __version__
from rawserve.api.served import ServedModel
from rawserve.config import Batching, ModelConfig, ServerConfig, WorkerPlan, plan_workers
from rawserve.fronts import Front, HttpProcesses, OneProcess
from rawserve.http.limits import PROBE_SEATS, REFUSALS_LINGERING
from rawserve.http.tls import validity_warning
from rawserve.http_process.front import FINAL_WRITE_SECONDS
from rawserve.models.hub import ModelNotFound
from rawserve.models.names import as_text
from rawserve.models.plan import ModelPlan, generates, plan_models
from rawserve.ops import layout, layout_trial, loops
from rawserve.ops.loading import log_loading_progress
from rawserve.ops.metrics import Metrics
from rawserve.ops.open_files import open_standard_descriptors, raise_open_files_limit
from rawserve.ops.stop_signals import interrupt_on_stop_signals, stop_signals
from rawserve.options import (
    KEY_VARIABLE,
    continuous_options,
    device_unservable,
    generation_options,
    ignored_by_the_handler,
    misspelled_variables,
    parse_config,
    set_by_note,
)
from rawserve.serving import CoreShare, ModelService, Scheduler, SchedulerCore
from rawserve.serving import WorkerPool as Executor
from rawserve.shared import installed, log_writer
from rawserve.shared.board import SharedMemoryError
from rawserve.shared.devices import cpu_cores, gpu_present
from rawserve.shared.logs import setup_logging
from rawserve.shared.memory import fix_mmap_threshold
from rawserve.shared.messages import WorkerConfig
from rawserve.tasks import CUSTOM_TASK, input_estimate

log = logging.getLogger("rawserve")

# A second stop signal this soon after the first is the same stop delivered twice
# (`make serve` stopped through its process group: from the group, then from make).
SIGNAL_REPEAT_SECONDS = 1.0
# this start's id, given to its workers and its layout trial's timers: a trial verdict
# kept under it was measured at this very start, which the ready line says
START_ID = secrets.token_hex(8)


def model_facts(plan: ModelPlan, config: ServerConfig, workers: WorkerPlan) -> dict[str, object]:
    """What /info reports of one served model: how it was named, what its folder says,
    and the options it is served with."""
    model = config.model
    # the task its folder says, which its workers serve: known before one loads
    task = plan.facts.task if plan.facts is not None else None
    facts: dict[str, object] = {
        "name": plan.name,
        "names": list(plan.names),
        "model": None if plan.handler else as_text(plan.source),
        "revision": plan.commit,
        "handler": plan.handler,
        "requested_task": plan.requested_task,
        "task": task,
    }
    if plan.facts is not None and task == "feature-extraction":
        facts.update(
            pooling=plan.facts.pooling,
            dense=[asdict(layer) for layer in plan.facts.dense],
            normalize=plan.facts.normalize,
        )
    facts.update(
        {
            "devices": list(workers.devices),
            "layout": workers.layout,
            "dtype": None if plan.handler else model.dtype,
            "requested_engine": model.engine.value,
            "threads_per_worker": workers.threads,
            "warmup": model.warmup and not plan.handler,  # a handler is not warmed
            "batching": {
                "mode": model.batching.value,  # (--batching: cost or count)
                "max_batch_size": model.max_batch_size,
                "max_batch_delay_ms": model.max_batch_delay_ms,
                "max_batch_tokens": model.max_batch_tokens,
                "limits": model.batch_limits,  # the device's defaults, or as given
                "max_queue": model.max_queue,
                "timeout_seconds": config.app.timeout,
            },
        }
    )
    if task == "text-generation":  # as asked: a worker may still batch statically (its log)
        generation: dict[str, object] = {"requested_mode": model.generation}
        if model.generation == "continuous":  # (a static batch has no steps to wait)
            generation["join_wait_steps"] = model.join_wait_steps
        facts["generation"] = generation
    return facts


def worker_config(
    plan: ModelPlan, model: ModelConfig, workers: WorkerPlan, name: str = ""
) -> WorkerConfig:
    """What each worker of `plan` is given: the resolved folder and the facts read from it
    (`name`: the model's, for log lines, when the server has several)."""
    facts = plan.facts
    return WorkerConfig(
        name=name,
        model=plan.folder or "",
        source=plan.source,
        task=facts.task if facts else None,
        handler=plan.handler,
        dtype=model.dtype,
        threads=workers.threads,
        engine=model.engine,
        pooling=facts.pooling if facts else "none",
        normalize=facts.normalize if facts else False,
        # no batch holds more than the queue does: a larger warm-up would only cost
        warmup_batch=min(model.max_batch_size, model.max_queue) if model.warmup else 0,
        cuda_graphs=model.cuda_graphs,
        chat_template=model.chat_template,
        generation=model.generation,
        max_sequences=model.max_sequences,
        join_wait_steps=model.join_wait_steps,
        start=START_ID,
    )


@dataclass(frozen=True)
class ModelParts:
    """One served model's own queue, scheduler and workers."""

    plan: ModelPlan
    executor: Executor
    scheduler: Scheduler
    service: ModelService  # the scheduler and workers together (`served` answers with it)
    served: ServedModel
    facts: dict[str, object]  # what /info says of it (`served.facts`: the same dict)


def build_model(
    plan: ModelPlan,
    config: ServerConfig,
    workers: WorkerPlan,
    metrics: Metrics,
    core_share: CoreShare,
    loop: asyncio.AbstractEventLoop,
    several: bool = False,
) -> ModelParts:
    """One model's parts; with `several` models, its log lines carry its name."""
    model = config.model
    counts = metrics.for_model(plan.name)
    executor = Executor(
        worker_config(plan, model, workers, plan.name if several else ""),
        workers.devices,
        batch_timeout=model.batch_timeout,
        share_cores=workers.share_cores,
        metrics=counts,
        core_share=core_share,
        loop=loop,
    )
    core = SchedulerCore(
        max_queue=model.max_queue,
        max_batch_size=model.max_batch_size,
        max_batch_delay=model.max_batch_delay_ms / 1000,
        max_batch_tokens=model.max_batch_tokens,
        group_lengths=model.batching is Batching.COST,
        workers=len(workers.devices),
        estimate=input_estimate(plan.facts.task if plan.facts is not None else None),
        max_call_seconds=model.batch_timeout,
    )
    # behind HTTP processes an answer settled here is a message, not a response to write:
    # a batch's answers go in one pass, one frame to each HTTP process (bench/RESULTS.md)
    slice_answers = config.http_processes == 1
    scheduler = Scheduler(core, executor, loop=loop, metrics=counts, slice_answers=slice_answers)
    executor.on_idle = scheduler.wake  # a worker may be free: the scheduler looks again
    executor.on_down = scheduler.answer_unreachable  # what cannot wait for a restart
    executor.on_pinned = scheduler.answer_pinned  # ... nor for its own worker's
    metrics.watch(plan.name, scheduler, executor)
    service = ModelService(scheduler, executor)
    facts = model_facts(plan, config, workers)
    served = ServedModel(
        plan.name,
        service,
        facts,
        aliases=plan.names[1:],
        longest_deadline=config.app.max_timeout,  # what a deadline's error says may be asked
        count_stream_error=counts.stream_error,
    )
    return ModelParts(plan, executor, scheduler, service, served, facts)


def relayout(model: ModelParts, config: ServerConfig, workers: WorkerPlan) -> None:
    """The model's workers on the layout its trial settled (before they start), and
    /info saying so."""
    model.executor.relayout(worker_config(model.plan, config.model, workers), workers.devices)
    model.facts.update(model_facts(model.plan, config, workers))


async def serve(
    config: ServerConfig,
    plans: Sequence[ModelPlan],
    workers: WorkerPlan,
    settle_layout: bool = False,
) -> int:
    """Serve until a signal stops the server (`settle_layout`: the one model's CPU layout
    is timed once the server listens, its workers started after)."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    metrics = Metrics()
    core_share = CoreShare()  # every model's CPU workers split the cores
    several = len(plans) > 1
    models = [
        build_model(plan, config, workers, metrics, core_share, loop, several) for plan in plans
    ]
    executors = [model.executor for model in models]
    schedulers = [model.scheduler for model in models]
    # A stop from the first moment: once workers or HTTP processes are started, dying of
    # the signal would orphan them; a stop during the start drains once it is done.
    stop = Stop(config.grace, executors)
    for signum in stop_signals():
        loop.add_signal_handler(signum, stop.on_signal, signum)
    try:
        if not settle_layout:
            for executor in executors:
                executor.start()
    except SharedMemoryError as exc:
        log.error("%s", exc)
        await asyncio.gather(*(executor.shutdown(wait=False) for executor in executors))
        return 1
    for scheduler in schedulers:
        scheduler.start()
    metrics.start(loop)
    try:
        front = await (
            HttpProcesses.start(config, models, metrics)
            if config.http_processes > 1
            else OneProcess.start(config, models, metrics)
        )
    except SharedMemoryError as exc:  # the HTTP processes' board
        log.error("%s", exc)
        front = None
    except OSError as exc:  # the address: in use, not this machine's, no such host
        log.error("cannot listen on %s port %d: %s", config.host, config.port, reason(exc))
        front = None
    stop.front = front
    if front is None:  # it could not start (the log said why)
        await abandon(models)
        return 1
    fix_mmap_threshold()  # large blocks mapped on their own: the heap does not creep
    # What is built by now lives as long as the server: leave it out of the collector's
    # full passes, which otherwise stall the event loop for ~8 ms every few thousand
    # requests (under 1 ms once frozen).
    gc.collect()
    gc.freeze()
    scheme = "https" if config.tls else "http"
    host = f"[{config.host}]" if ":" in config.host else config.host  # an IPv6 URL's brackets
    log.info(
        "rawserve %s listening on %s://%s:%d (model loading; %s)",
        __version__,
        scheme,
        host,
        front.port,
        front.describe(config),
    )
    if workers.chosen and not settle_layout:
        log.info("layout: %s", workers.layout)
    if workers.crowded:
        log.warning("layout: %s", workers.crowded)
    log.info("batch limits: %s", config.model.batch_limits)

    stop_trial = threading.Event()
    if settle_layout:  # the trial loads the model first: part of its load, as /ready says
        models[0].executor.preparing()
    trial = start_layout_trial(plans[0], config, workers, stop_trial) if settle_layout else None
    loaded = loop.create_task(loaded_after(trial, models, config, front, stop_trial))
    waiting_for = (
        (lambda: [model.plan.name for model in models if not model.service.ready])
        if len(models) > 1
        else None
    )
    progress = loop.create_task(log_loading_progress(loaded, log, waiting_for=waiting_for))
    stopping = loop.create_task(stop.asked.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    progress.cancel()
    if loaded.done():
        if loaded.exception() is not None:
            log.error("%s", loaded.exception())
            front.close()
            await abandon(models)
            await front.closed()
            return 1
        await front.announce()
        log.info(
            "ready in %.1f s: serving %s", time.monotonic() - started, describe_serving(models)
        )
    await stopping

    # Drain: no new connections, /ready and new requests 503, admitted work finishes.
    front.start_draining(config.grace)
    if trial is not None:  # a layout trial still timing stops, its timers with it
        stop_trial.set()
        await asyncio.wait([trial])
    pending = sum(scheduler.pending for scheduler in schedulers)
    log.info("stopped accepting connections; %d item(s) queued or running", pending)
    if not await front.requests_answered(config.grace):
        log.warning("grace period over: answering the remaining requests with 503")
    for scheduler in schedulers:
        await scheduler.stop()  # what is still queued: 503
    await metrics.stop()
    workers_stopped = loop.create_task(stop_all(executors))  # running batches: 503
    await front.requests_answered(FINAL_WRITE_SECONDS)
    front.close()
    await workers_stopped
    await front.closed()
    log.info("stopped")
    return 0


class Stop:
    """SIGTERM, SIGINT and SIGHUP: the first drains the server (`asked`); a second, unless it is
    the first delivered twice, kills every worker and HTTP process and exits at once."""

    def __init__(self, grace: float, executors: Sequence[Executor]):
        self.grace = grace
        self.executors = executors
        self.front: Front | None = None  # once started: its HTTP processes die too
        self.asked = asyncio.Event()
        self.first: float | None = None  # when the first signal came

    def on_signal(self, signum: int) -> None:
        now = time.monotonic()
        if self.first is not None:
            # within a second, any signal is the same stop delivered twice: `make`
            # forwards its group's SIGTERM, a wrapper turns a terminal's Ctrl-C into a
            # SIGTERM to its child (a first version that counted only the same signal
            # exited at once there, its answers lost)
            if now - self.first < SIGNAL_REPEAT_SECONDS:
                return
            log.warning("second signal: exiting now")
            for executor in self.executors:
                executor.kill()
            if self.front is not None:
                self.front.kill()
            kill_leftover_children()  # any started meanwhile (HTTP processes, timers)
            log_writer.wait_written(0.5)  # os._exit skips the exit hook that writes them
            os._exit(1)
        self.first = now
        name = signal.Signals(signum).name
        log.info("%s received: draining for up to %.0f s", name, self.grace)
        self.asked.set()


def reason(error: OSError) -> str:
    """An OS error's own words ("Address already in use"), without its number: its
    errno's (asyncio's bind error puts a sentence of its own in `strerror`, the line
    then said the address twice with one HTTP process, once with several)."""
    if error.errno is not None and error.errno > 0:  # (an address lookup's are below 0)
        return os.strerror(error.errno)
    return error.strerror or str(error)


def start_layout_trial(
    plan: ModelPlan, config: ServerConfig, workers: WorkerPlan, stopped: threading.Event
) -> asyncio.Task[WorkerPlan]:
    """The CPU layout of `plan`'s workers timed on a thread, the event loop serving
    meanwhile (`stopped`: the server is stopping, the trial with it)."""
    model = worker_config(plan, config.model, workers)
    settle = asyncio.to_thread(layout_trial.settle, workers, model, cpu_cores(), stopped)
    return asyncio.get_running_loop().create_task(settle)


async def abandon(models: Sequence[ModelParts]) -> None:
    """A server that cannot go on (it could not listen, a model could not load): its
    schedulers stopped, its workers shut down without waiting for their batches."""
    for model in models:
        await model.scheduler.stop()
    await asyncio.gather(*(model.executor.shutdown(wait=False) for model in models))


def describe_serving(models: Sequence[ModelParts]) -> str:
    """What the ready line says is served: each model's task and engine (and its name,
    when there are several)."""
    if len(models) == 1:
        return describe(models[0].executor)
    return ", ".join(f"{model.plan.name} ({describe(model.executor)})" for model in models)


def describe(executor: Executor) -> str:
    """A loaded model's task and engine, and why that engine, for the ready line."""
    engine = executor.engine
    if engine is None:
        return str(executor.task)
    if executor.task == CUSTOM_TASK:
        return "a custom handler"  # its engine is its own
    return f"{executor.task}, engine {engine[0].value} ({engine[1]})"


async def loaded_after(
    trial: asyncio.Task[WorkerPlan] | None,
    models: Sequence[ModelParts],
    config: ServerConfig,
    front: Front,
    stopped: threading.Event,
) -> None:
    """Every model's first worker ready; with a layout `trial`, its workers started on the
    layout it settles (none once the server is stopping: `stopped`)."""
    if trial is not None:
        try:
            workers = await trial
        except layout_trial.ModelLoadFailed as exc:
            raise RuntimeError(f"model {models[0].plan.name} could not be loaded: {exc}") from None
        if stopped.is_set():
            return
        relayout(models[0], config, workers)
        front.facts_changed()
        log.info("layout: %s", workers.layout)
        models[0].executor.start()
    await wait_all_ready(models)


async def wait_all_ready(models: Sequence[ModelParts]) -> None:
    """Until every model has a worker ready; raises RuntimeError naming a model that could
    not be loaded."""

    async def one(model: ModelParts) -> None:
        try:
            await model.executor.wait_ready()
        except RuntimeError as exc:
            raise RuntimeError(f"model {model.plan.name} could not be loaded: {exc}") from None

    await asyncio.gather(*(one(model) for model in models))


async def stop_all(executors: Sequence[Executor]) -> None:
    await asyncio.gather(*(executor.shutdown(wait=True) for executor in executors))


def command() -> int:
    """The `rawserve` command (the script pip writes calls this, through rawserve.__main__).

    multiprocessing's spawn runs the program's `__main__` script again in each process it
    starts (as `__mp_main__`), unless that script is a package's `__main__` module, as with
    `python -m rawserve`. The command's script imports rawserve: run again, it loaded the
    whole serving side (HTTP, routes, metrics) in every worker, ~1 s and ~28 MB each. Named
    as `python -m rawserve` is, the script is left alone in the processes it starts."""
    sys.modules["__main__"].__spec__ = importlib.util.find_spec("rawserve.__main__")
    return main()


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until stopped: the exit code. A stop signal (SIGTERM, SIGHUP and Ctrl-C raise
    KeyboardInterrupt until the server's own handlers take them) between any two steps of
    the start ends it with code 1 and a line saying so: one between them (the options read,
    the workers planned) ended it with Python's traceback and the exit status of SIGINT.
    The signals' handlers it found are put back as it returns (a program that runs the
    server in its own process kept those of the start)."""
    found = {signum: signal.getsignal(signum) for signum in stop_signals()}
    try:
        return start(argv)
    except KeyboardInterrupt:
        log.warning("stopped while starting")
        return 1
    finally:
        for signum, handler in found.items():
            if handler is not None:  # (None: one not set from Python, left as it is)
                signal.signal(signum, handler)


def start(argv: Sequence[str] | None) -> int:
    open_standard_descriptors()  # before anything opens a file that would take their place
    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format, access_log=config.access_log)
    for line in misspelled_variables(os.environ):
        log.warning("%s", line)
    if ignored := ignored_by_the_handler(config):
        log.warning("--handler serves its own callable: %s not applied", ", ".join(ignored))
    # (a download fills a cache for a GPU machine from one without: README "Serving your
    # own model")
    unservable = not config.download_only and device_unservable(config.model.devices)
    if not config.handler and unservable:
        # (what a worker would say once loaded)
        log.error("%s%s", unservable, set_by_note("--device", argv))
        return 1
    interrupt_on_stop_signals()  # (until serve() puts the server's own handlers in place)
    # The workers inherit the environment: they log at the same level and format.
    os.environ.update(RAWSERVE_LOG_LEVEL=config.log_level, RAWSERVE_LOG_FORMAT=config.log_format)
    # ... but not the API key, read now: a model's own code (trust_remote_code) could read
    # it there; the HTTP processes are given it
    os.environ.pop(KEY_VARIABLE, None)
    try:
        # before anything listens: a Hub model is downloaded (or found in the cache) once,
        # here, and the workers are given its folder
        with stopping_at_once():
            plans = plan_models(
                config.models,
                task=config.task,
                pooling=config.pooling,
                revision=config.revision,
                handler=config.handler,
                chat_template=config.model.chat_template is not None,
                engine=config.model.engine,
                onnx_graphs=config.model.onnx_graphs,
            )
    except ModelNotFound as exc:
        log.error("%s", exc)
        return 1
    unread = generation_options(config.model)
    if unread and not config.handler and not generates(plans):  # (a handler's are said)
        log.warning(
            "%s apply to text-generation models, and none is served: not applied",
            ", ".join(unread),
        )
    elif (unread := continuous_options(config.model)) and not config.handler:
        log.warning(
            "%s apply to --generation continuous, and it is static: not applied",
            ", ".join(unread),
        )
    workers = plan_workers(config.model, plans)
    if config.download_only:
        for plan in plans:
            log.info("model %s: %s", plan.name, plan.folder or plan.handler)
        return 0
    # (with --device auto, each worker says so as it loads)
    default_layout = config.model.devices is None and not config.handler
    if default_layout and gpu_present() and layout.cpu_only_torch():
        log.warning(
            "the machine shows a GPU, and torch %s is a build without CUDA: serving on the "
            "CPU (install a CUDA build of torch to serve on the GPU)",
            installed.version("torch"),
        )
    now = datetime.datetime.now(datetime.UTC)
    if config.tls and (warning := validity_warning(config.tls.certfile, now)):
        log.warning("%s: every client that verifies it will refuse to connect", warning)
    # each HTTP process holds its share of the cap, the probes' seats past it, and the
    # refused connections waiting for their clients' close (as many as the cap at most)
    cap = config.http.max_connections
    raise_open_files_limit(cap + PROBE_SEATS + max(cap, REFUSALS_LINGERING) if cap else 0)
    settle_layout = False
    if layout_trial.applies(workers, plans, config.model):
        # a verdict kept from an earlier start, or the trial once the server listens
        model = worker_config(plans[0], config.model, workers)
        kept = layout_trial.kept(workers, model, cpu_cores())
        workers = kept or workers
        settle_layout = kept is None
    try:
        return loops.run(serve(config, plans, workers, settle_layout), config.loop)
    except KeyboardInterrupt:
        return 1
    finally:
        kill_leftover_children()


@contextlib.contextmanager
def stopping_at_once() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP exit at once (code 1), saying so, while the models are
    found: huggingface_hub downloads on threads of its own, and an interrupt raised in
    this thread waited for them to end the files under way (a model's weights: minutes,
    past a container's grace), then exited without a word (SIGHUP killed it silently).
    Nothing else runs yet: no worker. A file left half-downloaded stays in the cache's
    `blobs/` as `*.incomplete` (huggingface_hub names each try apart): the next start
    downloads it whole."""

    def stop(signum: int, frame: Any) -> None:
        log.warning("%s received while the models were being found: stopped",
                    signal.Signals(signum).name)  # fmt: skip
        log_writer.wait_written(0.5)  # os._exit skips the exit hook that writes them
        os._exit(1)

    # (under nohup, SIGHUP stays ignored: a terminal closed during a Hub download
    # stopped the start it was to outlive)
    previous = {signum: signal.signal(signum, stop) for signum in stop_signals()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def kill_leftover_children() -> None:
    """Kill any worker or HTTP process still running (none is, unless an unexpected
    error ended the server): workers ignore SIGTERM (a stop sent to the whole group is
    the server's to carry out), and multiprocessing's exit hook terminates its children
    with SIGTERM and then waits for them."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)

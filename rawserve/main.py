"""The command line's entry point: build the parts from the configuration and run them.

`python -m rawserve` or `rawserve`. The options are read and checked by rawserve.options
into a frozen `ServerConfig` (rawserve.config); this module only builds the parts from
it, each given what it needs by its constructor: protocol → app → scheduler → executor,
and runs them until a signal stops them. The server process never imports torch; the
worker processes do.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rawserve import __version__
from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.config import Batching, ModelConfig, ServerConfig, WorkerPlan, plan_workers
from rawserve.http.limits import ProtocolSettings, ServerState
from rawserve.models.hub import ModelNotFound
from rawserve.models.plan import ModelPlan, plan_models
from rawserve.ops.loading import log_loading_progress
from rawserve.ops.metrics import Metrics
from rawserve.options import parse_config
from rawserve.protocol import HttpProtocol
from rawserve.serving import CoreShare, ModelService, Scheduler, SchedulerCore
from rawserve.serving import WorkerPool as Executor
from rawserve.shared.logs import setup_logging
from rawserve.shared.memory import fix_mmap_threshold
from rawserve.shared.messages import WorkerConfig

log = logging.getLogger("rawserve")

FINAL_WRITE_SECONDS = 1.0  # after the grace period: time to write the last 503s
# A second SIGTERM/SIGINT this soon after the first is the same stop delivered twice
# (`make serve` stopped through its process group: from the group, then from make).
SIGNAL_REPEAT_SECONDS = 1.0


def model_facts(plan: ModelPlan, config: ServerConfig, workers: WorkerPlan) -> dict[str, object]:
    """What /info reports of one served model: how it was named, what its folder says,
    and the options it is served with."""
    model = config.model
    facts: dict[str, object] = {
        "name": plan.name,
        "names": list(plan.names),
        "model": None if plan.handler else plan.source,
        "revision": plan.commit,
        "handler": plan.handler,
        "requested_task": plan.requested_task,
    }
    if plan.facts is not None and plan.facts.task == "feature-extraction":
        facts.update(pooling=plan.facts.pooling, normalize=plan.facts.normalize)
    facts.update(
        {
            "devices": list(workers.devices),
            "layout": workers.layout,
            "dtype": model.dtype,
            "requested_engine": model.engine.value,
            "threads_per_worker": workers.threads,
            "warmup": model.warmup,
            "batching": {
                "max_batch_size": model.max_batch_size,
                "max_batch_delay_ms": model.max_batch_delay_ms,
                "max_batch_tokens": model.max_batch_tokens,
                "max_queue": model.max_queue,
                "timeout_seconds": config.app.timeout,
            },
        }
    )
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
        task=facts.task if facts else None,
        handler=plan.handler,
        dtype=model.dtype,
        threads=workers.threads,
        engine=model.engine,
        pooling=facts.pooling if facts else "none",
        normalize=facts.normalize if facts else False,
        warmup_batch=model.max_batch_size if model.warmup else 0,
        chat_template=model.chat_template,
    )


@dataclass(frozen=True)
class ModelParts:
    """One served model's own queue, scheduler and workers."""

    plan: ModelPlan
    executor: Executor
    scheduler: Scheduler
    served: ServedModel


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
    wake = asyncio.Event()  # a worker may be free: the scheduler looks again
    executor = Executor(
        worker_config(plan, model, workers, plan.name if several else ""),
        workers.devices,
        batch_timeout=model.batch_timeout,
        share_cores=workers.share_cores,
        on_idle=wake.set,
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
    )
    scheduler = Scheduler(core, executor, wake=wake, loop=loop, metrics=counts)
    metrics.watch(plan.name, scheduler, executor)
    served = ServedModel(
        plan.name,
        ModelService(scheduler, executor),
        model_facts(plan, config, workers),
        aliases=plan.names[1:],
    )
    return ModelParts(plan, executor, scheduler, served)


async def serve(config: ServerConfig, plans: Sequence[ModelPlan], workers: WorkerPlan) -> int:
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
    app = App(
        ServedModels([model.served for model in models]),
        config.app,
        metrics=metrics,
    )
    state = ServerState(metrics=metrics)
    http = config.http
    settings = ProtocolSettings(
        max_body_bytes=http.max_body_bytes,
        max_connections=http.max_connections,
        keepalive_timeout=http.keepalive_timeout,
        head_timeout=http.head_timeout,
        body_timeout=http.body_timeout,
        write_timeout=http.write_timeout,
    )
    for executor in executors:
        executor.start()
    for scheduler in schedulers:
        scheduler.start()
    metrics.start(loop)
    server = await loop.create_server(
        lambda: HttpProtocol(app, settings, state, loop=loop),
        config.host,
        config.port,
        backlog=1024,
        ssl=config.ssl_context,
        # a client that never finishes its TLS hello is let go as a slow head would be
        ssl_handshake_timeout=http.head_timeout if config.tls else None,
    )
    port = server.sockets[0].getsockname()[1]
    fix_mmap_threshold()  # large blocks mapped on their own: the heap does not creep
    # What is built by now lives as long as the server: leave it out of the collector's
    # full passes, which otherwise stall the event loop for ~8 ms every few thousand
    # requests (under 1 ms once frozen).
    gc.collect()
    gc.freeze()
    scheme = "https" if config.tls else "http"
    log.info(
        "rawserve %s listening on %s://%s:%d (model loading)",
        __version__,
        scheme,
        config.host,
        port,
    )
    if workers.chosen:
        log.info("layout: %s", workers.layout)

    stop = asyncio.Event()
    first_signal: float | None = None

    def on_signal(signum: int) -> None:
        nonlocal first_signal
        now = time.monotonic()
        if first_signal is not None:
            if now - first_signal < SIGNAL_REPEAT_SECONDS:
                return  # the same stop, delivered twice
            log.warning("second signal: exiting now")
            for executor in executors:
                executor.kill()
            os._exit(1)
        first_signal = now
        log.info(
            "%s received: draining for up to %.0f s", signal.Signals(signum).name, config.grace
        )
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    loaded = loop.create_task(wait_all_ready(models))
    progress = loop.create_task(log_loading_progress(loaded, log))
    stopping = loop.create_task(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    progress.cancel()
    if loaded.done():
        if loaded.exception() is not None:
            log.error("%s", loaded.exception())
            server.close()
            for scheduler in schedulers:
                await scheduler.stop()
            await asyncio.gather(*(executor.shutdown(wait=False) for executor in executors))
            return 1
        serving = ", ".join(
            f"{model.plan.name} ({describe(model.executor)})"
            if len(models) > 1
            else describe(model.executor)
            for model in models
        )
        log.info("ready in %.1f s: serving %s", time.monotonic() - started, serving)
    await stopping

    # Drain: no new connections, /ready and new requests 503, admitted work finishes.
    app.start_draining()
    server.close()
    pending = sum(scheduler.pending for scheduler in schedulers)
    log.info("stopped accepting connections; %d item(s) queued or running", pending)
    if not await requests_answered(state, config.grace):
        log.warning("grace period over: answering the remaining requests with 503")
    for scheduler in schedulers:
        await scheduler.stop()  # what is still queued: 503
    await metrics.stop()
    workers_stopped = loop.create_task(stop_all(executors))  # running batches: 503
    await requests_answered(state, FINAL_WRITE_SECONDS)
    state.close_all()
    await workers_stopped
    log.info("stopped")
    return 0


def describe(executor: Executor) -> str:
    """A loaded model's task and engine, and why that engine, for the ready line."""
    engine = executor.engine
    if engine is None:
        return str(executor.task)
    return f"{executor.task}, engine {engine[0].value} ({engine[1]})"


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


async def requests_answered(state: ServerState, timeout: float) -> bool:
    """Wait until no connection has a request in progress (or `timeout` passes)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while busy := state.busy_tasks():
        if (left := until - loop.time()) <= 0:
            return False
        await asyncio.wait(busy, timeout=left)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format, access_log=config.access_log)
    # The workers inherit the environment: they log at the same level and format.
    os.environ.update(RAWSERVE_LOG_LEVEL=config.log_level, RAWSERVE_LOG_FORMAT=config.log_format)
    try:
        # before anything listens: a Hub model is downloaded (or found in the cache) once,
        # here, and the workers are given its folder
        plans = plan_models(
            config.models, task=config.task, revision=config.revision, handler=config.handler
        )
    except ModelNotFound as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 1
    workers = plan_workers(config.model, plans)
    if config.download_only:
        for plan in plans:
            log.info("model %s: %s", plan.name, plan.folder or plan.handler)
        return 0
    try:
        return asyncio.run(serve(config, plans, workers))
    except KeyboardInterrupt:
        return 1

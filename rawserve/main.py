"""The command line: parse options (flags or RAWSERVE_* variables) and wire the parts.

`python -m rawserve` or `rawserve`. This module only builds the parts, each given what it
needs by its constructor: protocol → app → scheduler → executor. The server process never
imports torch; the worker processes do.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rawserve import __version__
from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.tls import server_context
from rawserve.models.hub import ModelNotFound
from rawserve.models.plan import ModelPlan, plan_models
from rawserve.ops.layout import cpu_layout, gpu_present, model_bytes, ram_bytes
from rawserve.ops.loading import log_loading_progress
from rawserve.ops.metrics import Metrics
from rawserve.protocol import HttpProtocol, ProtocolSettings, ServerState
from rawserve.serving import CoreShare, ModelService, Scheduler, SchedulerCore
from rawserve.serving import WorkerPool as Executor
from rawserve.shared.devices import parse_devices
from rawserve.shared.logs import LOG_FORMATS, setup_logging
from rawserve.shared.memory import fix_mmap_threshold
from rawserve.shared.messages import Engine, WorkerConfig

log = logging.getLogger("rawserve")

FINAL_WRITE_SECONDS = 1.0  # after the grace period: time to write the last 503s
# A second SIGTERM/SIGINT this soon after the first is the same stop delivered twice
# (`make serve` stopped through its process group: from the group, then from make).
SIGNAL_REPEAT_SECONDS = 1.0
ENV_TRUE = ("1", "true", "yes", "on")
ENV_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Option:
    flag: str
    type: type
    default: object
    help: str
    repeatable: bool = False  # given several times; its variable is a comma-separated list

    @property
    def env(self) -> str:
        return "RAWSERVE_" + self.flag.removeprefix("--").replace("-", "_").upper()


MODEL_HELP = (
    "[ALIAS=]MODEL[@REVISION][:TASK], repeatable: MODEL is a local folder or a Hub repo id "
    "(org/name), REVISION a Hub branch, tag or commit, TASK the pipeline task where the "
    "model's files do not say it, ALIAS the name clients use for it; the first model is the "
    "default. E.g. --model emb=BAAI/bge-small-en-v1.5 --model cls=/models/sst2:text-"
    "classification (default: the packaged all-MiniLM-L6-v2)"
)

OPTIONS = [
    Option("--model", str, None, MODEL_HELP, repeatable=True),
    Option("--revision", str, None, "Hub revision of the models named without @REVISION"),
    Option(
        "--task",
        str,
        None,
        "pipeline task of the models named without :TASK (default: inferred from the files)",
    ),
    Option("--handler", str, None, "MODULE:FACTORY returning f(inputs: list, **params) -> list"),
    Option("--host", str, "127.0.0.1", "bind address"),
    Option("--port", int, 8000, "bind port"),
    Option(
        "--device",
        str,
        None,
        "cpu, cuda, cuda:N, or a comma list: one worker per entry (default: one worker per "
        "GPU; on a CPU machine one single-threaded worker per core, as memory allows)",
    ),
    Option(
        "--engine",
        str,
        "auto",
        "torch, onnx (ONNX Runtime, the `onnx` extra: encoder tasks on the CPU), or auto: "
        "ONNX Runtime where it serves the task and is installed, else torch",
    ),
    Option("--dtype", str, "auto", "auto, float32, float16 or bfloat16"),
    Option(
        "--threads",
        int,
        None,
        "torch threads per worker (default: the busy CPU workers share the cores)",
    ),
    Option("--max-batch-size", int, 32, "items per model call"),
    Option(
        "--no-warmup",
        bool,
        False,
        "report ready without first running a batch of --max-batch-size examples",
    ),
    Option(
        "--max-batch-delay-ms",
        float,
        0.0,  # measured: any delay adds itself at low load, buys nothing (bench/RESULTS.md)
        "how long a free worker may wait for a batch to fill, from the oldest item",
    ),
    Option("--max-batch-tokens", int, None, "token budget of a batch (padded length x items)"),
    Option(
        "--batching",
        str,
        "cost",
        "cost: batches planned by input length and measured call cost; count: deadline order",
    ),
    Option("--max-queue", int, 256, "queued items; beyond it: 503"),
    Option(
        "--max-client-batch-size", int, 32, "inputs allowed in one request (TEI's name); more: 413"
    ),
    Option("--timeout", float, 30.0, "default request deadline in seconds"),
    Option("--max-timeout", float, 300.0, "the longest deadline X-Request-Timeout may ask for"),
    Option("--max-body-bytes", int, 1024 * 1024, "largest accepted request body; beyond it: 413"),
    Option("--max-connections", int, 1000, "open connections; past it: 503 (0: no cap)"),
    Option("--keepalive-timeout", float, 5.0, "seconds an idle keep-alive connection stays open"),
    Option("--head-timeout", float, 10.0, "seconds to receive a request's head; beyond: 408"),
    Option("--body-timeout", float, 30.0, "seconds to receive a request's body; beyond: 408"),
    Option(
        "--write-timeout",
        float,
        30.0,
        "seconds a client may go without reading its answer before it is cut off",
    ),
    Option("--api-key", str, None, "inference endpoints need Authorization: Bearer KEY (401)"),
    Option(
        "--chat-template",
        str,
        None,
        "a Jinja chat template FILE for /v1/chat/completions, when the tokenizer has none",
    ),
    Option("--ssl-certfile", str, None, "TLS: the certificate chain (PEM; may hold the key too)"),
    Option("--ssl-keyfile", str, None, "TLS: the private key (PEM), when not in --ssl-certfile"),
    Option(
        "--cors-allow-origin",
        list,
        (),
        "a browser origin that may call the API (repeatable; * for any): answers preflight "
        "OPTIONS and adds the CORS headers",
    ),
    Option(
        "--grace",
        float,
        30.0,
        "seconds to drain on SIGTERM/SIGINT; then what is left gets 503, busy workers are "
        "killed, and the server exits within a second",
    ),
    Option(
        "--batch-timeout", float, 120.0, "seconds a batch may run before its worker is restarted"
    ),
    Option("--log-level", str, "info", "debug, info, warning or error"),
    Option("--log-format", str, "text", "text (one line per event) or json (one object a line)"),
    Option("--no-access-log", bool, False, "do not log a line per request"),
    Option(
        "--download-only",
        bool,
        False,
        "resolve every --model (downloading Hub models into the cache) and exit",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rawserve",
        description="Serve a Hugging Face transformers pipeline over HTTP/1.1. "
        "Every option can also be set as RAWSERVE_<OPTION>, e.g. RAWSERVE_PORT=8000.",
    )
    for option in OPTIONS:
        if option.type is bool:  # a switch; its variable is 1/true/yes/on or 0/false/no/off
            value = os.environ.get(option.env, "").strip().lower()
            if value not in ENV_TRUE + ENV_FALSE:
                parser.error(f"{option.env} must be one of {', '.join(ENV_TRUE + ENV_FALSE)}")
            help = f"{option.help} [env {option.env}=1]"
            parser.add_argument(
                option.flag, action="store_true", default=value in ENV_TRUE, help=help
            )
            continue
        if option.type is list:  # repeatable; its variable is a comma-separated list
            value = os.environ.get(option.env, "")
            values = [v.strip() for v in value.split(",") if v.strip()]
            parser.add_argument(
                option.flag,
                action="append",
                default=values,
                help=f"{option.help} [env {option.env}=A,B]",
            )
            continue
        if option.repeatable:  # given flags replace the variable's list (read in parse_args)
            help = f"{option.help} [env {option.env}=A,B]"
            parser.add_argument(option.flag, type=option.type, action="append", help=help)
            continue
        default = os.environ.get(option.env, option.default)
        shown = "" if default is None or "default:" in option.help else f" (default: {default})"
        parser.add_argument(
            option.flag,
            type=option.type,
            default=default,
            help=f"{option.help}{shown} [env {option.env}]",
        )
    parser.add_argument("--version", action="version", version=f"rawserve {__version__}")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None:
        listed = os.environ.get("RAWSERVE_MODEL", "")
        args.model = [name.strip() for name in listed.split(",") if name.strip()]
    if args.handler and args.model:
        parser.error("--handler serves its own callable: give no --model with it")
    try:
        args.engine = Engine(args.engine)
    except ValueError:
        parser.error("--engine must be torch, onnx or auto")
    args.devices = None  # settled with the models (settle_workers): the layout counts them
    if args.device:  # no --device (or RAWSERVE_DEVICE empty): the default layout
        try:
            args.devices = parse_devices(args.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as exc:
            parser.error(str(exc))
    for name in ("max_batch_size", "max_queue", "max_client_batch_size", "max_body_bytes", "port"):
        if getattr(args, name) < (0 if name == "port" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.batch_timeout <= 0 or args.grace < 0:
        parser.error("--batch-timeout must be positive and --grace not negative")
    if args.timeout <= 0 or args.max_batch_delay_ms < 0:
        parser.error("--timeout must be positive and --max-batch-delay-ms not negative")
    if args.max_timeout <= 0 or args.batching not in ("cost", "count"):
        parser.error("--max-timeout must be positive and --batching cost or count")
    timeouts = (args.keepalive_timeout, args.head_timeout, args.body_timeout, args.write_timeout)
    if min(timeouts) <= 0:
        parser.error(
            "--keepalive-timeout, --head-timeout, --body-timeout and --write-timeout "
            "must be positive"
        )
    if args.max_connections < 0 or args.api_key == "":
        parser.error("--max-connections must not be negative and --api-key not empty")
    if args.log_format not in LOG_FORMATS:
        parser.error(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    args.chat_template_text = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as template:
                args.chat_template_text = template.read()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"--chat-template: cannot read {args.chat_template}: {exc}")
    args.ssl_context = None
    if args.ssl_keyfile and not args.ssl_certfile:
        parser.error("--ssl-keyfile needs --ssl-certfile")
    if args.ssl_certfile:
        try:
            args.ssl_context = server_context(args.ssl_certfile, args.ssl_keyfile)
        except ValueError as exc:
            parser.error(f"--ssl-certfile/--ssl-keyfile: {exc}")
    if any(not origin or origin.endswith("/") for origin in args.cors_allow_origin):
        parser.error("--cors-allow-origin takes an origin such as https://app.example or *")
    args.share_cores = args.threads is None  # CPU workers split the cores as they are busy
    return args


def settle_workers(args: argparse.Namespace, plans: Sequence[ModelPlan]) -> None:
    """The devices and threads of every model's workers. With no --device and no GPU: one
    single-threaded worker per core for each model, as many as memory holds copies of all
    the models (rawserve.ops.layout); otherwise one worker per device given."""
    args.layout = None
    if args.devices is None:
        if gpu_present():
            args.devices = parse_devices("auto", os.environ.get("CUDA_VISIBLE_DEVICES"))
        else:
            size = sum(model_bytes(Path(plan.folder)) for plan in plans if plan.folder)
            args.layout = cpu_layout(os.cpu_count() or 1, ram_bytes(), size, models=len(plans))
            args.devices = ["cpu"] * args.layout.workers
    if args.threads is None:  # every model has a worker per device
        cpu_devices = sum(d in ("cpu", "auto") for d in args.devices)
        cpu_workers = max(1, cpu_devices * max(1, len(plans)))
        args.threads = max(1, (os.cpu_count() or 1) // cpu_workers)


def model_facts(plan: ModelPlan, args: argparse.Namespace) -> dict[str, Any]:
    """What /info reports of one served model: how it was named, what its folder says,
    and the options it is served with."""
    facts: dict[str, Any] = {
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
            "devices": list(args.devices),
            "layout": args.layout.reason if args.layout else f"--device {args.device or 'auto'}",
            "dtype": args.dtype,
            "requested_engine": args.engine.value,
            "threads_per_worker": args.threads,
            "warmup": not args.no_warmup,
            "batching": {
                "max_batch_size": args.max_batch_size,
                "max_batch_delay_ms": args.max_batch_delay_ms,
                "max_batch_tokens": args.max_batch_tokens,
                "max_queue": args.max_queue,
                "timeout_seconds": args.timeout,
            },
        }
    )
    return facts


def worker_config(plan: ModelPlan, args: argparse.Namespace, name: str = "") -> WorkerConfig:
    """What each worker of `plan` is given: the resolved folder and the facts read from it
    (`name`: the model's, for log lines, when the server has several)."""
    facts = plan.facts
    return WorkerConfig(
        name=name,
        model=plan.folder or "",
        task=facts.task if facts else None,
        handler=plan.handler,
        dtype=args.dtype,
        threads=args.threads,
        engine=args.engine,
        pooling=facts.pooling if facts else "none",
        normalize=facts.normalize if facts else False,
        warmup_batch=0 if args.no_warmup else args.max_batch_size,
        chat_template=args.chat_template_text,
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
    args: argparse.Namespace,
    metrics: Metrics,
    core_share: CoreShare,
    loop: asyncio.AbstractEventLoop,
    several: bool = False,
) -> ModelParts:
    """One model's parts; with `several` models, its log lines carry its name."""
    counts = metrics.for_model(plan.name)
    wake = asyncio.Event()  # a worker may be free: the scheduler looks again
    executor = Executor(
        worker_config(plan, args, plan.name if several else ""),
        args.devices,
        batch_timeout=args.batch_timeout,
        share_cores=args.share_cores,
        on_idle=wake.set,
        metrics=counts,
        core_share=core_share,
        loop=loop,
    )
    core = SchedulerCore(
        max_queue=args.max_queue,
        max_batch_size=args.max_batch_size,
        max_batch_delay=args.max_batch_delay_ms / 1000,
        max_batch_tokens=args.max_batch_tokens,
        group_lengths=args.batching == "cost",
        workers=len(args.devices),
    )
    scheduler = Scheduler(core, executor, wake=wake, loop=loop, metrics=counts)
    metrics.watch(plan.name, scheduler, executor)
    served = ServedModel(
        plan.name,
        ModelService(scheduler, executor),
        model_facts(plan, args),
        aliases=plan.names[1:],
    )
    return ModelParts(plan, executor, scheduler, served)


async def serve(args: argparse.Namespace, plans: Sequence[ModelPlan]) -> int:
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    metrics = Metrics()
    core_share = CoreShare()  # every model's CPU workers split the cores
    several = len(plans) > 1
    models = [build_model(plan, args, metrics, core_share, loop, several) for plan in plans]
    executors = [model.executor for model in models]
    schedulers = [model.scheduler for model in models]
    app = App(
        ServedModels([model.served for model in models]),
        AppSettings(
            timeout=args.timeout,
            max_timeout=args.max_timeout,
            api_key=args.api_key,
            max_client_batch_size=args.max_client_batch_size,
            cors_allow_origins=tuple(args.cors_allow_origin),
        ),
        metrics=metrics,
    )
    state = ServerState(metrics=metrics)
    settings = ProtocolSettings(
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        keepalive_timeout=args.keepalive_timeout,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
    )
    for executor in executors:
        executor.start()
    for scheduler in schedulers:
        scheduler.start()
    metrics.start(loop)
    server = await loop.create_server(
        lambda: HttpProtocol(app, settings, state, loop=loop),
        args.host,
        args.port,
        backlog=1024,
        ssl=args.ssl_context,
        # a client that never finishes its TLS hello is let go as a slow head would be
        ssl_handshake_timeout=args.head_timeout if args.ssl_context else None,
    )
    port = server.sockets[0].getsockname()[1]
    fix_mmap_threshold()  # large blocks mapped on their own: the heap does not creep
    # What is built by now lives as long as the server: leave it out of the collector's
    # full passes, which otherwise stall the event loop for ~8 ms every few thousand
    # requests (under 1 ms once frozen).
    gc.collect()
    gc.freeze()
    scheme = "https" if args.ssl_context else "http"
    log.info(
        "rawserve %s listening on %s://%s:%d (model loading)", __version__, scheme, args.host, port
    )
    if args.layout:
        log.info("layout: %s", args.layout.reason)

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
        log.info("%s received: draining for up to %.0f s", signal.Signals(signum).name, args.grace)
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
    if not await requests_answered(state, args.grace):
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
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format, access_log=not args.no_access_log)
    # The workers inherit the environment: they log at the same level and format.
    os.environ.update(RAWSERVE_LOG_LEVEL=args.log_level, RAWSERVE_LOG_FORMAT=args.log_format)
    try:
        # before anything listens: a Hub model is downloaded (or found in the cache) once,
        # here, and the workers are given its folder
        plans = plan_models(
            args.model, task=args.task, revision=args.revision, handler=args.handler
        )
    except ModelNotFound as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 1
    settle_workers(args, plans)
    if args.download_only:
        for plan in plans:
            log.info("model %s: %s", plan.name, plan.folder or plan.handler)
        return 0
    try:
        return asyncio.run(serve(args, plans))
    except KeyboardInterrupt:
        return 1

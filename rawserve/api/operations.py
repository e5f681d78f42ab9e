"""The operations routes: `/health` (liveness), `/ready` (readiness), `/info`, `/metrics`.

Probes are answered from state already at hand, without waiting, so the protocol can
answer them in the event-loop pass that read them (`App.answer_now`).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol
from urllib.parse import parse_qs

from rawserve.api import schemas
from rawserve.api.bodies import json_response
from rawserve.api.context import RouteContext
from rawserve.api.gate import loading_retry_after
from rawserve.api.outcomes import DEFAULT_RETRY_AFTER
from rawserve.api.routing import Handler, Operation, Route
from rawserve.api.served import ServedModel
from rawserve.api.tei import tei_info
from rawserve.api.tgi import tgi_info
from rawserve.http.errors import BadRequest, NotFound
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.ops.info import versions
from rawserve.serving.face import WorkerStatus

TAG = "Operations"
# probes and metrics need no API key (a load balancer, Prometheus)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
READY_PREFIX = "/ready/"  # GET /ready/<name>: that model's readiness alone
FULL_RETRY_AFTER = 1  # seconds a load balancer should wait before retrying a full server
# `GET /ready?full=ok`: a full queue counts as ready, for an orchestrator that takes a
# replica out of its Service while readiness fails (Kubernetes). Under an overload of
# every replica, a readiness that said "full" took them all out, and clients' connections
# were refused where each replica would have answered a fast 503 with Retry-After.
FULL_IS_READY = "ok"
FULL_PARAMETER = {
    "name": "full",
    "in": "query",
    "required": False,
    "description": "`ok`: a full queue counts as ready (200, status `full`)",
    "schema": {"type": "string", "enum": [FULL_IS_READY]},
}
# what /info says of a model that generates in its entry (TGI's names)
GENERATION_LIMITS = ("max_input_tokens", "max_input_length", "max_total_tokens")


class MetricsPage(Protocol):
    """Renders the Prometheus exposition (rawserve.ops.metrics.Metrics)."""

    async def scrape(self) -> tuple[bytes, str]:
        """The exposition of every process of the server, and its content type."""
        ...


class OperationsRoutes:
    def __init__(
        self,
        context: RouteContext,
        metrics: MetricsPage | None = None,
    ):
        self.models = context.models
        self.gate = context.gate
        self.max_client_batch_size = context.settings.max_client_batch_size
        self.metrics = metrics
        # the server's processes, for /info: this one alone, unless --http-processes
        # puts the HTTP side in processes of its own (rawserve.http_process)
        self.processes: Callable[[], list[dict[str, Any]]] = lambda: [
            {"role": "http+serving", "pid": os.getpid()}
        ]
        # brings the models' snapshots up to date before /info reads them (a round trip to
        # the serving process from an HTTP process; nothing to do in one process)
        self.refresh: Callable[[], Awaitable[None]] = _nothing

    def routes(self) -> list[Route]:
        def get(path: str, handler: Handler, operation: Operation) -> Route:
            return Route("GET", path, handler, operation, secured=path not in OPEN_PATHS)

        status = {503: schemas.STATUS}
        ready = Operation(
            "Readiness: a model loaded and room in the queue",
            TAG,
            response=lambda _: schemas.STATUS,
            errors=(400,),  # `full` with another value than "ok"
            answers=status,
            parameters=(FULL_PARAMETER,),
        )
        # each model's own readiness, by each of its names
        named = [
            Route(
                "GET",
                READY_PREFIX + name,
                self.model_route(model),
                replace(ready, summary=f"Readiness of the model {model.name!r} alone"),
                serves=model,
                secured=False,
            )
            for model in self.models.all
            for name in model.names
        ]
        return [
            get("/health", self.health, Operation(
                "Liveness", TAG, response=lambda _: schemas.STATUS, answers=status)),
            get("/ready", self.ready, ready),
            *named,
            get("/info", self.info, Operation(
                "The model, its task and settings, the workers (and TEI's fields)", TAG,
                response=lambda _: schemas.INFO)),
            get("/metrics", self.metrics_page, Operation(
                "Prometheus metrics", TAG, response=lambda _: schemas.TEXT,
                media_type="text/plain", errors=(404,))),
        ]  # fmt: skip

    def health_now(self) -> HttpResponse:
        """503 once any model's workers keep dying (its restarts keep failing): the whole
        process is then to be replaced. Of several models, the body says which."""
        healthy = {model.name: model.serving.snapshot().healthy for model in self.models.all}
        status = "ok" if all(healthy.values()) else "unhealthy"
        document: dict[str, Any] = {"status": status}
        if len(healthy) > 1:
            document["models"] = {name: "ok" if ok else "unhealthy" for name, ok in healthy.items()}
        return json_response(200 if status == "ok" else 503, document)

    def ready_now(self, request: HttpRequest, model: ServedModel | None = None) -> HttpResponse:
        """200 when every served model (or `model` alone) takes work now: loaded, warm and
        with room in its queue (or full, with `?full=ok`); 503 otherwise, saying why."""
        full_is_ready = full_counts_as_ready(request.query)
        if self.gate.draining:  # (with the Retry-After of the work it refuses now)
            headers = [("Retry-After", str(math.ceil(DEFAULT_RETRY_AFTER)))]
            return json_response(503, {"status": "draining"}, headers)
        models = [model] if model is not None else self.models.all
        statuses = {served.name: self.readiness(served) for served in models}
        # /ready of several models also says each one's status
        several = (
            {"models": {name: status["status"] for name, status in statuses.items()}}
            if len(models) > 1
            else {}
        )
        waiting = [
            (served, status)
            for served, status in zip(models, statuses.values(), strict=True)
            if status["status"] not in ("ready", "full")  # says more than a full one
        ]
        if waiting:
            # ready when the last of them is back: a probe that came back with the first
            # found the others still loading
            wait = max(math.ceil(loading_retry_after(served)) for served, _ in waiting)
            return json_response(503, {**waiting[0][1], **several}, [("Retry-After", str(wait))])
        full = any(status["status"] == "full" for status in statuses.values())
        if full and not full_is_ready:
            # as long as a request refused now is told to wait (a probe said 1 s, beside
            # refusals saying 4)
            waits = [served.serving.snapshot().full_retry_after for served in models]
            told = max((w for w in waits if w is not None), default=FULL_RETRY_AFTER)
            headers = [("Retry-After", str(max(1, math.ceil(told))))]
            return json_response(503, {"status": "full", **several}, headers)
        answer = "full" if full else "ready"
        if several:
            return json_response(200, {"status": answer, **several})
        return json_response(200, {"status": answer, "task": models[0].task})

    def readiness(self, model: ServedModel) -> dict[str, Any]:
        """One model's state for /ready: ready, full, or why it is not loaded (how long)."""
        snapshot = model.serving.snapshot()
        if not snapshot.ready:
            status: dict[str, Any] = {"status": snapshot.load_state.value}
            if snapshot.loading_seconds is not None:
                status["elapsed_seconds"] = round(snapshot.loading_seconds, 1)
            return status
        return {"status": "full" if snapshot.full else "ready"}

    def model_route(self, model: ServedModel) -> Callable[[HttpRequest], Awaitable[HttpResponse]]:
        """The handler of `GET /ready/<name>`: that model's readiness alone."""

        async def ready_named(request: HttpRequest) -> HttpResponse:
            return self.ready_now(request, model)

        return ready_named

    async def health(self, request: HttpRequest) -> HttpResponse:
        return self.health_now()

    async def ready(self, request: HttpRequest) -> HttpResponse:
        return self.ready_now(request)

    async def info(self, request: HttpRequest) -> HttpResponse:
        """The default model's document (as with one model), every model's in "models",
        and TEI's fields for the default model (TGI's too for one that generates)."""
        await self.refresh()
        model = self.models.default
        document = self.info_document(model)
        document["models"] = [
            {**self.info_document(served, server=False), **input_limits(served)}
            for served in self.models.all
        ]
        document.update(
            tei_info(model, self.max_client_batch_size),
            **tgi_info(model, self.max_client_batch_size),
        )
        return json_response(200, document)

    async def metrics_page(self, request: HttpRequest) -> HttpResponse:
        if self.metrics is None:
            raise NotFound("metrics are not enabled")
        body, content_type = await self.metrics.scrape()
        return HttpResponse(200, body, [], content_type)

    def info_document(self, model: ServedModel, server: bool = True) -> dict[str, Any]:
        """The model's facts (its options among them) and what its workers are doing
        now; with `server`, the server's own (its processes, event loop, versions) too."""
        snapshot = model.serving.snapshot()
        workers = snapshot.workers
        document = dict(model.facts)
        batching = dict(document.get("batching", {}))
        # the size in use: the option, or lower where a worker ran out of memory
        caps = [worker.batch_cap for worker in workers if worker.batch_cap]
        batching["effective_max_batch_size"] = min([snapshot.max_batch_size, *caps])
        document.update(
            {
                "task": model.task,
                "ready": snapshot.ready,
                "batching": batching,
                "workers": [_worker_info(worker) for worker in workers],
                "engine": next((w.engine for w in workers if w.engine), None),
                "worker_pids": [worker.pid for worker in workers if worker.pid],
            }
        )
        if server:
            processes = self.processes()
            serving = next((p["pid"] for p in processes if p["role"] != "http"), os.getpid())
            document.update(
                server_pid=serving,
                http_pid=os.getpid(),  # the process that answers this request
                processes=processes,
                event_loop=_event_loop(),
                versions=versions(),
            )
        return document


def input_limits(model: ServedModel) -> dict[str, int]:
    """The most tokens the model reads of an input (TEI's `max_input_length`), or for a
    model that generates, TGI's limits of a prompt and of a prompt and its answer: what
    `/info` says of the default model at its top, in each model's entry (of several
    models, only the first's limits were to be found)."""
    limits = tgi_info(model)
    if limits:
        return {name: limits[name] for name in GENERATION_LIMITS}
    return {"max_input_length": model.positions}


def _event_loop() -> str:
    """The event loop this process runs (--loop): "uvloop" or "asyncio"."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


async def _nothing() -> None:
    pass


def _worker_info(worker: WorkerStatus) -> dict[str, Any]:
    return {
        "index": worker.index,
        "device": worker.device,
        "dtype": worker.dtype or None,  # (a handler's precision is its own)
        "dtype_reason": worker.dtype_reason,
        "bfloat16_trial": worker.bfloat16_trial,
        "attention": worker.attention,
        "cuda_graphs": worker.cuda_graphs,
        "generation": worker.generation,
        "untrained": worker.untrained,  # (its answers mean nothing: the log's warning)
        "engine": worker.engine,
        "engine_reason": worker.engine_reason,
        "state": worker.state.value,
        "pid": worker.pid,
        "restarts": worker.restarts,
        "max_batch_size": worker.batch_cap,  # lowered after out-of-memory errors
        "warmup_seconds": worker.warmup_seconds,
        # continuous generation: sequences it runs at once, and now (0: batches run whole)
        "max_sequences": worker.sequences,
        "running_sequences": worker.running,
    }


def full_counts_as_ready(query: str) -> bool:
    """Whether a readiness query (`full=ok`) counts a full queue as ready."""
    values = parse_qs(query, keep_blank_values=True).get("full")
    if values is None:
        return False
    if values != [FULL_IS_READY]:
        raise BadRequest(
            f'"full" takes only "{FULL_IS_READY}": /ready?full=ok counts a full queue as ready'
        )
    return True

"""The operations routes: `/health` (liveness), `/ready` (readiness), `/info`, `/metrics`.

Probes are answered from state already at hand, without waiting, so the protocol can
answer them in the event-loop pass that read them (`App.answer_now`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from rawserve.api.bodies import json_response
from rawserve.api.context import RouteContext
from rawserve.api.gate import LOADING_RETRY_AFTER
from rawserve.api.served import ServedModel
from rawserve.executor import WorkerStatus
from rawserve.http.errors import NotFound
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.ops.info import versions

FULL_RETRY_AFTER = 1  # seconds a load balancer should wait before retrying a full server


class MetricsPage(Protocol):
    """Renders the Prometheus exposition (rawserve.ops.metrics.Metrics)."""

    def render(self) -> tuple[bytes, str]: ...


class OperationsRoutes:
    def __init__(
        self,
        context: RouteContext,
        metrics: MetricsPage | None = None,
        facts: Mapping[str, Any] | None = None,
    ):
        self.models = context.models
        self.gate = context.gate
        self.metrics = metrics
        self.facts = dict(facts or {})  # the server's options, for /info

    def health_now(self) -> HttpResponse:
        if not all(model.workers.healthy for model in self.models.all):
            return json_response(503, {"status": "unhealthy"})  # restarts keep failing
        return json_response(200, {"status": "ok"})

    def ready_now(self) -> HttpResponse:
        model = self.models.default
        if self.gate.draining:
            return json_response(503, {"status": "draining"})
        workers = model.workers
        if not workers.ready:
            state, elapsed = workers.load_state()
            status: dict[str, Any] = {"status": state.value}
            if elapsed is not None:
                status["elapsed_seconds"] = round(elapsed, 1)
            return json_response(503, status, [("Retry-After", str(round(LOADING_RETRY_AFTER)))])
        if model.queue.full:
            return json_response(503, {"status": "full"}, [("Retry-After", str(FULL_RETRY_AFTER))])
        return json_response(200, {"status": "ready", "task": workers.task})

    async def health(self, request: HttpRequest) -> HttpResponse:
        return self.health_now()

    async def ready(self, request: HttpRequest) -> HttpResponse:
        return self.ready_now()

    async def info(self, request: HttpRequest) -> HttpResponse:
        return json_response(200, self.info_document(self.models.default))

    async def metrics_page(self, request: HttpRequest) -> HttpResponse:
        if self.metrics is None:
            raise NotFound("metrics are not enabled")
        body, content_type = self.metrics.render()
        return HttpResponse(200, body, [], content_type)

    def info_document(self, model: ServedModel) -> dict[str, Any]:
        """The server's options and the model's facts, then what its workers are doing now."""
        workers = model.workers.status()
        document = {**self.facts, **model.facts}
        batching = dict(document.get("batching", {}))
        # the size in use: the option, or lower where a worker ran out of memory
        caps = [worker.batch_cap for worker in workers if worker.batch_cap]
        batching["effective_max_batch_size"] = min([model.queue.max_batch_size, *caps])
        document.update(
            {
                "task": model.workers.task,
                "ready": model.workers.ready,
                "batching": batching,
                "workers": [_worker_info(worker) for worker in workers],
                "worker_pids": [worker.pid for worker in workers if worker.pid],
                "server_pid": os.getpid(),
                "versions": versions(),
            }
        )
        return document


def _worker_info(worker: WorkerStatus) -> dict[str, Any]:
    return {
        "index": worker.index,
        "device": worker.device,
        "dtype": worker.dtype,
        "state": worker.state.value,
        "pid": worker.pid,
        "restarts": worker.restarts,
        "max_batch_size": worker.batch_cap,  # lowered after out-of-memory errors
    }

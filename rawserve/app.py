"""The HTTP application: routes, request parsing, and turning results into responses.

Sits between the protocol (which speaks HTTP/1.1 bytes) and the scheduler. It never
sees a socket and never imports h11 or torch. Errors are raised as `errors.HTTPError`
and rendered by the protocol through `errors.error_response`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rawserve import encoding
from rawserve.errors import (
    BadRequest,
    HTTPError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    ServiceUnavailable,
    UnprocessableInput,
    UnsupportedMediaType,
)
from rawserve.http import HttpRequest, HttpResponse, require_bearer
from rawserve.info import loading_status, server_info
from rawserve.messages import FailureKind, ItemFailure
from rawserve.openai_api import OpenAIRoutes
from rawserve.scheduler import ItemResult, Scheduler
from rawserve.streaming import TokenStreams
from rawserve.tasks import (
    ParsedRequest,
    parse_binary_body,
    parse_json_body,
    parse_text_body,
    shape_answer,
    takes_binary_body,
)

Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
LOADING_RETRY_AFTER = 5.0
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # no API key: probes, Prometheus


@dataclass(frozen=True)
class AppSettings:
    timeout: float = 30.0  # default request deadline, seconds
    max_timeout: float = 300.0  # the most X-Request-Timeout may ask for
    api_key: str | None = field(default=None, repr=False)  # Bearer token; None: open


class App:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Any,
        settings: AppSettings = AppSettings(),
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: Any = None,  # a metrics.Metrics, for /metrics
        info: dict[str, Any] | None = None,  # info.static_info(...), for /info
    ):
        self.scheduler = scheduler
        self.executor = executor
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self.static_info = info or {}
        self.draining = False  # set by main on SIGTERM/SIGINT
        self.openai = OpenAIRoutes(self)
        self.streams = TokenStreams(scheduler, executor)
        self.routes: dict[str, dict[str, Handler]] = {
            "/": {"POST": self.infer},
            "/health": {"GET": self.health},
            "/ready": {"GET": self.ready},
            "/info": {"GET": self.info},
            "/metrics": {"GET": self.metrics_page},
            "/v1/embeddings": {"POST": self.openai.embeddings},
            "/v1/models": {"GET": self.openai.models},
        }

    async def handle(self, request: HttpRequest) -> HttpResponse:
        methods = self.routes.get(request.path)
        if methods is None:
            raise NotFound(f"no route for {request.path}")
        self.authorize(request)
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")  # the protocol drops the body
        if handler is None:
            raise MethodNotAllowed(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
        return await handler(request)

    def answer_now(self, request: HttpRequest) -> HttpResponse | None:
        """The response to a request that needs no waiting, or None: go through `handle`.

        Probes, and inference requests the server cannot take at all right now (draining,
        loading, the queue full), are answered in the event-loop pass that read them: a
        probe is not queued behind the pass's other work, and a refusal under overload
        costs no task. Raises HTTPError as `handle` does.
        """
        if request.method not in ("GET", "HEAD", "POST"):
            return None
        if request.path == "/health" and request.method != "POST":
            return self.health_now()
        if request.path == "/ready" and request.method != "POST":
            return self.ready_now()
        if request.path == "/" and request.method == "POST":
            self.authorize(request)
            self.check_available()
            self.scheduler.refuse_if_full()
        return None

    def authorize(self, request: HttpRequest) -> None:
        """Raise 401 unless the request may use its path (probes and metrics are open)."""
        if self.settings.api_key and request.path not in OPEN_PATHS:
            require_bearer(request, self.settings.api_key)

    # --- operations -------------------------------------------------------------------

    async def health(self, request: HttpRequest) -> HttpResponse:
        return self.health_now()

    def health_now(self) -> HttpResponse:
        if not self.executor.healthy:  # the workers keep failing to restart: replace us
            return json_response(503, {"status": "unhealthy"})
        return json_response(200, {"status": "ok"})

    async def ready(self, request: HttpRequest) -> HttpResponse:
        return self.ready_now()

    def ready_now(self) -> HttpResponse:
        if self.draining:
            return json_response(503, {"status": "draining"})
        if not self.executor.ready:
            return json_response(503, loading_status(self.executor), [("Retry-After", "5")])
        if len(self.scheduler.core) >= self.scheduler.core.max_queue:
            return json_response(503, {"status": "full"}, [("Retry-After", "1")])
        return json_response(200, {"status": "ready", "task": self.executor.task})

    async def info(self, request: HttpRequest) -> HttpResponse:
        return json_response(200, server_info(self.static_info, self.executor, self.scheduler))

    async def metrics_page(self, request: HttpRequest) -> HttpResponse:
        if self.metrics is None:
            raise NotFound("metrics are not enabled")
        body, content_type = self.metrics.render()
        return HttpResponse(200, body, [], content_type)

    # --- inference --------------------------------------------------------------------

    def check_available(self) -> None:
        """Raise 503 while the server takes no inference work (draining, loading)."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down")
        if not self.executor.ready:
            raise ServiceUnavailable("the model is loading", retry_after=LOADING_RETRY_AFTER)

    async def infer(self, request: HttpRequest) -> HttpResponse:
        self.check_available()
        parsed = self.parse_body(request)
        started = self.clock()
        deadline = started + self.request_timeout(request)
        if parsed.stream:
            return await self.streams.open(parsed, deadline)
        results = await self.scheduler.run(parsed.inputs, parsed.params, deadline)
        outputs = [unwrap(result) for result in results]
        body = encoding.dumps(shape_answer(self.executor.task, outputs, parsed.is_list))
        return HttpResponse(200, body, [("Server-Timing", server_timing(results))])

    def parse_body(self, request: HttpRequest) -> ParsedRequest:
        task = self.executor.task
        content_type = (request.header("content-type") or "").split(";")[0].strip().lower()
        # InferenceClient posts JSON without a Content-Type: a body that has none and
        # starts like an object is read as JSON.
        if content_type == "application/json" or (
            not content_type and request.body.lstrip()[:1] == b"{"
        ):
            try:
                document = json.loads(request.body)
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise BadRequest("the body is not valid JSON") from None
            return parse_json_body(task, document)
        if takes_binary_body(task):  # an image's bytes, with or without image/* type
            return parse_binary_body(task, request.body)
        try:
            text = request.body.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsupportedMediaType("the body is not UTF-8 text") from None
        return parse_text_body(task, text)

    def request_timeout(self, request: HttpRequest) -> float:
        header = request.header("x-request-timeout")
        if header is None:
            return self.settings.timeout
        try:
            seconds = float(header)
        except ValueError:
            raise BadRequest("X-Request-Timeout must be a number of seconds") from None
        if not seconds > 0:  # also refuses NaN
            raise BadRequest("X-Request-Timeout must be positive")
        return min(seconds, self.settings.max_timeout)


def unwrap(result: ItemResult) -> Any:
    """An item's output, or the HTTP error its failure stands for."""
    output = result.output
    if not isinstance(output, ItemFailure):
        return output
    error: HTTPError
    if output.kind is FailureKind.INPUT:
        error = UnprocessableInput(output.message)
    else:
        error = InternalError(output.message)
    raise error


def server_timing(results: list[ItemResult]) -> str:
    queue_ms = 1000 * max(r.queue_seconds for r in results)
    model_ms = 1000 * max(r.compute_seconds for r in results)
    batch = max(r.batch_size for r in results)
    return f'queue;dur={queue_ms:.2f}, model;dur={model_ms:.2f}, batch;desc="{batch}"'


def json_response(
    status: int, document: Any, headers: list[tuple[str, str]] | None = None
) -> HttpResponse:
    return HttpResponse(status, encoding.dumps(document), headers or [])

"""The HTTP application: the route table, the API key, and which requests are answered at once.

The protocol hands it complete requests (it is the protocol's `Application`); each route
is a handler of one of the route families (inference, OpenAI, TGI, TEI, operations).
Errors are raised as `rawserve.http.errors.HTTPError` and rendered by the protocol, except
where a route's clients read a shape of their own (OpenAI's error object, TGI's and TEI's
error types, and the shape used with CORS on): the app renders those itself
(`error_renderer`), refusals before the route runs included. Never sees a socket,
never imports h11 or torch.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from rawserve.api import sagemaker, schemas, tgi
from rawserve.api.bodies import json_response
from rawserve.api.context import RouteContext
from rawserve.api.gate import Gate
from rawserve.api.inference import MODELS_PREFIX, InferenceRoutes
from rawserve.api.openai import (
    MODEL_GENERATION_PATHS,
    OPENAI_MODEL_PREFIX,
    OpenAIRoutes,
    speaks_openai,
)
from rawserve.api.openapi import openapi_document
from rawserve.api.operations import READY_PREFIX, MetricsPage, OperationsRoutes
from rawserve.api.routing import Handler, Needs, Operation, Route
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.api.tei import TeiRoutes
from rawserve.api.tgi import TgiRoutes
from rawserve.api.vllm_pooling import VllmPoolingRoutes
from rawserve.http.auth import require_bearer
from rawserve.http.cors import CorsPolicy
from rawserve.http.errors import (
    ErrorRenderer,
    HTTPError,
    MethodNotAllowed,
    NotFound,
    error_response,
    openai_error_response,
    tei_error_response,
    tgi_error_response,
)
from rawserve.http.exchange import HttpRequest, HttpResponse

# the paths that end in a model's name: a route for each name, and 404 for a name not served
MODEL_PREFIXES = (MODELS_PREFIX, READY_PREFIX, OPENAI_MODEL_PREFIX)
# the asterisk form's target: `OPTIONS *` asks about the server as a whole (RFC 9110
# section 9.3.7); it names no route, so it needs no API key
SERVER_WIDE = "*"


class RouteMetrics(MetricsPage, Protocol):
    """The metrics the app serves on /metrics and tells its routes (rawserve.ops.metrics)."""

    def name_routes(self, paths: Collection[str]) -> None: ...


class App:
    def __init__(
        self,
        models: ServedModels,
        settings: AppSettings | None = None,
        *,
        metrics: RouteMetrics | None = None,
    ):
        settings = settings or AppSettings()
        context = RouteContext(models, settings, Gate())
        self.models = models
        self.settings = settings
        self.context = context
        self.gate = context.gate
        self.inference = InferenceRoutes(context)
        self.openai = OpenAIRoutes(context)
        self.tei = TeiRoutes(context)
        self.tgi = TgiRoutes(context)
        self.vllm_pooling = VllmPoolingRoutes(context)
        tei_routes = self.tei.routes()
        self.tei_paths = frozenset(route.path for route in tei_routes)
        self.operations = OperationsRoutes(context, metrics)
        openapi = Operation(
            "This document: the routes this server serves",
            "Operations",
            response=lambda _: schemas.DOCUMENT,
        )
        # The route table: the app dispatches on it, and /openapi.json describes it.
        self.table: list[Route] = [
            *self.inference.routes(),  # POST /, and POST /models/<name> for each name
            *self.operations.routes(),
            *self.openai.routes(),
            *tei_routes,
            *self.tgi.routes(),
            *self.vllm_pooling.routes(),
            Route("GET", "/openapi.json", self.openapi, openapi),
        ]
        self.routes: dict[str, dict[str, Handler]] = {}
        for route in self.table:
            self.routes.setdefault(route.path, {})[route.method] = route.handler
        # the models by their own paths (POST /models/<name>, GET /ready/<name>), for what
        # is answered at once; the paths that need no API key (probes, metrics)
        self.model_paths: dict[str, Route] = {}
        self.ready_paths: dict[str, ServedModel] = {}
        for route in self.table:
            if route.serves is not None and route.method == "POST":
                self.model_paths[route.path] = route
            elif route.serves is not None:
                self.ready_paths[route.path] = route.serves
        self.open_paths = frozenset(
            [SERVER_WIDE, *(route.path for route in self.table if not route.secured)]
        )
        # what `OPTIONS *` answers: every method some route serves
        self.server_methods = sorted(
            {"OPTIONS"}.union(*(allowed_methods(methods) for methods in self.routes.values()))
        )
        # the routes that run the model, and so have a deadline (/invocations: most of its)
        self.timed_paths = frozenset(
            [sagemaker.INVOCATIONS]
            + [route.path for route in self.table if route.method == "POST" and route.needs.worker]
        )
        # the routes whose body names the model: what each needs of it
        self.named_model_paths: dict[str, Needs] = {
            route.path: route.needs for route in self.table if route.queued
        }
        if metrics is not None:  # requests to other paths are counted as "other"
            metrics.name_routes([*self.routes, *sagemaker.PATHS])
        origins = settings.cors_allow_origins
        self.cors = CorsPolicy(origins) if origins else None

    @property
    def draining(self) -> bool:
        return self.gate.draining

    def start_draining(self) -> None:
        """From now on /ready and new inference requests get 503 (SIGTERM, SIGINT, SIGHUP)."""
        self.gate.start_draining()

    async def handle(self, request: HttpRequest) -> HttpResponse:
        routed = request
        try:
            routed = sagemaker.target(request, self.models)  # (/invocations: its route)
            response = sagemaker.answered(request, routed, await self.route(routed))
        except Exception as exc:
            render = self.error_renderer(routed)
            if render is None:
                raise  # the protocol renders it
            response = render(exc, routed.request_id)
        if self.cors is not None:
            self.cors.add_headers(routed, response)
        return response

    def error_renderer(self, request: HttpRequest) -> ErrorRenderer | None:
        """How the app renders a request's errors itself, or None: the protocol renders
        them (rawserve's shape). OpenAI's object on its routes, TGI's or TEI's types where
        their clients call, and rawserve's shape where a page must read them (CORS)."""
        if speaks_openai(request.path) or self.is_model_base_url(request):
            return openai_error_response
        if self.speaks_tgi(request):
            return tgi_error_response
        if request.path in self.tei_paths:
            return tei_error_response
        return error_response if self.cors is not None else None

    def refusal_renderer(self, request: HttpRequest) -> ErrorRenderer | None:
        """How the protocol's own refusals (framing, size, coding) are shaped: OpenAI's
        object on its routes, whose clients read no other; rawserve's shape elsewhere
        (TGI's and TEI's types are for their inputs' validation: TGI's would make a
        refused framing's 400 a 422). A SageMaker name takes the shape of the route it
        stands for (TEI's `/embeddings`: OpenAI's, as everything else it answers)."""
        path = sagemaker.target(request, self.models, body_read=False).path
        return openai_error_response if speaks_openai(path) else None

    def is_model_base_url(self, request: HttpRequest) -> bool:
        """A path under a model's own OpenAI base URL (`/models/<name>/v1/...`) that is
        no route: its client is the openai SDK, which reads only OpenAI's error object."""
        after = request.path.removeprefix(MODELS_PREFIX)
        name = after.removesuffix("/v1") if after.endswith("/v1") else after.partition("/v1/")[0]
        return (
            request.path.startswith(MODELS_PREFIX)
            and name != after
            and request.path not in self.routes
            and name in self.models.names
        )

    def speaks_tgi(self, request: HttpRequest) -> bool:
        """TGI's routes, and `POST /` (or `/models/<name>`) on a text-generation model:
        TGI's client and InferenceClient post there and type errors by TGI's rules."""
        if request.path in tgi.PATHS:
            return True
        if request.path == "/":
            return self.models.default.task == tgi.TASK
        route = self.model_paths.get(request.path)
        return route is not None and route.serves is not None and route.serves.task == tgi.TASK

    async def route(self, request: HttpRequest) -> HttpResponse:
        methods = self.methods(request)
        if self.cors is not None and self.cors.is_preflight(request):
            # a browser sends no API key here; `*` is every route's (RFC 9110 9.3.7)
            server_wide = request.path == SERVER_WIDE
            allowed = self.server_methods if server_wide else allowed_methods(methods)
            return self.cors.preflight(request, allowed)
        return await self.handler(request, methods)(request)

    def is_preflight(self, request: HttpRequest) -> bool:
        """A browser's CORS preflight, where the server allows an origin at all."""
        return self.cors is not None and self.cors.is_preflight(request)

    def methods(self, request: HttpRequest) -> dict[str, Handler]:
        """The handlers of the request's path by method; 404 for a path not served."""
        if request.path == SERVER_WIDE:
            return {"OPTIONS": self.server_options}
        methods = self.routes.get(request.path)
        if methods is not None:
            return methods
        prefix = next((p for p in MODEL_PREFIXES if request.path.startswith(p)), "")
        if not prefix:
            raise NotFound(f"no route for {request.path}")
        # a model not served: 404 naming the served ones (after the API key: they are not
        # for everyone's eyes); the protocol has decoded %-escapes (org%2Fname). A CORS
        # preflight carries no key: it is answered with the methods of the path's kind,
        # naming nothing, and the request that follows gets the 404 (a browser reported a
        # 401 to its preflight as a CORS failure)
        preflight = self.is_preflight(request)
        if not preflight:
            self.authorize(request)
        name = request.path.removeprefix(prefix)
        route = ""  # the path after the name: /models/<name>/v1/chat/completions
        if prefix == MODELS_PREFIX:
            route = next((path for path in MODEL_GENERATION_PATHS if name.endswith(path)), "")
        try:
            model = self.models.get(name.removesuffix(route))
        except NotFound:
            if preflight:
                model = self.models.default
            elif self.is_model_base_url(request):
                served = ", ".join(path.removeprefix("/v1/") for path in MODEL_GENERATION_PATHS)
                raise NotFound(
                    f"no route for {request.path}: a text-generation model's own base URL "
                    f"(/models/<name>/v1) serves {served}; every other route is /v1's"
                ) from None
            else:
                raise
        return self.routes[prefix + model.name + route]

    def handler(self, request: HttpRequest, methods: dict[str, Handler]) -> Handler:
        """The handler of the request's method, once its API key is checked (401), or 405."""
        self.authorize(request)
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")  # the protocol drops the body
        if handler is None:
            raise MethodNotAllowed(sorted(allowed_methods(methods)))
        return handler

    def answer_now(self, request: HttpRequest) -> HttpResponse | None:
        """The response to a request that needs no waiting, or None: go through `handle`.

        Probes, what the head alone refuses (a path not served, a method it does not
        take, no API key), and inference requests the server cannot take at all right now
        (draining, loading, the queue full), are answered in the event-loop pass that read
        them: a probe is not queued behind the pass's other work, a refusal under overload
        costs no task, and a refused body is never asked for. Raises HTTPError as
        `handle` does.
        """
        request = sagemaker.target(request, self.models, body_read=False)
        try:
            response = self.answer_now_plain(request)
        except Exception as exc:
            render = self.error_renderer(request)
            if render is None:
                raise
            response = render(exc, request.request_id)
        if response is not None and self.cors is not None:
            self.cors.add_headers(request, response)
        return response

    def deadline_seconds(self, request: HttpRequest) -> float | None:
        """Seconds a request to a route that runs the model may take from its head (its
        X-Request-Timeout or --timeout): its body is not waited for past them. None for
        a route of no deadline (/tokenize, the probes) and for a header that is refused
        once the body is read."""
        request = sagemaker.target(request, self.models, body_read=False)  # (/embeddings)
        if request.method != "POST" or request.path not in self.timed_paths:
            return None
        try:
            return self.context.timeout_seconds(request)
        except HTTPError:
            return None

    def answer_now_plain(self, request: HttpRequest) -> HttpResponse | None:
        """`answer_now` without the CORS headers."""
        if self.is_preflight(request):
            return None
        if request.path == sagemaker.INVOCATIONS:  # its route is known from its body
            self.authorize(request)
            if request.method != "POST":
                raise MethodNotAllowed(["POST"])
            return None
        # What the head alone refuses (404, 401, 405) is refused before the body is read:
        # a client that sent `Expect: 100-continue` is then never asked for it.
        self.handler(request, self.methods(request))
        if request.path == SERVER_WIDE:
            return self.server_options_now()
        if request.method not in ("GET", "HEAD", "POST"):
            return None
        if request.path == "/health" and request.method != "POST":
            return self.operations.health_now()
        if request.path == "/ready" and request.method != "POST":
            return self.operations.ready_now(request)
        if request.method != "POST" and (model := self.ready_paths.get(request.path)):
            return self.operations.ready_now(request, model)
        if request.path == "/" and request.method == "POST":
            self.inference.refuse_now(request)
        elif request.method == "POST" and (route := self.model_paths.get(request.path)):
            # (a model's OpenAI path, /models/emb/v1/chat/completions, is 404 for a model
            # that does not generate before its body is asked for, as /v1's paths are)
            self.inference.refuse_now(request, route.serves, route.needs)
        elif request.method == "POST" and (needs := self.named_model_paths.get(request.path)):
            self.inference.refuse_now_if_none_can(request, needs)
        return None

    async def server_options(self, request: HttpRequest) -> HttpResponse:
        return self.server_options_now()

    def server_options_now(self) -> HttpResponse:
        """204 with `Allow`: the methods this server serves."""
        allow = ("Allow", ", ".join(self.server_methods))
        return HttpResponse(204, b"", [allow], content_type="")

    async def openapi(self, request: HttpRequest) -> HttpResponse:
        document = openapi_document(
            self.table,
            self.models.all,
            self.settings.max_client_batch_size,
            api_key=self.settings.api_key is not None,
        )
        sagemaker.document_aliases(document["paths"], self.models)
        return json_response(200, document)

    def authorize(self, request: HttpRequest) -> None:
        """Raise 401 unless the request may use its path (probes and metrics are open)."""
        if self.settings.api_key and request.path not in self.open_paths:
            require_bearer(request, self.settings.api_key)


def allowed_methods(methods: dict[str, Handler]) -> set[str]:
    """A path's methods, with HEAD wherever GET is."""
    return {*methods, *(["HEAD"] if "GET" in methods else [])}

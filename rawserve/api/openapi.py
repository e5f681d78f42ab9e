"""`GET /openapi.json`: an OpenAPI 3.1 document of the routes this server serves, made from
the app's route table (the one it dispatches on): every route that fits a served model
(its own, or for a route whose body names the model the first that fits, which a body
naming none gets), with its request and answer schemas for that model's task, and the
error answers it may give (each `{"error", "error_type"}`, or OpenAI's error object on
the OpenAI routes).

Server process; plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import quote

from rawserve import __version__
from rawserve.api.openai import speaks_openai
from rawserve.api.routing import DocContext, Route
from rawserve.api.schemas import ERROR, OPENAI_ERROR, TEXT
from rawserve.api.served import ServedModel
from rawserve.tasks import task_rules

OPENAPI_VERSION = "3.1.0"
PATH_CHARACTERS = "/:@!$&'()*+,;=-._~"  # what a URL's path holds as it is (RFC 3986's pchar)
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
OPENAI_ERROR_REF = {"$ref": "#/components/schemas/OpenAIErrorResponse"}
DESCRIPTION = (
    "rawserve serves a Hugging Face transformers model over HTTP/1.1: the Inference API's "
    "POST /, and the routes of the APIs its clients already call (OpenAI's /v1, Text "
    "Embeddings Inference's) where they fit the model."
)


def openapi_document(
    routes: Sequence[Route], models: Sequence[ServedModel], max_inputs: int, api_key: bool
) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        candidates = models if route.serves is None else [route.serves]
        fitting = [m for m in candidates if route.needs.missing(m) is None]
        if not fitting:
            continue  # answered 404: not part of this server's API
        context = DocContext(fitting[0], max_inputs, shared=len(fitting) > 1)
        operation = describe(route, context, api_key)
        paths.setdefault(path_key(route.path), {})[route.method.lower()] = operation
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "rawserve", "version": __version__, "description": DESCRIPTION},
        "paths": paths,
        "components": {"schemas": {"ErrorResponse": ERROR, "OpenAIErrorResponse": OPENAI_ERROR}},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return document


def describe(route: Route, context: DocContext, api_key: bool) -> dict[str, Any]:
    operation = route.operation
    content = {operation.media_type: {"schema": operation.response(context)}}
    event = operation.events(context) if operation.events is not None else None
    if event is not None:
        content["text/event-stream"] = {
            "schema": {**TEXT, "description": "server-sent events, each `data: <JSON>`"},
            "x-event": event,
        }
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status, schema in operation.answers.items():  # non-error bodies (e.g. /ready's 503)
        responses[str(status)] = answer(status, {"application/json": {"schema": schema}})
    errors = set(operation.errors)
    if api_key and route.secured:
        errors.add(401)
    error = OPENAI_ERROR_REF if speaks_openai(route.path) else ERROR_REF
    for status in sorted(errors - set(operation.answers)):
        responses[str(status)] = answer(status, {"application/json": {"schema": error}})
    described: dict[str, Any] = {
        "summary": operation.summary,
        "tags": [operation.tag],
        "operationId": operation_id(route),
        "responses": responses,
    }
    if operation.parameters:
        described["parameters"] = list(operation.parameters)
    if operation.request is not None:
        body = {"application/json": {"schema": operation.request(context)}}
        if operation.text_body:  # `curl -d`: the whole body is one input
            body.update(raw_bodies(context.model.known_task))
        described["requestBody"] = {"required": True, "content": body}
    if api_key:
        described["security"] = [{"apiKey": []}] if route.secured else []
    return described


def path_key(path: str) -> str:
    """A route's path as an OpenAPI path key, a URL's path: a model's name percent-encoded
    where it holds what a URL's path cannot (`/models/my cls` is `/models/my%20cls`, which
    the server reads as that name), braces too (OpenAPI's templates)."""
    return quote(path, safe=PATH_CHARACTERS)


def raw_bodies(task: str | None) -> dict[str, Any]:
    """What a route that takes a raw body (`POST /`) takes besides JSON for `task`: an
    image model's image, its bytes (any type but JSON: `curl --data-binary @cat.png`);
    else a text."""
    rules = task_rules(task) if task else None
    if rules is not None and rules.binary_input:
        image = {"description": "the image's bytes: PNG, JPEG, GIF, BMP, WebP..."}
        return {"image/*": {"schema": image}, "application/octet-stream": {"schema": image}}
    return {"text/plain": {"schema": TEXT}}


def answer(status: int, content: dict[str, Any]) -> dict[str, Any]:
    return {"description": HTTPStatus(status).phrase, "content": content}


def operation_id(route: Route) -> str:
    words = "".join(c if c.isalnum() else "_" for c in route.path).strip("_") or "root"
    return f"{route.method.lower()}_{words}"

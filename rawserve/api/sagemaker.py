"""The routes SageMaker calls, as TEI's and TGI's containers serve them: `GET /ping` (its
health check, which a 200 says the container takes inference requests: `/ready`, a full
queue counted as ready, as `?full=ok` asks) and `POST /invocations` (the model's own
route); and TEI's `POST /embeddings` (OpenAI's embeddings, `/v1/embeddings`).

Each is another name for a route rawserve serves: the app reads a request to one of them
as a request to the route it stands for (`target`), which then checks, answers and
refuses it in its own shapes. `/invocations` stands for the route of the model the body
names (else the default model's), as TEI and TGI pick it, so it is known only once the
body is read (from the head alone, only its method and API key are checked):
- a text-generation model: OpenAI's chat completions for a body with `messages`, its
  completions for one with `prompt`, else TGI's `/generate` (`/generate_stream` where
  the body says `"stream": true`) as TGI's `POST /` answers it (`answered`), as TGI's
  SageMaker route reads its three bodies; a
  body with `messages` or `prompt` (no `inputs`) that names no model goes to OpenAI's
  route whatever the first model is, which picks the model that can answer it;
- a feature-extraction model: TEI's `/embed` (a SPLADE model: `/embed_sparse`; a body
  whose `inputs` has a `source_sentence`: `/similarity`); a text classifier: TEI's
  `/rerank` where it has one label (a cross-encoder) or, before it has loaded, where the
  body has a `query`, else `/predict`;
- any other task: the Inference API's `POST /models/<name>` (the body's `"model"`, which
  that route does not take, left out).
Never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from rawserve.api.bodies import read_json
from rawserve.api.inference import MODELS_PREFIX
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.tgi import GENERATE, GENERATE_STREAM
from rawserve.http.errors import HTTPError
from rawserve.http.exchange import HttpRequest, HttpResponse

PING = "/ping"
INVOCATIONS = "/invocations"
EMBEDDINGS = "/embeddings"
PATHS = (PING, INVOCATIONS, EMBEDDINGS)


def target(request: HttpRequest, models: ServedModels, body_read: bool = True) -> HttpRequest:
    """`request` as a request to the route its path stands for (itself where it stands
    for none, or for `/invocations` before its body is read)."""
    if request.path == PING:
        return replace(request, path="/ready", query="full=ok")
    if request.path == EMBEDDINGS:
        return replace(request, path="/v1/embeddings")
    if request.path != INVOCATIONS or not body_read:
        return request
    document = body_document(request)
    path = invocation_path(document, models)
    if path in (GENERATE, GENERATE_STREAM) and isinstance(document, dict):
        return replace(request, path=path, body=full_text_asked(document, request.body))
    if path.startswith(MODELS_PREFIX) and isinstance(document, dict) and "model" in document:
        # checked here, as the other routes check it: the route it goes to reads no name
        # (a name not served, or not a text, was served by the first model, 200)
        models.named(document["model"])
        unnamed = {key: value for key, value in document.items() if key != "model"}
        return replace(request, path=path, body=json.dumps(unnamed).encode())
    return replace(request, path=path)


def full_text_asked(document: dict[str, Any], body: bytes) -> bytes:
    """The body of a generation asked through `/invocations`, its answer the prompt and
    its continuation unless it says otherwise: TGI's SageMaker route is its `POST /`,
    whose `return_full_text` is true by default for a text-generation model (`/generate`'s
    is false). Parameters that are not an object are left to the route to refuse."""
    parameters = document.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict) or parameters.get("return_full_text") is not None:
        return body
    return json.dumps({**document, "parameters": {**parameters, "return_full_text": True}}).encode()


def answered(asked: HttpRequest, routed: HttpRequest, response: HttpResponse) -> HttpResponse:
    """The answer to `asked`, routed as `routed`: a generation asked through
    `/invocations` and answered whole comes in a list, as TGI's SageMaker route (its
    `POST /`) answers it, and as SageMaker code written for it reads it
    (`predict(...)[0]["generated_text"]`)."""
    listed = asked.path == INVOCATIONS and routed.path == GENERATE
    if listed and response.status == 200 and response.stream is None:
        return replace(response, body=b"[" + response.body + b"]")
    return response


def document_aliases(paths: dict[str, dict[str, Any]], models: ServedModels) -> None:
    """SageMaker's names in an OpenAPI document's `paths`, each described as the route it
    stands for where that one is served (/openapi.json left them out, though they
    answer): `/invocations` as every route it may stand for (`invocation_operation`)."""
    stands_for = {PING: ("/ready", "get"), EMBEDDINGS: ("/v1/embeddings", "post")}
    for alias, (path, method) in stands_for.items():
        operation = paths.get(path, {}).get(method)
        if operation is not None:
            summary = f"SageMaker's name for {method.upper()} {path}: {operation['summary']}"
            operation = {**operation, "summary": summary, "operationId": f"{method}_{alias[1:]}"}
            paths[alias] = {method: operation}
    invocations = invocation_operation(paths, models)
    if invocations is not None:
        paths[INVOCATIONS] = {"post": invocations}


def invocation_routes(models: ServedModels) -> list[str]:
    """Each route `/invocations` may stand for, by the bodies it reads (`invocation_path`):
    each served model's, and OpenAI's chat and completions."""
    bodies: list[dict[str, Any]] = [{"messages": []}, {"prompt": ""}]
    for model in models.all:
        for inputs in ("text", {"source_sentence": "text"}):
            bodies.append({"inputs": inputs, "model": model.name})
        bodies.append({"inputs": "text", "model": model.name, "stream": True})
    return list(dict.fromkeys(invocation_path(body, models) for body in bodies))


def invocation_operation(
    paths: dict[str, dict[str, Any]], models: ServedModels
) -> dict[str, Any] | None:
    """`/invocations` in an OpenAPI document: its body any of the bodies of the routes it
    may stand for (a route of the Inference API's taking the body's "model" too, which is
    left out on the way), its answers any of theirs (a generation's, whole, in a list);
    None where it stands for no route served."""
    routes = [path for path in invocation_routes(models) if "post" in paths.get(path, {})]
    if not routes:
        return None
    operations = [paths[path]["post"] for path in routes]
    bodies = [  # (every media type: text/plain too)
        taking_model(operation["requestBody"]["content"])
        if path.startswith(MODELS_PREFIX)
        else operation["requestBody"]["content"]
        for path, operation in zip(routes, operations, strict=True)
    ]
    answers = [
        listed_answer(operation) if path == GENERATE else operation
        for path, operation in zip(routes, operations, strict=True)
    ]
    named = ", ".join(f"POST {path}" for path in routes)
    return {
        **operations[0],
        "summary": f"SageMaker's route: the route of the model the body names (else the "
        f"default model's), for the body it is: {named}",
        "operationId": "post_invocations",
        "requestBody": {
            "required": True,
            "content": merged_content(bodies),
        },
        "responses": merged_responses([operation["responses"] for operation in answers]),
    }


def taking_model(content: dict[str, Any]) -> dict[str, Any]:
    """A body's `content` with the "model" field `/invocations` reads in its JSON before
    the route does."""
    json_body = content.get("application/json")
    if json_body is None:
        return content
    schema = json_body["schema"]
    model = {"type": "string", "description": "The served model to use, by name"}
    named = {**schema, "properties": {**schema.get("properties", {}), "model": model}}
    return {**content, "application/json": {**json_body, "schema": named}}


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """One schema for any of `schemas` (each once)."""
    unique = list({json.dumps(schema, sort_keys=True): schema for schema in schemas}.values())
    return unique[0] if len(unique) == 1 else {"anyOf": unique}


def merged_content(contents: list[dict[str, Any]]) -> dict[str, Any]:
    """Several bodies' `content` as one: per media type, any of their schemas."""
    schemas: dict[str, list[dict[str, Any]]] = {}
    for content in contents:
        for media, spec in content.items():
            schemas.setdefault(media, []).append(spec["schema"])
    return {media: {"schema": any_of(found)} for media, found in schemas.items()}


def merged_responses(listings: list[dict[str, Any]]) -> dict[str, Any]:
    """Each status's answers, of any of several operations (`merged_content`; a status's
    description the first operation's)."""
    answers: dict[str, list[dict[str, Any]]] = {}
    for responses in listings:
        for status, answer in responses.items():
            answers.setdefault(status, []).append(answer)
    merged: dict[str, Any] = {}
    for status, given in answers.items():
        merged[status] = {"description": given[0]["description"]}
        if content := merged_content([answer.get("content", {}) for answer in given]):
            merged[status]["content"] = content
    return merged


def listed_answer(operation: dict[str, Any]) -> dict[str, Any]:
    """`operation` (/generate's) as `/invocations` answers it: whole, in a list, as TGI's
    SageMaker route (its `POST /`) answers it (`answered`)."""
    responses = dict(operation["responses"])
    answer = responses["200"]
    whole = answer["content"]["application/json"]
    listed = {**whole, "schema": {"type": "array", "items": whole["schema"]}}
    responses["200"] = {**answer, "content": {**answer["content"], "application/json": listed}}
    return {**operation, "responses": responses}


def invocation_path(document: Any, models: ServedModels) -> str:
    """The route `/invocations` stands for, given its body (None where it cannot be read
    as a JSON object: the route the model alone says, which refuses it)."""
    body = document if isinstance(document, dict) else {}
    if "inputs" not in body:
        # OpenAI's bodies go to OpenAI's routes, whatever model they name: those pick the
        # model (the first that can answer them where none is named, a chat template for
        # messages) and answer one that cannot in OpenAI's words; the default model's
        # route refused them ("an object with an "inputs" field") where the first model
        # served is not a generation model, and so did one named
        if "messages" in body:
            return "/v1/chat/completions"
        if "prompt" in body:
            return "/v1/completions"
    model = chosen_model(body.get("model"), models)
    task = model.known_task
    if task == "text-generation":  # (TGI tries its bodies in this order)
        return GENERATE_STREAM if body.get("stream") is True else GENERATE
    if task == "feature-extraction":  # (a SPLADE model's: its sparse vectors, as TEI's)
        if isinstance(body.get("inputs"), dict) and "source_sentence" in body["inputs"]:
            return "/similarity"  # (TEI's container serves it so where TASK says it)
        return "/embed_sparse" if model.facts.get("pooling") == "splade" else "/embed"
    if task == "text-classification":
        return "/rerank" if is_reranker(model, body) else "/predict"
    return MODELS_PREFIX + model.name


def chosen_model(name: Any, models: ServedModels) -> ServedModel:
    """The model a body names, else the default (the route it goes to answers a name
    that is not served with its 404)."""
    try:
        return models.get(name if isinstance(name, str) else None)
    except HTTPError:
        return models.default


def is_reranker(model: ServedModel, body: dict[str, Any]) -> bool:
    """A cross-encoder (a classifier of one label, as TEI tells a reranker), or, before
    its labels are known, a body that asks to rank."""
    loaded = model.serving.loaded
    labels = loaded.details.get("id2label") if loaded is not None else None
    if labels:
        return len(labels) == 1
    return "query" in body


def body_document(request: HttpRequest) -> Any:
    """The body as the routes read JSON, or None where it is none (the head alone is being
    looked at) or cannot be read (the route refuses it in its own words)."""
    try:
        return read_json(request) if request.body else None
    except HTTPError:
        return None

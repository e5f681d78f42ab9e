"""The OpenAI-compatible routes: `POST /v1/embeddings` and `GET /v1/models`.

Owns the OpenAI request and response shapes for feature-extraction models. It asks the
scheduler for pooled, normalized sentence embeddings with their real token counts (the
worker computes both) and only reshapes them here: base64 is the little-endian float32
bytes of the vector, encoded by numpy and `base64` in C, never float by float in Python.
Never imports torch.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import numpy as np

from rawserve.errors import BadRequest, NotFound, ServiceUnavailable
from rawserve.http import HttpRequest, HttpResponse

if TYPE_CHECKING:
    from rawserve.app import App

EMBEDDING_TASK = "feature-extraction"
ENCODING_FORMATS = ("float", "base64")
MAX_INPUTS = 2048
DEFAULT_MODEL_ID = "all-MiniLM-L6-v2"  # what the server loads without --model
# The worker answers {"embedding": float32 vector, "tokens": n} for these parameters.
EMBEDDING_API_PARAM = "embedding_api"


def served_model_id(executor: Any) -> str:
    """The name clients see: the model folder's name, or the hub id as given."""
    workers = getattr(executor, "workers", None) or []
    config = workers[0].config if workers else None
    model = (config.model or config.handler) if config else None
    if not model:
        return DEFAULT_MODEL_ID
    if model.startswith(("/", ".")):
        return PurePath(model).name or model
    return model


def parse_embeddings_request(document: Any) -> tuple[list[str], dict[str, Any], str]:
    """(texts, worker parameters, encoding format) of an OpenAI embeddings body."""
    if not isinstance(document, dict) or "input" not in document:
        raise BadRequest('the JSON body must be an object with an "input" field')
    unknown = set(document) - {"input", "model", "encoding_format", "dimensions", "user"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    raw = document["input"]
    texts = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(texts, list)
        or not 1 <= len(texts) <= MAX_INPUTS
        or not all(isinstance(t, str) for t in texts)
    ):
        raise BadRequest(
            f'"input" must be a string or a list of 1 to {MAX_INPUTS} strings '
            "(token arrays are not supported)"
        )
    encoding_format = document.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise BadRequest('"encoding_format" must be "float" or "base64"')
    params: dict[str, Any] = {EMBEDDING_API_PARAM: True}
    dimensions = document.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise BadRequest('"dimensions" must be a positive integer')
        params["dimensions"] = dimensions
    for name in ("model", "user"):
        if document.get(name) is not None and not isinstance(document[name], str):
            raise BadRequest(f'"{name}" must be a string')
    return texts, params, encoding_format


def embedding_response(
    outputs: list[dict[str, Any]], encoding_format: str, model_id: str
) -> dict[str, Any]:
    data = []
    for index, output in enumerate(outputs):
        vector = np.asarray(output["embedding"], dtype="<f4")
        embedding: Any = (
            base64.b64encode(vector.tobytes()).decode("ascii")
            if encoding_format == "base64"
            else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(int(output["tokens"]) for output in outputs)
    return {
        "object": "list",
        "data": data,
        "model": model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


class OpenAIRoutes:
    """Handlers for the /v1 routes; the app's scheduler and executor do the work."""

    def __init__(self, app: App, *, clock=time.time):
        self.app = app
        self.created = int(clock())

    async def embeddings(self, request: HttpRequest) -> HttpResponse:
        from rawserve.app import json_response, server_timing, unwrap

        app = self.app
        if not app.executor.ready:
            raise ServiceUnavailable("the model is loading", retry_after=5.0)
        if app.executor.task != EMBEDDING_TASK:
            raise NotFound(f"/v1/embeddings serves {EMBEDDING_TASK} models only")
        try:
            document = json.loads(request.body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise BadRequest("the body is not valid JSON") from None
        texts, params, encoding_format = parse_embeddings_request(document)
        deadline = app.clock() + app.request_timeout(request)
        results = await app.scheduler.run(texts, params, deadline)
        outputs = [unwrap(result) for result in results]
        answer = embedding_response(outputs, encoding_format, served_model_id(app.executor))
        return json_response(200, answer, [("Server-Timing", server_timing(results))])

    async def models(self, request: HttpRequest) -> HttpResponse:
        from rawserve.app import json_response

        model = {
            "id": served_model_id(self.app.executor),
            "object": "model",
            "created": self.created,
            "owned_by": "rawserve",
        }
        return json_response(200, {"object": "list", "data": [model]})

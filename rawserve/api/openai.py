"""The OpenAI-compatible routes: `POST /v1/embeddings` and `GET /v1/models`.

Owns the OpenAI request and response shapes for feature-extraction models. It asks the
scheduler for pooled, normalized sentence embeddings with their real token counts (the
worker computes both) and only reshapes them here: base64 is the little-endian float32
bytes of the vector, encoded by numpy and `base64` in C, never float by float in Python.
Never imports torch.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rawserve.api.bodies import answer, check_client_batch, json_response, read_json, unwrap
from rawserve.api.context import RouteContext
from rawserve.http.errors import BadRequest, NotFound
from rawserve.http.exchange import HttpRequest, HttpResponse

EMBEDDING_TASK = "feature-extraction"
ENCODING_FORMATS = ("float", "base64")
# The worker answers {"embedding": float32 vector, "tokens": n} for these parameters.
EMBEDDING_API_PARAM = "embedding_api"


def parse_embeddings_request(
    document: Any, max_inputs: int
) -> tuple[list[str], dict[str, Any], str]:
    """(texts, worker parameters, encoding format) of an OpenAI embeddings body."""
    if not isinstance(document, dict) or "input" not in document:
        raise BadRequest('the JSON body must be an object with an "input" field')
    unknown = set(document) - {"input", "model", "encoding_format", "dimensions", "user"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    raw = document["input"]
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest(
            '"input" must be a string or a non-empty list of strings '
            "(token arrays are not supported)"
        )
    check_client_batch(len(texts), max_inputs)
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


def requested_model(document: Any) -> str | None:
    """The "model" field of an OpenAI-shaped body: the served model it names (None: the
    default). 400 when it is there but not a string."""
    name = document.get("model") if isinstance(document, dict) else None
    if name is not None and not isinstance(name, str):
        raise BadRequest('"model" must be a string')
    return name


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
    """Handlers for the /v1 routes; the served model's scheduler and workers do the work."""

    def __init__(self, context: RouteContext, wall_clock: Callable[[], float] = time.time):
        self.context = context
        self.created = int(wall_clock())  # when the models were first served, for /v1/models

    async def embeddings(self, request: HttpRequest) -> HttpResponse:
        document = read_json(request)
        model = self.context.models.get(requested_model(document))
        self.context.gate.check(model)
        if model.workers.task != EMBEDDING_TASK:
            raise NotFound(f"/v1/embeddings serves {EMBEDDING_TASK} models only")
        texts, params, encoding_format = parse_embeddings_request(
            document, self.context.settings.max_client_batch_size
        )
        results = await model.queue.run(texts, params, self.context.deadline(request))
        outputs = [unwrap(result) for result in results]
        return answer(embedding_response(outputs, encoding_format, model.name), results)

    async def models_list(self, request: HttpRequest) -> HttpResponse:
        data = [
            {"id": model.name, "object": "model", "created": self.created, "owned_by": "rawserve"}
            for model in self.context.models.all
        ]
        return json_response(200, {"object": "list", "data": data})

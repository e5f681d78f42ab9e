"""What every route family shares: reading a JSON body, the deadline a request asks for,
an item's result as output or error, and JSON responses with their Server-Timing.

The one JSON body reader and the one way answers are encoded (orjson, through
`rawserve.http.encoding`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rawserve.http.encoding import dumps
from rawserve.http.errors import (
    BadRequest,
    HTTPError,
    InternalError,
    PayloadTooLarge,
    UnprocessableInput,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.scheduling.core import ItemResult
from rawserve.shared.messages import FailureKind, ItemFailure


def read_json(request: HttpRequest) -> Any:
    """The request's body as JSON; 400 when it is not valid JSON."""
    try:
        return json.loads(request.body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadRequest("the body is not valid JSON") from None


def is_json(request: HttpRequest) -> bool:
    """The body is JSON: so typed, or untyped and starting like an object (InferenceClient
    posts JSON without a Content-Type)."""
    content_type = (request.header("content-type") or "").split(";")[0].strip().lower()
    return content_type == "application/json" or (
        not content_type and request.body.lstrip()[:1] == b"{"
    )


def check_client_batch(count: int, limit: int) -> None:
    """413 for a request with more inputs than one request may carry: it never fits."""
    if count > limit:
        raise PayloadTooLarge(
            f"{count} inputs in one request: at most {limit} are allowed (--max-client-batch-size)"
        )


def request_timeout(request: HttpRequest, default: float, longest: float) -> float:
    """Seconds the request may take: its X-Request-Timeout (at most `longest`) or `default`."""
    header = request.header("x-request-timeout")
    if header is None:
        return default
    try:
        seconds = float(header)
    except ValueError:
        raise BadRequest("X-Request-Timeout must be a number of seconds") from None
    if not seconds > 0:  # also refuses NaN
        raise BadRequest("X-Request-Timeout must be positive")
    return min(seconds, longest)


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


def server_timing(results: Sequence[ItemResult]) -> str:
    queue_ms = 1000 * max(r.queue_seconds for r in results)
    model_ms = 1000 * max(r.compute_seconds for r in results)
    batch = max(r.batch_size for r in results)
    return f'queue;dur={queue_ms:.2f}, model;dur={model_ms:.2f}, batch;desc="{batch}"'


def json_response(
    status: int, document: Any, headers: list[tuple[str, str]] | None = None
) -> HttpResponse:
    return HttpResponse(status, dumps(document), headers or [])


def answer(document: Any, results: Sequence[ItemResult]) -> HttpResponse:
    """200 with `document`, timed by the results it was made of."""
    return json_response(200, document, [("Server-Timing", server_timing(results))])

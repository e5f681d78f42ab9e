"""Errors that carry their HTTP status, and the one place that renders any error: in
rawserve's shape (`error_response`, every route but OpenAI's) or OpenAI's
(`openai_error_response`, the `/v1/` routes, whose clients read only that shape, with
TGI's type beside it for TGI's clients), and
with TGI's or TEI's types in rawserve's shape (`tgi_error_response`, `tei_error_response`:
the routes those servers' clients use).

Messages are written for the client: they say what to fix and never contain a
traceback, a path or a repr of internals (those go to the log).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from rawserve.http.encoding import dumps
from rawserve.http.exchange import HttpRequest, HttpResponse

log = logging.getLogger("rawserve.errors")

NO_THREAD = "can't start new thread"  # CPython's RuntimeError where a thread cannot start

MAX_MESSAGE_CHARS = 300  # messages may quote the client's input (a path): keep them short
# OpenAI's error types by status; other 4xx are "invalid_request_error", 5xx "server_error"
OPENAI_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class HTTPError(Exception):
    status = 500
    error_type = "internal_error"
    # OpenAI's error object also names the request field at fault and a code (its
    # `error_type` unless a subclass says better)
    param: str | None = None
    code: str | None = None
    # its message is answered whole: the served models it lists are the server's words
    # (another's is cut to MAX_MESSAGE_CHARS, as it may quote the client's input)
    whole = False

    def __init__(
        self,
        message: str,
        *,
        headers: list[tuple[str, str]] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.headers = headers or []
        if param is not None:  # the field at fault, where a check after its reading knows
            self.param = param


class BadRequest(HTTPError):
    status = 400
    error_type = "bad_request"


class UnknownFields(BadRequest):
    """A body's fields that the route does not take: named (at most ten, each cut to 60
    characters), with every field it does take, answered whole (cut at 300 characters, the
    list of those it takes ended mid-way, `stream, st...`)."""

    whole = True


class EmptyInput(BadRequest):
    """A list of inputs with nothing in it: TEI types it apart (`Empty`)."""


class MalformedRequest(BadRequest):
    """A request that cannot be read at all (a body that is not JSON, two Authorization
    headers): nothing it asks was looked at, so it is no validation failure."""


def single_header(request: HttpRequest, name: str) -> str | None:
    """The request's `name` header (lower-case), or None; two of them are 400: which one
    counts would be a guess (a proxy may have added its own, or checked the other)."""
    given = [value for key, value in request.headers if key == name]
    if len(given) > 1:
        raise MalformedRequest(f"a request may carry one {name.title()} header, not several")
    return given[0] if given else None


class Unauthorized(HTTPError):
    status = 401
    error_type = "unauthorized"


class Forbidden(HTTPError):
    status = 403
    error_type = "forbidden"


class NotFound(HTTPError):
    status = 404
    error_type = "not_found"


class ModelNotFound(NotFound):
    """A request names a model that is not served (its name cut to 100 characters)."""

    param = "model"
    code = "model_not_found"  # OpenAI's code for it
    whole = True


class NoModelFits(NotFound):
    """None of the served models serves the route: each named with what it serves."""

    whole = True


class MethodNotAllowed(HTTPError):
    status = 405
    error_type = "method_not_allowed"

    def __init__(self, allowed: list[str]):
        # (a browser's GET / had no word on what to do but the Allow header)
        methods = ", ".join(allowed)
        message = f"method not allowed: this path takes {methods} (GET /info says what is served)"
        super().__init__(message, headers=[("Allow", methods)])


class RequestTimeout(HTTPError):
    status = 408
    error_type = "request_timeout"


class PayloadTooLarge(HTTPError):
    status = 413
    error_type = "payload_too_large"


class UnsupportedMediaType(HTTPError):
    status = 415
    error_type = "unsupported_media_type"


class UnprocessableInput(HTTPError):
    status = 422
    error_type = "unprocessable_input"


class ValidationFailed(HTTPError):
    """TGI's refusal of what a request asks (a parameter out of range, a blank or too long
    prompt): the only type TGI's client and InferenceClient raise as ValidationError."""

    status = 422
    error_type = "validation"


class HeadersTooLarge(HTTPError):
    status = 431
    error_type = "headers_too_large"


class URITooLong(HTTPError):
    """A request line past the head's limit: 414, as nginx answers it (RFC 9110 15.5.15)."""

    status = 414
    error_type = "uri_too_long"


class InternalError(HTTPError):
    status = 500
    error_type = "internal_error"


class ServiceUnavailable(HTTPError):
    status = 503
    error_type = "unavailable"

    def __init__(
        self, message: str, *, retry_after: float = 1.0, in_ms: bool = False, busy: bool = False
    ):
        """`in_ms`: say the wait in milliseconds too (`Retry-After-Ms`, which the openai
        SDKs read before `Retry-After`), where a spread wait must not be rounded back
        to the same second for every client; `busy`: refused for the load (a full queue),
        not for the server's state (loading, restarting, stopping)."""
        millis = round(retry_after * 1000)
        # rounded up: a client that reads only `Retry-After` (curl, urllib3, the Hub's
        # client) comes back no sooner than told in milliseconds (1,256 ms was "1")
        seconds = max(1, math.ceil(millis / 1000))
        headers = [("Retry-After", str(seconds))]
        if in_ms:
            headers.append(("Retry-After-Ms", str(millis)))
        super().__init__(message, headers=headers)
        self.retry_after = seconds
        self.busy = busy


class GatewayTimeout(HTTPError):
    """The request's deadline passed. The deadline spans a client's retries, as gRPC's
    does: a retry only runs the model again to the same 504, and the openai SDKs retry
    every 5xx twice unless told not to (`X-Should-Retry: false`), which kept a caller
    of a 50 ms deadline 1.6 s for three 504s."""

    status = 504
    error_type = "timeout"

    def __init__(self, message: str):
        super().__init__(message, headers=[("X-Should-Retry", "false")])


# How an error becomes a response, in one dialect's shape: the error, the request id
ErrorRenderer = Callable[[BaseException, str], HttpResponse]


def error_response(exc: BaseException, request_id: str | None = None) -> HttpResponse:
    """Turn any exception into a JSON error response; unknown ones become a bare 500.

    The protocol calls it for what the app raises and for its own connection-level
    errors (malformed, too large, too slow) where the route has no shape of its own
    (OpenAI's, rendered by the app's `refusal_renderer`); a stream's error after its head
    went out is an event in its dialect's shape (`error_document`, OpenAI's document).
    """
    error = as_http_error(exc, request_id)
    return HttpResponse(error.status, dumps(error_document(error)), list(error.headers))


def as_http_error(exc: BaseException, request_id: str | None = None) -> HTTPError:
    """The error itself if it carries a status; else a bare 500, its traceback logged
    with the id of the request it answers (the one its access line and client see). The
    server's own memory running out is no bug of the request's: a 503 that a retry, later
    or on another replica, may get past (a traceback per request would only add to the
    pressure)."""
    if isinstance(exc, HTTPError):
        return exc
    # (a thread's stack is memory too: the routes that tokenize or encode in a thread)
    if isinstance(exc, MemoryError) or str(exc) == NO_THREAD:
        log.warning("out of memory handling request %s: answered 503", request_id or "-")
        return ServiceUnavailable("the server is out of memory: try again later")
    log.error(
        "unexpected error while handling request %s",
        request_id or "-",
        exc_info=exc,
        extra={"request_id": request_id},
    )
    return InternalError("internal server error")


def error_document(error: HTTPError) -> dict[str, str]:
    """The JSON body of an error: `{"error": message, "error_type": kind}`."""
    return {"error": _short(error), "error_type": error.error_type}


def tgi_error_response(exc: BaseException, request_id: str | None = None) -> HttpResponse:
    """`error_response` with TGI's types, for the routes TGI's clients call (`tgi_error`)."""
    error = tgi_error(as_http_error(exc, request_id))
    return HttpResponse(error.status, dumps(error_document(error)), list(error.headers))


class GenerationFailed(HTTPError):
    """TGI's type for a model that failed while it answered (a worker lost mid-stream, an
    error in the model), which TGI's client and InferenceClient raise as
    `GenerationError`; the status stays rawserve's 500 (TGI answers 424)."""

    status = 500
    error_type = "generation"


class Overloaded(HTTPError):
    """TGI's type for a full queue, which its client and InferenceClient raise as
    `OverloadedError` (TGI answers it 429; rawserve keeps its 503 and Retry-After)."""

    status = 503
    error_type = "overloaded"


def tgi_error(error: HTTPError) -> HTTPError:
    """The error as TGI types it: TGI refuses whatever its validation finds wrong with 422
    "validation", so rawserve's 400 and 422 become that, and a busy queue's 503 is
    "overloaded". A request that cannot be read keeps its 400 (TGI's JSON reader answers
    so), a failure of the model or the server's own is "generation"; the rest keep theirs
    (TGI has no equivalent of rawserve's 504 or 413, nor of its 503 for a model loading)."""
    client_error = isinstance(error, (BadRequest, UnprocessableInput))
    if client_error and not isinstance(error, MalformedRequest):
        failed = ValidationFailed(error.message, headers=error.headers)
        failed.whole = error.whole  # (answered whole where it was)
        return failed
    if isinstance(error, ServiceUnavailable) and error.busy:
        return Overloaded(error.message, headers=error.headers)
    if isinstance(error, InternalError):
        return GenerationFailed(error.message, headers=error.headers)
    return error


def tei_error_response(exc: BaseException, request_id: str | None = None) -> HttpResponse:
    """`error_response` with TEI's types (`tei_error_type`), for TEI's routes."""
    error = as_http_error(exc, request_id)
    document = {"error": _short(error), "error_type": tei_error_type(error)}
    return HttpResponse(error.status, dumps(document), list(error.headers))


def tei_error_type(error: HTTPError) -> str:
    """The error as TEI types it, where TEI has a type for it (its `ErrorType`: `Empty`,
    `Validation`, `Tokenizer`, `Overloaded`, `Unhealthy`, `Backend`): what TEI's
    validation refuses (rawserve's 400, 413 and 422) is `Validation`, a full queue
    `Overloaded`, a model loading or restarting `Unhealthy`, a model's failure `Backend`.
    The statuses stay rawserve's (TEI answers a full queue 429 where rawserve answers 503
    with Retry-After), and the rest keep rawserve's types (401, 404, 504: TEI has none)."""
    if isinstance(error, EmptyInput):
        return "Empty"
    if isinstance(error, (BadRequest, PayloadTooLarge, UnprocessableInput)):
        return error.error_type if isinstance(error, MalformedRequest) else "Validation"
    if isinstance(error, ServiceUnavailable):
        return "Overloaded" if error.busy else "Unhealthy"
    if isinstance(error, InternalError):
        return "Backend"
    return error.error_type


def openai_error_response(exc: BaseException, request_id: str | None = None) -> HttpResponse:
    """`error_response` in OpenAI's shape, for the OpenAI routes (`/v1/...`): its clients
    (the openai SDK, langchain, litellm) show `body["error"]["message"]` and nothing else."""
    error = as_http_error(exc, request_id)
    return HttpResponse(error.status, dumps(openai_error_document(error)), list(error.headers))


def openai_error_document(error: HTTPError) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`, the same
    status codes; `type` is one of OpenAI's documented kinds, `code` says more. Beside it,
    TGI's `error_type` (`tgi_error`): TGI's client calls these routes too and tells its
    errors apart by it alone (`ValidationError`, `OverloadedError`), as InferenceClient
    does a stream's error event, where OpenAI's clients read only `error`."""
    if error.status >= 500:
        kind = "server_error"
    else:
        kind = OPENAI_ERROR_TYPES.get(error.status, "invalid_request_error")
    return {
        "error": {
            "message": _short(error),
            "type": kind,
            "param": error.param,
            "code": error.code or error.error_type,
        },
        "error_type": tgi_error(error).error_type,
    }


def _short(error: HTTPError) -> str:
    message = error.message
    if len(message) > MAX_MESSAGE_CHARS and not error.whole:
        return message[: MAX_MESSAGE_CHARS - 3] + "..."
    return message

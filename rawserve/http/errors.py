"""Errors that carry their HTTP status, and the one function that renders any error.

Messages are written for the client: they say what to fix and never contain a
traceback, a path or a repr of internals (those go to the log).
"""

from __future__ import annotations

import logging

from rawserve.http.encoding import dumps
from rawserve.http.exchange import HttpResponse

log = logging.getLogger("rawserve.errors")

MAX_MESSAGE_CHARS = 300  # messages may quote the client's input (a path): keep them short


class HTTPError(Exception):
    status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, headers: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or []


class BadRequest(HTTPError):
    status = 400
    error_type = "bad_request"


class Unauthorized(HTTPError):
    status = 401
    error_type = "unauthorized"


class Forbidden(HTTPError):
    status = 403
    error_type = "forbidden"


class NotFound(HTTPError):
    status = 404
    error_type = "not_found"


class MethodNotAllowed(HTTPError):
    status = 405
    error_type = "method_not_allowed"

    def __init__(self, allowed: list[str]):
        super().__init__("method not allowed", headers=[("Allow", ", ".join(allowed))])


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


class HeadersTooLarge(HTTPError):
    status = 431
    error_type = "headers_too_large"


class InternalError(HTTPError):
    status = 500
    error_type = "internal_error"


class ServiceUnavailable(HTTPError):
    status = 503
    error_type = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0):
        seconds = max(1, round(retry_after))
        super().__init__(message, headers=[("Retry-After", str(seconds))])
        self.retry_after = seconds


class GatewayTimeout(HTTPError):
    status = 504
    error_type = "timeout"


def error_response(exc: BaseException) -> HttpResponse:
    """Turn any exception into a JSON error response; unknown ones become a bare 500.

    The one place where errors become responses: the protocol calls it for what the app
    raises and for its own connection-level errors (malformed, too large, too slow), and
    a stream calls it for an error after its head went out.
    """
    error = as_http_error(exc)
    return HttpResponse(error.status, dumps(error_document(error)), list(error.headers))


def as_http_error(exc: BaseException) -> HTTPError:
    """The error itself if it carries a status; else (logged) a bare 500."""
    if isinstance(exc, HTTPError):
        return exc
    log.error("unexpected error while handling a request", exc_info=exc)
    return InternalError("internal server error")


def error_document(error: HTTPError) -> dict[str, str]:
    """The JSON body of an error: `{"error": message, "error_type": kind}`."""
    message = error.message
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return {"error": message, "error_type": error.error_type}

"""The request and response values that pass between the protocol and the app, and the
bearer-token check the app applies to them."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rawserve.errors import Unauthorized


@dataclass
class HttpRequest:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]  # names lower-cased
    body: bytes
    request_id: str
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass
class HttpResponse:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "application/json"
    # A body produced piece by piece (sent chunked); `body` is ignored when set.
    stream: AsyncIterator[bytes] | None = None


def require_bearer(request: HttpRequest, api_key: str) -> None:
    """Raise 401 unless the request carries `Authorization: Bearer <api_key>`.

    The comparison takes the same time whatever the token, so it leaks nothing.
    """
    scheme, _, token = (request.header("authorization") or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "this endpoint needs an Authorization: Bearer <api key> header",
            headers=[("WWW-Authenticate", 'Bearer realm="rawserve"')],
        )
    if not hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode()):
        raise Unauthorized(
            "the API key is not valid",
            headers=[("WWW-Authenticate", 'Bearer realm="rawserve", error="invalid_token"')],
        )

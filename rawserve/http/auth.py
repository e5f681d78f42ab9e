"""The bearer-token check of `--api-key`."""

from __future__ import annotations

import hmac

from rawserve.http.errors import Unauthorized, single_header
from rawserve.http.exchange import HttpRequest


def require_bearer(request: HttpRequest, api_key: str) -> None:
    """Raise 401 unless the request carries `Authorization: Bearer <api_key>`.

    The comparison takes the same time whatever the token, so it leaks nothing. Two
    Authorization headers are 400 (`single_header`).
    """
    scheme, _, token = (single_header(request, "authorization") or "").strip().partition(" ")
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

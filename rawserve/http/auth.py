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
    # (RFC 9110 11.4: the scheme, spaces, the token; only spaces and tabs are the
    # header's white space: str.strip's would take a NO-BREAK SPACE off a token)
    value = (single_header(request, "authorization") or "").strip(" \t")
    scheme, _, token = value.partition(" ")
    token = token.lstrip(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized(
            "this endpoint needs an Authorization: Bearer <api key> header",
            headers=[("WWW-Authenticate", 'Bearer realm="rawserve"')],
        )
    if not hmac.compare_digest(token.encode("latin-1"), api_key.encode()):
        raise Unauthorized(
            "the API key is not valid",
            headers=[("WWW-Authenticate", 'Bearer realm="rawserve", error="invalid_token"')],
        )

"""CORS: which browser origins may call the API (`--cors-allow-origin`, repeatable, `*` for
any), the answer to a browser's preflight `OPTIONS`, and the headers that let a page read
an answer (errors included).

Server process; plain functions of requests and responses, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rawserve.http.errors import Forbidden, MethodNotAllowed
from rawserve.http.exchange import HttpRequest, HttpResponse

ANY_ORIGIN = "*"
PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight's answer
# response headers a page's script may read besides the CORS-safelisted ones
EXPOSED_HEADERS = "X-Request-Id, Server-Timing, Retry-After"


class CorsPolicy:
    def __init__(self, origins: Sequence[str]):
        self.any_origin = ANY_ORIGIN in origins
        self.origins = frozenset(origins) - {ANY_ORIGIN}

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    @staticmethod
    def is_preflight(request: HttpRequest) -> bool:
        """A browser asking whether it may send a request (not an OPTIONS of its own)."""
        return (
            request.method == "OPTIONS"
            and request.header("origin") is not None
            and request.header("access-control-request-method") is not None
        )

    def preflight(self, request: HttpRequest, methods: Collection[str]) -> HttpResponse:
        """204 allowing the method the browser asks for; 403 for an origin not allowed,
        405 for a method the route does not serve."""
        origin = request.header("origin") or ""
        if not self.allows(origin):
            raise Forbidden(f"the origin {origin} may not call this server (--cors-allow-origin)")
        if request.header("access-control-request-method") not in methods:
            raise MethodNotAllowed(sorted(methods))
        headers = [
            ("Access-Control-Allow-Origin", ANY_ORIGIN if self.any_origin else origin),
            ("Access-Control-Allow-Methods", ", ".join(sorted(methods))),
            ("Access-Control-Max-Age", str(PREFLIGHT_MAX_AGE)),
            ("Vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
        ]
        asked = request.header("access-control-request-headers")
        if asked:  # any header: the API key and X-Request-Timeout are the likely ones
            headers.append(("Access-Control-Allow-Headers", asked))
        return HttpResponse(204, b"", headers, content_type="")

    def add_headers(self, request: HttpRequest, response: HttpResponse) -> None:
        """Let the page of an allowed origin read `response`."""
        origin = request.header("origin")
        if origin is None or not self.allows(origin):
            return
        if self.any_origin:
            response.headers.append(("Access-Control-Allow-Origin", ANY_ORIGIN))
        else:
            response.headers += [("Access-Control-Allow-Origin", origin), ("Vary", "Origin")]
        response.headers.append(("Access-Control-Expose-Headers", EXPOSED_HEADERS))

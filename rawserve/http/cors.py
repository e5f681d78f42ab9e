"""CORS: which browser origins may call the API (`--cors-allow-origin`, repeatable, `*` for
any), the answer to a browser's preflight `OPTIONS`, and the headers that let a page read
an answer (errors included). The app adds those headers to what it answers; the
protocol's one writer adds them to every other answer to a parsed head (its own 413,
414, 431, 408 and 503 refusals), never twice.

Server process; plain functions of requests and responses, no I/O.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Collection, Sequence

from rawserve.http.errors import Forbidden, MethodNotAllowed
from rawserve.http.exchange import HttpRequest, HttpResponse

ANY_ORIGIN = "*"
OPAQUE_ORIGIN = "null"  # what a file:// page or a sandboxed frame sends
# where a browser leaves the port out of an Origin: the scheme's own
DEFAULT_PORTS = {"http": 80, "https": 443}
# an origin as allowed: a scheme (an extension's or an app's too), "://", and a host with
# its port, nothing after
_ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#@%\s]+")
_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight's answer
# response headers a page's script may read besides the CORS-safelisted ones: the request's id
# and timing, when to come back or not (503, 429, 504), what a 401 asks for, what a 405 allows
EXPOSED_HEADERS = (
    "X-Request-Id, Server-Timing, Retry-After, Retry-After-Ms, X-Should-Retry, "
    "WWW-Authenticate, Allow"
)
ALLOW_ORIGIN = "Access-Control-Allow-Origin"
ALLOW_ORIGIN_LOWER = ALLOW_ORIGIN.lower()
VARY_ORIGIN = ("Vary", "Origin")
# What a browser asks for in Access-Control-Request-Headers: header names, comma-separated
_NAME = r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"  # RFC 9110's token
_HEADER_NAMES = re.compile(rf"{_NAME}(?:[ \t]*,[ \t]*{_NAME})*")


def browser_origin(text: str) -> str:
    """An allowed origin (--cors-allow-origin) as a browser sends it in `Origin`, which is
    compared as it is: for http and https in lower case, the host in ASCII (IDNA) and an
    address in its usual form, with no port where it is the scheme's own; another
    scheme's (an extension's, an app's: `chrome-extension://ID`, `capacitor://localhost`)
    as given. ValueError for what no browser sends: it would match nothing, every call
    from the page refused without a word why; and for `null`, which any page can send (a
    sandboxed frame of its own, a data: URL): allowed, it let every site read the answers
    while the operator meant file:// pages alone."""
    if text == ANY_ORIGIN:
        return text
    if text == OPAQUE_ORIGIN:
        raise ValueError(
            "not null: any page can send Origin: null (a sandboxed frame, a data: URL), so "
            "allowing it allows every site; allow * if every page may read the answers"
        )
    if not _ORIGIN.fullmatch(text):
        raise ValueError("a scheme and a host, such as https://app.example (no path)")
    scheme, _, authority = text.partition("://")
    scheme = scheme.lower()
    if scheme not in DEFAULT_PORTS:
        return f"{scheme}://{authority}"
    if "*" in authority:
        raise ValueError("no wildcards: list each origin, or allow any with *")
    try:
        parts = urllib.parse.urlsplit(f"{scheme}://{authority}")
        port, host = parts.port, parts.hostname or ""
        host = _canonical_host(host)
    except (ValueError, UnicodeError):
        raise ValueError("a scheme and a host, such as https://app.example (no path)") from None
    shown_port = "" if port is None or port == DEFAULT_PORTS[scheme] else f":{port}"
    return f"{scheme}://{host}{shown_port}"


def _canonical_host(host: str) -> str:
    """`host` as a browser writes it: an IPv6 address compressed in brackets, an IPv4 one
    in four decimal parts (`127.1` is 127.0.0.1), a name in lower-case ASCII."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return f"[{address.compressed}]" if address.version == 6 else str(address)
    if re.fullmatch(r"[0-9a-fA-FxX.]+", host):
        try:  # the shorthand forms an address may take (`127.1`, `0x7f.1`)
            return socket.inet_ntoa(socket.inet_aton(host))
        except OSError:
            pass
    name = host.encode("idna").decode("ascii").lower()
    if not _HOST_NAME.fullmatch(name):
        raise ValueError(f"{host!r} is not a host name")
    return name


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
            (ALLOW_ORIGIN, ANY_ORIGIN if self.any_origin else origin),
            ("Access-Control-Allow-Methods", ", ".join(sorted(methods))),
            ("Access-Control-Max-Age", str(PREFLIGHT_MAX_AGE)),
            ("Vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
        ]
        asked = request.header("access-control-request-headers")
        # any header: the API key and X-Request-Timeout are the likely ones. Only names come
        # back: other bytes cannot be written in a head, or are no header's
        if asked and _HEADER_NAMES.fullmatch(asked):
            headers.append(("Access-Control-Allow-Headers", asked))
        return HttpResponse(204, b"", headers, content_type="")

    def add_headers(self, request: HttpRequest, response: HttpResponse) -> None:
        """Let the page of an allowed origin read `response` (once: an answer that already
        carries them, a preflight's, is left as it is)."""
        response.headers += self.headers_for(request.header("origin"), response.headers)

    def headers_for(
        self, origin: str | None, present: Sequence[tuple[str, str]] = ()
    ) -> list[tuple[str, str]]:
        """The headers that let the page of `origin` read an answer: none for no origin, an
        origin not allowed, or an answer whose headers (`present`) already carry them.
        With a list of origins every answer says `Vary: Origin`, whoever asked: a cache
        between browsers and the server must not hand one origin's answer to another."""
        if any(name.lower() == ALLOW_ORIGIN_LOWER for name, _ in present):
            return []
        vary = [] if self.any_origin or _varies_by_origin(present) else [VARY_ORIGIN]
        if origin is None or not self.allows(origin):
            return vary
        allow = ANY_ORIGIN if self.any_origin else origin
        return [(ALLOW_ORIGIN, allow), *vary, ("Access-Control-Expose-Headers", EXPOSED_HEADERS)]


def _varies_by_origin(headers: Sequence[tuple[str, str]]) -> bool:
    return any(
        name.lower() == "vary" and "origin" in {v.strip().lower() for v in value.split(",")}
        for name, value in headers
    )

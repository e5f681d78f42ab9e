"""What a connection refuses on its own, before the app sees a request, as typed errors.

A head that h11 lets through but a hardened origin server must not (an HTTP version we do
not speak, an over-long head that came whole, CONNECT, two framings, a body announced past
the limit), what h11 could not parse, and the refusals of the connection cap. The protocol
answers each through the one writer; the messages are written for the client. No I/O.
"""

from __future__ import annotations

import logging
import re

import h11

from rawserve.http.chunked import CHUNKS_AS_SENT, MIN_CHUNK_BYTES
from rawserve.http.cycle import head_size, header, request_line_size
from rawserve.http.errors import (
    BadRequest,
    GatewayTimeout,
    HeadersTooLarge,
    HTTPError,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    URITooLong,
)
from rawserve.http.head_lines import MAX_HEADER_LINES

log = logging.getLogger("rawserve.protocol")

SUPPORTED_VERSIONS = (b"1.0", b"1.1")
# A Host value: uri-host [":" port] (RFC 3986): an IP literal in brackets, or a name of
# unreserved characters, %-escapes and sub-delims (no space, "/", "@" or "?").
_HOST = re.compile(r"(\[[-0-9A-Za-z._~!$&'()*+,;=:]+\]|[-0-9A-Za-z._~%!$&'()*+,;=]*)(:[0-9]*)?")
# The absolute form of a target: a scheme (RFC 3986 section 3.1), an authority, and a path
# or a query (no fragment: RFC 9112 section 3.2.2)
_ABSOLUTE = re.compile(rb"[A-Za-z][-A-Za-z0-9+.]*://([^/?#]+)([/?][^#]*)?")


def check_head(
    event: h11.Request, fields: list[tuple[bytes, bytes]], max_head_bytes: int, max_body_bytes: int
) -> HTTPError | None:
    """Refuse what h11 lets through but a hardened origin server must not."""
    if event.http_version not in SUPPORTED_VERSIONS:
        return BadRequest("only HTTP/1.0 and HTTP/1.1 are supported")
    if request_line_size(event) > max_head_bytes:
        return request_line_too_long()
    if head_size(event, fields) > max_head_bytes:
        # h11 bounds only a head still incomplete; one that came whole is checked here.
        return HeadersTooLarge("request headers too large")
    if event.method == b"CONNECT":
        return BadRequest("CONNECT is not supported")  # a 2xx would switch protocols
    if b"#" in event.target:  # (in a path it was routed as the path's: `/health#x`, 404)
        return BadRequest("the request target has a fragment (#...), which is the client's own")
    if not _is_served_target(event.method, event.target):
        return BadRequest("the request target is not a path or an absolute URI")
    host = header(fields, b"host")  # h11 has refused a second one, and none on HTTP/1.1
    if host is not None and _HOST.fullmatch(host) is None:
        return BadRequest("the Host header is not a host name and port")  # RFC 9112 3.2
    length = header(fields, b"content-length")
    chunked = header(fields, b"transfer-encoding") is not None
    # Two framings (or chunked on HTTP/1.0) is how requests get smuggled.
    if chunked and length is not None:
        return BadRequest("conflicting Content-Length and Transfer-Encoding")
    if chunked and event.http_version == b"1.0":
        return BadRequest("Transfer-Encoding on HTTP/1.0, which has no chunked bodies")
    # h11 has checked the length is digits only (at most 20) and the same in every copy.
    if length is not None and int(length) > max_body_bytes:
        return body_too_large(max_body_bytes)
    return None


def _is_served_target(method: bytes, target: bytes) -> bool:
    """A target in a form a server answers (RFC 9112 section 3.2): a path, an absolute
    URI (what proxies send), or `*` for OPTIONS; the authority form is CONNECT's."""
    if target.startswith(b"/"):
        return True
    if (absolute := _ABSOLUTE.fullmatch(target)) is not None:  # its host as a Host's
        return _HOST.fullmatch(absolute[1].decode("ascii", "replace")) is not None
    return target == b"*" and method == b"OPTIONS"


# h11's words for a header line it could not read, which quote the line whole; its name
# kept where it has one
HEADER_LINE = re.compile(
    r"illegal header line: (?:bytearray\()?b['\"]([-!#$%&'*+.^_`|~0-9A-Za-z]{1,64}):"
)


NO_HOST = "Missing mandatory Host: header"  # h11's words


def without_header_values(message: str) -> str:
    """h11's `message` without a header's value: it quotes a malformed line whole, an
    Authorization's API key with it (a key ending in a stray CR or NUL, from a file with
    Windows line ends, was written to the debug log)."""
    if message.startswith("Illegal header value"):
        return "Illegal header value (not shown)"
    if message.startswith("illegal header line"):
        named = HEADER_LINE.match(message)
        field = f" (field {named[1]!r}" if named else " (a line with no field name"
        return f"illegal header line{field}; its value not shown)"
    return message


def protocol_error(
    exc: h11.RemoteProtocolError, in_body: bool = False, unparsed: bytes = b""
) -> HTTPError:
    """What h11 could not parse, as a typed error (details go to the debug log only).
    Past the head, what h11 finds too long is a chunk-size line or a trailer: the body's;
    before it, the request line when `unparsed` (what h11 holds) has not ended one yet."""
    log.debug("malformed request: %s", without_header_values(str(exc)))
    if exc.error_status_hint == 431 and in_body:
        return PayloadTooLarge("a chunk-size line or trailer field is too long")
    if exc.error_status_hint == 431 and b"\n" not in unparsed.lstrip(b"\r\n"):
        return request_line_too_long()
    if exc.error_status_hint == 431:
        return HeadersTooLarge("request headers too large")
    if str(exc) == NO_HOST:  # (a proxy that dropped an empty one: its operator is told)
        return BadRequest("malformed HTTP request: an HTTP/1.1 request must send a Host header")
    return BadRequest("malformed HTTP request")


def too_many_header_lines() -> HeadersTooLarge:
    return HeadersTooLarge(f"the request has more than {MAX_HEADER_LINES} header fields")


def too_many_trailer_fields() -> HeadersTooLarge:
    return HeadersTooLarge(f"the chunked body has more than {MAX_HEADER_LINES} trailer fields")


def request_line_too_long() -> URITooLong:
    return URITooLong("the request line is too long")


def bare_line_feed() -> BadRequest:
    return BadRequest("malformed HTTP request: a chunk-size line must end in CRLF")


def body_too_large(max_body_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the body is over the limit of {max_body_bytes} bytes (the server's --max-body-bytes)"
    )


def too_many_chunks(max_body_bytes: int, chunks: int) -> PayloadTooLarge:
    """A chunked body over the limit by its count of tiny chunks, not its bytes."""
    return PayloadTooLarge(
        f"the body came in too many small chunks ({chunks}): past the first "
        f"{CHUNKS_AS_SENT}, each counts as at least {MIN_CHUNK_BYTES} bytes toward the "
        f"limit of {max_body_bytes} bytes; send it in larger chunks, or with a Content-Length"
    )


def not_plain_http() -> BadRequest:
    """A first byte that cannot start a method (a TLS ClientHello, binary garbage)."""
    return BadRequest("this port speaks plain HTTP/1.1")


def too_many_connections() -> ServiceUnavailable:
    return ServiceUnavailable("too many open connections", retry_after=1)


def stopped_before_the_body() -> ServiceUnavailable:
    return ServiceUnavailable("server shutting down: the request's body did not come in time")


def deadline_passed_in_body() -> GatewayTimeout:
    return GatewayTimeout(
        "the request's deadline passed before its body was all received; X-Request-Timeout "
        "asks for a longer deadline, in seconds"
    )


def too_slow(part: str) -> RequestTimeout:
    return RequestTimeout(f"the request {part} was not received in time")

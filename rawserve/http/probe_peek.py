"""Whether a new connection past the connection cap has already sent a probe's whole
head.

Past --max-connections, an HTTP process keeps 32 seats for probes, and a connection
past those is refused before anything is read: reading costs what the cap is there to
save. But under a flood of new connections (clients refused by the cap come back on new
ones) those seats were always taken by flood connections whose requests were not read
yet, and a liveness probe, which opens a connection of its own each time (kubelet's
does), was refused "too many open connections" with them: an orchestrator would restart
a server for being busy. A look at the bytes already waiting (`MSG_PEEK`: nothing is
taken from the socket) finds a probe's whole head, which may take a seat past the
reserve, answered as soon as it is read.
"""

from __future__ import annotations

import enum
import socket
from typing import Any

from rawserve.http.cycle import is_probe_target

# a probe's whole head is short (kubelet's is ~110 bytes, its own headers added); a
# longer one is read in a reserve seat, as any other
PEEK_BYTES = 2048
PROBE_METHODS = (b"GET", b"HEAD")
BODY_FIELDS = (b"content-length", b"transfer-encoding")


class Waiting(enum.Enum):
    PROBE = "a probe's whole head, announcing no body: answered as soon as it is read"
    OTHER = "the start of anything else"
    UNKNOWN = "nothing yet, a start that may still be a probe's, or no socket to look at"


def what_waits(transport: Any) -> Waiting:
    """What the bytes already waiting on `transport`'s socket begin with."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return Waiting.UNKNOWN
    try:
        # the loop's own socket object may not read (uvloop's does not): a second object
        # on the same descriptor does, and lets it go without closing it
        look = socket.socket(fileno=sock.fileno())
    except OSError:
        return Waiting.UNKNOWN
    try:
        waiting = look.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing yet (BlockingIOError), or reset
        return Waiting.UNKNOWN
    finally:
        look.detach()
    return sort_request_start(waiting)


def sort_request_start(data: bytes) -> Waiting:
    """Whether `data`, a request's first bytes, is a probe's whole head announcing no
    body (its target in any form the routes take: `/health`, `/ready?x`,
    `http://host/health`, `/%68ealth`), surely something else, or too short to tell."""
    data = data.lstrip(b"\r\n")  # empty lines before a request are skipped (RFC 9112 2.2)
    if not data:  # nothing, or the client closed without a word
        return Waiting.UNKNOWN
    line, found, rest = data.partition(b"\n")
    if not found:
        if len(data) >= PEEK_BYTES:
            return Waiting.UNKNOWN  # more than a look holds: read in a reserve seat
        method, spaced, _ = data.partition(b" ")
        if spaced:
            return Waiting.UNKNOWN if method in PROBE_METHODS else Waiting.OTHER
        starts = any(known.startswith(method) for known in PROBE_METHODS)
        return Waiting.UNKNOWN if starts else Waiting.OTHER
    parts = line.rstrip(b"\r").split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/") or not is_probe_target(*parts[:2]):
        return Waiting.OTHER
    # only a whole head that announces no body is answered as soon as it is read: one
    # still coming (or a body) could hold its seat for --head-timeout or --body-timeout
    fields = b"\n" + rest  # each field after a line feed; the head ends at an empty line
    ends = [at for at in (fields.find(b"\n\r\n"), fields.find(b"\n\n")) if at >= 0]
    if not ends:  # still coming, or more than a look holds: read in a reserve seat
        return Waiting.UNKNOWN
    for field in fields[: min(ends)].split(b"\n"):
        if field.partition(b":")[0].strip().lower() in BODY_FIELDS:
            return Waiting.UNKNOWN  # a probe with a body: a probe seat's, if one is free
    return Waiting.PROBE

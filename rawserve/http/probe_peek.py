"""What a new connection past the connection cap has already sent: a probe's request,
something else, or nothing to tell by yet.

Past --max-connections, an HTTP process keeps 32 seats for probes, and a connection
past those is refused before anything is read: reading costs what the cap is there to
save. But under a flood of new connections (clients refused by the cap come back on new
ones) those seats were always taken by flood connections whose requests were not read
yet, and a liveness probe, which opens a connection of its own each time (kubelet's
does), was refused "too many open connections" with them: an orchestrator would restart
a server for being busy. A look at the bytes already waiting (`MSG_PEEK`: nothing is
taken from the socket) sorts the connections past the cap for one system call: a probe
is seated, past the reserve if need be; anything else is refused at once, leaving the
reserve to connections that have not said what they are yet (a probe among them).
"""

from __future__ import annotations

import enum
import socket
from typing import Any

from rawserve.http.cycle import is_probe_target

# a probe's request line is short (`GET /ready/<model> HTTP/1.1`); a longer first line
# is not a probe's
PEEK_BYTES = 512
PROBE_METHODS = (b"GET", b"HEAD")


class Waiting(enum.Enum):
    PROBE = "a probe's whole request line"
    OTHER = "the start of anything else"
    UNKNOWN = "nothing yet, a line that may still be a probe's, or no socket to look at"


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
    """Whether `data`, a request's first bytes, is a probe's request line (in any form
    of its target the routes take: `/health`, `/ready?x`, `http://host/health`,
    `/%68ealth`), surely something else, or too short to tell."""
    if not data:  # nothing, or the client closed without a word
        return Waiting.UNKNOWN
    line, found, _ = data.partition(b"\n")
    if not found:
        if len(data) >= PEEK_BYTES:
            return Waiting.OTHER
        method, spaced, _ = data.partition(b" ")
        if spaced:
            return Waiting.UNKNOWN if method in PROBE_METHODS else Waiting.OTHER
        starts = any(known.startswith(method) for known in PROBE_METHODS)
        return Waiting.UNKNOWN if starts else Waiting.OTHER
    parts = line.rstrip(b"\r").split(b" ")
    if len(parts) == 3 and parts[2].startswith(b"HTTP/") and is_probe_target(*parts[:2]):
        return Waiting.PROBE
    return Waiting.OTHER

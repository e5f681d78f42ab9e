"""Whether a new connection's first request, already waiting in the kernel, is a probe.

Past --max-connections and the probes' reserve, a connection is refused before anything
is read: reading costs what the cap is there to save. But under a flood of new
connections (clients refused by the cap come back on new ones) the reserve is always
taken by connections whose requests are not read yet, and a liveness probe, which opens
a connection of its own each time (kubelet's does), was refused "too many open
connections" with them: an orchestrator would restart a server because it was busy.
A look at the bytes waiting (`MSG_PEEK`: nothing is taken from the socket) tells a probe
from the rest for one system call, and only on that refusal's path.
"""

from __future__ import annotations

import socket
from typing import Any

from rawserve.http.cycle import is_probe_target

# a probe's request line is short (`GET /ready/<model> HTTP/1.1`); a longer first line
# is not a probe's
PEEK_BYTES = 512


def probe_waiting(transport: Any) -> bool:
    """Whether the first bytes waiting on `transport`'s socket are a probe's whole
    request line (False where nothing waits yet, or there is no socket to look at)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        # the loop's own socket object may not read (uvloop's does not): a second object
        # on the same descriptor does, and lets it go without closing it
        look = socket.socket(fileno=sock.fileno())
    except OSError:
        return False
    try:
        waiting = look.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing yet (BlockingIOError), or reset
        return False
    finally:
        look.detach()
    return is_probe_line(waiting)


def is_probe_line(data: bytes) -> bool:
    """Whether `data` begins with the request line of a probe, in any form of its target
    the routes take (`/health`, `/ready?x`, `http://host/health`, `/%68ealth`)."""
    line, found, _ = data.partition(b"\n")
    if not found:
        return False
    parts = line.rstrip(b"\r").split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return False
    return is_probe_target(parts[0], parts[1])

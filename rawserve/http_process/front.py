"""What any process serving HTTP needs, with one process or several: the listening server,
and waiting for the requests in progress while draining."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable

from rawserve.config import ServerConfig
from rawserve.http.limits import ServerState

BACKLOG = 1024
BODY_LOOK_SECONDS = 0.05  # while draining: how often a body still coming is looked at
FINAL_WRITE_SECONDS = 1.0  # after the grace period: time to write the last answers (503s)


async def listen(
    config: ServerConfig,
    factory: Callable[[], asyncio.BaseProtocol],
    port: int,
    reuse_port: bool = False,
) -> asyncio.Server:
    """The listening server on `port` (`reuse_port`: beside the other HTTP processes, the
    kernel spreading new connections between them). Plain TCP, with TLS too: each
    connection's protocol does its own handshake once the connection cap has seated it
    (`rawserve.http.handshake`). `::` is one socket for IPv4 and IPv6 (`dual_stack`)."""
    loop = asyncio.get_running_loop()
    if not dual_stack(config.host):
        return await loop.create_server(
            factory, config.host, port, backlog=BACKLOG, reuse_port=reuse_port or None
        )
    sock = socket.create_server(
        (config.host, port),
        family=socket.AF_INET6,
        backlog=BACKLOG,
        reuse_port=reuse_port,
        dualstack_ipv6=True,
    )
    try:
        return await loop.create_server(factory, sock=sock, backlog=BACKLOG)
    except BaseException:
        sock.close()
        raise


def dual_stack(host: str) -> bool:
    """Whether `host` is `::`, served to IPv4 clients too, as Linux binds it by default
    and gunicorn, hypercorn, Go and Node serve it (asyncio alone would bind it for IPv6
    only); where the system has no such sockets, it is bound as given."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name
        return False
    return address.version == 6 and address.is_unspecified and socket.has_dualstack_ipv6()


async def requests_answered(state: ServerState, timeout: float) -> bool:
    """Wait until no connection has a request in progress (or `timeout` passes): one the
    app works on, or one whose body is still coming, which gets its answer (503 while
    draining) once the body is in. Waited for by its tasks alone, a drain with nothing
    running closed such a request unanswered, as its head had been read."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while True:
        busy, reading = state.busy_tasks(), state.reading_bodies()
        if not (busy or reading):
            return True
        if (left := until - loop.time()) <= 0:
            return False
        # no event tells of a body's end: it is looked at again shortly
        wait = min(left, BODY_LOOK_SECONDS) if reading else left
        if busy:
            await asyncio.wait(busy, timeout=wait)
        else:
            await asyncio.sleep(wait)

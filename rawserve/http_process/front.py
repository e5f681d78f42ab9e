"""What any process serving HTTP needs, with one process or several: the listening server,
and waiting for the requests in progress while draining."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from rawserve.config import ServerConfig
from rawserve.http.limits import ServerState

BACKLOG = 1024


async def listen(
    config: ServerConfig,
    factory: Callable[[], asyncio.BaseProtocol],
    port: int,
    reuse_port: bool = False,
) -> asyncio.Server:
    """The listening server on `port` (`reuse_port`: beside the other HTTP processes, the
    kernel spreading new connections between them). Plain TCP, with TLS too: each
    connection's protocol does its own handshake once the connection cap has seated it
    (`rawserve.http.handshake`)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        factory, config.host, port, backlog=BACKLOG, reuse_port=reuse_port or None
    )


async def requests_answered(state: ServerState, timeout: float) -> bool:
    """Wait until no connection has a request in progress (or `timeout` passes)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while busy := state.busy_tasks():
        if (left := until - loop.time()) <= 0:
            return False
        await asyncio.wait(busy, timeout=left)
    return True

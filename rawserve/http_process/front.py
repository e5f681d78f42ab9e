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
    kernel spreading new connections between them)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        factory,
        config.host,
        port,
        backlog=BACKLOG,
        ssl=config.ssl_context,
        reuse_port=reuse_port or None,
        # a client that never finishes its TLS hello is let go as a slow head would be
        ssl_handshake_timeout=config.http.head_timeout if config.tls else None,
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

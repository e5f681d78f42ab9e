"""The listening socket, in-process on loopback: `--host ::` serves IPv4 clients too, in
one process and with several HTTP processes on one reserved port."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rawserve.fronts import reserve_port
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http_process.front import listen
from rawserve.options import parse_config
from rawserve.protocol import HttpProtocol, ServerState
from tests.fake_transport import FakeApp, read_responses
from tests.server import ipv6_loopback


class OkApp(FakeApp):
    async def handle(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"{}")


async def answer(address: str, port: int) -> int:
    """The status of one GET to (`address`, `port`), the connection closed after."""
    reader, writer = await asyncio.open_connection(address, port)
    request = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    writer.write(request)
    [(response, _)] = read_responses(await reader.read(), [request])
    writer.close()
    return response.status_code


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 on this machine")
@pytest.mark.parametrize("http_processes", [1, 2])
async def test_the_ipv6_wildcard_serves_ipv4_clients_too(http_processes):
    """`::` was IPv6 alone (asyncio sets IPV6_V6ONLY): a client of 127.0.0.1 was refused,
    unlike with gunicorn, hypercorn or uvicorn --workers."""
    config = parse_config(["--handler", "tests.handlers:echo", "--host", "::", "--port", "0"])
    loop, app, state = asyncio.get_running_loop(), OkApp(), ServerState()

    def factory() -> HttpProtocol:
        return HttpProtocol(app, config.http, state, loop=loop)

    if http_processes == 1:
        servers = [await listen(config, factory, 0)]
        port = servers[0].sockets[0].getsockname()[1]
    else:  # the serving process holds the port; each HTTP process listens on it
        reserved = reserve_port("::", 0)
        port = reserved.port
        servers = [await listen(config, factory, port, reuse_port=True) for _ in range(2)]
    try:
        assert [await answer(address, port) for address in ("127.0.0.1", "::1")] == [200, 200]
    finally:
        for server in servers:
            server.close()
        if http_processes > 1:
            reserved.close()


def test_the_port_is_let_go_where_the_http_processes_board_cannot_be_made(monkeypatch):
    """Out of shared memory (a container's small /dev/shm), the start stops: the port it
    reserved was held on, for code that runs the server in its own process (a reader)."""
    from rawserve.fronts import HttpProcesses
    from rawserve.shared.board import Board, SharedMemoryError

    def no_room(cls, models: int) -> Board:
        raise SharedMemoryError(OSError(28, "No space left on device"))

    probe = reserve_port("127.0.0.1", 0)
    port = probe.port
    probe.close()
    config = parse_config(["--handler", "tests.handlers:echo", "--host", "127.0.0.1"])
    config = dataclasses.replace(config, port=port)
    monkeypatch.setattr(Board, "create", classmethod(no_room))
    with pytest.raises(SharedMemoryError):
        asyncio.run(HttpProcesses.start(config, [], None))  # type: ignore[arg-type]
    reserve_port("127.0.0.1", port).close()  # free again

"""A small load client on raw asyncio sockets (loopback only, bounded in count and time)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11


class Client:
    """One keep-alive HTTP/1.1 connection per request task, opened on demand."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
    ) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            return await exchange(reader, writer, method, path, body, headers or [])
        finally:
            writer.close()

    async def post_json(self, document: Any) -> tuple[int, Any]:
        status, body = await self.request(
            "POST", "/", json.dumps(document).encode(), [("Content-Type", "application/json")]
        )
        return status, json.loads(body)


async def exchange(reader, writer, method, path, body, headers, conn=None) -> tuple[int, bytes]:
    conn = conn or h11.Connection(h11.CLIENT)
    request = h11.Request(
        method=method,
        target=path,
        headers=[("Host", "127.0.0.1"), ("Content-Length", str(len(body))), *headers],
    )
    writer.write(
        conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
    )
    status, chunks = 0, []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            chunks.append(event.data)
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return status, b"".join(chunks)


async def run_load(
    port: int,
    bodies: list[bytes],
    concurrency: int,
    time_limit: float,
    headers: list[tuple[str, str]] | None = None,
) -> list[tuple[int, bytes]]:
    """Send every body as POST / over `concurrency` keep-alive connections; answers in order."""
    results: list[Any] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        try:
            for index in next_index:
                results[index] = await exchange(
                    reader, writer, "POST", "/", bodies[index], headers or [], conn
                )
                if conn.our_state is h11.MUST_CLOSE:
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    conn = h11.Connection(h11.CLIENT)
                else:
                    conn.start_next_cycle()
        finally:
            writer.close()

    async with asyncio.timeout(time_limit):
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results

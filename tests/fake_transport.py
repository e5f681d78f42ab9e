"""A fake asyncio transport and an h11 client that reads what the server wrote."""

from __future__ import annotations

import asyncio

import h11


class FakeTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 50000) if name == "peername" else default


def read_responses(
    data: bytes, requests: list[bytes] | None = None
) -> list[tuple[h11.Response, bytes]]:
    """Parse every response in `data` with an h11 client connection."""
    client = h11.Connection(h11.CLIENT)
    responses = []
    for request in requests or [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"] * 64:
        # the client must have "sent" a request to parse the matching response
        client_request = h11.Connection(h11.SERVER)
        client_request.receive_data(request)
        event = client_request.next_event()
        if not isinstance(event, h11.Request):
            break
        headers = [
            (k, v) for k, v in event.headers if k not in (b"content-length", b"transfer-encoding")
        ]
        client.send(h11.Request(method=event.method, target=event.target, headers=headers))
        client.send(h11.EndOfMessage())
        client.receive_data(bytes(data))
        data = b""
        head, body = None, bytearray()
        while True:
            got = client.next_event()
            if got is h11.NEED_DATA or isinstance(got, h11.ConnectionClosed):
                return responses
            if isinstance(got, h11.Response):
                head = got
            elif isinstance(got, h11.Data):
                body += got.data
            elif isinstance(got, h11.EndOfMessage):
                responses.append((head, bytes(body)))
                break
        if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
            return responses
        client.start_next_cycle()
    return responses

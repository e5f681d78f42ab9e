"""The HTTP/1.1 protocol, fed bytes through a fake transport; answers parsed with h11."""

from __future__ import annotations

import asyncio
import json

import pytest

from rawserve.errors import BadRequest, GatewayTimeout
from rawserve.http import HttpRequest, HttpResponse
from rawserve.protocol import HttpProtocol, ProtocolSettings
from tests.fake_transport import FakeTransport, read_responses


class EchoApp:
    """Answers the body back; `/slow` waits for `release`, `/fail` raises."""

    def __init__(self):
        self.release = asyncio.Event()
        self.seen: list[HttpRequest] = []
        self.cancelled = 0

    async def handle(self, request: HttpRequest) -> HttpResponse:
        self.seen.append(request)
        if request.path == "/slow":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if request.path == "/bad":
            raise BadRequest("the body is not valid JSON")
        if request.path == "/timeout":
            raise GatewayTimeout("deadline passed")
        if request.path == "/crash":
            raise RuntimeError("secret /home/internal/path detail")
        return HttpResponse(
            200, json.dumps({"path": request.path, "body": request.body.decode()}).encode()
        )


@pytest.fixture
async def server():
    loop = asyncio.get_running_loop()
    app = EchoApp()
    protocol = HttpProtocol(app, ProtocolSettings(max_body_bytes=100), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return app, protocol, transport


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_post_answers_json_with_request_id(server):
    app, protocol, transport = server
    request = (
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nX-Request-Id: abc-1\r\n\r\nhello"
    )
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 200
    assert json.loads(body) == {"path": "/x", "body": "hello"}
    headers = dict(response.headers)
    assert headers[b"x-request-id"] == b"abc-1"
    assert headers[b"content-type"] == b"application/json"
    assert not transport.finished  # keep-alive


async def test_pipelined_requests_are_answered_in_order(server):
    app, protocol, transport = server
    requests = [
        f"POST /{i} HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\n{i}".encode() for i in range(3)
    ]
    protocol.data_received(b"".join(requests))
    await settle()
    responses = read_responses(transport.written, requests)
    assert [json.loads(body)["path"] for _, body in responses] == ["/0", "/1", "/2"]


async def test_no_second_request_is_read_while_one_is_pending(server):
    app, protocol, transport = server
    slow = b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
    fast = b"GET /fast HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(slow + fast)
    await settle()
    assert [r.path for r in app.seen] == ["/slow"]
    app.release.set()
    await settle()
    assert [r.path for r in app.seen] == ["/slow", "/fast"]
    assert len(read_responses(transport.written, [slow, fast])) == 2


async def test_body_over_the_limit_is_413_from_content_length(server):
    app, protocol, transport = server
    request = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 413
    assert json.loads(body)["error_type"] == "payload_too_large"
    assert transport.finished and not app.seen


async def test_chunked_body_over_the_limit_is_413(server):
    app, protocol, transport = server
    request = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(request + b"64\r\n" + b"x" * 100 + b"\r\n" + b"1\r\nx\r\n0\r\n\r\n")
    await settle()
    [(response, _)] = read_responses(transport.written, [request])
    assert response.status_code == 413 and transport.finished and not app.seen


async def test_malformed_request_is_400_and_closes(server):
    app, protocol, transport = server
    protocol.data_received(b"THIS IS NOT HTTP\r\n\r\n")
    await settle()
    [(response, body)] = read_responses(transport.written)
    assert response.status_code == 400
    assert json.loads(body) == {"error": "malformed HTTP request", "error_type": "bad_request"}
    assert transport.finished


async def test_errors_are_json_and_hide_internals(server):
    app, protocol, transport = server
    requests = [b"GET /bad HTTP/1.1\r\nHost: a\r\n\r\n", b"GET /crash HTTP/1.1\r\nHost: a\r\n\r\n"]
    protocol.data_received(b"".join(requests))
    await settle()
    (bad, bad_body), (crash, crash_body) = read_responses(transport.written, requests)
    assert bad.status_code == 400
    assert json.loads(bad_body)["error"] == "the body is not valid JSON"
    assert crash.status_code == 500
    assert json.loads(crash_body) == {
        "error": "internal server error",
        "error_type": "internal_error",
    }
    assert b"secret" not in transport.written and b"/home" not in transport.written
    assert transport.finished  # 5xx closes the connection


async def test_a_client_that_leaves_cancels_its_request(server):
    app, protocol, transport = server
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    protocol.connection_lost(None)
    await settle()
    assert app.cancelled == 1 and not transport.written


async def test_head_answers_headers_only(server):
    app, protocol, transport = server
    request = b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(request)
    await settle()
    assert b"\r\n\r\n" in transport.written and transport.written.endswith(b"\r\n\r\n")


async def test_streamed_response_is_chunked_and_stops_when_the_client_leaves():
    loop = asyncio.get_running_loop()
    produced: list[int] = []
    stopped = asyncio.Event()
    gate = asyncio.Event()

    async def tokens():
        try:
            for i in range(100):
                produced.append(i)
                yield f"data: {i}\n\n".encode()
                if i == 1:
                    await gate.wait()
        finally:
            stopped.set()

    class StreamApp:
        async def handle(self, request):
            return HttpResponse(200, headers=[], content_type="text/event-stream", stream=tokens())

    protocol = HttpProtocol(StreamApp(), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    assert b"transfer-encoding: chunked" in transport.written.lower()
    assert b"data: 1" in transport.written
    protocol.connection_lost(None)
    gate.set()
    await asyncio.wait_for(stopped.wait(), 1)
    assert produced == [0, 1]

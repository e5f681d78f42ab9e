"""The HTTP/1.1 protocol, fed bytes through a fake transport; answers parsed with h11."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import gzip
import json
import logging
import re
import resource
import socket
import ssl
import time
import zlib
from typing import Any, cast

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rawserve.api.bodies import MAX_JSON_DEPTH, read_json, request_timeout
from rawserve.http import refusals, response_head
from rawserve.http.auth import require_bearer
from rawserve.http.chunked import CHUNKS_AS_SENT, MIN_CHUNK_BYTES, ChunkedMeter
from rawserve.http.content_coding import codings, decoded
from rawserve.http.cors import EXPOSED_HEADERS, CorsPolicy
from rawserve.http.cycle import head_size
from rawserve.http.errors import (
    BadRequest,
    GatewayTimeout,
    HeadersTooLarge,
    MalformedRequest,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    UnsupportedMediaType,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http.flow_control import FlowControl
from rawserve.http.limits import (
    GIVE_WAY_AFTER,
    LINGER_SECONDS,
    OWN_FILES,
    REFUSALS_LINGERING,
    REQUESTS_PER_LOOP_PASS,
    Phase,
    refusals_bound,
)
from rawserve.http.probe_peek import Waiting, sort_request_start
from rawserve.http.refusals import check_head
from rawserve.http.request_ids import request_id
from rawserve.http.response_head import (
    fixed_fields,
    reason,
    render_kept,
    render_request_fields,
)
from rawserve.http.tls import server_context, validity_warning
from rawserve.protocol import (
    ANSWER_GOING_CHECK,
    PROBE_RESERVE,
    PROBE_SEATS,
    READ_AHEAD_LIMIT,
    REQUESTS_PER_PASS,
    HttpProtocol,
    ProtocolSettings,
    ServerState,
)
from rawserve.shared.json_text import nested_deeper_than
from rawserve.shared.logs import REQUEST_ID
from tests.fake_transport import (
    FakeApp,
    FakeTimerLoop,
    FakeTransport,
    count_responses,
    read_responses,
)


class EchoApp(FakeApp):
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
        if request.path == "/no-memory":
            raise MemoryError
        if request.path == "/no-thread":
            raise RuntimeError("can't start new thread")
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


async def test_the_task_answering_a_request_knows_its_request_id():
    """What the serving side tags the request's items with, for a worker's log lines: each
    request's own, in the task that answers it, and nothing outside it."""

    class IdApp(FakeApp):
        def __init__(self) -> None:
            self.ids: list[str] = []

        async def handle(self, request: HttpRequest) -> HttpResponse:
            self.ids.append(REQUEST_ID.get())
            return HttpResponse(200, b"{}")

    app = IdApp()
    protocol = HttpProtocol(app, ProtocolSettings(), loop=asyncio.get_running_loop())
    protocol.connection_made(FakeTransport())
    for sent_id in (b"abc-1", b"abc-2"):
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\nX-Request-Id: %s\r\n\r\n" % sent_id)
        await settle()
    assert app.ids == ["abc-1", "abc-2"] and REQUEST_ID.get() == ""


@pytest.mark.parametrize(
    ("given", "echoed"),
    [
        ("a" * 128, True),
        ("!~" * 64, True),  # the first and last visible characters
        ("a" * 129, False),
        ("", False),
        (None, False),
        ("two words", False),
        ("caf\u00e9", False),
        ("tab\there", False),
        ("del\x7f", False),
        ("x\n", False),
    ],
)
def test_a_request_id_is_echoed_only_when_it_is_1_to_128_visible_ascii_characters(given, echoed):
    made = request_id(given)
    assert (made == given) is echoed
    if not echoed:  # 32 hex digits, new each time
        assert re.fullmatch("[0-9a-f]{32}", made) and request_id(given) != made


@pytest.mark.parametrize(
    ("target", "path"),
    [
        (b"/health", "/health"),
        (b"http://localhost:8000/health?x=1", "/health"),  # a proxy's absolute form
        (b"HTTPS://example.org", "/"),
        (b"/%68ealth", "/health"),
        (b"/models/org%2Fname", "/models/org/name"),  # a Hub id, encoded by its client
        (b"/ready/tests.handlers%3Aecho", "/ready/tests.handlers:echo"),
        (b"/%ff", "/\ufffd"),  # not UTF-8: replaced, still no route
    ],
)
async def test_the_routes_see_the_path_whatever_form_the_target_takes(server, target, path):
    app, protocol, transport = server
    protocol.state.metrics = observed = RequestsSeen()
    request = b"GET " + target + b" HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 200 and json.loads(body)["path"] == path
    assert app.seen[-1].path == path
    assert observed.paths == [path]  # and /metrics counts it under its route


class RequestsSeen:
    """Records the paths the protocol reports to the metrics."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def observe_request(self, path: str, method: str, status: int, seconds: float) -> None:
        self.paths.append(path)

    def observe_refused_connection(self) -> None:
        pass


@pytest.mark.parametrize(
    ("fields", "body"),
    [
        ("Content-Encoding: gzip", gzip.compress(b"hello world")),
        ("Content-Encoding: deflate", zlib.compress(b"hello world")),
        ("Content-Encoding: GZIP, identity", gzip.compress(b"hello world")),
        # RFC 1952: gzip data may be several members, read one after the other (as gzip,
        # curl and nginx read them); the first alone would be a silently cut input
        ("Content-Encoding: gzip", gzip.compress(b"hello ") + gzip.compress(b"world")),
        # several fields are one list, in order (RFC 9110 section 5.3)
        ("Content-Encoding: identity\r\nContent-Encoding: gzip", gzip.compress(b"hello world")),
        (
            "Content-Encoding: gzip\r\nContent-Encoding: gzip",
            gzip.compress(gzip.compress(b"hello world")),
        ),
        # listed in the order applied: undone last first
        ("Content-Encoding: deflate, gzip", gzip.compress(zlib.compress(b"hello world"))),
    ],
    ids=[
        "gzip",
        "deflate",
        "list",
        "gzip members",
        "two fields",
        "gzip in two fields",
        "deflate then gzip",
    ],
)
async def test_a_compressed_body_is_read_as_its_plain_bytes(server, fields, body):
    app, protocol, transport = server
    head = f"POST /x HTTP/1.1\r\nHost: a\r\n{fields}\r\n"
    request = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    protocol.data_received(request)
    await settle()
    [(response, answer)] = read_responses(transport.written, [request])
    assert response.status_code == 200 and json.loads(answer)["body"] == "hello world"


def test_a_body_of_more_than_two_codings_one_over_another_is_refused():
    """Each layer is a pass of Python over up to the whole limit: 2,900 gzip layers in a
    15 KB head held the event loop for 4.5 s (a tester)."""
    assert codings("gzip, gzip") == ["gzip", "gzip"]
    with pytest.raises(UnsupportedMediaType, match="3 content codings"):
        codings("gzip, deflate, gzip")


def test_x_gzip_is_read_as_gzip():
    """RFC 9110 8.4.1.3: a recipient should take x-gzip as gzip (older clients send it)."""
    assert codings("X-Gzip") == ["x-gzip"]
    assert decoded(gzip.compress(b"hello"), codings("x-gzip"), 100) == b"hello"


def test_a_gzip_body_of_many_tiny_members_is_refused():
    # 20 bytes a member: a 1 MiB body of them would cost the event loop ~50,000 passes
    assert decoded(gzip.compress(b"a") * 64, ["gzip"], 100) == b"a" * 64
    with pytest.raises(BadRequest, match="the body's gzip data has over 64 members"):
        decoded(gzip.compress(b"") * 65, ["gzip"], 100)


def gzipped(data: bytes) -> bytes:
    """gzip without the time in its header: a test's id holds its body, and parallel runs
    must collect the same ids."""
    return gzip.compress(data, mtime=0)


@pytest.mark.parametrize(
    ("coding", "body", "status", "says"),
    [
        ("br", b"hello", 415, "content coding 'br' is not one this server reads"),
        ("gzip", b"hello", 400, "the body is not valid gzip data"),
        ("gzip", gzipped(b"hello")[:-12], 400, "the body's gzip data ends early"),
        ("gzip", gzipped(b"x" * 1_000), 413, "bytes (the server's --max-body-bytes)"),
        # the limit holds for the members together, not for each
        ("gzip", gzipped(b"x" * 60) * 2, 413, "the body decoded is over the limit"),
        ("gzip", gzipped(b"hello") + b"junk", 400, "the body is not valid gzip data"),
        ("deflate", zlib.compress(b"hello") + b"junk", 400, "data after the deflate stream"),
        ("identity\r\nContent-Encoding: br", b"hello", 415, "content coding 'br'"),
        # bytes past ASCII escaped once, as sent (read as Latin-1 and repr'd, they were mojibake)
        ("\u2028abc", b"hello", 415, "content coding '\\xe2\\x80\\xa8abc' is not one"),
    ],
)
async def test_a_body_in_a_coding_it_cannot_read_is_refused_not_read_as_text(
    server, coding, body, status, says
):
    app, protocol, transport = server
    head = f"POST /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: {coding}\r\n"
    request = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    protocol.data_received(request)
    await settle()
    [(response, answer)] = read_responses(transport.written, [request])
    assert response.status_code == status and says in json.loads(answer)["error"]
    if status == 415:
        assert dict(response.headers)[b"accept-encoding"] == b"gzip, deflate"
    assert not app.seen  # never handed to the app as if it had no coding
    assert not transport.finished  # the connection goes on


async def test_any_transport_with_the_methods_it_uses_will_do():
    # uvloop's transports are no asyncio.Transport; neither is the fake
    transport = FakeTransport()
    assert not isinstance(transport, asyncio.BaseTransport)
    protocol = HttpProtocol(EchoApp(), loop=asyncio.get_running_loop())
    protocol.connection_made(transport)
    request = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 200 and json.loads(body)["body"] == "hi"
    assert transport.eof_written  # closed gracefully through the same methods


async def test_pipelined_requests_are_answered_in_order(server):
    app, protocol, transport = server
    requests = [
        f"POST /{i} HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\n{i}".encode() for i in range(3)
    ]
    protocol.data_received(b"".join(requests))
    await settle()
    responses = read_responses(transport.written, requests)
    assert [json.loads(body)["path"] for _, body in responses] == ["/0", "/1", "/2"]


def with_fields(count: int, path: str = "/x", body: bytes = b"") -> bytes:
    """A POST whose head has `count` header fields (its Host and Content-Length among them)."""
    fields = b"".join(b"X-%d: 1\r\n" % i for i in range(count - 2))
    length = b"Content-Length: %d\r\n" % len(body)
    return b"POST " + path.encode() + b" HTTP/1.1\r\nHost: a\r\n" + length + fields + b"\r\n" + body


def test_a_heads_lines_are_counted_to_its_end_across_reads():
    from rawserve.http.head_lines import HeadLines

    whole = b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\r\n\r\nbody\nwith\nlines\n"
    for size in (1, 2, 3, 5, len(whole)):
        lines = HeadLines()
        for at in range(0, len(whole), size):
            lines.add(whole[at : at + size])
        assert (lines.count, lines.ended) == (3, True), size  # the body's are not its
    bare = HeadLines()
    bare.add(b"GET / HTTP/1.0\nX: 1\n\nA\nB\n")  # (bare line feeds end lines too)
    assert (bare.count, bare.ended) == (2, True)


@pytest.mark.parametrize("size", [None, 7])
async def test_a_head_of_too_many_fields_is_refused_before_it_is_parsed(server, size):
    """A head of 16 KiB in 3,000 one-letter fields cost h11 8 ms of the event loop (40
    times one of the same size in 10): past 100 fields it is refused (431) as it comes,
    whole or in pieces; 100 are read, and a body's lines are not the head's."""
    from rawserve.http.head_lines import MAX_HEADER_LINES

    app, protocol, transport = server
    read = with_fields(MAX_HEADER_LINES, body=b"a\nb\n" * 20)
    over = with_fields(MAX_HEADER_LINES + 1)
    for sent in (read, over):
        chunks = [sent] if size is None else [sent[i : i + size] for i in range(0, len(sent), size)]
        for chunk in chunks:
            protocol.data_received(chunk)
        await settle()
    [(first, _), (refused, body)] = read_responses(transport.written, [read, over])
    assert first.status_code == 200 and len(app.seen) == 1
    assert refused.status_code == 431
    assert (
        json.loads(body)["error"] == f"the request has more than {MAX_HEADER_LINES} header fields"
    )


class ShapedApp(EchoApp):
    """Shapes the protocol's refusals on /v1/ paths its own way (the real app: OpenAI's)."""

    def refusal_renderer(self, request):
        if not request.path.startswith("/v1/"):
            return None
        return lambda exc, request_id: HttpResponse(
            exc.status, b'{"shaped": "' + exc.message.encode() + b'"}'
        )


@pytest.mark.parametrize("size", [None, 9])
@pytest.mark.parametrize(("path", "shaped"), [("/v1/models", True), ("/x", False)])
async def test_a_head_of_too_many_fields_is_refused_in_its_routes_shape(size, path, shaped):
    """Refused before h11 parsed it, a /v1/ head of 101 fields came in rawserve's shape,
    where a head too large on the same path came in OpenAI's: its request line says it."""
    from rawserve.http.head_lines import MAX_HEADER_LINES

    protocol = HttpProtocol(ShapedApp(), loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    over = with_fields(MAX_HEADER_LINES + 1, path)
    for at in range(0, len(over), size or len(over)):
        protocol.data_received(over[at : at + (size or len(over))])
    await settle()
    [(refused, body)] = read_responses(transport.written, [over])
    assert refused.status_code == 431
    said = f"the request has more than {MAX_HEADER_LINES} header fields"
    assert json.loads(body) == {"shaped": said} if shaped else json.loads(body)["error"] == said


def test_a_heads_request_line_is_kept_once_whole():
    from rawserve.http.head_lines import REQUEST_LINE_KEPT, HeadLines

    lines = HeadLines()
    for piece in (b"GET /v1/mo", b"dels HTTP/1.1\r", b"\nHost: a\r\n"):
        assert lines.request_line == b""
        lines.add(piece)
    assert lines.request_line == b"GET /v1/models HTTP/1.1"
    long = HeadLines()
    long.add(b"GET /" + b"x" * REQUEST_LINE_KEPT + b" HTTP/1.1\r\n")
    assert long.request_line == b""  # (too long to keep: refused in rawserve's shape)


@pytest.mark.parametrize(
    "head",
    [
        "GET /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\n\r\n",
        "GET /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: br\r\n\r\n",
        "POST /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\nContent-Length: 0\r\n\r\n",
        "POST /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: deflate\r\n"
        "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ],
    ids=["GET gzip", "GET br", "empty gzip", "empty chunked deflate"],
)
async def test_a_request_with_no_body_has_nothing_to_decode(server, head):
    """RFC 9110 8.4: a coding is the content's; a GET of /info saying gzip was 400 "the
    body's gzip data ends early" (and 415 saying br), where /health answered it."""
    app, protocol, transport = server
    request = head.encode()
    protocol.data_received(request)
    await settle()
    [(response, answer)] = read_responses(transport.written, [request])
    assert response.status_code == 200 and json.loads(answer) == {"path": "/x", "body": ""}
    assert not transport.finished


async def test_a_pipelined_head_of_too_many_fields_is_refused_after_the_answers_before_it(server):
    app, protocol, transport = server
    requests = [with_fields(3, "/1", b"1"), with_fields(300, "/2"), with_fields(3, "/3")]
    protocol.data_received(b"".join(requests))
    await settle()
    responses = read_responses(transport.written, requests)
    assert [response.status_code for response, _ in responses] == [200, 431]
    assert [request.path for request in app.seen] == ["/1"]


class App(EchoApp):
    """EchoApp whose `/now...` paths are answered at once (as probes and refusals are)."""

    def answer_now(self, request: HttpRequest) -> HttpResponse | None:
        if request.path == "/now-refused":
            raise ServiceUnavailable("queue full", retry_after=2)
        if request.path.startswith("/now"):
            return HttpResponse(200, request.path.encode())
        return None


def connected_to(app: FakeApp) -> tuple[HttpProtocol, FakeTransport]:
    protocol = HttpProtocol(app, ProtocolSettings(), loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def test_requests_answered_at_once_keep_pipelined_order_without_a_task():
    protocol, transport = connected_to(App())
    paths = [f"/now{i}" for i in range(2000)] + ["/later", "/now-after", "/now-refused"]
    requests = [f"GET {path} HTTP/1.1\r\nHost: a\r\n\r\n".encode() for path in paths]
    protocol.data_received(b"".join(requests[:2001]))  # deep pipelining: no recursion
    # a pass of the loop reads a few: in one, 10,000 held every other client a second
    assert len(read_responses(transport.written, requests)) == REQUESTS_PER_PASS
    assert not transport.reading  # the rest are read in later passes
    for _ in range(2000 // REQUESTS_PER_PASS + 5):
        await asyncio.sleep(0)
    assert len(read_responses(transport.written, requests)) >= 2000  # (/later's too, soon)
    protocol.data_received(b"".join(requests[2001:]))
    await settle()
    responses = read_responses(transport.written, requests)
    assert [body.decode() for _, body in responses[:2000]] == paths[:2000]
    assert json.loads(responses[2000][1])["path"] == "/later"
    assert responses[2001][1] == b"/now-after"
    refused, body = responses[2002]
    assert refused.status_code == 503 and (b"retry-after", b"2") in refused.headers
    assert json.loads(body)["error_type"] == "unavailable"
    assert not transport.finished  # a 503 keeps the connection


async def test_pipelining_connections_take_turns_within_one_budget_a_pass():
    """20 connections each pipeline 200 requests answered at once. Each reading its own
    32 a pass made passes of 640 answers (300 such connections: 9,600, and a new client
    waited seconds to be read); now all of them together read REQUESTS_PER_LOOP_PASS a
    pass, round and round so that none starves, and a new client is answered at once."""
    state, app, loop = ServerState(), App(), asyncio.get_running_loop()
    floods = []
    for _ in range(20):
        protocol = HttpProtocol(app, ProtocolSettings(), state, loop=loop)
        transport = FakeTransport()
        protocol.connection_made(transport)
        floods.append((protocol, transport))
    request = b"GET /now HTTP/1.1\r\nHost: a\r\n\r\n"
    for protocol, _ in floods:
        protocol.data_received(request * 200)

    def answered() -> list[int]:
        return [transport.written.count(b"HTTP/1.1 200") for _, transport in floods]

    # bytes just arrived: each connection reads one at least, the first ones their cap
    assert answered() == [REQUESTS_PER_PASS] * 2 + [1] * 18
    turns_between = []  # passes each connection waited between two of its turns
    last_turn = [0] * 20
    for pass_number in range(1, 200):
        before = answered()
        await asyncio.sleep(0)
        after = answered()
        if sum(after) == 20 * 200:
            break
        assert sum(after) - sum(before) <= REQUESTS_PER_LOOP_PASS
        for index, (old, new) in enumerate(zip(before, after, strict=True)):
            if new > old:
                turns_between.append(pass_number - last_turn[index])
                last_turn[index] = pass_number
        fresh, transport = HttpProtocol(app, ProtocolSettings(), state, loop=loop), FakeTransport()
        fresh.connection_made(transport)
        fresh.data_received(request)  # in the middle of it all
        assert transport.written.count(b"HTTP/1.1 200") == 1
    assert answered() == [200] * 20
    # a round of 20 turns of 32 takes 10 passes of 64
    assert max(turns_between) <= 20 * REQUESTS_PER_PASS // REQUESTS_PER_LOOP_PASS + 1


async def test_a_request_after_a_pass_of_quick_answers_still_sees_its_client_leave():
    """Past the requests one pass reads, reading paused until all that was read had been
    parsed: a generation after 32 pipelined 404s ran whole for a client that had gone
    (its FIN never read). A small backlog reads on; a large one waits, as while
    answering (`test_a_large_pipelined_backlog_pauses_reading_until_answered`)."""
    app = App()
    protocol, transport = connected_to(app)
    quick = [b"GET /now%d HTTP/1.1\r\nHost: a\r\n\r\n" % i for i in range(40)]
    protocol.data_received(b"".join([*quick, b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"]))
    assert not transport.reading  # 32 answered: the others' turn
    await settle()
    assert [r.path for r in app.seen] == ["/slow"] and transport.reading
    protocol.connection_lost(None)  # the client leaves: seen, its work withdrawn
    await settle()
    assert app.cancelled == 1


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


def test_a_head_or_an_announced_body_of_exactly_the_limit_is_taken():
    event = h11.Request(
        method="POST", target="/", headers=[("Host", "a"), ("Content-Length", "100")]
    )
    fields = list(event.headers)
    size = head_size(event, fields)
    assert check_head(event, fields, max_head_bytes=size, max_body_bytes=100) is None
    assert isinstance(check_head(event, fields, size - 1, 100), HeadersTooLarge)
    assert isinstance(check_head(event, fields, size, 99), PayloadTooLarge)


async def test_a_body_of_exactly_the_limit_is_taken_and_one_byte_more_is_413(server):
    """The limit is inclusive, as the head's check and the chunk meter have it: a body of
    exactly --max-body-bytes must reach the app, not be refused by an off-by-one."""
    app, protocol, transport = server  # max_body_bytes=100
    exact = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    protocol.data_received(exact)
    await settle()
    [(response, body)] = read_responses(transport.written, [exact])
    assert response.status_code == 200 and json.loads(body)["body"] == "x" * 100
    over = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 101\r\n\r\n" + b"x" * 101
    protocol.data_received(over)
    await settle()
    statuses = [r.status_code for r, _ in read_responses(transport.written, [exact, over])]
    assert statuses == [200, 413] and len(app.seen) == 1


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


async def test_an_http_1_1_request_without_host_is_told_so(server):
    """Its 400 said only "malformed HTTP request": behind a proxy that dropped an empty
    Host (nginx passing on `$host` of an HTTP/1.0 probe), nothing said why."""
    app, protocol, transport = server
    protocol.data_received(b"GET /health HTTP/1.1\r\n\r\n")
    await settle()
    [(response, body)] = read_responses(transport.written)
    assert response.status_code == 400 and "must send a Host header" in json.loads(body)["error"]


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


async def test_the_server_out_of_memory_answers_503_not_a_reset_nor_a_traceback(
    server, monkeypatch, caplog
):
    """Under `ulimit -v` or strict overcommit, a body the server cannot hold once reset
    the connection with no answer (and a traceback a connection in the log), and a route
    out of memory (or with no memory left for a thread's stack) was a 500, as a bug; all
    are a 503 a retry may get past."""
    app, protocol, transport = server
    failing = [
        f"GET /{path} HTTP/1.1\r\nHost: a\r\n\r\n".encode() for path in ("no-memory", "no-thread")
    ]
    protocol.data_received(b"".join(failing))
    await settle()
    head = b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n"
    protocol.data_received(head)

    def no_memory():
        raise MemoryError

    monkeypatch.setattr(protocol.conn, "next_event", no_memory)  # the body cannot be held
    protocol.data_received(b"0123456789")
    answers = read_responses(transport.written, [*failing, head + b"0123456789"])
    assert [answer.status_code for answer, _ in answers] == [503, 503, 503]
    for answer, body in answers:
        assert (b"retry-after", b"1") in answer.headers
        assert json.loads(body)["error_type"] == "unavailable"
    assert transport.finished
    assert "Traceback" not in caplog.text and "out of memory" in caplog.text


async def test_a_client_that_leaves_cancels_its_request(server, caplog):
    """Its work is withdrawn, and the access log says so (nginx's 499) with its address,
    though its socket, closed, names none: a client that half-closes after its request,
    or gives up, is visible to the operator."""
    app, protocol, transport = server
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\nX-Request-Id: gone-1\r\n\r\n")
        await settle()
        transport.closed = True  # reset by the client: the loop closes it, then says so
        protocol.connection_lost(None)
        await settle()
    assert app.cancelled == 1 and not transport.written
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("127.0.0.1:50000 ")
    assert '"GET /slow" 499 0 ' in line and line.endswith("gone-1")


async def test_an_answer_ready_after_its_clients_fin_closed_the_connection_is_a_499(server, caplog):
    """Pipelined requests, then the client's FIN: the transport closes once what was
    written is sent, and an answer ready after that reaches nobody. It was logged (and
    counted) as the 200 it was never sent."""
    app, protocol, transport = server
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(
            b"GET /fast HTTP/1.1\r\nHost: a\r\nX-Request-Id: r-0\r\n\r\n"
            b"GET /slow HTTP/1.1\r\nHost: a\r\nX-Request-Id: r-1\r\n\r\n"
        )
        await settle()
        assert count_responses(transport.written) == 1
        assert not protocol.eof_received()  # falsy: the transport closes itself
        transport.closed = True
        app.release.set()  # /slow's answer is ready now, into a closing transport
        await settle()
        protocol.connection_lost(None)
    assert count_responses(transport.written) == 1
    lines = [record.getMessage() for record in caplog.records]
    assert ['"GET /fast" 200' in lines[0], '"GET /slow" 499 0 ' in lines[1]] == [True, True]
    assert len(lines) == 2 and lines[1].endswith("r-1")


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nhalf!",
        b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhalf!\r\n",
        b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Le",
    ],
    ids=["content-length", "chunked", "head"],
)
@pytest.mark.parametrize("leaving", ["fin", "reset"])
async def test_a_client_that_leaves_amid_its_request_is_one_400_line_however_it_closes(
    server, caplog, sent, leaving
):
    """A request cut off (its head or body) is the 400 nginx logs for either close: a
    reset left no line and no count where a FIN had its 400."""
    app, protocol, transport = server
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(sent)
        await settle()
        if leaving == "fin":
            protocol.eof_received()
        transport.closed = True
        protocol.connection_lost(None)
        await settle()
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("127.0.0.1:50000 ") and '" 400 ' in line
    assert not app.seen


async def test_a_probe_in_any_form_the_routes_take_is_logged_at_debug_only(server, caplog):
    """`GET http://a/health` (the absolute form proxies send) and `/he%61lth` are the
    routes' /health: their 200s were logged at INFO, every few seconds of a probe."""
    app, protocol, transport = server
    probes = [b"GET http://a/health HTTP/1.1\r\nHost: a\r\n\r\n"]
    probes.append(b"GET /he%61lth HTTP/1.1\r\nHost: a\r\n\r\n")
    with caplog.at_level("DEBUG", logger="rawserve.access"):
        protocol.data_received(b"".join(probes))
        await settle()
    levels = [record.levelname for record in caplog.records]
    assert levels == ["DEBUG", "DEBUG"] and [r.path for r in app.seen] == ["/health"] * 2


async def test_head_answers_headers_only(server, caplog):
    """...and its access line counts no body bytes sent, as nginx's does."""
    app, protocol, transport = server
    head = b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n"
    get = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(head + get)
        await settle()
    head_line, get_line = [record.getMessage() for record in caplog.records]
    assert '"HEAD /x" 200 0 ' in head_line and '"GET /x" 200 26 ' in get_line
    (head_response, head_body), (get_response, get_body) = read_responses(
        transport.written, [head, get]
    )
    assert head_response.status_code == get_response.status_code == 200
    assert head_body == b"" and get_body
    length = dict(head_response.headers)[b"content-length"]
    assert length == dict(get_response.headers)[b"content-length"] == str(len(get_body)).encode()
    assert not transport.finished


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

    class StreamApp(FakeApp):
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


class GatedStreamApp(FakeApp):
    """Streams one event, then a second once `gate` is set."""

    def __init__(self):
        self.gate = asyncio.Event()

    async def tokens(self):
        yield b"data: 0\n\n"
        await self.gate.wait()
        yield b"data: 1\n\n"

    async def handle(self, request):
        return HttpResponse(200, content_type="text/event-stream", stream=self.tokens())


async def test_a_stream_the_client_leaves_midway_has_its_access_line(caplog):
    """A token stream whose client vanishes mid-answer is still one access line (and one
    count in /metrics): the status its head said and the bytes sent until then, as
    nginx logs a response cut short."""
    loop = asyncio.get_running_loop()
    protocol = HttpProtocol(GatedStreamApp(), loop=loop)
    protocol.connection_made(FakeTransport())
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\nX-Request-Id: left-1\r\n\r\n")
        await settle()
        protocol.connection_lost(None)
        await settle()
    [line] = [record.getMessage() for record in caplog.records]
    assert '"GET /s" 200 9 ' in line and line.endswith("left-1")


@pytest.fixture(scope="module")
def tls_contexts():
    """A server's and a client's TLS contexts, from a throwaway CA."""
    import trustme

    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
async def test_a_stream_its_client_does_not_read_waits_in_the_server_not_the_kernel(
    tls_contexts, secure
):
    """A stream's bytes the kernel holds unsent are bounded (TCP_NOTSENT_LOWAT), and so are
    those a TLS layer holds: the rest waits in the transport, writing pauses, and the
    stream stops taking tokens, which is what its bound on unread tokens counts. The
    kernel's send buffer took 2.8 MB here (~30,000 tokens), and over TLS its layers
    ~1 MB: the generation ran on to its length for a client reading none."""
    loop = asyncio.get_running_loop()
    produced = 0
    token = b"data: " + b"x" * 130 + b"\n\n"  # about one token's event

    async def tokens():
        nonlocal produced
        while True:
            produced += len(token)
            yield token

    class StreamApp(FakeApp):
        async def handle(self, request):
            return HttpResponse(200, content_type="text/event-stream", stream=tokens())

    server_tls, client_tls = tls_contexts

    def protocol() -> HttpProtocol:
        return HttpProtocol(StreamApp(), loop=loop, tls=server_tls if secure else None)

    server = await loop.create_server(protocol, "127.0.0.1")
    address = server.sockets[0].getsockname()

    def reader_of_none() -> socket.socket:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(address)
        if secure:
            client = client_tls.wrap_socket(client, server_hostname="localhost")
        client.sendall(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
        return client

    client = await asyncio.to_thread(reader_of_none)
    try:
        before = -1
        for _ in range(50):  # until the stream stops taking tokens (at once, without)
            await asyncio.sleep(0.05)
            if produced == before:
                break
            before = produced
        assert produced == before, "the stream kept taking tokens nobody read"
        # the transports' high-water marks, the bound unsent, and what the client's
        # window took: well under the megabytes the kernel took unbounded
        assert produced < 256 * 1024
    finally:
        client.close()
        server.close()
        await server.wait_closed()


class PiecesApp(FakeApp):
    """Streams three pieces of different sizes (one of them empty), or answers JSON."""

    PIECES = (b"data: 1\n\n", b"", b"x" * 300)

    async def handle(self, request):
        if request.path != "/stream":
            return HttpResponse(200, b'{"after": true}')

        async def pieces():
            for piece in self.PIECES:
                yield piece

        return HttpResponse(200, content_type="text/event-stream", stream=pieces())


async def test_a_streamed_body_is_chunked_as_h11_reads_it_and_the_connection_goes_on():
    protocol = HttpProtocol(PiecesApp(), loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    requests = [
        b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n",
    ]
    protocol.data_received(b"".join(requests))
    await settle()
    [(streamed, body), (after, after_body)] = read_responses(transport.written, requests)
    assert dict(streamed.headers)[b"transfer-encoding"] == b"chunked"
    assert body == b"".join(PiecesApp.PIECES)
    assert b"\r\n12c\r\n" + b"x" * 300 + b"\r\n0\r\n\r\n" in transport.written  # 300 bytes
    assert after.status_code == 200 and after_body == b'{"after": true}'
    assert not transport.finished


async def test_a_streamed_body_to_an_http_1_0_client_is_sent_as_is_and_the_close_ends_it():
    protocol = HttpProtocol(PiecesApp(), loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /stream HTTP/1.0\r\n\r\n")
    await settle()
    head, _, body = bytes(transport.written).partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"".join(PiecesApp.PIECES)
    assert transport.finished


# --- the request line: empty lines before it, the target's form --------------------


async def test_empty_lines_before_a_request_line_are_skipped(server):
    """RFC 9112 section 2.2: a server SHOULD skip them (old clients send a CRLF after a
    POST body); h11 alone refuses them as a request with no request line."""
    app, protocol, transport = server
    first = b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi\r\n"
    second = b"\r\n\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(b"\r\n" + first + second)  # before the first, and after a body
    await settle()
    protocol.data_received(b"\r\n")  # alone, between requests
    protocol.data_received(b"\n")
    await settle()
    third = b"GET /c HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(third)
    await settle()
    responses = read_responses(transport.written, [first, second.lstrip(), third])
    assert [response.status_code for response, _ in responses] == [200, 200, 200]
    assert [request.path for request in app.seen] == ["/a", "/b", "/c"]
    assert not transport.finished


async def test_a_connection_sending_only_empty_lines_is_closed_at_its_keep_alive_deadline(timed):
    app, protocol, transport, loop = timed
    for _ in range(10):
        loop.advance(0.6)
        protocol.data_received(b"\r\n")  # an empty line does not restart the deadline
    assert transport.closed and not transport.written and not app.seen


@pytest.mark.parametrize(
    ("method", "target", "status"),
    [
        (b"GET", b"*", 400),  # the asterisk form is OPTIONS's
        (b"POST", b"*", 400),
        (b"GET", b"example.com:80", 400),  # the authority form is CONNECT's
        (b"POST", b"localhost:8000", 400),
        (b"GET", b"health", 400),  # no form at all
        (b"GET", b"http://example.com/x", 200),  # the absolute form, as proxies send it
        (b"GET", b"http://example.com:8000?x=1", 200),
        (b"GET", b"http:///x", 400),  # no host
        (b"GET", b"http://x#/x", 400),  # a fragment
        (b"GET", b"http://a@b@c/x", 400),  # not a host and port
        (b"GET", b"http://[::1/x", 400),
        (b"GET", b"/x", 200),
    ],
)
async def test_a_target_in_a_form_its_method_cannot_take_is_refused(server, method, target, status):
    app, protocol, transport = server
    request = method + b" " + target + b" HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == status
    if status == 400:
        assert "target" in json.loads(body)["error"] and not app.seen


async def test_connect_in_any_target_form_is_400_and_never_reaches_the_app(server):
    """`CONNECT / HTTP/1.1` has a target a GET could take: it still asks to tunnel, which
    a 2xx would grant, so it is refused by its method, whatever its target."""
    app, protocol, transport = server
    request = b"CONNECT / HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 400
    assert json.loads(body)["error"] == "CONNECT is not supported" and not app.seen


# --- keep-alive, HTTP/1.0, Connection: close, 100-continue ----------------------------


async def test_a_keep_alive_connection_serves_requests_one_after_another(server):
    app, protocol, transport = server
    requests = []
    for i in range(3):
        request = f"POST /{i} HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\n{i}".encode()
        requests.append(request)
        protocol.data_received(request)
        await settle()
    assert [json.loads(b)["path"] for _, b in read_responses(transport.written, requests)] == [
        "/0",
        "/1",
        "/2",
    ]
    assert not transport.finished


async def test_an_http_1_0_client_is_answered_then_closed(server):
    app, protocol, transport = server
    request = b"POST /old HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 200 and json.loads(body)["body"] == "hi"
    assert dict(response.headers)[b"connection"] == b"close"
    assert transport.finished


async def test_connection_close_is_honoured_and_later_bytes_are_ignored(server):
    app, protocol, transport = server
    first = b"GET /a HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    protocol.data_received(first + b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    [(response, _)] = read_responses(transport.written, [first])
    assert dict(response.headers)[b"connection"] == b"close"
    assert [r.path for r in app.seen] == ["/a"] and transport.finished


async def test_a_crlf_after_a_body_is_skipped_when_the_answer_went_through_h11():
    """RFC 9112 section 2.2: a CRLF a client sends after a POST body is skipped. Skipped
    behind an answer written by hand, it was a malformed next request behind a 204."""

    class NoContentApp(FakeApp):
        async def handle(self, request):
            if request.method == "POST":  # no body: its head is h11's
                return HttpResponse(204, b"", content_type="")
            return HttpResponse(200, b"{}")

    protocol, transport = connected_to(NoContentApp())
    post = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
    get = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(post + b"\r\n" + get)
    await settle()
    statuses = [r.status_code for r, _ in read_responses(transport.written, [post, get])]
    assert statuses == [204, 200] and not transport.finished


async def test_expect_100_continue_gets_100_then_the_answer(server):
    app, protocol, transport = server
    head = b"POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    protocol.data_received(head)
    await settle()
    assert transport.written.startswith(b"HTTP/1.1 100 Continue\r\n") and not app.seen
    protocol.data_received(b"hello")
    await settle()
    [(response, body)] = read_responses(transport.written, [head])
    assert response.status_code == 200 and json.loads(body)["body"] == "hello"
    assert count_responses(transport.written) == 1 and not transport.finished


async def test_expect_100_continue_over_the_limit_gets_413_and_never_100(server):
    app, protocol, transport = server
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 101\r\nExpect: 100-continue\r\n\r\n"
    protocol.data_received(head)
    await settle()
    assert b"HTTP/1.1 100" not in transport.written
    [(response, _)] = read_responses(transport.written, [head])
    assert response.status_code == 413 and transport.finished


async def test_expect_100_continue_refused_from_the_head_is_never_asked_for_its_body():
    protocol, transport = connected_to(App())
    head = b"POST /now-refused HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    head += b"Expect: 100-continue\r\n\r\n"
    protocol.data_received(head)
    await settle()
    assert b"HTTP/1.1 100" not in transport.written
    [(response, _)] = read_responses(transport.written, [head])
    # the body may still come: the answer says the connection ends
    assert response.status_code == 503 and (b"connection", b"close") in response.headers
    protocol.data_received(b"hello")  # sent anyway: drained, never read as a request
    assert count_responses(transport.written) == 1 and transport.finished


@pytest.mark.parametrize("framing", [b"", b"Content-Length: 0\r\n"])
async def test_expect_100_continue_without_a_body_is_answered_and_the_connection_kept(framing):
    """No content to wait for (RFC 9110 section 10.1.1): no 100, and an answer from the
    head, as any other, leaves the connection open for the next request."""
    protocol, transport = connected_to(App())
    head = b"POST /now-refused HTTP/1.1\r\nHost: a\r\n" + framing
    head += b"Expect: 100-continue\r\n\r\n"
    protocol.data_received(head + head)
    await settle()
    assert b"HTTP/1.1 100" not in transport.written
    answers = read_responses(transport.written, [head, head])
    assert [response.status_code for response, _ in answers] == [503, 503]
    assert not transport.finished


# --- read timeouts on a hand-driven timer ---------------------------------------------


@pytest.fixture
async def timed():
    loop = FakeTimerLoop(asyncio.get_running_loop())
    app = EchoApp()
    settings = ProtocolSettings(
        max_body_bytes=100, keepalive_timeout=5, head_timeout=10, body_timeout=20
    )
    protocol = HttpProtocol(app, settings, loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return app, protocol, transport, loop


class DueApp(EchoApp):
    """Each request is due `seconds` after its head (X-Request-Timeout's, in the app)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def deadline_seconds(self, request):
        return self.seconds


@pytest.mark.parametrize(("due", "status", "at"), [(3, 504, 3), (60, 408, 20), (20, 408, 20)])
async def test_a_body_slower_than_its_deadline_is_answered_504_at_the_deadline(due, status, at):
    """A body sent a byte at a time past its request's deadline had its 504 once its
    last byte came (up to --body-timeout, 30 s, late for a 1 s deadline); the deadline
    bounds the body's time now, and --body-timeout where it is as near (the defaults:
    both 30 s) or nearer."""
    app = DueApp(due)
    response, body = await answered_at(app, at)
    assert response.status_code == status and not app.seen
    if status == 504:
        assert "deadline passed before its body was all received" in json.loads(body)["error"]
        assert dict(response.headers)[b"x-should-retry"] == b"false"


class LoadingApp(DueApp):
    """Answers every POST from its head: 503, as while the model loads."""

    def answer_now(self, request):
        if request.method != "POST":
            return None
        return HttpResponse(503, b'{"error": "loading"}', [("Retry-After", "1")])


@pytest.mark.parametrize(("due", "at"), [(None, 20), (3, 3)])
async def test_a_slow_body_of_a_request_answered_from_its_head_gets_that_answer(due, at):
    """Refused from its head while the model loaded (503), a request whose body came
    slowly waited for --body-timeout and got a 408, never the 503 (a review); it now
    gets the 503 by its deadline, or at --body-timeout where it has none."""
    response, body = await answered_at(LoadingApp(due), at)
    assert response.status_code == 503 and json.loads(body) == {"error": "loading"}


async def answered_at(app, at):
    """The one answer to a POST whose body never comes whole (`--body-timeout` 20 s),
    which comes at `at` seconds and not before, and closes the connection."""
    loop = FakeTimerLoop(asyncio.get_running_loop())
    protocol = HttpProtocol(app, ProtocolSettings(body_timeout=20), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc")
    await settle()
    loop.advance(at - 0.1)
    assert not transport.written
    loop.advance(0.2)
    [(response, body)] = read_responses(transport.written)
    assert transport.finished
    return response, body


async def test_a_body_that_comes_whole_is_answered_whatever_its_deadline():
    loop = FakeTimerLoop(asyncio.get_running_loop())
    app = DueApp(0.001)  # (the app's own 504, where it is due: not the protocol's)
    protocol = HttpProtocol(app, ProtocolSettings(), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    request = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi"
    protocol.data_received(request)
    await settle()
    [(response, _)] = read_responses(transport.written, [request])
    assert response.status_code == 200 and not transport.finished


async def test_an_idle_connection_is_closed_quietly(timed):
    app, protocol, transport, loop = timed
    loop.advance(4.9)
    assert not transport.finished
    loop.advance(0.2)
    assert transport.closed and not transport.written


async def test_the_idle_deadline_counts_from_the_last_answer(timed):
    app, protocol, transport, loop = timed
    request = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
    for _ in range(3):  # an answer every 3 s: each moves the 5 s idle deadline on
        loop.advance(3)
        protocol.data_received(request)
        await settle()
        assert not transport.finished
    loop.advance(4.9)  # 4.9 s after the last answer (timers armed earlier fired meanwhile)
    assert not transport.finished
    loop.advance(0.2)
    assert transport.closed and len(read_responses(transport.written)) == 3


async def test_the_idle_deadline_counts_from_when_the_answer_has_gone(timed):
    """A large answer read slowly (within --write-timeout): counted from its queueing, the
    keep-alive time ran out while the client still read it, and the connection was closed
    under its next request."""
    app, protocol, transport, loop = timed
    protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    transport.buffered = 500_000  # the client reads it slowly
    loop.advance(12)  # past the 5 s keep-alive, still reading
    assert not transport.finished
    transport.buffered = 0  # all of it taken
    loop.advance(ANSWER_GOING_CHECK)  # seen gone: the keep-alive time starts
    loop.advance(4.9)
    assert not transport.finished
    protocol.data_received(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert len(read_responses(transport.written)) == 2 and not transport.finished
    loop.advance(5.1)  # idle after that one: closed
    assert transport.closed


async def test_heads_held_unread_while_answers_cannot_be_written_are_not_late(timed):
    """Pipelined heads the server holds unparsed while the client reads its answers
    slowly: their head deadline was the client's, and they were refused 408 "the request
    head was not received in time" with the rest of the pipeline lost."""
    app, protocol, transport, loop = timed
    protocol.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    transport.buffered = 500_000
    protocol.pause_writing()  # the transport's buffer is past its mark
    protocol.data_received(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
    await settle()
    loop.advance(12)  # past the 10 s head deadline, still unable to write
    assert b" 408 " not in transport.written and not transport.finished
    transport.buffered = 0
    protocol.resume_writing()
    await settle()
    answers = read_responses(transport.written)
    assert [response.status_code for response, _ in answers] == [200] * 4


async def test_a_slowloris_dribbling_its_head_gets_408_at_the_head_deadline(timed):
    app, protocol, transport, loop = timed
    for byte in b"GET / HTTP/1.1\r\nHos":  # one byte every 0.4 s: each keeps it "active"
        protocol.data_received(bytes([byte]))
        loop.advance(0.4)
        if transport.finished:
            break
    # 19 bytes x 0.4 s = 7.6 s: still inside the 10 s head deadline, counted from byte one
    assert not transport.finished
    loop.advance(2.5)
    [(response, body)] = read_responses(transport.written)
    assert response.status_code == 408 and json.loads(body)["error_type"] == "request_timeout"
    assert transport.finished


async def test_a_head_that_never_finishes_is_timed_from_its_own_first_bytes(timed, caplog):
    """Its access line and Server-Timing said 0.2 ms (its time began at its 408), then,
    for a head that came behind another request, that request's whole time too."""
    app, protocol, transport, loop = timed
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nab")
        time.sleep(0.3)  # the first request's time, not the second's
        protocol.data_received(b"c" + b"GET /next HTTP/1.1\r\nHos")
        await settle()
        started = time.perf_counter()
        time.sleep(0.2)  # the unfinished head's own time
        loop.advance(10.5)  # past the head deadline
        held = time.perf_counter() - started
    first, refused = [record.getMessage() for record in caplog.records]
    assert '"POST /" 200' in first and '"- -" 408' in refused, (first, refused)
    logged = float(re.search(r" 408 \d+ ([\d.]+)ms", refused).group(1)) / 1000
    assert 0.2 <= logged <= held + 0.05, (logged, held)


async def test_a_body_that_stops_arriving_gets_408(timed):
    app, protocol, transport, loop = timed
    request = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc"
    protocol.data_received(request)
    loop.advance(19)
    assert not transport.written
    loop.advance(2)
    [(response, _)] = read_responses(transport.written, [request])
    assert response.status_code == 408 and transport.finished and not app.seen


async def test_no_read_timer_runs_while_the_app_works_and_idle_restarts_after(timed):
    app, protocol, transport, loop = timed
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    loop.advance(1000)
    assert not transport.written and not transport.finished
    app.release.set()
    await settle()
    assert count_responses(transport.written) == 1 and not transport.finished
    loop.advance(5.1)
    assert transport.closed  # back to idle: the keep-alive timer closed it


async def test_after_an_error_the_peer_is_drained_then_closed(timed):
    app, protocol, transport, loop = timed
    protocol.data_received(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n")
    assert transport.eof_written and not transport.closed  # FIN sent, still reading
    protocol.data_received(b"x" * 500)  # the rest of the refused body is dropped
    assert count_responses(transport.written) == 1
    loop.advance(LINGER_SECONDS + 0.1)
    assert transport.closed


async def test_the_peer_closing_ends_the_linger_at_once(timed):
    app, protocol, transport, loop = timed
    protocol.data_received(b"\x16\x03\x01")
    assert transport.eof_written
    assert not protocol.eof_received()  # falsy: the transport closes itself


async def test_lingering_after_the_last_answer_reads_even_where_reading_was_paused(server):
    """Reading paused for a pipelined backlog behind a slow answer that then closes the
    connection: lingering must read (and drop) the peer's bytes, else they turn the close
    into a reset that can destroy the answer, and the peer's FIN is never seen."""
    app, protocol, transport = server
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    await settle()
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n" * (READ_AHEAD_LIMIT // 20))
    assert not transport.reading  # the backlog paused reading
    app.release.set()
    await settle()
    assert count_responses(transport.written) == 1
    assert transport.eof_written and transport.reading and not transport.closed


# --- connection cap -------------------------------------------------------------------


def connector(app, settings, state, loop=None):
    loop = loop or asyncio.get_running_loop()

    def connect():
        protocol = HttpProtocol(app, settings, state, loop=loop)
        transport = FakeTransport()
        protocol.connection_made(transport)
        return protocol, transport

    return connect


async def test_connections_past_the_cap_get_503_and_the_cap_frees_up():
    state = ServerState()
    app = EchoApp()
    connect = connector(app, ProtocolSettings(max_connections=2), state)
    kept = [connect(), connect()]
    for protocol, _ in kept:  # busy: an idle one would give way
        protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    # past the cap, a connection is taken for one probe: anything else is 503
    over, over_transport = connect()
    over.data_received(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
    await settle()
    [(response, body)] = read_responses(over_transport.written)
    assert response.status_code == 503 and dict(response.headers)[b"retry-after"] == b"1"
    assert json.loads(body)["error_type"] == "unavailable" and over_transport.finished
    probe, probe_transport = connect()
    probe.data_received(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    [(response, _)] = read_responses(probe_transport.written)
    assert response.status_code == 200 and probe_transport.finished  # answered, then closed
    # past the cap and the probes' reserve, every one busy (the two answered linger):
    # refused at once
    reserve = [connect() for _ in range(PROBE_RESERVE - 2)]
    for protocol, _ in reserve:
        protocol.data_received(b"GET /hea")  # mid-head
    refused, refused_transport = connect()
    [(response, body)] = read_responses(refused_transport.written)
    assert response.status_code == 503 and refused_transport.finished
    assert len(state.connections) == 2 and state.refused == 1
    assert not any(transport.closed for _, transport in [*kept, *reserve])
    kept[0][0].connection_lost(None)
    protocol, transport = connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    assert [r.status_code for r, _ in read_responses(transport.written)] == [200]


async def test_past_the_cap_a_new_connection_takes_the_place_of_the_one_idle_longest(caplog):
    loop = FakeTimerLoop(asyncio.get_running_loop())
    state = ServerState()
    connect = connector(EchoApp(), ProtocolSettings(max_connections=2), state, loop)
    (answered, answered_transport), (_, fresh_transport) = connect(), connect()
    loop.advance(GIVE_WAY_AFTER)
    request = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n"
    answered.data_received(request)  # answered, then idle again: after `fresh`
    await settle()
    assert count_responses(answered_transport.written) == 1
    protocol, transport = connect()
    # the one idle longest is closed quietly, as at keep-alive expiry; the new one is
    # seated in full
    assert fresh_transport.closed and not fresh_transport.written
    assert not answered_transport.closed and not protocol.probe_only
    assert "2 connections open (--max-connections): closing the connection idle" in caplog.text
    protocol.data_received(b"POST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
    await settle()
    [(response, _)] = read_responses(transport.written)
    assert response.status_code == 200 and not transport.finished
    # one idle for less than GIVE_WAY_AFTER may be a new connection whose request is on
    # its way: it stays, and the next connection gets a probe's seat (503 but a probe)
    loop.advance(GIVE_WAY_AFTER / 2)
    over, _ = connect()
    assert over.probe_only and not answered_transport.closed
    # then the one idle longest gives way: its one answer is all it was written
    loop.advance(GIVE_WAY_AFTER / 2)
    connect()
    assert answered_transport.closed and count_responses(answered_transport.written) == 1
    assert not transport.closed and len(state.connections) == 2


async def test_past_the_cap_an_idle_connection_still_sending_its_answer_keeps_its_seat():
    """Closed, it would hold its socket, no longer counted, until its client reads."""
    loop = FakeTimerLoop(asyncio.get_running_loop())
    connect = connector(EchoApp(), ProtocolSettings(max_connections=1), ServerState(), loop)
    _, slow_reader = connect()
    slow_reader.buffered = 1000  # of its last answer, not yet taken by its client
    loop.advance(GIVE_WAY_AFTER)
    over, _ = connect()
    assert over.probe_only and not slow_reader.closed
    slow_reader.buffered = 0
    protocol, _ = connect()
    assert not protocol.probe_only and slow_reader.closed


async def test_past_the_cap_idle_probe_connections_give_way_to_a_probe(caplog):
    loop = FakeTimerLoop(asyncio.get_running_loop())
    state = ServerState()
    app = EchoApp()
    connect = connector(app, ProtocolSettings(max_connections=1), state, loop)
    busy, _ = connect()
    busy.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    reserve = [connect() for _ in range(PROBE_RESERVE)]  # idle, each holding a probe seat
    # the operator is told (the connections refused a full answer said nothing)
    assert "(--max-connections): taking new connections for one probe each" in caplog.text
    loop.advance(GIVE_WAY_AFTER)
    probe, transport = connect()
    assert probe.probe_only and state.refused == 0
    assert [t.closed for _, t in reserve] == [True] + [False] * (PROBE_RESERVE - 1)
    probe.data_received(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    [(response, _)] = read_responses(transport.written)
    assert response.status_code == 200 and not busy.transport.closed


async def test_refusals_past_the_probe_seats_are_logged_after_the_probe_seats_line(caplog):
    """Every kind of line about the cap shared one 10 s limit: the probe seats' line, logged
    just before the first refusal, silenced the refusals of any burst under 10 s."""
    state = ServerState()
    connect = connector(EchoApp(), ProtocolSettings(max_connections=1), state)
    connect()[0].data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")  # busy
    for _ in range(PROBE_RESERVE):  # fresh, each holding a probe seat
        connect()
    assert "taking new connections for one probe each" in caplog.text
    connect()
    assert state.refused == 1
    assert "refusing connections, every one busy; 1 so far" in caplog.text


@pytest.mark.parametrize("cap", [1, REFUSALS_LINGERING + 8])
async def test_refused_connections_waiting_for_their_clients_close_are_bounded(cap):
    """Each refused connection waits after its 503 for its client's close, holding a
    descriptor: clients that never close took every one the process may open (a flood of
    1,000 a second past --max-connections 100 under ulimit -n 512: 26 of 118 probes
    answered, the rest reset or closed unanswered). Past the bound (the cap, or
    REFUSALS_LINGERING where the cap is smaller) the one waiting longest is reset."""
    state = ServerState(open_files=None)  # (no limit: the bound is the cap's alone)
    connect = connector(EchoApp(), ProtocolSettings(max_connections=cap), state)
    for _ in range(cap):
        connect()[0].data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")  # busy
    for _ in range(PROBE_RESERVE):  # fresh, each holding a probe seat
        connect()
    bound = max(cap, REFUSALS_LINGERING)
    refused = [connect() for _ in range(bound)]
    for _, transport in refused:  # each answered 503, its FIN sent, waiting for the client
        [(response, _)] = read_responses(transport.written)
        assert response.status_code == 503 and transport.eof_written
    assert not any(transport.closed for _, transport in refused)
    assert len(state.refusals_lingering) == bound
    refused[1][0].connection_lost(None)  # a client that closes leaves the count at once
    assert len(state.refusals_lingering) == bound - 1
    more = [connect() for _ in range(3)]  # one in the freed place, then two past it
    assert state.refused == bound + 3 and len(state.refusals_lingering) == bound
    (_, first), (_, gone), (_, third) = refused[:3]
    assert first.aborted and not gone.aborted and third.aborted  # the longest waiting
    assert not any(transport.closed for _, transport in [*refused[3:], *more])


def test_the_refusals_waiting_fit_what_the_open_files_limit_leaves():
    """With a cap of 300 under `ulimit -n` 512, 300 refusals waiting took the descriptors
    the probes needed (29 of 119 answered): they wait only in what the limit leaves past
    the seats, the probes' and the process's own; none left, each is reset at once."""
    assert refusals_bound(300, None) == 300
    assert refusals_bound(10, None) == REFUSALS_LINGERING
    assert refusals_bound(300, 512) == 512 - 300 - PROBE_SEATS - OWN_FILES
    assert refusals_bound(300, 4096) == 300
    assert refusals_bound(400, 512) == 0


@pytest.mark.parametrize(
    ("limits", "raised"),
    [
        ((1024, 10**6), (2000 + OWN_FILES, 10**6)),  # the connections and its own files
        ((1024, 2010), (2010, 2010)),  # as far as the hard limit allows (warned of)
        ((2000 + OWN_FILES, 10**6), None),  # enough already: left as it is
    ],
)
def test_the_open_files_limit_is_raised_for_the_connections_and_the_process_s_own(
    monkeypatch, limits, raised
):
    """Raised for the connections alone, the refusals' bound (which takes the process's
    own files off the limit) left 64 fewer refused connections their 503: reset."""
    from rawserve.ops import open_files

    calls = []
    monkeypatch.setattr(open_files.resource, "getrlimit", lambda which: limits)
    monkeypatch.setattr(open_files.resource, "setrlimit", lambda which, to: calls.append(to))
    open_files.raise_open_files_limit(2000)
    assert calls == ([] if raised is None else [raised])


@pytest.mark.parametrize(
    ("limits", "raised"),
    [
        ((1024, 20000), (20000, 20000)),
        ((1024, resource.RLIM_INFINITY), (1_048_576, resource.RLIM_INFINITY)),
        ((20000, 20000), None),
    ],
)
def test_no_connection_cap_raises_the_open_files_limit_to_the_hard_one(
    monkeypatch, caplog, limits, raised
):
    """`--max-connections 0` left a shell's soft limit as it was: "no cap" served 177
    of 400 connections under a soft limit of 200, resetting the rest without a word,
    where the default cap raised it and served all (a tester)."""
    from rawserve.ops import open_files

    calls = []
    monkeypatch.setattr(open_files.resource, "getrlimit", lambda which: limits)
    monkeypatch.setattr(open_files.resource, "setrlimit", lambda which, to: calls.append(to))
    with caplog.at_level("INFO", logger="rawserve"):
        open_files.raise_open_files_limit(0)
    assert calls == ([] if raised is None else [raised])
    [line] = [record.getMessage() for record in caplog.records]
    assert f"up to its open files limit ({(raised or limits)[0]:,}" in line


async def test_a_refusal_the_open_files_limit_leaves_no_room_for_is_reset_at_once():
    state = ServerState(open_files=1 + PROBE_SEATS + OWN_FILES)  # room for no refusal
    connect = connector(EchoApp(), ProtocolSettings(max_connections=1), state)
    connect()[0].data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")  # busy
    for _ in range(PROBE_RESERVE):  # fresh, each holding a probe seat
        connect()
    _, refused = connect()
    [(response, _)] = read_responses(refused.written)
    assert response.status_code == 503 and refused.aborted  # written, then reset
    assert len(state.refusals_lingering) == 0


@pytest.mark.parametrize(
    "target", [b"/health", b"/ready?x=1", b"/ready/cls", b"http://a/health", b"/%68ealth"]
)
async def test_a_probe_past_the_cap_is_answered_in_any_form_the_routes_take(target):
    connect = connector(EchoApp(), ProtocolSettings(max_connections=1), ServerState())
    connect()[0].data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")  # busy
    protocol, transport = connect()  # past the cap
    protocol.data_received(b"GET " + target + b" HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    [(response, _)] = read_responses(transport.written)
    assert response.status_code == 200 and transport.finished


class SocketTransport(FakeTransport):
    """A fake transport over one end of a real socket pair, as the loop's name it."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock

    def get_extra_info(self, name, default=None):
        return self.sock if name == "socket" else super().get_extra_info(name, default)


def past_the_probe_seats(state: ServerState, app: FakeApp):
    """A capped server's seats, its probes' reserve too, each taken by a connection
    whose request is not read yet (a flood of new connections); then `connect(waiting)`,
    a new connection with `waiting` already sent on it."""
    connect = connector(app, ProtocolSettings(max_connections=1), state)
    for protocol, _ in [connect() for _ in range(1 + PROBE_RESERVE)]:
        protocol.data_received(b"GET /hea")  # each mid-head: none gives way
    loop = asyncio.get_running_loop()
    pairs = []

    def connect_with(waiting: bytes):
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        pairs.append((ours, theirs))
        theirs.sendall(waiting)
        protocol = HttpProtocol(app, ProtocolSettings(max_connections=1), state, loop=loop)
        transport = SocketTransport(ours)
        protocol.connection_made(transport)
        return protocol, transport, ours

    return connect_with, pairs


@pytest.mark.parametrize(
    "request_line",
    [b"GET /health HTTP/1.1", b"HEAD /ready?x=1 HTTP/1.1", b"GET /ready/cls HTTP/1.0",
     b"GET http://a/ping HTTP/1.1", b"GET /%68ealth HTTP/1.1"],
)  # fmt: skip
async def test_past_the_probe_seats_a_probe_waiting_in_the_kernel_is_answered(request_line):
    """Under a flood of new connections the reserve is always taken, and a liveness
    probe, a new connection each time, was refused with the flood: now what waits on a
    connection is looked at (left in the kernel, read as usual) before refusing it."""
    state = ServerState()
    connect_with, pairs = past_the_probe_seats(state, EchoApp())
    request = request_line + b"\r\nHost: a\r\n\r\n"
    try:
        protocol, transport, ours = connect_with(request)
        assert protocol.probe_only and state.refused == 0 and not transport.written
        assert ours.recv(1024) == request  # looked at, not taken
        protocol.data_received(request)
        await settle()
        [(response, _)] = read_responses(transport.written, [request])
        assert response.status_code == 200 and transport.finished
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()


@pytest.mark.parametrize(
    ("waiting", "sorted_as"),
    [(b"", Waiting.UNKNOWN), (b"GE", Waiting.UNKNOWN), (b"HEAD /re", Waiting.UNKNOWN),
     (b"GET /health HTTP/1.1\r\n", Waiting.UNKNOWN),
     (b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n", Waiting.PROBE),
     (b"\r\nGET /health HTTP/1.1\r\nHost: a\r\n\r\n", Waiting.PROBE),  # RFC 9112 2.2
     (b"GET /health HTTP/1.1\nHost: a\n\n", Waiting.PROBE),
     (b"GET /health HTTP/1.1\r\nX-Pad: " + b"p" * 2100, Waiting.UNKNOWN),  # read in a seat
     (b"GET /health HTTP/1.1\r\nContent-Length: 5\r\n\r\n", Waiting.UNKNOWN),
     (b"POST / HTTP/1.1\r\n", Waiting.OTHER), (b"PO", Waiting.OTHER),
     (b"DELETE /", Waiting.OTHER), (b"GET / HTTP/1.1\r\n\r\n", Waiting.OTHER),
     (b"\x16\x03\x01\x02\x00", Waiting.OTHER), (b"GET /" + b"x" * 2100, Waiting.UNKNOWN),
     # only a well-formed head takes a seat past the reserve: one of no HTTP version
     (b"GET /health FOO\r\nHost: a\r\n\r\n", Waiting.OTHER),
     (b"GET /health\r\n\r\n", Waiting.OTHER)],
)  # fmt: skip
def test_what_waits_on_a_connection_is_sorted_as_a_probe_only_when_whole(waiting, sorted_as):
    assert sort_request_start(waiting) is sorted_as


async def test_past_the_cap_a_request_on_a_reserve_seat_is_read_and_refused_in_its_shape():
    """One that has sent what no probe sends still takes a free reserve seat: refused
    unread, its 503 lost its route's shape (OpenAI's) and CORS (a tester)."""
    state = ServerState()
    app = EchoApp()
    connect = connector(app, ProtocolSettings(max_connections=1), state)
    connect()[0].data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")  # busy
    request = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        theirs.sendall(request)
        protocol = HttpProtocol(app, ProtocolSettings(max_connections=1), state)
        transport = SocketTransport(ours)
        protocol.connection_made(transport)
        assert protocol.probe_only and not transport.written and state.refused == 0
        protocol.data_received(request)
        await settle()
        [(response, _)] = read_responses(transport.written, [request])
        assert response.status_code == 503 and transport.finished
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize(
    "waiting",
    [b"", b"GET /hea", b"POST /health HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
     b"GET /health\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\n"],
)  # fmt: skip
async def test_past_the_probe_seats_anything_but_a_probes_request_line_is_refused(waiting):
    state = ServerState()
    connect_with, pairs = past_the_probe_seats(state, EchoApp())
    try:
        protocol, transport, _ = connect_with(waiting)
        [(response, body)] = read_responses(transport.written)
        assert response.status_code == 503 and transport.finished and state.refused == 1
        assert json.loads(body)["error"] == "too many open connections"
        assert not protocol.probe_only
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()


async def test_past_the_probe_seats_only_whole_probe_heads_without_a_body_are_seated_and_few():
    """A probe's request line alone, or its head announcing a body, could hold a seat
    past the reserve until --head-timeout or --body-timeout: opened by the hundred
    they took every file descriptor, and a real probe with them (a tester). Only a
    whole head announcing no body is seated there, and no more than PROBE_SEATS."""
    state = ServerState()
    connect_with, pairs = past_the_probe_seats(state, EchoApp())
    try:
        for partial in (
            b"GET /health HTTP/1.1\r\n",
            b"GET /health HTTP/1.1\r\nHost: a\r\n",
            b"GET /health HTTP/1.1\r\nContent-Length: 9\r\n\r\n",
            b"GET /health HTTP/1.1\r\ntransfer-encoding : chunked\r\n\r\n",
        ):
            protocol, transport, _ = connect_with(partial)
            assert not protocol.probe_only and transport.finished
        whole = b"GET /health HTTP/1.1\r\nHost: a\r\nUser-Agent: kube-probe/1.31\r\n\r\n"
        seated = [connect_with(whole)[0] for _ in range(PROBE_SEATS)]
        assert all(protocol.probe_only for protocol in seated[: PROBE_SEATS - PROBE_RESERVE])
        assert not any(protocol.probe_only for protocol in seated[PROBE_SEATS - PROBE_RESERVE :])
        assert len(state.probe_connections) == PROBE_SEATS
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()


class RefusalsCounted(RequestsSeen):
    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def observe_refused_connection(self) -> None:
        self.refused += 1


async def test_every_connection_refused_at_the_cap_is_counted_for_the_metrics():
    """Refused before its request is read, or on a probe seat after (then its 503 is
    counted under its route too): /metrics tells them from a full queue's."""
    counted = RefusalsCounted()
    state = ServerState(metrics=counted)
    connect = connector(EchoApp(), ProtocolSettings(max_connections=1), state)
    connect()[0].data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")  # busy
    on_a_probe_seat, _ = connect()
    on_a_probe_seat.data_received(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    await settle()
    assert counted.refused == 1 and counted.paths == ["/x"]
    # the rest of the reserve (the refused one lingers in its seat)
    for protocol, _ in [connect() for _ in range(PROBE_RESERVE - 1)]:
        protocol.data_received(b"GET /hea")
    connect()  # past everything: refused unread
    assert counted.refused == 2 and state.refused == 1


async def test_a_tls_connection_past_the_cap_is_closed_without_a_plain_text_503():
    """A 503 written in plain text on a TLS port reaches no client (its TLS layer reads
    it as garbage): the connection is closed with nothing written."""
    state = ServerState()
    connect = connector(EchoApp(), ProtocolSettings(max_connections=1), state)
    for protocol, _ in [connect() for _ in range(1 + PROBE_RESERVE)]:
        protocol.data_received(b"GET /hea")  # each mid-head: none gives way
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    protocol = HttpProtocol(
        EchoApp(),
        ProtocolSettings(max_connections=1),
        state,
        loop=asyncio.get_running_loop(),
        tls=tls,
    )
    transport = FakeTransport()
    protocol.connection_made(transport)
    assert transport.closed and not transport.written and state.refused == 1


async def test_a_drain_waits_only_for_requests_still_being_answered():
    """A request answered leaves its task done on its connection until the next one:
    counted as busy, it held a draining HTTP process for its whole grace."""

    class Connection:
        sending = False

        def __init__(self, task: asyncio.Task[None]) -> None:
            self.cycle = type("Cycle", (), {"task": task})()

        def close(self) -> None:
            pass

    answered = asyncio.ensure_future(asyncio.sleep(0))
    await answered
    working = asyncio.ensure_future(asyncio.Event().wait())
    state = ServerState()
    for task in (answered, working):
        state.connections.take(Connection(task), 10, 0.0)
    assert state.busy_tasks() == {working}
    working.cancel()


# --- flow control ---------------------------------------------------------------------


async def test_a_large_pipelined_backlog_pauses_reading_until_answered(server):
    app, protocol, transport = server
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    filler = b"GET /next HTTP/1.1\r\nHost: a\r\nX: " + b"y" * 1000 + b"\r\n\r\n"
    for _ in range(70):
        protocol.data_received(filler)
    assert not transport.reading
    app.release.set()
    for _ in range(1000):  # each answer lets the next buffered request in, one a pass
        if transport.reading:
            break
        await asyncio.sleep(0)
    # reading resumed only once every buffered request was answered, not at the first
    assert transport.reading and len(app.seen) == 71


async def test_a_few_pipelined_bytes_after_many_earlier_requests_do_not_pause_reading():
    """READ_AHEAD_LIMIT bounds the bytes read and not yet parsed, not all a connection
    ever sent: after 100 KB of earlier requests, 16 bytes pipelined behind a slow answer
    paused reading, and a paused connection does not see its client leave."""
    app = EchoApp()
    settings = ProtocolSettings(max_body_bytes=1 << 20)
    protocol = HttpProtocol(app, settings, loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    for _ in range(2):
        protocol.data_received(
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 50000\r\n\r\n" + b"x" * 50_000
        )
        await settle()
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    protocol.data_received(b"GET / HTTP/1.1\r\n")
    assert transport.reading
    protocol.connection_lost(None)  # so the client leaving is seen: its work withdrawn
    await settle()
    assert app.cancelled == 1


async def test_a_peer_that_does_not_read_its_answers_is_not_read_from(server):
    app, protocol, transport = server
    protocol.pause_writing()  # the transport's buffer is full
    protocol.data_received(b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    assert not app.seen and not transport.reading
    protocol.resume_writing()
    await settle()
    assert [r.path for r in app.seen] == ["/a"] and transport.reading
    protocol.pause_writing()  # it stops reading again: so does the server
    protocol.data_received(b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    assert [r.path for r in app.seen] == ["/a"] and not transport.reading
    protocol.resume_writing()
    await settle()
    assert [r.path for r in app.seen] == ["/a", "/b"] and transport.reading


async def test_a_connection_closing_with_a_few_bytes_unsent_is_cut_off_at_the_write_timeout():
    """Writing never paused (what waits is under the transport's high mark): a peer that
    reads none of it still holds its socket no longer than the write timeout."""
    stalled = asyncio.Event()
    flow = FlowControl(FakeTransport(), asyncio.get_running_loop(), 0.05, stalled.set)
    flow.closing()
    await asyncio.wait_for(stalled.wait(), timeout=5.0)


async def test_a_client_reading_slowly_is_not_cut_off_while_it_takes_some_of_its_answer():
    """The write timeout was timed from its arming alone: a client reading a 31 MB answer
    steadily at 0.7 MB/s was cut off at 21 MB. One that takes some of what waits within
    each timeout reads on; one that takes nothing for a whole timeout is cut off."""
    stalled = asyncio.Event()
    transport = FakeTransport()
    transport.buffered = 1_000_000
    flow = FlowControl(transport, asyncio.get_running_loop(), 0.2, stalled.set)
    flow.pause_writing()
    for _ in range(4):  # 0.4 s, two timeouts: some taken in each
        await asyncio.sleep(0.1)
        transport.buffered -= 100_000
    assert not stalled.is_set()
    await asyncio.wait_for(stalled.wait(), timeout=5.0)  # then nothing taken: cut off
    assert transport.buffered == 600_000


def test_closing_every_connection_closes_those_taken_for_a_probe_past_the_cap_too():
    from rawserve.http.limits import ServerState

    closed, refused = [], []

    class Connection:
        cycle = None
        sending = False

        def __init__(self, reading_body: bool = False) -> None:
            self.reading_body = reading_body

        def refuse_unread(self) -> None:
            refused.append(self)

        def close(self) -> None:
            closed.append(self)

    state = ServerState()
    seated, probe, reading = Connection(), Connection(), Connection(reading_body=True)
    state.connections.take(seated, 2, 0.0)
    state.connections.take(reading, 2, 0.0)
    state.probe_connections.take(probe, 32, 0.0)
    state.close_all()
    assert set(closed) == {seated, reading, probe} and closed[-1] is probe
    assert refused == [reading]  # its body still coming: answered 503 first


async def test_a_released_flow_lets_writers_on_and_can_pause_again():
    """Once the connection is gone, nothing waits to write; the flow is as if writing
    had never paused, so a later pause (of a new transport's buffer) holds writers."""
    flow = FlowControl(FakeTransport(), asyncio.get_running_loop(), 60.0, lambda: None)
    flow.pause_writing()
    flow.release()
    assert not flow.write_paused
    await asyncio.wait_for(flow.drain(), timeout=5.0)
    flow.pause_writing()
    waiting = asyncio.ensure_future(flow.drain())
    await settle()
    assert not waiting.done()
    flow.resume_writing()
    await asyncio.wait_for(waiting, timeout=5.0)


async def test_a_stream_waits_while_writing_is_paused():
    loop = asyncio.get_running_loop()
    produced: list[int] = []

    async def chunks():
        for i in range(3):
            produced.append(i)
            yield b"x"

    class StreamApp(FakeApp):
        async def handle(self, request):
            return HttpResponse(200, content_type="text/plain", stream=chunks())

    protocol = HttpProtocol(StreamApp(), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")  # the app's task starts
    protocol.pause_writing()
    protocol.resume_writing()  # pause and resume are idempotent
    protocol.pause_writing()
    protocol.pause_writing()
    await settle()
    assert produced == [0]  # one chunk written, then waiting for the drain
    protocol.resume_writing()
    await settle()
    [(response, body)] = read_responses(transport.written)
    assert produced == [0, 1, 2] and body == b"xxx"


async def test_a_stream_answered_after_its_connection_closed_is_still_closed():
    """The drain's last step closes every connection; a streamed answer made after it
    was never written, and never closed: the serving side kept generating for no one."""
    closed: list[int] = []
    release = asyncio.Event()

    class LateStreamApp(FakeApp):
        async def handle(self, request):
            await release.wait()

            async def tokens():
                yield b"data: 1\n\n"

            return HttpResponse(200, stream=tokens(), on_stream_close=lambda: closed.append(1))

    protocol, transport = connected_to(LateStreamApp())
    protocol.data_received(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    protocol.close()  # as ServerState.close_all() at the end of a drain
    release.set()
    await settle()
    assert closed == [1] and not transport.written


# --- at most one response per request -------------------------------------------------


async def test_an_error_after_the_head_is_out_closes_instead_of_a_second_response():
    loop = asyncio.get_running_loop()

    async def failing():
        yield b"partial"
        raise RuntimeError("/secret/path")

    class StreamApp(FakeApp):
        async def handle(self, request):
            return HttpResponse(200, content_type="text/plain", stream=failing())

    protocol = HttpProtocol(StreamApp(), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    assert count_responses(transport.written) == 1 and transport.closed
    assert b"0\r\n\r\n" not in transport.written  # the body was cut, not ended
    assert b"secret" not in transport.written


async def test_an_answer_whose_head_cannot_be_written_is_a_500_then_the_close(caplog):
    """A header value outside ASCII (h11 writes none) is a 500 and a log line, where the
    failure was lost in the request's task and the client waited on without an answer."""

    class BadHeaderApp(FakeApp):
        async def handle(self, request):
            return HttpResponse(200, b"{}", [("X-Echo", "caf\xe9")])

    protocol, transport = connected_to(BadHeaderApp())
    request = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(request)
        await settle()
    [(response, body)] = read_responses(transport.written, [request])
    assert response.status_code == 500 and b"x-echo" not in dict(response.headers)
    assert json.loads(body)["error"] == "the answer could not be written"
    assert transport.finished
    assert "could not send the response to request " in caplog.text
    assert '"GET /" 500' in caplog.text  # its access line


async def test_an_unexpected_errors_traceback_names_the_request_its_500_answers(server, caplog):
    """The client and the access line know a 500 by its request id; the log line with the
    traceback says the same id (and carries it as a field), so an operator finds why a
    request failed on a busy server."""
    app, protocol, transport = server
    request = b"GET /crash HTTP/1.1\r\nHost: a\r\nX-Request-Id: failing-7\r\n\r\n"
    with caplog.at_level("ERROR", logger="rawserve.errors"):
        protocol.data_received(request)
        await settle()
    [(response, _)] = read_responses(transport.written, [request])
    assert response.status_code == 500 and dict(response.headers)[b"x-request-id"] == b"failing-7"
    [record] = [r for r in caplog.records if r.name == "rawserve.errors"]
    assert "request failing-7" in record.getMessage() and record.exc_info is not None
    assert getattr(record, "request_id", None) == "failing-7"


async def test_every_response_has_a_date_request_id_server_timing_and_an_access_line(
    server, caplog
):
    app, protocol, transport = server
    requests = [
        b"GET /ok HTTP/1.1\r\nHost: a\r\nX-Request-Id: mine-1\r\n\r\n",
        b"GET /bad HTTP/1.1\r\nHost: a\r\n\r\n",
    ]
    with caplog.at_level("INFO", logger="rawserve.access"):
        protocol.data_received(b"".join(requests))
        await settle()
    responses = read_responses(transport.written, requests)
    ids = [dict(r.headers)[b"x-request-id"] for r, _ in responses]
    assert ids[0] == b"mine-1" and len(ids[1]) == 32
    assert all(b"total;dur=" in dict(r.headers)[b"server-timing"] for r, _ in responses)
    dates = [
        email.utils.parsedate_to_datetime(dict(r.headers)[b"date"].decode()) for r, _ in responses
    ]
    now = datetime.datetime.now(datetime.UTC)
    assert all(abs((now - date).total_seconds()) < 5 for date in dates)  # RFC 9110 6.6.1
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert '"GET /ok" 200' in lines[0] and lines[0].endswith("mine-1")
    assert '"GET /bad" 400' in lines[1]


async def test_a_streamed_answer_whose_app_timed_it_has_one_server_timing_field():
    """A stream's head goes through h11: the app's Server-Timing and the protocol's own
    were both written, two fields a client reads as one list with two totals."""

    class TimedStreamApp(FakeApp):
        async def handle(self, request):
            async def tokens():
                yield b"data: 1\n\n"

            return HttpResponse(
                200,
                headers=[("Server-Timing", "queue;dur=1.0")],
                stream=tokens(),
                content_type="text/event-stream",
            )

    protocol, transport = connected_to(TimedStreamApp())
    request = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    timings = [value for name, value in response.headers if name == b"server-timing"]
    assert timings == [b"queue;dur=1.0"] and body == b"data: 1\n\n"
    assert email.utils.parsedate_to_datetime(dict(response.headers)[b"date"].decode())


async def test_a_clients_retry_is_marked_in_its_access_record(server, caplog):
    """OpenAI's SDK says which try a request is (`x-stainless-retry-count`, 0 the first):
    its retries after a 429 or a 503 are marked (the JSON key `retry`), the first try
    and a count that is none are not."""
    app, protocol, transport = server
    counts = [b"0", b"2", b"-1", b"12345", b"\xb2", None]
    requests = [
        b"GET /ok HTTP/1.1\r\nHost: a\r\n"
        + (b"x-stainless-retry-count: " + count + b"\r\n" if count is not None else b"")
        + b"\r\n"
        for count in counts
    ]
    with caplog.at_level("INFO", logger="rawserve.access"):
        for request in requests:
            protocol.data_received(request)
            await settle()
    assert [getattr(record, "retry", 0) for record in caplog.records] == [0, 2, 0, 0, 0, 0]
    # the text line is as it was: its request id last
    assert all(r.getMessage().endswith(f"ms {r.request_id}") for r in caplog.records)


# --- CORS on the protocol's own refusals -----------------------------------------------

ORIGIN = "https://app.example"


class CorsApp(EchoApp):
    cors = CorsPolicy([ORIGIN])


def cors_of(response) -> dict[bytes, bytes]:
    return {k: v for k, v in response.headers if k.startswith(b"access-control-") or k == b"vary"}


def with_origin(head: bytes, origin: str = ORIGIN) -> bytes:
    return head.replace(b"Host: a\r\n", b"Host: a\r\nOrigin: " + origin.encode() + b"\r\n")


REFUSALS_AFTER_THE_HEAD = [
    ("413 announced", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 101\r\n\r\n", 0, 413),
    (
        "413 as sent",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"65\r\n"
        + b"x" * 101
        + b"\r\n0\r\n\r\n",
        0,
        413,
    ),
    ("431 whole head", b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 1100 + b"\r\n\r\n", 0, 431),
    ("408 body", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc", 21, 408),
]


@pytest.mark.parametrize(
    ("request_bytes", "wait", "status"),
    [case[1:] for case in REFUSALS_AFTER_THE_HEAD],
    ids=[case[0] for case in REFUSALS_AFTER_THE_HEAD],
)
async def test_a_refusal_after_the_head_lets_an_allowed_page_read_it(request_bytes, wait, status):
    for origin, allowed in [(ORIGIN, True), ("https://evil.example", False)]:
        loop = FakeTimerLoop(asyncio.get_running_loop())
        settings = ProtocolSettings(max_body_bytes=100, max_head_bytes=1024, body_timeout=20)
        protocol = HttpProtocol(CorsApp(), settings, loop=loop)
        transport = FakeTransport()
        protocol.connection_made(transport)
        sent = with_origin(request_bytes, origin)
        protocol.data_received(sent)
        await settle()
        loop.advance(wait)
        [(response, _)] = read_responses(transport.written, [sent])
        assert response.status_code == status
        if allowed:
            assert cors_of(response) == {
                b"access-control-allow-origin": ORIGIN.encode(),
                b"access-control-expose-headers": EXPOSED_HEADERS.encode(),
                b"vary": b"Origin",
            }
        else:  # nothing to read it by, but a cache is told the answer depends on Origin
            assert cors_of(response) == {b"vary": b"Origin"}


async def test_the_503_past_the_connection_cap_lets_an_allowed_page_read_it():
    connect = connector(CorsApp(), ProtocolSettings(max_connections=1), ServerState())
    connect()[0].data_received(b"GET /h")  # busy, mid-head: it keeps its seat
    protocol, transport = connect()
    sent = with_origin(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
    protocol.data_received(sent)
    await settle()
    [(response, _)] = read_responses(transport.written, [sent])
    assert response.status_code == 503 and (b"retry-after", b"1") in response.headers
    assert cors_of(response)[b"access-control-allow-origin"] == ORIGIN.encode()


@pytest.mark.parametrize(
    ("method", "headers", "preflight"),
    [
        ("OPTIONS", [("origin", ORIGIN), ("access-control-request-method", "POST")], True),
        ("POST", [("origin", ORIGIN), ("access-control-request-method", "POST")], False),
        ("OPTIONS", [("access-control-request-method", "POST")], False),  # no browser's
        ("OPTIONS", [("origin", ORIGIN)], False),  # a page's own OPTIONS request
    ],
)
def test_only_a_browsers_options_asking_for_a_method_is_a_preflight(method, headers, preflight):
    request = HttpRequest(method, "/", "", headers, b"", "id")
    assert CorsPolicy.is_preflight(request) is preflight


def test_cors_headers_say_vary_origin_once_and_only_for_a_list_of_origins():
    exposed = ("Access-Control-Expose-Headers", EXPOSED_HEADERS)
    assert CorsPolicy(["*"]).headers_for(ORIGIN) == [("Access-Control-Allow-Origin", "*"), exposed]
    listed = CorsPolicy([ORIGIN])
    allow = ("Access-Control-Allow-Origin", ORIGIN)
    assert listed.headers_for(ORIGIN, [("Vary", "Accept-Encoding, origin")]) == [allow, exposed]
    other = [("Vary", "Accept-Encoding"), ("X-Request-Id", "origin")]  # no Vary on Origin yet
    assert listed.headers_for(ORIGIN, other) == [allow, ("Vary", "Origin"), exposed]
    assert listed.headers_for("https://other.example") == [("Vary", "Origin")]


async def test_cors_headers_are_added_once_and_never_to_a_preflight_answer():
    class PreflightApp(CorsApp):
        def answer_now(self, request: HttpRequest) -> HttpResponse | None:
            if request.method == "OPTIONS":  # a preflight carries its own CORS headers
                response = self.cors.preflight(request, ["POST"])
            else:
                response = HttpResponse(200, b"{}")
            self.cors.add_headers(request, response)  # as the app does for all its answers
            return response

    protocol = HttpProtocol(PreflightApp(), loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    requests = [
        with_origin(
            b"OPTIONS / HTTP/1.1\r\nHost: a\r\nAccess-Control-Request-Method: POST\r\n\r\n"
        ),
        with_origin(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"),
    ]
    protocol.data_received(b"".join(requests))
    await settle()
    preflight, answer = [response for response, _ in read_responses(transport.written, requests)]
    names = [name for name, _ in preflight.headers]
    assert names.count(b"access-control-allow-origin") == 1
    assert b"access-control-expose-headers" not in names
    names = [name for name, _ in answer.headers]
    assert names.count(b"access-control-allow-origin") == 1
    assert names.count(b"access-control-expose-headers") == 1


class PreflightApp(CorsApp):
    """Answers preflights as the routes do: a route that serves POST alone."""

    def answer_now(self, request: HttpRequest) -> HttpResponse | None:
        if CorsPolicy.is_preflight(request):
            return self.cors.preflight(request, {"POST"})
        return None


async def preflight(origin: str, method: str, asked_headers: bytes | None = None):
    protocol, transport = connected_to(PreflightApp())
    request = with_origin(
        b"OPTIONS /generate HTTP/1.1\r\nHost: a\r\nAccess-Control-Request-Method: "
        + method.encode()
        + b"\r\n"
        + (b"Access-Control-Request-Headers: " + asked_headers + b"\r\n" if asked_headers else b"")
        + b"\r\n",
        origin,
    )
    protocol.data_received(request)
    await settle()
    [(response, body)] = read_responses(transport.written, [request])
    return response, json.loads(body) if body else None


async def test_a_preflight_from_an_origin_not_allowed_is_403_and_allows_nothing():
    """A 204 would let the page of any origin send its real request (with the key its
    user's browser holds, for a server that trusts the browser's origin)."""
    response, body = await preflight("https://evil.example", "POST", b"content-type")
    assert response.status_code == 403 and body["error_type"] == "forbidden"
    assert "the origin https://evil.example may not call this server" in body["error"]
    assert b"access-control-allow-origin" not in cors_of(response)
    allowed, _ = await preflight(ORIGIN, "POST", b"content-type")
    assert allowed.status_code == 204
    assert cors_of(allowed)[b"access-control-allow-origin"] == ORIGIN.encode()
    assert cors_of(allowed)[b"access-control-allow-headers"] == b"content-type"


async def test_a_preflight_for_a_method_the_route_does_not_serve_is_405_with_allow():
    response, body = await preflight(ORIGIN, "DELETE")
    assert response.status_code == 405 and dict(response.headers)[b"allow"] == b"POST"
    assert body["error_type"] == "method_not_allowed"


async def test_a_preflight_asking_for_headers_that_are_no_names_is_allowed_without_them():
    """Only a list of header names is echoed: a non-ASCII value cannot be written in a
    head (h11 refused it: the preflight became a 500 and a logged traceback)."""
    response, _ = await preflight(ORIGIN, "POST", b"x-caf\xe9")
    assert response.status_code == 204
    assert b"access-control-allow-headers" not in cors_of(response)


# --- the bearer check the app applies under --api-key ---------------------------------


@pytest.mark.parametrize(
    ("authorization", "accepted"),
    [
        ("Bearer k3y", True),
        ("bearer k3y", True),  # the scheme is case-insensitive
        ("  Bearer k3y  ", True),
        ("Bearer   k3y", True),  # RFC 9110 11.4: auth-scheme 1*SP token68
        (None, False),
        ("", False),
        ("Bearer", False),
        ("Bearer ", False),
        ("Basic k3y", False),
        ("Token k3y", False),  # the key under another scheme
        ("Bearer k3", False),
        ("Bearer k3yy", False),
        ("Bearer K3Y", False),  # the token is not
        ("Bearer k3y\xe9", False),  # non-ASCII from the wire: refused, not a crash
        ("Bearer k3y\xa0", False),  # a NO-BREAK SPACE is no header white space
        ("Bearer \x85k3y", False),  # nor is a NEXT LINE
        ("Bearer\xa0k3y", False),
        ("Bearer\tk3y", False),  # a tab does not part the scheme from the token
    ],
)
def test_require_bearer(authorization, accepted):
    headers = [] if authorization is None else [("authorization", authorization)]
    request = HttpRequest("POST", "/", "", headers, b"", "id")
    if accepted:
        require_bearer(request, "k3y")
        return
    with pytest.raises(Unauthorized) as caught:
        require_bearer(request, "k3y")
    assert dict(caught.value.headers)["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("authorization", ["Bearer wrong", "bearer K3Y", "Bearer k3y\xe9"])
def test_a_token_sent_and_refused_is_said_to_be_invalid(authorization):
    """RFC 6750 3.1: `error="invalid_token"` tells a client its token was refused, where
    a request without one gets the bare challenge."""
    request = HttpRequest("POST", "/", "", [("authorization", authorization)], b"", "id")
    with pytest.raises(Unauthorized, match="not valid") as caught:
        require_bearer(request, "k3y")
    challenge = dict(caught.value.headers)["WWW-Authenticate"]
    assert challenge == 'Bearer realm="rawserve", error="invalid_token"'


@pytest.mark.parametrize("authorization", [None, "Bearer", "Bearer ", "Bearer    "])
def test_no_token_gets_the_bare_challenge_not_an_invalid_tokens(authorization):
    """RFC 6750 section 3.1: a request with no token gets the challenge without an error
    code; `invalid_token` is for a token sent and refused."""
    headers = [] if authorization is None else [("authorization", authorization)]
    request = HttpRequest("POST", "/", "", headers, b"", "id")
    with pytest.raises(Unauthorized, match="needs an Authorization: Bearer") as caught:
        require_bearer(request, "k3y")
    assert dict(caught.value.headers)["WWW-Authenticate"] == 'Bearer realm="rawserve"'


def json_request(body: bytes) -> HttpRequest:
    return HttpRequest("POST", "/", "", [("content-type", "application/json")], body, "id")


def test_a_json_body_nested_past_the_limit_or_with_a_lone_surrogate_is_refused():
    depth = MAX_JSON_DEPTH
    # at the limit, with more brackets than the limit in all: taken
    deepest = b"[" * depth + b"]" * depth
    assert read_json(json_request(b"[" + deepest[1:-1] + b", []]")) is not None
    for body in (
        b"[" * (depth + 1) + b"]" * (depth + 1),
        b'{"a": ' * (depth + 1) + b"1" + b"}" * (depth + 1),
    ):
        with pytest.raises(MalformedRequest, match="nested more than"):
            read_json(json_request(body))
    for escape in (b'"\\ud800"', b'"\\uDC00"'):
        with pytest.raises(MalformedRequest, match="lone surrogate"):
            read_json(json_request(escape))
    assert read_json(json_request(b'"\\ud83d\\ude00"')) == "\U0001f600"  # a pair: one character

    # brackets in strings (escaped quotes too) are no nesting, in keys neither
    text = b'"[[[[\\"' + b"{" * (2 * depth) + b'"'
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)  # in the object: at the limit
    taken = b'{"a": ' + text + b", " + text + b': [[], {}], "b": ' + inner + b"}"
    assert read_json(json_request(taken))["a"] == '[[[["' + "{" * (2 * depth)
    with pytest.raises(MalformedRequest, match="lone surrogate"):
        read_json(json_request(b'{"\\ud800": 1}'))  # in a key
    # its own bytes, which no UTF-8 holds, but json.loads reads: a 500 in the tokenizer
    for raw in (b'{"inputs": "ab\xed\xa0\x80cd"}', b'["\xed\xbf\xbf"]'):
        with pytest.raises(MalformedRequest, match="lone surrogate"):
            read_json(json_request(raw))
    # JSON in UTF-16 (json.loads reads it): checked as the text it reads as
    for wide in ("utf-16", "utf-32-le"):
        with pytest.raises(MalformedRequest, match="nested more than"):
            read_json(json_request(("[" * (depth + 1) + "]" * (depth + 1)).encode(wide)))
        with pytest.raises(MalformedRequest, match="lone surrogate"):
            read_json(json_request('["\\ud800"]'.encode(wide)))
        assert read_json(json_request(deepest.decode().encode(wide))) is not None
    # 340,000 empty lists (1 MB, a kilobyte gzipped): checked without a walk in Python
    flood = b'{"x": [' + b",".join([b"[]"] * 340_000) + b"]}"
    assert len(read_json(json_request(flood))["x"]) == 340_000


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_no_json_and_refused(constant):
    # Python's json reads them; orjson wrote them back as null: a schema's {"const": NaN}
    # was answered "null"
    with pytest.raises(MalformedRequest, match="not valid JSON: .*not JSON numbers"):
        read_json(json_request(b'{"response_format": {"const": ' + constant + b"}}"))
    # as a string it is JSON; a number past a float's range read as one too (orjson wrote
    # it null)
    assert read_json(json_request(b'["' + constant + b'", 1e308]')) == [constant.decode(), 1e308]
    for huge in (b"1e400", b"-1e999", b"1" + b"0" * 400 + b".5"):
        with pytest.raises(MalformedRequest, match="a number past a float's range"):
            read_json(json_request(b'{"const": ' + huge + b"}"))
    assert read_json(json_request(b"[1e-400, " + b"1" * 400 + b"]")) == [0.0, int("1" * 400)]


@pytest.mark.parametrize("order", [("k3y", "wrong"), ("wrong", "k3y"), ("k3y", "k3y")])
def test_two_authorization_headers_are_a_bad_request_whatever_their_order(order):
    headers = [("authorization", f"Bearer {token}") for token in order]
    with pytest.raises(BadRequest, match="one Authorization header"):
        require_bearer(HttpRequest("POST", "/", "", headers, b"", "id"), "k3y")


# --- numbers in headers are read in HTTP's grammar ------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"), [("10", 10.0), ("0.5", 0.5), (".5", 0.5), ("2.", 2.0), ("007", 7.0)]
)
def test_a_header_number_is_digits_and_at_most_one_dot(value, seconds):
    request = HttpRequest("POST", "/", "", [("x-request-timeout", value)], b"", "id")
    assert request_timeout(request, default=30, longest=60) == seconds


def test_a_request_timeout_past_max_timeout_is_cut_to_it():
    """`--max-timeout` is the longest deadline a request may ask for (the README's
    "capped at `--max-timeout`"): past it, a client could have its requests queued and
    running for as long as it liked, the server's own bound on a request's time gone."""
    request = HttpRequest("POST", "/", "", [("x-request-timeout", "1000")], b"", "id")
    assert request_timeout(request, default=30, longest=300) == 300


@pytest.mark.parametrize(
    "value",
    ["1_0", " 1", "1 ", "1e1", "inf", "nan", "+1", "-1", "1.2.3", "0x10", "", ".", "\u0661", "²"],
)
def test_what_python_reads_as_a_number_but_http_does_not_is_400(value):
    request = HttpRequest("POST", "/", "", [("x-request-timeout", value)], b"", "id")
    with pytest.raises(BadRequest, match="X-Request-Timeout must be a number of seconds in digits"):
        request_timeout(request, default=30, longest=60)


@pytest.mark.parametrize("value", ["0", "0.0", "000"])
def test_a_deadline_of_no_time_is_400(value):
    request = HttpRequest("POST", "/", "", [("x-request-timeout", value)], b"", "id")
    with pytest.raises(BadRequest, match="more than 0 seconds"):
        request_timeout(request, default=30, longest=60)


@pytest.mark.parametrize("values", [("5", "0.5"), ("0.5", "5"), ("5", "5")])
def test_two_request_timeout_headers_are_a_bad_request_whatever_their_order(values):
    headers = [("x-request-timeout", value) for value in values]
    request = HttpRequest("POST", "/", "", headers, b"", "id")
    with pytest.raises(BadRequest, match="one X-Request-Timeout header"):
        request_timeout(request, default=30, longest=60)


# --- what one connection may cost, whatever its client does ---------------------------


async def test_a_pipelining_client_gets_no_more_read_ahead_per_answer(server):
    app, protocol, transport = server
    request = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    sent = 0
    while transport.reading:  # the client writes as long as the server reads
        protocol.data_received(request * 100)
        sent += 100
    app.release.set()
    for _ in range(20):  # some answers go out: reading stays paused while much waits
        await asyncio.sleep(0)
    answered = len(app.seen)
    assert 1 < answered < sent and not transport.reading
    buffered = len(protocol.conn.trailing_data[0])
    assert buffered <= READ_AHEAD_LIMIT + len(request) * 100


class Hanging(FakeApp):
    """`/first` answered after 0.3 s, `/fast` at once, any other path never: `cancelled`
    is set once that one's work is withdrawn."""

    def __init__(self):
        self.cancelled, self.started = asyncio.Event(), asyncio.Event()

    def answer_now(self, request):
        return HttpResponse(404, b"{}") if request.path == "/fast" else None

    async def handle(self, request):
        if request.path == "/first":
            await asyncio.sleep(0.3)
            return HttpResponse(200, b"{}")
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@contextlib.asynccontextmanager
async def pipelining(app: FakeApp, before: bytes):
    """A real loopback connection that sends `before`, then as many pipelined requests
    as the kernels take (reading on the server pauses behind them), and reads answers;
    its client socket."""
    loop = asyncio.get_running_loop()
    connections: list[HttpProtocol] = []

    def protocol() -> HttpProtocol:
        connections.append(HttpProtocol(app, ProtocolSettings(), loop=loop))
        return connections[-1]

    server = await loop.create_server(protocol, "127.0.0.1")
    client = socket.socket()
    client.setblocking(False)

    async def read_answers() -> None:
        with contextlib.suppress(OSError):
            while await loop.sock_recv(client, 65536):
                pass

    reader = None
    try:
        await loop.sock_connect(client, server.sockets[0].getsockname())
        data = before + b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n" * 20_000
        sent = 0
        while sent < len(data):  # as much as the kernels take
            try:
                sent += client.send(data[sent : sent + 65536])
            except BlockingIOError:
                break
            await asyncio.sleep(0)
        assert sent > len(before) + 2 * READ_AHEAD_LIMIT
        reader = asyncio.ensure_future(read_answers())
        yield client
    finally:
        if reader is not None:
            reader.cancel()
        client.close()
        for connection in connections:
            if connection.transport is not None:
                connection.transport.abort()
        await asyncio.sleep(0)
        server.close()
        await server.wait_closed()


def reset(client: socket.socket) -> None:
    """Close `client` with a reset (SO_LINGER 0), as a client that gives up may."""
    import struct

    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


@pytest.mark.parametrize("quick", [0, 300], ids=["alone", "after-quick-answers"])
@pytest.mark.parametrize("leaving", ["reset", "stays"])
async def test_a_client_that_resets_behind_its_pipelined_backlog_has_its_work_withdrawn(
    monkeypatch, leaving, quick
):
    """Past READ_AHEAD_LIMIT pipelined bytes, reading pauses, and a reset by the client is
    read no more: its request's work ran on to its end (a generation to its deadline,
    120 s) for nobody. The kernel holds the reset: it is looked for while reading stays
    paused, after requests answered at once too (a reviewer: reading paused for the other
    connections' turn stayed paused behind the backlog, and none looked)."""
    monkeypatch.setattr("rawserve.protocol.RESET_LOOK_SECONDS", 0.05)
    app = Hanging()
    before = b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n" if quick else b""
    before += b"GET /fast HTTP/1.1\r\nHost: a\r\n\r\n" * quick
    async with pipelining(app, before + b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n") as client:
        await asyncio.wait_for(app.started.wait(), 5)
        await asyncio.sleep(0.3)  # the server reads some, and pauses
        if leaving == "reset":
            reset(client)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(app.cancelled.wait(), 3 if leaving == "reset" else 0.5)
        assert app.cancelled.is_set() == (leaving == "reset")  # (one that stays: served on)


def test_the_chunk_meter_counts_every_byte_sent_and_tiny_chunks_at_a_minimum():
    body = b"5;name=value\r\nhello\r\n0\r\nTrailer: x\r\n\r\n"
    meter = ChunkedMeter(limit=1000)
    meter.feed(body + b"GET / HTTP/1.1")  # (what follows the body is not counted)
    assert meter.done and meter.counted == len(body)
    byte_by_byte = ChunkedMeter(limit=1000)
    for byte in body:
        byte_by_byte.feed(bytes([byte]))
    assert byte_by_byte.done and byte_by_byte.counted == meter.counted
    big = ChunkedMeter(limit=1000)
    big.feed(b"12c\r\n" + b"x" * 300 + b"\r\n")  # over the minimum: its bytes as sent
    assert big.counted == len(b"12c\r\n") + 300 + 2
    announced = ChunkedMeter(limit=1000)
    announced.feed(b"3e9\r\n")  # 1,001 bytes announced: over before any of them arrives
    assert announced.over
    endless = ChunkedMeter(limit=1000)
    endless.feed(b"1;" + b"e" * 2000)  # an extension that never ends
    assert endless.over


def test_a_body_of_tiny_chunks_is_over_the_limit_long_before_its_bytes_are():
    """A chunk costs the event loop a pass of h11 whatever its size: a million 1-byte
    chunks (counted as their 1 MB of data) held the loop, and every other client of the
    process, for 4.7 s (a tester). Refused, it is told why: by its chunks, not its bytes."""
    meter = ChunkedMeter(limit=2**20)
    chunks = 0
    while not meter.over:
        meter.feed(b"1\r\nX\r\n")
        chunks += 1
    assert chunks == CHUNKS_AS_SENT + (2**20 - 6 * CHUNKS_AS_SENT) // MIN_CHUNK_BYTES + 1
    assert meter.too_many_chunks and meter.sent == 6 * chunks
    message = str(refusals.too_many_chunks(2**20, meter.chunks))
    assert f"too many small chunks ({chunks})" in message and "larger chunks" in message
    fat = ChunkedMeter(limit=1000)
    fat.feed(b"3e9\r\n")  # over by its bytes
    assert fat.over and not fat.too_many_chunks


def test_a_body_of_exactly_the_limit_over_only_by_its_tiny_chunks_is_told_so():
    """Its bytes at the limit, it is over by its chunks' minimum cost alone: told to send
    larger chunks, not that its body is over the limit."""
    chunks = CHUNKS_AS_SENT + 1
    meter = ChunkedMeter(limit=6 * chunks)
    for _ in range(chunks):
        meter.feed(b"1\r\nX\r\n")
    assert meter.sent == meter.limit
    assert meter.over and meter.too_many_chunks


def test_the_chunk_meter_takes_a_body_of_exactly_the_limit_and_reads_across_splits():
    exact = ChunkedMeter(limit=len(b"12c\r\n") + 302 + len(b"0\r\n\r\n"))
    exact.feed(b"12c\r\n" + b"x" * 300 + b"\r\n0\r\n\r\n")
    assert exact.done and not exact.over
    split = ChunkedMeter(limit=1000)  # a chunk's data split between two reads
    split.feed(b"5\r\nhel")
    split.feed(b"lo\r\n1;" + b"e" * 2000)
    assert split.over
    # h11 takes chunk sizes of up to 20 digits: leading zeros do not stop the count
    padded = ChunkedMeter(limit=1000)
    padded.feed(b"0" * 19 + b"1;" + b"e" * 600 + b"\r\nx\r\n1;" + b"e" * 600 + b"\r\n")
    assert padded.over
    for refused in (b"0" * 20 + b"1\r\n", b"x\r\n"):  # h11 refuses the body: 400, not 413
        meter = ChunkedMeter(limit=100)
        meter.feed(refused)
        assert meter.done and not meter.over


@pytest.mark.parametrize(
    "body",
    [
        b"1;" + b"e" * 4000 + b"\r\nx\r\n0\r\n\r\n",  # a chunk extension
        b"1\r\nx\r\n0\r\nTrailer: " + b"t" * 4000 + b"\r\n\r\n",  # a trailer field
    ],
    ids=["extension", "trailer"],
)
async def test_a_chunk_line_longer_than_h11_takes_is_413_as_the_body_it_is_part_of(body):
    """Within the body's limit but past the longest unfinished line h11 holds (the head's
    limit): the body's bytes, so 413, not a 431 that speaks of headers."""
    settings = ProtocolSettings(max_body_bytes=1024 * 1024, max_head_bytes=1024)
    protocol = HttpProtocol(EchoApp(), settings, loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head + body[:3000])  # the line arrives in parts, as over a socket
    protocol.data_received(body[3000:])
    await settle()
    [(response, answer)] = read_responses(transport.written, [head])
    assert response.status_code == 413
    assert json.loads(answer)["error"] == "a chunk-size line or trailer field is too long"


@pytest.mark.parametrize(
    "body",
    [b'12\n{"inputs":"hello"}\n0\n\n', b"1\r\nx\r\n0\n\n"],
    ids=["every line", "the last chunk"],
)
async def test_a_chunk_size_line_ended_by_a_bare_line_feed_is_400_at_once(server, body):
    """h11 waits for the CRLF of a chunk-size line: the body sat until --body-timeout
    (30 s), then 408. A trailer line's bare line feed h11 takes, and so does the meter."""
    app, protocol, transport = server
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head + body)
    await settle()
    [(response, answer)] = read_responses(transport.written, [head])
    assert response.status_code == 400 and not app.seen
    assert "chunk-size line must end in CRLF" in json.loads(answer)["error"]
    taken = ChunkedMeter(limit=100)
    taken.feed(b"1\r\nx\r\n0\r\nA: b\n\n")
    assert taken.done and not taken.malformed


@pytest.mark.parametrize("split", [False, True])
async def test_a_chunked_body_of_too_many_trailer_fields_is_refused_before_h11_parses_them(
    split,
):
    """h11 parses trailer fields as it parses header lines (3,000 of them took it 37 ms
    more than none): as a head's, more than 100 are refused (431) as they come."""
    from rawserve.http.head_lines import MAX_HEADER_LINES

    settings = ProtocolSettings(max_body_bytes=1024 * 1024)
    head = b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    answers = []
    for fields in (MAX_HEADER_LINES, MAX_HEADER_LINES + 1):
        app = EchoApp()
        protocol = HttpProtocol(app, settings, loop=asyncio.get_running_loop())
        transport = FakeTransport()
        protocol.connection_made(transport)
        trailers = b"".join(b"T%d: 1\r\n" % i for i in range(fields))
        sent = head + b"2\r\nhi\r\n0\r\n" + trailers + b"\r\n"
        for piece in [sent[i : i + 7] for i in range(0, len(sent), 7)] if split else [sent]:
            protocol.data_received(piece)
        await settle()
        [(response, body)] = read_responses(transport.written, [head])
        answers.append((response.status_code, json.loads(body).get("error"), len(app.seen)))
    assert answers == [
        (200, None, 1),
        (431, f"the chunked body has more than {MAX_HEADER_LINES} trailer fields", 0),
    ]


async def test_a_chunked_body_over_the_limit_on_the_wire_is_413(server):
    app, protocol, transport = server  # max_body_bytes=100
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head + b"1;" + b"e" * 60 + b"\r\nx\r\n" + b"1;" + b"e" * 60)
    await settle()
    assert [r.status_code for r, _ in read_responses(transport.written)] == [413]
    assert not app.seen


async def test_a_chunked_body_whose_framing_comes_in_reads_after_its_head_is_counted(server):
    """Only the bytes that came with the head were counted: a head alone, then tiny chunks
    with long extensions one read each, reached the app far past --max-body-bytes."""
    app, protocol, transport = server  # max_body_bytes=100
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head)  # the head alone, as a socket read often brings it
    for _ in range(50):  # 50 chunks of 1 byte, each in ~70 bytes of framing
        protocol.data_received(b"1;" + b"e" * 60 + b"\r\nx\r\n")
    protocol.data_received(b"0\r\n\r\n")
    await settle()
    assert [r.status_code for r, _ in read_responses(transport.written, [head])] == [413]
    assert not app.seen


async def test_a_body_of_too_many_tiny_chunks_is_told_to_send_larger_chunks():
    """A 413 by its count of chunks says so: the client is told how to send the body
    (larger chunks, or a Content-Length), not that its few bytes are too many."""
    settings = ProtocolSettings(max_body_bytes=2**20)
    protocol = HttpProtocol(EchoApp(), settings, loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(head + b"1\r\nX\r\n" * 10_000)  # 10 KB of data, 10,000 chunks
    await settle()
    [(response, body)] = read_responses(transport.written, [head])
    error = json.loads(body)["error"]
    assert response.status_code == 413 and "too many small chunks" in error
    assert "send it in larger chunks" in error


async def test_a_client_that_reads_nothing_is_cut_off_after_the_write_timeout(caplog):
    loop = FakeTimerLoop(asyncio.get_running_loop())
    settings = ProtocolSettings(write_timeout=3, keepalive_timeout=60)
    protocol = HttpProtocol(EchoApp(), settings, loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\nX-Request-Id: big-1\r\n\r\n")
    await settle()
    protocol.pause_writing()  # its answer filled the buffers: the client reads nothing
    loop.advance(2.9)
    protocol.resume_writing()  # it read some: the clock starts again when it stops again
    protocol.pause_writing()
    loop.advance(2.9)
    assert not transport.closed
    transport.buffered = 12345
    with caplog.at_level("INFO", logger="rawserve.protocol"):
        loop.advance(0.2)
    assert transport.aborted  # what waits to be written is dropped, not flushed forever
    # its access line, written as it was queued, gave the whole size: this one says not
    [line] = [r.getMessage() for r in caplog.records if "--write-timeout" in r.getMessage()]
    assert line.endswith("12345 bytes of its answers were not sent (the last: request big-1)")


async def test_a_connection_gone_while_writing_waited_has_no_write_timeout_line(caplog):
    """The write timeout's timer outlived the connection: a client that reset while its
    answer waited got a "waited 3 s for room" line, and an abort, 3 s after it had gone."""
    loop = FakeTimerLoop(asyncio.get_running_loop())
    protocol = HttpProtocol(EchoApp(), ProtocolSettings(write_timeout=3), loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    transport.buffered = 1000
    protocol.pause_writing()  # the client reads nothing
    protocol.connection_lost(ConnectionResetError())  # ... then resets
    with caplog.at_level("INFO", logger="rawserve.protocol"):
        loop.advance(10)
    assert "--write-timeout" not in caplog.text and not transport.aborted


class EndlessStreamApp(FakeApp):
    """Answers /stream with a 1,000-byte piece, then, once `more` is set, more of them for
    as long as they are read; else JSON."""

    def __init__(self):
        super().__init__()
        self.more = asyncio.Event()

    async def handle(self, request):
        if request.path != "/stream":
            return HttpResponse(200, b"{}")

        async def pieces():
            yield b"x" * 1000
            await self.more.wait()
            while True:
                yield b"x" * 1000

        return HttpResponse(200, content_type="text/event-stream", stream=pieces())


async def test_a_stream_cut_by_the_write_timeout_is_named_and_logs_what_it_sent(caplog):
    """The write timeout's line named the answer logged last (the one before the stream,
    delivered whole; or none), as a stream's access line comes at its end; that line
    gave the bytes left unsent as sent."""
    loop = FakeTimerLoop(asyncio.get_running_loop())
    settings = ProtocolSettings(write_timeout=3, keepalive_timeout=60)
    app = EndlessStreamApp()
    protocol = HttpProtocol(app, settings, loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\nX-Request-Id: whole-1\r\n\r\n")
    await settle()
    protocol.data_received(b"GET /stream HTTP/1.1\r\nHost: a\r\nX-Request-Id: stream-2\r\n\r\n")
    await settle()
    protocol.pause_writing()  # its first piece filled the buffers: the next one waits
    app.more.set()
    await settle()
    transport.buffered = 400
    with caplog.at_level("INFO"):
        loop.advance(3.1)
        assert transport.aborted
        protocol.connection_lost(None)  # (as the event loop's transport tells it)
        await settle()
    [cut] = [r.getMessage() for r in caplog.records if "--write-timeout" in r.getMessage()]
    assert cut.endswith("400 bytes of its answers were not sent (the last: request stream-2)")
    [access] = [r.getMessage() for r in caplog.records if '"GET /stream"' in r.getMessage()]
    assert '"GET /stream" 200 1600 ' in access and access.endswith("stream-2")


def answered_once(
    settings: ProtocolSettings, request: bytes = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
) -> tuple[HttpProtocol, FakeTransport, FakeTimerLoop]:
    """A connection on a hand-driven clock whose first answer, to `request`, was just
    written."""
    loop = FakeTimerLoop(asyncio.get_running_loop())
    protocol = HttpProtocol(EchoApp(), settings, loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    return protocol, transport, loop


@pytest.mark.parametrize("taken", [False, True], ids=["unread", "read-at-last"])
async def test_a_connection_closed_with_some_of_its_answer_unread_is_cut_off_in_time(taken):
    """The transport closes once what waits in it is written; under the high-water mark
    writing never paused, so nothing cut off a client that read none of it: its socket
    stayed open (and counted by the connection cap) for as long as it did not read. At
    the linger's end an answer still going is watched as an idle connection's is: cut
    once its client has taken none of it for --write-timeout, closed once it has gone."""
    settings = ProtocolSettings(write_timeout=3, keepalive_timeout=5)
    request = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    _, transport, loop = answered_once(settings, request)
    await settle()
    transport.buffered = 1000  # of its answer, never taken by its client
    loop.advance(LINGER_SECONDS)
    assert not transport.closed  # still going: not closed under it
    loop.advance(settings.write_timeout - ANSWER_GOING_CHECK)
    assert not transport.closed
    if taken:
        transport.buffered = 0
        loop.advance(ANSWER_GOING_CHECK)
        assert transport.closed and not transport.aborted
    else:
        loop.advance(2 * ANSWER_GOING_CHECK)
        assert transport.aborted  # dropped: the socket closes


async def test_an_answer_still_unread_at_the_idle_deadline_is_cut_at_the_write_timeout(caplog):
    """At keep-alive plus write timeout, an answer its client had taken none of was closed
    normally, without a line: where the kernel held it whole, the socket stayed there
    with it for minutes. It is cut as a stalled write is, and its line says so."""
    settings = ProtocolSettings(write_timeout=3, keepalive_timeout=5)
    request = b"GET / HTTP/1.1\r\nHost: a\r\nX-Request-Id: unread-1\r\n\r\n"
    _, transport, loop = answered_once(settings, request)
    await settle()
    transport.buffered = 1000  # of its answer, never taken by its client
    with caplog.at_level("INFO", logger="rawserve.protocol"):
        loop.advance(5 + settings.write_timeout - ANSWER_GOING_CHECK)
        assert not transport.finished
        loop.advance(2 * ANSWER_GOING_CHECK)
    assert transport.aborted  # a reset: what the kernel holds unsent goes too
    [line] = [r.getMessage() for r in caplog.records if "--write-timeout" in r.getMessage()]
    assert line.endswith("1000 bytes of its answers were not sent (the last: request unread-1)")


async def test_a_client_reading_its_answer_slowly_after_the_idle_deadline_is_not_cut():
    """The write timeout after the idle deadline was counted from its first look: a
    client reading a 1.4 MB answer steadily for 17 s was closed at keep-alive plus write
    timeout, and its next request met the close. It bounds a time with none taken."""
    protocol, transport, loop = answered_once(
        ProtocolSettings(keepalive_timeout=5, write_timeout=3)
    )
    await settle()
    transport.buffered = 400_000
    for _ in range(40):  # 20 s, some taken every half second
        loop.advance(0.5)
        transport.buffered -= 5_000
    loop.advance(2.4)  # then none taken, for less than the write timeout
    assert not transport.finished
    transport.buffered = 0  # all of it taken: the keep-alive time starts at the next look
    loop.advance(ANSWER_GOING_CHECK + 4.5)
    protocol.data_received(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    await settle()
    assert len(read_responses(transport.written)) == 2 and not transport.finished


async def test_a_client_that_stops_reading_after_the_idle_deadline_is_cut_then():
    protocol, transport, loop = answered_once(
        ProtocolSettings(keepalive_timeout=5, write_timeout=3)
    )
    await settle()
    transport.buffered = 400_000
    for _ in range(20):  # 5 s past the idle deadline, reading on ... then no more
        loop.advance(0.5)
        transport.buffered -= 5_000
    loop.advance(2.4)  # (taken at the last look, just after the loop's last step)
    assert not transport.finished
    loop.advance(1.5)
    assert transport.aborted


class BigAnswerApp(FakeApp):
    async def handle(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"x" * (4 << 20))


async def test_the_event_loops_own_transport_pauses_writing_for_a_client_that_reads_nothing():
    """On the standard event loop's socket transport (--loop asyncio), not a fake: its
    writelines never pauses writing on Python 3.12 and 3.13, so a client that read nothing
    was never cut off and its answer stayed buffered."""
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    protocol = HttpProtocol(
        BigAnswerApp(), ProtocolSettings(write_timeout=0.2, keepalive_timeout=60), loop=loop
    )
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, ours)
    try:
        peer.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        async with asyncio.timeout(10):
            while not transport.is_closing():  # the write timeout aborts it
                await asyncio.sleep(0.05)
    finally:
        transport.abort()
        peer.close()


# an answer the kernel's send buffer takes whole on Linux's loopback (tcp_wmem grows it
# to 4 MiB), as /embed_all's to 32 long inputs is
KERNEL_SIZED_ANSWER = 400_000


class KernelSizedAnswerApp(FakeApp):
    async def handle(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"x" * KERNEL_SIZED_ANSWER)


async def served_to_a_small_window(
    settings: ProtocolSettings, state: ServerState | None = None, last: bool = False
) -> tuple[asyncio.Server, HttpProtocol, socket.socket]:
    """A real loopback connection whose client's window is 4 KB, its request sent."""
    loop = asyncio.get_running_loop()
    connections: list[HttpProtocol] = []

    def protocol() -> HttpProtocol:
        connections.append(HttpProtocol(KernelSizedAnswerApp(), settings, state, loop=loop))
        return connections[-1]

    server = await loop.create_server(protocol, "127.0.0.1")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await loop.sock_connect(client, server.sockets[0].getsockname())
    closing = b"Connection: close\r\n" if last else b""  # (`last`: its last request)
    await loop.sock_sendall(client, b"GET /a HTTP/1.1\r\nHost: a\r\n" + closing + b"\r\n")
    async with asyncio.timeout(10):
        while not connections or connections[0].last_request_id == "-":  # until answered
            await asyncio.sleep(0.01)
    return server, connections[0], client


async def closed_down(server: asyncio.Server, client: socket.socket) -> None:
    client.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("last", [False, True], ids=["kept-alive", "connection-close"])
async def test_an_answer_the_kernel_holds_whole_is_reset_at_the_write_timeout(caplog, last):
    """A client that reads none of an answer the kernel's send buffer took whole (the
    transport's empty: writing never paused) was closed normally at keep-alive plus
    write timeout (or, its last answer, at the linger's end), without a line, and its
    socket stayed in FIN-WAIT-1 with the answer for minutes. It is reset, and the line
    counts what the kernel held."""
    settings = ProtocolSettings(keepalive_timeout=0.2, write_timeout=0.5)
    with caplog.at_level("INFO", logger="rawserve.protocol"):
        server, protocol, client = await served_to_a_small_window(settings, last=last)
        try:
            transport = cast(asyncio.Transport, protocol.transport)
            async with asyncio.timeout(10):
                while not transport.is_closing():
                    await asyncio.sleep(0.05)
        finally:
            await closed_down(server, client)
    [line] = [r.getMessage() for r in caplog.records if "--write-timeout" in r.getMessage()]
    unsent = int(re.search(r"(\d+) bytes of its answers were not sent", line)[1])
    assert unsent > KERNEL_SIZED_ANSWER // 2  # all but what the client's window took


async def test_a_client_reading_steadily_past_the_idle_deadline_keeps_its_connection():
    """Over a real socket: a client reading its answer slowly, but on and on, for well
    past keep-alive plus write timeout, asks again on the same connection."""
    loop = asyncio.get_running_loop()
    settings = ProtocolSettings(keepalive_timeout=0.2, write_timeout=1.5)
    server, protocol, client = await served_to_a_small_window(settings)
    reader = h11.Connection(h11.CLIENT)
    reader.send(h11.Request(method="GET", target="/a", headers=[("Host", "a")]))
    reader.send(h11.EndOfMessage())
    try:
        async with asyncio.timeout(60):
            started = loop.time()
            assert await answered(reader, client, pause=0.03) == 200
            assert loop.time() - started > 0.2 + 1.5 + ANSWER_GOING_CHECK  # read slowly
            reader.start_next_cycle()
            again = h11.Request(method="GET", target="/b", headers=[("Host", "a")])
            await loop.sock_sendall(client, reader.send(again) or b"")
            reader.send(h11.EndOfMessage())
            assert await answered(reader, client, pause=0) == 200
    finally:
        await closed_down(server, client)


async def answered(reader: h11.Connection, client: socket.socket, pause: float) -> int:
    """The status of the answer `client` reads whole, a few KB at a time, `pause`
    seconds apart."""
    loop = asyncio.get_running_loop()
    status = 0
    while True:
        event = reader.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.EndOfMessage):
            return status
        elif event is h11.NEED_DATA:
            await asyncio.sleep(pause)
            reader.receive_data(await loop.sock_recv(client, 4096))


async def test_a_connection_whose_answer_the_kernel_holds_keeps_its_seat_at_the_cap():
    """Past --max-connections the one idle longest gives way unless still sending; an
    answer the kernel held whole did not count, so each new client closed one that read
    nothing, its socket kept by the kernel with the answer, uncounted: 40 clients held
    their answers in FIN-WAIT-1 under a cap of 20."""
    loop = asyncio.get_running_loop()
    state = ServerState()
    settings = ProtocolSettings(keepalive_timeout=60, write_timeout=60, max_connections=1)
    server, protocol, client = await served_to_a_small_window(settings, state)
    try:
        transport = cast(asyncio.Transport, protocol.transport)
        for _ in range(100):  # written out of the transport: Linux's kernel takes it all
            if not transport.get_write_buffer_size():
                break
            await asyncio.sleep(0.05)

        class Newcomer:
            cycle = None
            sending = False

            def close(self) -> None:
                pass

        later = loop.time() + GIVE_WAY_AFTER + 1  # idle long enough to give way
        assert not state.connections.take(Newcomer(), 1, later)
        assert protocol.phase is Phase.IDLE and not transport.is_closing()
    finally:
        await closed_down(server, client)


async def test_a_refusal_answered_from_the_head_is_a_whole_keep_alive_503():
    protocol, transport = connected_to(App())
    refused = b"POST /now-refused HTTP/1.1\r\nHost: a\r\nX-Request-Id: r-1\r\n"
    refused += b"Content-Length: 5\r\n\r\nhello"
    protocol.data_received(refused + b"GET /now-next HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    [(first, body), (second, next_body)] = read_responses(transport.written)
    headers = dict(first.headers)
    assert first.status_code == 503 and headers[b"retry-after"] == b"2"
    assert headers[b"x-request-id"] == b"r-1" and headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {"error": "queue full", "error_type": "unavailable"}
    assert b"connection" not in headers and b"server-timing" in headers
    assert (second.status_code, next_body) == (200, b"/now-next")  # the same connection
    assert not transport.finished


async def test_a_refusal_to_an_http_1_0_client_still_closes():
    protocol, transport = connected_to(App())
    protocol.data_received(b"POST /now-refused HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    await settle()
    [(response, _)] = read_responses(transport.written)
    assert response.status_code == 503 and transport.finished


async def test_while_draining_every_answer_says_the_connection_closes():
    # The drain ends by closing every connection: one left open after an answer would be
    # closed later without a word, under a pooled client that may be sending on it.
    app = App()
    protocol, transport = connected_to(app)
    protocol.data_received(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    app.draining = True  # a stop signal, while the request is in progress
    app.release.set()
    await settle()
    [(response, _)] = read_responses(transport.written)
    assert response.status_code == 200 and (b"connection", b"close") in response.headers
    assert transport.finished
    probe, probe_transport = connected_to(app)
    probe.data_received(b"GET /now-probe HTTP/1.1\r\nHost: a\r\n\r\n")  # answered at once
    [(response, _)] = read_responses(probe_transport.written)
    assert response.status_code == 200 and (b"connection", b"close") in response.headers
    assert probe_transport.finished


@pytest.mark.parametrize("draining", [True, False])
async def test_a_stream_begun_before_a_drain_closes_its_connection_at_its_end(draining):
    """Its head went out before the drain began, saying nothing of a close: the
    connection was kept after the stream ended, and a pooled client sending its next
    request on it got a 503, or a reset as the drain ended a moment later (a tester)."""
    app = GatedStreamApp()
    protocol, transport = connected_to(app)
    protocol.data_received(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
    await settle()
    assert b"connection: close" not in transport.written.lower()
    app.draining = draining  # a stop signal, while the stream runs
    app.gate.set()
    await settle()
    assert b"data: 1" in transport.written and transport.written.endswith(b"0\r\n\r\n")
    assert transport.finished is draining


def test_reason_phrases_are_rfc_9110s():
    assert [reason(s) for s in (200, 413, 416, 422, 503, 299)] == [
        "OK",
        "Content Too Large",
        "Range Not Satisfiable",
        "Unprocessable Content",
        "Service Unavailable",
        "",
    ]


def h11_written(status: int, fields: list[tuple[str, str]], body: bytes) -> bytes:
    """What h11 writes for this answer to a keep-alive request it read whole."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    while conn.next_event() is not h11.NEED_DATA:
        pass
    written = conn.send(h11.Response(status_code=status, headers=fields, reason=reason(status)))
    written += conn.send(h11.Data(data=body)) if body else b""
    written += conn.send(h11.EndOfMessage()) or b""
    assert conn.our_state is h11.DONE and conn.their_state is h11.DONE  # the connection stays
    return written


@pytest.mark.parametrize(
    ("status", "content_type", "headers"),
    [
        (200, "application/json", ()),
        (201, "text/plain; charset=utf-8", (("X-Custom", "a  b"), ("x-lower", "v"))),
        (503, "application/json", (("Retry-After", "2"),)),
        (404, "", (("Access-Control-Allow-Origin", "https://a.example"), ("Vary", "Origin"))),
        (299, "application/json", ()),  # no reason phrase
        (413, "application/json", ()),
        (422, "application/json", ()),
        (200, "application/json", (("Server-Timing", 'queue;dur=0.10, batch;desc="3"'),)),
        (200, "application/json", (("X-Tab", "a\tb"), ("X-Empty", ""), ("x~!#$%&'*+.^_`|", "~"))),
    ],
)
def test_a_head_written_by_hand_is_the_bytes_h11_writes(status, content_type, headers, monkeypatch):
    monkeypatch.setattr(response_head, "http_date", lambda: "Thu, 03 Dec 2026 09:00:00 GMT")
    body = b'{"x": 1}'
    if all(name != "Server-Timing" for name, _ in headers):
        headers += (("Server-Timing", "app;dur=1"),)  # timed by the app: no clock in the bytes
    head = render_kept(status, content_type, headers, len(body))
    own = render_request_fields(HttpResponse(status, headers=list(headers)), "r-1", 0.0)
    fields = fixed_fields(content_type, headers, len(body), False) + (
        ("Date", "Thu, 03 Dec 2026 09:00:00 GMT"),
        ("X-Request-Id", "r-1"),
    )
    assert head is not None and head + own + body == h11_written(status, list(fields), body)


def test_an_answer_of_no_type_writes_no_content_type_field():
    """A preflight's 204 has no type: no `Content-Type:` field goes out, empty or not."""
    assert [name for name, _ in fixed_fields("", (), None, False)] == ["Server"]
    assert ("Content-Type", "application/json") in fixed_fields("application/json", (), 2, False)


def test_a_repeated_header_reads_as_its_first_value():
    """The protocol reads a repeated field's first value (an Origin, a Content-Type): the
    app reads the same one, or a preflight sent two Origins is judged on another than
    the protocol's refusals were."""
    fields = [("origin", "https://app.example"), ("origin", "https://evil.example")]
    fields += [("access-control-request-method", "POST")]
    fields += [("content-type", "application/json"), ("content-type", "text/plain")]
    request = HttpRequest("OPTIONS", "/", "", fields, b"", "id")
    assert request.header("content-type") == "application/json"
    response = CorsPolicy(["https://app.example"]).preflight(request, {"POST"})
    assert dict(response.headers)["Access-Control-Allow-Origin"] == "https://app.example"


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (204, ()),  # h11 frames no body, whatever Content-Length says
        (304, ()),
        (101, ()),  # not a final answer: h11 refuses it
        (200, (("Host", "a"),)),  # h11 writes Host first
        (200, (("Connection", "close"),)),  # h11 rewrites these three
        (200, (("Content-Length", "3"),)),
        (200, (("Transfer-Encoding", "chunked"),)),
        (200, (("X-Split", "a\r\nInjected: 1"),)),  # h11 refuses it: logged, closed
        (200, (("X-Name", "caf\u00e9"),)),  # h11 writes ASCII only
        (200, (("X-Space", " leading"),)),  # outside the grammar: h11 refuses these
        (200, (("X-Space", "trailing\t"),)),
        (200, (("X-Nul", "a\x00b"),)),
        (200, (("X-Del", "a\x7fb"),)),  # obs-text and DEL: h11 decides
        (200, (("Bad Name", "v"),)),
        (200, (("", "v"),)),
    ],
)
def test_a_head_h11_would_write_its_own_way_is_left_to_h11(status, headers):
    assert render_kept(status, "application/json", headers, 3) is None


def json_depth(value: Any) -> int:
    """Levels of nested arrays and objects, counted on the parsed document."""
    children = value.values() if isinstance(value, dict) else value
    if isinstance(value, (list, dict)):
        return 1 + max((json_depth(child) for child in children), default=0)
    return 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab:,'),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(alphabet='[]{}"\\a', max_size=4), children, max_size=4)
    ),
    max_leaves=30,
)


@given(JSON_VALUES, st.integers(min_value=0, max_value=8), st.booleans())
def test_the_depth_read_from_the_bytes_is_the_documents(value, limit, ascii_only):
    """The depth check reads the body's brackets outside strings (in C), where it walked
    the parsed document in Python: the two agree, whatever the strings hold."""
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nested_deeper_than(body, limit) == (json_depth(value) > limit)


# --- the TLS files and context (`--ssl-certfile`, `--ssl-keyfile`) ---------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A certificate and its key, another's key, the key encrypted, and an expired
    certificate, from a throwaway CA."""
    import trustme
    from cryptography.hazmat.primitives import serialization

    folder = tmp_path_factory.mktemp("tls-files")
    ca = trustme.CA()
    issued, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    files = {name: folder / f"{name}.pem" for name in ("cert", "key", "other", "encrypted")}
    issued.cert_chain_pems[0].write_to_path(str(files["cert"]))
    issued.private_key_pem.write_to_path(str(files["key"]))
    other.private_key_pem.write_to_path(str(files["other"]))
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
    files["encrypted"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    now = datetime.datetime.now(datetime.UTC)
    expired = ca.issue_cert(
        "127.0.0.1",
        not_before=now - datetime.timedelta(days=10),
        not_after=now - datetime.timedelta(days=1),
    )
    files["expired"] = folder / "expired.pem"
    expired.cert_chain_pems[0].write_to_path(str(files["expired"]))
    return {name: str(path) for name, path in files.items()}


def test_the_tls_context_offers_http_1_1_by_alpn(tls_files):
    """A client offering h2 and http/1.1 (curl, browsers) must be told http/1.1: with no
    ALPN answer some clients assume nothing, and h2 clients fail to negotiate."""
    context = server_context(tls_files["cert"], tls_files["key"])
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    client.set_alpn_protocols(["h2", "http/1.1"])
    server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
    server = context.wrap_bio(server_in, server_out, server_side=True)
    peer = client.wrap_bio(client_in, client_out, server_hostname="localhost")
    for _ in range(10):  # the handshake, bytes passed by hand
        for side in (peer, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        server_in.write(client_out.read())
        client_in.write(server_out.read())
    assert server.selected_alpn_protocol() == "http/1.1"
    assert peer.selected_alpn_protocol() == "http/1.1"


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("other", "does not match the certificate in"),
        ("encrypted", "is encrypted: give it without a passphrase"),
    ],
    ids=["key-of-another", "encrypted-key"],
)
def test_a_key_that_cannot_serve_the_certificate_is_named_with_what_is_wrong(tls_files, key, says):
    """Not OpenSSL's "[SSL] PEM lib", nor its prompt for a passphrase on the terminal of a
    server started unattended."""
    with pytest.raises(ValueError) as caught:
        server_context(tls_files["cert"], tls_files[key])
    message = str(caught.value)
    assert says in message and tls_files[key] in message


def test_an_expired_certificate_is_warned_of_with_its_date(tls_files):
    now = datetime.datetime.now(datetime.UTC)
    said = validity_warning(tls_files["expired"], now)
    expired_on = (now - datetime.timedelta(days=1)).strftime("%Y-%m-%d")
    assert said is not None and f"expired on {expired_on}" in said
    assert validity_warning(tls_files["cert"], now) is None


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"Authorization: Bearer sk-test-0123456789abcdef\x00", "field 'Authorization'"),
        (b"Authorization: Bearer sk-test-0123456789abcdef\rx", "field 'Authorization'"),
        (b"sk-test-0123456789abcdef", "a line with no field name"),
    ],
)
def test_a_malformed_header_line_is_logged_without_its_value(caplog, line, said):
    """h11 quotes a line it cannot read whole: an API key ending in a stray NUL or CR (a
    key read from a file with Windows line ends) was written to the debug log."""
    from rawserve.http.refusals import protocol_error

    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n\r\n")
    with pytest.raises(h11.RemoteProtocolError) as raised:
        connection.next_event()
    with caplog.at_level(logging.DEBUG, logger="rawserve.protocol"):
        error = protocol_error(raised.value)
    assert error.status == 400
    [logged] = [r.getMessage() for r in caplog.records]
    assert said in logged and "sk-test" not in logged, logged


@pytest.mark.parametrize(
    ("peer", "named"),
    [
        (("127.0.0.1", 50000), "127.0.0.1:50000"),
        (("::1", 55436, 0, 0), "[::1]:55436"),  # was `::1:55436`: where the port starts?
        ("/run/rawserve.sock", "-"),  # a Unix socket's peer has no address
        (None, "-"),
    ],
)
def test_a_peer_is_named_as_nginx_and_urls_name_it(peer, named):
    from rawserve.protocol import _peer

    assert _peer(peer) == named

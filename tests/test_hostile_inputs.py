"""Hostile and malformed input: each case is bytes a peer may send and the exact outcome.

The outcome is the list of response statuses (parsed with an h11 client) and whether the
server then ends the connection. Read timeouts run on a hand-driven timer, so a case
that stalls ends in 408 (or a quiet close when nothing at all was sent) without waiting.
A property test then feeds arbitrary byte streams split at arbitrary points.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.protocol import HttpProtocol, ProtocolSettings
from tests.fake_transport import (
    FakeApp,
    FakeTimerLoop,
    FakeTransport,
    count_responses,
    read_responses,
)

LIMITS = ProtocolSettings(
    max_body_bytes=100,
    max_head_bytes=1024,
    keepalive_timeout=5,
    head_timeout=10,
    body_timeout=10,
)
HOST = b"Host: a\r\n"


class EchoApp(FakeApp):
    """Answers 200 with what it got; the protocol alone decides every other status."""

    def __init__(self):
        self.seen: list[HttpRequest] = []

    async def handle(self, request: HttpRequest) -> HttpResponse:
        self.seen.append(request)
        document = {"method": request.method, "path": request.path, "body": request.body.hex()}
        return HttpResponse(200, json.dumps(document).encode())


@dataclass
class Outcome:
    protocol: HttpProtocol
    transport: FakeTransport
    app: EchoApp
    responses: list[tuple[h11.Response, bytes]]
    kept_open: bool  # still open once answered, before the read timers ran out

    @property
    def statuses(self) -> list[int]:
        return [response.status_code for response, _ in self.responses]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def exchange(
    chunks: list[bytes], *, eof: bool = False, wait: float = 60.0, pause_between: bool = True
) -> Outcome:
    """Feed `chunks`, optionally half-close, let the read timers run out, parse the answer."""
    loop = FakeTimerLoop(asyncio.get_running_loop())
    app = EchoApp()
    protocol = HttpProtocol(app, LIMITS, loop=loop)  # type: ignore[arg-type]
    transport = FakeTransport()
    protocol.connection_made(transport)
    for chunk in chunks:
        if transport.closed:
            break  # a real transport stops delivering once closed
        protocol.data_received(chunk)
        if pause_between:
            await settle()
    await settle()
    if eof and not transport.closed and not protocol.eof_received():
        transport.close()
        protocol.connection_lost(None)
    await settle()
    kept_open = not transport.finished
    loop.advance(wait)
    await settle()
    return Outcome(protocol, transport, app, read_responses(transport.written), kept_open)


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    statuses: list[int]
    closes: bool = True  # the server ends the connection afterwards
    eof: bool = False  # the client half-closes after sending


def get(extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"GET / HTTP/" + version + b"\r\n" + HOST + extra + b"\r\n"


def post(headers: bytes, body: bytes = b"") -> bytes:
    return b"POST / HTTP/1.1\r\n" + HOST + headers + b"\r\n" + body


CHUNKED = b"Transfer-Encoding: chunked\r\n"
TLS_CLIENT_HELLO = bytes.fromhex("16030100f4010000f00303") + bytes(32) + b"\x00\x02\x13\x01"

CASES = [
    # --- well-formed, as a baseline ---
    Case("plain GET", get(), [200], closes=False),
    Case("POST with Content-Length", post(b"Content-Length: 5\r\n", b"hello"), [200], False),
    Case("chunked POST", post(CHUNKED, b"5\r\nhello\r\n0\r\n\r\n"), [200], closes=False),
    Case("chunk extension", post(CHUNKED, b"5;a=b\r\nhello\r\n0\r\n\r\n"), [200], False),
    Case("chunked trailer", post(CHUNKED, b"1\r\nx\r\n0\r\nT: 1\r\n\r\n"), [200], False),
    Case("HTTP/1.0 closes after", b"GET / HTTP/1.0\r\n\r\n", [200]),
    Case("Connection: close", get(b"Connection: close\r\n"), [200]),
    Case("two pipelined", get() + get(), [200, 200], closes=False),
    Case("latin-1 header value is opaque", get(b"X-Name: caf\xe9\r\n"), [200], False),
    Case("obs-fold is unfolded (RFC 9112 5.2)", get(b"X-A: 1\r\n 2\r\n"), [200], False),
    Case(
        "Upgrade is declined by answering",
        get(b"Upgrade: h2c\r\nConnection: upgrade\r\n"),
        [200],
        False,
    ),
    Case(
        "identical duplicate lengths (RFC 9112 6.3)",
        post(b"Content-Length: 1\r\nContent-Length: 1\r\n", b"x"),
        [200],
        False,
    ),
    Case("a length list of one value", post(b"Content-Length: 1, 1\r\n", b"x"), [200], False),
    Case(
        "body smuggled inside a body stays a body",
        post(b"Content-Length: 32\r\n", get(b"X: yy\r\n")[:32]),
        [200],
        False,
    ),
    # --- request smuggling: two framings, conflicting lengths ---
    Case(
        "Content-Length and Transfer-Encoding",
        post(b"Content-Length: 4\r\n" + CHUNKED, b"0\r\n\r\n"),
        [400],
    ),
    Case(
        "Transfer-Encoding and Content-Length",
        post(CHUNKED + b"Content-Length: 4\r\n", b"0\r\n\r\n"),
        [400],
    ),
    Case(
        "conflicting Content-Length headers",
        post(b"Content-Length: 1\r\nContent-Length: 2\r\n", b"xy"),
        [400],
    ),
    Case("conflicting length list", post(b"Content-Length: 1, 2\r\n", b"xy"), [400]),
    Case("negative length", post(b"Content-Length: -1\r\n"), [400]),
    Case("signed length", post(b"Content-Length: +1\r\n", b"x"), [400]),
    Case("hex length", post(b"Content-Length: 0x1\r\n", b"x"), [400]),
    Case("length with inner space", post(b"Content-Length: 1 1\r\n", b"x"), [400]),
    Case("21-digit length", post(b"Content-Length: " + b"9" * 21 + b"\r\n"), [400]),
    Case(
        "20-digit length is over the limit", post(b"Content-Length: " + b"9" * 20 + b"\r\n"), [413]
    ),
    Case("length over --max-body-bytes", post(b"Content-Length: 101\r\n", b"x" * 101), [413]),
    Case("Transfer-Encoding gzip", post(b"Transfer-Encoding: gzip\r\n"), [400]),
    Case("Transfer-Encoding list", post(b"Transfer-Encoding: gzip, chunked\r\n"), [400]),
    Case("two Transfer-Encoding headers", post(CHUNKED + CHUNKED, b"0\r\n\r\n"), [400]),
    Case("Transfer-Encoding xchunked", post(b"Transfer-Encoding: xchunked\r\n"), [400]),
    Case("chunked on HTTP/1.0", b"POST / HTTP/1.0\r\n" + CHUNKED + b"\r\n0\r\n\r\n", [400]),
    # --- bad chunks ---
    Case("chunk size not hex", post(CHUNKED, b"zz\r\nhello\r\n0\r\n\r\n"), [400]),
    Case("negative chunk size", post(CHUNKED, b"-5\r\nhello\r\n0\r\n\r\n"), [400]),
    Case("0x chunk size", post(CHUNKED, b"0x5\r\nhello\r\n0\r\n\r\n"), [400]),
    Case("overflowing chunk size", post(CHUNKED, b"f" * 21 + b"\r\n"), [400]),
    Case("chunk longer than its size", post(CHUNKED, b"2\r\nhello\r\n0\r\n\r\n"), [400]),
    Case(
        "chunks add up past the limit",
        post(CHUNKED, b"40\r\n" + b"x" * 64 + b"\r\n" + b"40\r\n" + b"x" * 64 + b"\r\n0\r\n\r\n"),
        [413],
    ),
    # --- not HTTP/1.x at all ---
    Case("TLS ClientHello on the plain port", TLS_CLIENT_HELLO, [400]),
    Case("binary garbage", b"\xff\xfe\xfd\x00garbage", [400]),
    Case("NUL first", b"\x00GET / HTTP/1.1\r\n\r\n", [400]),
    Case("HTTP/2 prior-knowledge preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", [400]),
    Case("HTTP/2.0 request line", get(version=b"2.0"), [400]),
    Case("HTTP/1.2 request line", get(version=b"1.2"), [400]),
    Case("lower-case protocol name", b"GET / http/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("request line without a version", b"GET /\r\n\r\n", [400]),
    Case("request line with two spaces", b"GET  / HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("space inside the target", b"GET /a b HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    # RFC 9112 section 2.2: empty lines before a request line are skipped
    Case("blank lines only: idle close, no answer", b"\r\n\r\n", [], closes=False),
    Case("blank line before the request", b"\r\n" + get(), [200], closes=False),
    Case("bare LFs before the request", b"\n\n" + get(), [200], closes=False),
    Case("target in authority form", b"GET a:80 HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("asterisk target on GET", b"GET * HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("fragment in the target", b"GET /health#x HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case(
        "SSH banner: h11 waits for a blank line, the head timer ends it",
        b"SSH-2.0-OpenSSH_9.6\r\n",
        [408],
    ),
    # --- NUL bytes, non-ASCII, header syntax ---
    Case("NUL in the method", b"G\x00T / HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("NUL in the target", b"GET /\x00 HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("NUL in a header value", get(b"X: a\x00b\r\n"), [400]),
    Case("non-ASCII in the target", b"GET /\xc3\xa9 HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case("non-ASCII in a header name", get(b"X-\xff: 1\r\n"), [400]),
    Case("bare CR inside a header", get(b"X: a\rb\r\n"), [400]),
    Case("space before the colon", get(b"X : a\r\n"), [400]),
    Case("header line without a colon", get(b"NoColonHere\r\n"), [400]),
    Case("missing Host on HTTP/1.1", b"GET / HTTP/1.1\r\n\r\n", [400]),
    Case("two Host headers", get(b"Host: b\r\n"), [400]),
    # RFC 9112 section 3.2: a Host that is no uri-host[:port] is 400, as nginx answers
    Case("space inside Host", b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", [400]),
    Case("path inside Host", b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", [400]),
    Case("user inside Host", b"GET / HTTP/1.1\r\nHost: u@a\r\n\r\n", [400]),
    Case("port not in digits", b"GET / HTTP/1.1\r\nHost: a:b\r\n\r\n", [400]),
    Case("bad Host on HTTP/1.0", b"GET / HTTP/1.0\r\nHost: a b\r\n\r\n", [400]),
    Case("IPv6 Host", b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", [200], closes=False),
    Case("empty Host", b"GET / HTTP/1.1\r\nHost:\r\n\r\n", [200], closes=False),
    Case("method with a parenthesis", b"GE(T / HTTP/1.1\r\n" + HOST + b"\r\n", [400]),
    Case(
        "CONNECT tunnel",
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        [400],
    ),
    Case("valid request then garbage", get() + b"\x16\x03\x01garbage\r\n\r\n", [200, 400]),
    # --- size limits (head limit here: 1 KiB) ---
    Case("one huge header, whole", get(b"X: " + b"a" * 2000 + b"\r\n"), [431]),
    Case("one huge header, unfinished", b"GET / HTTP/1.1\r\nX: " + b"a" * 2000, [431]),
    Case("many small headers", get(b"".join(b"X-%d: 1\r\n" % i for i in range(200))), [431]),
    Case("huge target", b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\n" + HOST + b"\r\n", [414]),
    Case("huge target, unfinished", b"GET /" + b"a" * 2000, [414]),
    Case("huge target after a blank line", b"\r\nGET /" + b"a" * 2000, [414]),
    Case("huge method", b"A" * 2000 + b" / HTTP/1.1\r\n" + HOST + b"\r\n", [414]),
    # --- slow or vanishing clients (timers run out; EOF is a half-close) ---
    Case("nothing sent: idle close, no answer", b"", []),
    Case("half a request line, then silence", b"GET / HT", [408]),
    Case("head without its blank line, then silence", b"GET / HTTP/1.1\r\n" + HOST, [408]),
    Case(
        "body shorter than its length, then silence", post(b"Content-Length: 10\r\n", b"abc"), [408]
    ),
    Case("chunked body never finished, then silence", post(CHUNKED, b"5\r\nhello\r\n"), [408]),
    Case("half a head, then EOF", b"GET / HTTP/1.1\r\n", [400], eof=True),
    Case("half a body, then EOF", post(b"Content-Length: 10\r\n", b"abc"), [400], eof=True),
]


def test_there_are_at_least_forty_hostile_cases():
    assert len(CASES) >= 40 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_hostile_input_gets_its_exact_outcome(case: Case):
    outcome = await exchange([case.data] if case.data else [], eof=case.eof)
    assert outcome.statuses == case.statuses
    if case.closes:
        assert outcome.transport.finished
    else:
        assert outcome.kept_open  # (and the idle timer closed it quietly later)
    assert count_responses(outcome.transport.written) == len(case.statuses)  # nothing else
    for response, body in outcome.responses:
        headers = dict(response.headers)
        assert headers[b"x-request-id"] and headers[b"server-timing"]
        if response.status_code >= 400:
            assert headers[b"connection"] == b"close"
            document = json.loads(body)
            assert set(document) == {"error", "error_type"}
            assert "Traceback" not in document["error"] and "h11" not in document["error"]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (post(CHUNKED + b"Content-Length: 5\r\n", b"0\r\n\r\n"), "conflicting Content-Length"),
        (b"POST / HTTP/1.0\r\n" + CHUNKED + b"\r\n0\r\n\r\n", "on HTTP/1.0"),
    ],
    ids=["two framings", "chunked on HTTP/1.0"],
)
async def test_a_refused_framing_says_which_it_is(data, says):
    """Chunked on HTTP/1.0 was refused as "conflicting Content-Length and
    Transfer-Encoding", with no Content-Length sent (a tester)."""
    outcome = await exchange([data])
    [(response, body)] = outcome.responses
    assert response.status_code == 400 and says in json.loads(body)["error"]


# Long inputs are covered whole above and split at random points by the property test.
SHORT_CASES = [c for c in CASES if c.data and len(c.data) <= 300]


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: c.name)
async def test_the_same_bytes_one_at_a_time_get_the_same_outcome(case: Case):
    """Splitting changes nothing: every boundary is a place h11 must resume from."""
    data = case.data
    outcome = await exchange([data[i : i + 1] for i in range(len(data))], eof=case.eof)
    assert outcome.statuses == case.statuses
    assert outcome.transport.finished if case.closes else outcome.kept_open


async def test_a_header_injection_attempt_never_reaches_the_response_headers():
    data = get(b"X-Request-Id: ok\r\nSet-Cookie: stolen=1\r\n")
    outcome = await exchange([data])
    [(response, _)] = outcome.responses
    names = [name for name, _ in response.headers]
    assert b"set-cookie" not in names
    assert dict(response.headers)[b"x-request-id"] == b"ok"


@pytest.mark.parametrize(
    "given",
    [b"a" * 129, b"has space", b'quote"d', b"tab\there", b"caf\xe9", b""],
    ids=["too long", "space", "quote-ok", "tab", "non-ascii", "empty"],
)
async def test_an_unsafe_request_id_is_replaced(given: bytes):
    outcome = await exchange([get(b"X-Request-Id: " + given + b"\r\n")])
    [(response, _)] = outcome.responses
    echoed = dict(response.headers)[b"x-request-id"]
    if given == b'quote"d':
        assert echoed == given  # visible ASCII is echoed as is
    else:
        assert echoed != given and len(echoed) == 32  # a generated id: 32 hex digits


# --- property: arbitrary bytes, arbitrary splits --------------------------------------

FRAGMENTS = [
    get(),
    get(b"Connection: close\r\n"),
    b"GET / HTTP/1.0\r\n\r\n",
    post(b"Content-Length: 5\r\n", b"hello"),
    post(b"Expect: 100-continue\r\nContent-Length: 2\r\n", b"hi"),
    post(CHUNKED),
    b"5\r\nhello\r\n",
    b"0\r\n\r\n",
    b"Content-Length: 3\r\n",
    CHUNKED,
    HOST,
    b"\r\n",
    b"GET / HTTP/1.1\r\n",
    b"\x00",
    b"\xff\xfe",
    TLS_CLIENT_HELLO,
    b"X: " + b"a" * 600 + b"\r\n",
]

streams = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=40)), min_size=1, max_size=8
).map(b"".join)


@settings(max_examples=200, deadline=None)
@given(
    data=streams,
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
    settle_between=st.booleans(),
    eof=st.booleans(),
)
def test_arbitrary_bytes_never_raise_and_never_answer_twice(data, cuts, settle_between, eof):
    points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    chunks = [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]
    outcome = asyncio.run(exchange(chunks, eof=eof, pause_between=settle_between))
    written = outcome.transport.written
    answered = count_responses(written)
    # one answer per request the app saw, plus at most one error for bytes that failed
    assert len(outcome.app.seen) <= answered <= len(outcome.app.seen) + 1
    # everything written parses as whole HTTP/1.1 responses (HEAD excluded by design)
    if b"HEAD" not in data:
        assert len(outcome.responses) == answered
    if answered > len(outcome.app.seen):
        assert outcome.transport.finished  # the error ended the connection

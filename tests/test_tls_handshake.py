"""TLS connections on a real loopback socket, in-process, on both event loops: each
connection takes its seat under the connection cap at its TCP accept and then upgrades
itself (`rawserve.http.handshake`); a handshake that fails or times out frees its seat,
and so does a connection the server closes, without waiting for the client's own
close_notify; a client that reads none of a large answer is cut at --write-timeout.
Certificates come from `trustme`; the server is `rawserve.http_process.front.listen`
with the protocol the fronts build."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import h11
import pytest

from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http.handshake import begun_now
from rawserve.http.limits import GIVE_WAY_AFTER, LINGER_SECONDS, PROBE_RESERVE
from rawserve.http_process.front import listen
from rawserve.ops import loops
from rawserve.options import parse_config
from rawserve.protocol import HttpProtocol, ServerState
from tests.fake_transport import FakeApp, read_responses

LOOPS = ["asyncio", "uvloop"]
HEAD_TIMEOUT = 60.0  # also the handshake's: none times out unless a test says so
BIG_ANSWER = 4 * 1024 * 1024  # more than every buffer between the server and its client
REQUESTS = (
    b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /2 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
)


class PathApp(FakeApp):
    async def handle(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, json.dumps({"path": request.path}).encode())


class LargeApp(FakeApp):
    """Answers every request with BIG_ANSWER bytes, in one body."""

    async def handle(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"x" * BIG_ANSWER)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    import trustme

    ca = trustme.CA()
    folder = tmp_path_factory.mktemp("tls")
    issued = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    issued.private_key_pem.write_to_path(str(keyfile))
    issued.cert_chain_pems[0].write_to_path(str(certfile))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return certfile, keyfile, client


class SteppedClock:
    """The running loop, but the clock the connections read moves on only when told (its
    timers run in real time alike): which connection gives way to which under the cap
    does not depend on how fast a busy machine runs the test."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.now = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Any:
        return self._loop.call_later(when - self.now, callback, *args)


@contextlib.asynccontextmanager
async def serving_tls(
    tls_files, state: ServerState, *flags: str, loop: Any = None, app: Any = None
) -> AsyncIterator[int]:
    """A server on a free loopback port (yielded), its connections closed on the way out."""
    certfile, keyfile, _ = tls_files
    argv = ["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)]
    config = parse_config([*argv, "--head-timeout", str(HEAD_TIMEOUT), *flags])
    loop = loop or asyncio.get_running_loop()
    app, settings, tls = app or PathApp(), config.http, config.ssl_context

    def factory() -> HttpProtocol:
        return HttpProtocol(app, settings, state, loop=loop, tls=tls)

    server = await listen(config, factory, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        state.close_all()


async def until(condition: Callable[[], bool]) -> None:
    """Wait for `condition` (the server's own tasks change what it reads)."""
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.005)


async def ask(port: int, client: ssl.SSLContext, paths: list[str]) -> list[tuple[int, dict]]:
    """`paths` asked one after another on one TLS connection: each answer's status and
    body, parsed with an h11 client."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client, server_hostname="localhost"
    )
    connection = h11.Connection(h11.CLIENT)
    answers = []
    try:
        for path in paths:
            request = h11.Request(method="GET", target=path, headers=[("Host", "a")])
            writer.write(connection.send(request) + connection.send(h11.EndOfMessage()))
            status, body = 0, b""
            while not isinstance(event := connection.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    connection.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                else:
                    raise AssertionError(f"the connection ended: {event}")
            answers.append((status, json.loads(body)))
            connection.start_next_cycle()
    finally:
        writer.close()
    return answers


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_connection_counts_under_the_cap_from_its_accept_and_a_stalled_hello_gives_back_its_seat(
    tls_files, loop_name
):
    """Connections that never send their TLS hello once held a descriptor each, uncounted,
    for the whole handshake timeout: now they hold the seats, so the next is refused
    before any handshake work; one silent for GIVE_WAY_AFTER gives way to a new one, as
    an idle one does, and each frees its seat as it fails or is closed."""
    client = tls_files[2]

    async def scenario() -> None:
        state = ServerState()
        clock = SteppedClock(asyncio.get_running_loop())
        async with serving_tls(tls_files, state, "--max-connections", "2", loop=clock) as port:
            with contextlib.ExitStack() as held:
                # seats in full and the probes' reserve, all taken by hellos that never come
                stalled = [
                    held.enter_context(socket.create_connection(("127.0.0.1", port)))
                    for _ in range(2 + PROBE_RESERVE)
                ]
                await stalled_out(state, stalled, clock, port, client)

    loops.run(scenario(), loop_name)


async def stalled_out(
    state: ServerState,
    stalled: list[socket.socket],
    clock: SteppedClock,
    port: int,
    client: ssl.SSLContext,
) -> None:
    """Every seat (the probes' too) held by a connection that says no TLS hello."""
    await until(lambda: len(state.connections) + len(state.probe_connections) == len(stalled))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await ask(port, client, ["/refused"])
    assert state.refused == 1
    # silent long enough, the first gives way: closed, the new one served in its place
    clock.now += GIVE_WAY_AFTER
    answers = await ask(port, client, ["/a", "/b"])
    assert answers == [(200, {"path": "/a"}), (200, {"path": "/b"})] and state.refused == 1
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, stalled[0].recv, 10) == b""
    # plain HTTP instead of a hello fails at once, a close ends one: their seats freed
    stalled[1].sendall(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    stalled[2].close()
    await until(lambda: len(state.connections) == 0)
    await until(lambda: len(state.probe_connections) == PROBE_RESERVE - 1)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_hello_not_finished_within_the_head_timeout_is_let_go_with_its_seat(tls_files, loop_name):
    async def scenario() -> None:
        state = ServerState()
        async with serving_tls(tls_files, state, "--head-timeout", "0.2") as port:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, sock.recv, 10) == b""
                await until(lambda: len(state.connections) == 0)

    loops.run(scenario(), loop_name)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_requests_sent_with_the_handshakes_last_flight_are_answered_in_order(tls_files, loop_name):
    """A TLS 1.3 client sends its first request right behind its Finished: the loop may
    pass it on before the handshake's task sees the handshake end."""
    client = tls_files[2]

    def pipelining_client(port: int) -> bytes:
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with client.wrap_socket(raw, server_hostname="localhost") as sock:
            sock.sendall(b"".join(REQUESTS))
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
            return received

    async def scenario() -> bytes:
        state = ServerState()
        async with serving_tls(tls_files, state) as port:
            assert await ask(port, client, ["/0"]) == [(200, {"path": "/0"})]
            loop = asyncio.get_running_loop()
            received = await loop.run_in_executor(None, pipelining_client, port)
            await until(lambda: len(state.connections) == 0)
        return received

    answers = read_responses(loops.run(scenario(), loop_name), list(REQUESTS))
    assert [(head.status_code, json.loads(body)) for head, body in answers] == [
        (200, {"path": "/1"}),
        (200, {"path": "/2"}),
    ]


@pytest.mark.parametrize("loop_name", LOOPS)
def test_closing_every_connection_ends_those_in_their_handshake(tls_files, loop_name):
    async def scenario() -> None:
        state = ServerState()
        async with serving_tls(tls_files, state) as port:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                await until(lambda: len(state.connections) == 1)
                state.close_all()  # shutting down
                await until(lambda: len(state.connections) == 0)
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, sock.recv, 10) == b""

    loops.run(scenario(), loop_name)


# --- closing --------------------------------------------------------------------------


def tls_socket(port: int, client: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    return client.wrap_socket(raw, server_hostname="localhost")


def read_answer(sock: ssl.SSLSocket, pause: float = 0.0) -> bytes:
    """One answer's head and body, read as they come (`pause` seconds between reads)."""
    received = b""
    while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < size(received):
        chunk = sock.recv(16384)
        if not chunk:
            break
        received += chunk
        time.sleep(pause)
    return received


def size(received: bytes) -> int:
    head = received.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length: ")[1].split(b"\r\n")[0])


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_connection_the_server_closes_frees_its_seat_without_the_clients_close_notify(
    tls_files, loop_name
):
    """An idle connection closed at --keepalive-timeout whose client reads no more (a
    pooled client's, its close_notify never sent back) waited 30 s for it (the SSL
    transport's own shutdown timeout), holding its seat: 52 such clients locked every
    new one out for ~24 s. Now the wait is LINGER_SECONDS, a plain connection's."""
    client = tls_files[2]

    async def scenario() -> None:
        state = ServerState()
        async with serving_tls(tls_files, state, "--keepalive-timeout", "0.3") as port:
            loop = asyncio.get_running_loop()
            sock = await loop.run_in_executor(None, tls_socket, port, client)
            with sock:
                sock.sendall(REQUESTS[0])
                answer = await loop.run_in_executor(None, read_answer, sock)
                assert answer.endswith(b'{"path":"/1"}') or b'"/1"' in answer
                began = time.monotonic()
                await until(lambda: len(state.connections) == 0)
                assert time.monotonic() - began < 0.3 + LINGER_SECONDS + 3

    loops.run(scenario(), loop_name)


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_client_that_reads_none_of_a_large_answer_is_cut_at_the_write_timeout(
    tls_files, loop_name, caplog
):
    """The SSL transport passed a whole answer on to the socket's transport below it at
    once, where its size was not counted: writing never paused, so --write-timeout never
    came and the connection sat until its keep-alive deadline and 30 s more."""
    client = tls_files[2]

    async def scenario() -> None:
        state = ServerState()
        flags = ("--write-timeout", "0.5", "--keepalive-timeout", "60")
        async with serving_tls(tls_files, state, *flags, app=LargeApp()) as port:
            loop = asyncio.get_running_loop()
            sock = await loop.run_in_executor(None, tls_socket, port, client)
            with sock:
                sock.sendall(REQUESTS[0])  # and reads nothing
                await until(lambda: len(state.connections) == 1)
                await until(lambda: len(state.connections) == 0)

    with caplog.at_level(logging.INFO, logger="rawserve.protocol"):
        loops.run(scenario(), loop_name)
    [line] = [r.getMessage() for r in caplog.records if "--write-timeout" in r.getMessage()]
    unsent = int(line.split("; ")[-1].split(" bytes")[0])
    assert 0 < unsent < BIG_ANSWER, line


@pytest.mark.parametrize("loop_name", LOOPS)
def test_a_slow_reader_of_a_large_answer_before_the_close_gets_all_of_it(tls_files, loop_name):
    """The close waits for the answer to be written (within --write-timeout of no
    progress) before it waits LINGER_SECONDS for the client's close_notify: a client
    reading slowly for longer than that is not cut short."""
    client = tls_files[2]
    closing = b"GET /big HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"

    async def scenario() -> bytes:
        state = ServerState()
        # (a write timeout past the reading's time: the kernel's buffers take megabytes,
        # and free room for more only once half of them is read, seconds at this pace)
        async with serving_tls(tls_files, state, "--write-timeout", "20", app=LargeApp()) as port:
            loop = asyncio.get_running_loop()
            sock = await loop.run_in_executor(None, tls_socket, port, client)
            with sock:
                sock.sendall(closing)
                # 256 reads of 16 KB, 20 ms apart: about 5 s
                return await loop.run_in_executor(None, read_answer, sock, 0.02)

    answer = loops.run(scenario(), loop_name)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"x" * 1000)
    assert len(answer.partition(b"\r\n\r\n")[2]) == BIG_ANSWER


# --- begun_now ------------------------------------------------------------------------


async def test_a_coroutine_begun_now_runs_to_its_first_wait_at_once_then_in_a_task():
    steps: list[str] = []
    gate = asyncio.Event()

    async def work() -> str:
        steps.append("before")
        await gate.wait()
        steps.append("after")
        return "done"

    future = begun_now(work(), asyncio.get_running_loop())
    assert steps == ["before"]
    gate.set()
    assert await future == "done" and steps == ["before", "after"]

    async def waits_for_nothing() -> str:
        return "at once"

    assert (await begun_now(waits_for_nothing(), asyncio.get_running_loop())) == "at once"


async def test_a_coroutine_begun_now_sees_its_cancellation_and_its_errors_come_out():
    seen: list[str] = []

    async def waits() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("no")

    loop = asyncio.get_running_loop()
    waiting = begun_now(waits(), loop)
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert seen == ["cancelled"]
    with pytest.raises(ValueError, match="no"):
        await begun_now(fails(), loop)

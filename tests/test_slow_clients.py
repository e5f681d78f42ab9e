"""End to end over real loopback sockets: slow and vanishing clients, the connection cap,
the API key, pipelining. The servers run the model-free test handlers, so they start fast.
Every scenario is bounded in connections and in time."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import time
from collections.abc import Callable
from contextlib import suppress

import h11
import pytest

from rawserve.http.limits import GIVE_WAY_AFTER
from tests.load import Client
from tests.server import RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

API_KEY = "test-key-0123456789"
AUTH = [("Authorization", f"Bearer {API_KEY}")]
SLOW_CLIENTS = 100  # of each kind: silent, half a head, half a body
CAP = 20  # connections the capped server holds


@pytest.fixture(scope="module")
def servers(request):
    """The module's servers its selected tests use, started together: `guarded_server`
    has long read timeouts (slow clients stay connected) and an API key, `strict_server`
    read timeouts of one second; the others are each a test's own."""
    echo = ["--handler", "tests.handlers:echo"]
    guarded = ["--head-timeout", "60", "--body-timeout", "60", "--keepalive-timeout", "60"]
    strict = ["--head-timeout", "1", "--body-timeout", "1", "--keepalive-timeout", "30"]
    recording = ["--handler", "tests.handlers:recording", "--max-batch-size", "1"]

    def recording_server() -> RunningServer:
        record, gate = request.getfixturevalue("recording_files")
        env = {"RAWSERVE_TEST_RECORD": str(record), "RAWSERVE_TEST_GATE": str(gate)}
        return RunningServer([*recording, "--max-queue", "1"], env=env)

    with started_as_used(
        request,
        {
            "guarded_server": lambda: RunningServer(
                [*echo, *guarded], env={"RAWSERVE_API_KEY": API_KEY}
            ),
            "strict_server": lambda: RunningServer([*echo, *strict]),
            "idle_closing_server": lambda: RunningServer([*echo, "--keepalive-timeout", "1"]),
            "capped_server": lambda: RunningServer([*echo, "--max-connections", str(CAP)]),
            "recording_server": recording_server,
        },
    ) as server:
        yield server


guarded_server = module_server("guarded_server")
strict_server = module_server("strict_server")
# --keepalive-timeout 1
idle_closing_server = module_server("idle_closing_server")
# --max-connections CAP
capped_server = module_server("capped_server")


@pytest.fixture(scope="module")
def recording_files(tmp_path_factory):
    """The file `recording_server`'s handler appends each input it computes to, and the
    one its input "gate" waits for."""
    folder = tmp_path_factory.mktemp("recording")
    return folder / "record", folder / "gate"


# The recording handler, one item a batch, a queue of one.
recording_server = module_server("recording_server")


async def read_until_closed(reader: asyncio.StreamReader, limit: float) -> bytes:
    data = bytearray()
    async with asyncio.timeout(limit):
        while chunk := await reader.read(65536):
            data += chunk
    return bytes(data)


def parse(data: bytes, closed: bool = True) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The whole responses in `data` (all the server sent before closing, unless not
    `closed`), read by an h11 client that sent as many GETs."""
    client = h11.Connection(h11.CLIENT)
    answers: list[tuple[int, dict[bytes, bytes], bytes]] = []
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    if data:  # (empty data would mean "closed" to h11)
        client.receive_data(data)
    if closed:
        client.receive_data(b"")
    status, headers, body = 0, {}, bytearray()
    while True:
        event = client.next_event()
        if isinstance(event, h11.Response):
            status, headers, body = event.status_code, dict(event.headers), bytearray()
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            answers.append((status, headers, bytes(body)))
            if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
                return answers
            client.start_next_cycle()
            client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
            client.send(h11.EndOfMessage())
        elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            return answers


async def until(condition: Callable[[], object], limit: float = 20.0) -> None:
    """Wait for state in another process, which has no event to offer: check, bounded."""
    end = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- slow clients ---------------------------------------------------------------------


def test_hundreds_of_half_open_connections_do_not_slow_a_normal_request(guarded_server):
    port = guarded_server.port

    async def scenario():
        slow = []
        openers = [
            b"",  # connected, silent
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-",  # half a head
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc",  # half a body
        ]
        for opener in openers:
            for _ in range(SLOW_CLIENTS):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(opener)
                slow.append((reader, writer))
        await asyncio.gather(*(writer.drain() for _, writer in slow))
        try:
            timings = []
            for text in ("first", "second", "third"):
                started = time.monotonic()
                status, body = await Client(port).request("POST", "/", text.encode(), AUTH)
                timings.append(time.monotonic() - started)
                assert status == 200 and json.loads(body)["input"] == text
            health_started = time.monotonic()
            assert (await Client(port).request("GET", "/health"))[0] == 200
            timings.append(time.monotonic() - health_started)
            return timings
        finally:
            for _, writer in slow:
                writer.close()

    timings = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert max(timings) < 2.0, timings  # an unloaded answer takes a few ms


def test_slow_clients_get_408_at_the_read_timeout_then_a_close(strict_server):
    port = strict_server.port

    async def one(opener: bytes) -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        writer.write(opener)
        try:
            return await read_until_closed(reader, 20), time.monotonic() - started
        finally:
            writer.close()

    async def scenario():
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
        body = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab"
        return await asyncio.gather(*(one(opener) for opener in [head, body] * 20))

    results = asyncio.run(asyncio.wait_for(scenario(), 40))
    for data, seconds in results:
        [(status, headers, body)] = parse(data)  # one answer, then the server's close
        assert status == 408 and headers[b"connection"] == b"close"
        assert json.loads(body)["error_type"] == "request_timeout"
        assert 0.9 <= seconds < 15
    # each access line's duration is the time the connection was held: a head that never
    # finished was logged as 0.2 ms, as if its time began at its 408
    timed_out = strict_server.wait_for_lines(re.compile(r'" 408 \d+ ([\d.]+)ms'), 40)
    durations = [float(found.group(1)) for found in timed_out]
    assert len(durations) == 40 and min(durations) >= 900, durations
    # an idle connection that never sent a byte is not a slow request: no 408 for it
    assert strict_server.request("GET", "/health")[0] == 200


def test_a_body_slower_than_its_deadline_is_answered_504_by_its_deadline(guarded_server):
    """X-Request-Timeout: 1 and a body that dribbles in: its 504 came once its last byte
    did (6.9 s for a byte every 50 ms; up to --body-timeout, 60 s here), not at 1 s."""
    port = guarded_server.port

    async def scenario() -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        head = f"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        writer.write(f"{head}X-Request-Timeout: 1\r\nContent-Length: 100\r\n\r\nab".encode())
        try:
            return await read_until_closed(reader, 20), time.monotonic() - started
        finally:
            writer.close()

    data, seconds = asyncio.run(asyncio.wait_for(scenario(), 30))
    [(status, headers, body)] = parse(data)
    assert status == 504 and headers[b"connection"] == b"close", body
    assert "deadline passed before its body was all received" in json.loads(body)["error"]
    assert 0.9 <= seconds < 15  # (at its deadline; never the 60 s of --body-timeout)


def test_an_idle_connection_with_nothing_sent_is_closed_without_an_answer(idle_closing_server):
    with idle_closing_server as server:

        async def scenario():
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                return await read_until_closed(reader, 20)
            finally:
                writer.close()

        assert asyncio.run(scenario()) == b""


# --- the connection cap ---------------------------------------------------------------


def test_past_the_cap_a_new_connection_is_answered_in_place_of_the_one_idle_longest(
    capped_server,
):
    cap = CAP
    with capped_server as server:
        port = server.port

        async def info_over_new_connection():
            # not a probe: past the cap, /health and /ready are still answered (tested elsewhere)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n")
            data = bytearray()
            async with asyncio.timeout(20):
                while not (answers := parse(bytes(data), closed=False)):
                    chunk = await reader.read(65536)
                    assert chunk, "closed without an answer"
                    data += chunk
            return answers[0], (reader, writer)

        async def scenario():
            held = []
            try:
                for _ in range(cap):
                    (status, _, _), connection = await info_over_new_connection()
                    assert status == 200  # kept alive, so it counts against the cap
                    held.append(connection)
                # every one is idle between requests, for long enough: the first to go
                # idle gives way, closed without a word (as at keep-alive expiry), and
                # the rest stay
                await asyncio.sleep(GIVE_WAY_AFTER)
                (status, _, _), connection = await info_over_new_connection()
                held.append(connection)
                assert status == 200
                assert await read_until_closed(held[0][0], 10) == b""
                (status, _, _), connection = await info_over_new_connection()
                held.append(connection)
                assert status == 200
                assert await read_until_closed(held[1][0], 10) == b""
                return not any(reader.at_eof() for reader, _ in held[2:])
            finally:
                for _, writer in held:
                    writer.close()

        assert asyncio.run(asyncio.wait_for(scenario(), 60))


# --- a client leaving while its request is queued --------------------------------------


def test_a_request_whose_client_leaves_while_queued_is_never_computed(
    recording_server, recording_files
):
    record, gate = recording_files
    with recording_server as server:
        port = server.port
        computed = lambda: record.read_text().split() if record.exists() else []  # noqa: E731

        async def ready_status() -> int:
            return (await Client(port).request("GET", "/ready"))[0]

        async def until_ready(expected: int) -> None:
            end = time.monotonic() + 20
            while (status := await ready_status()) != expected:
                assert time.monotonic() < end, f"/ready stayed {status}"
                await asyncio.sleep(0.02)

        async def scenario():
            held = asyncio.create_task(Client(port).request("POST", "/", b"gate"))
            await until(lambda: computed() == ["gate"])  # the worker is busy with it
            await until_ready(200)  # in the worker, not in the queue
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nwithdrawn")
            await writer.drain()
            await until_ready(503)  # queued: the queue (of one item) is full
            writer.close()  # the client leaves before its answer
            await until_ready(200)  # withdrawn from the queue
            gate.touch()
            assert (await held)[0] == 200
            status, body = await Client(port).request("POST", "/", b"after")
            assert status == 200 and json.loads(body)["input"] == "after"

        asyncio.run(asyncio.wait_for(scenario(), 60))
        assert computed() == ["gate", "after"]  # "withdrawn" never reached the model


# --- the API key, HEAD and pipelining over a real socket --------------------------------


def test_inference_needs_the_api_key_and_health_does_not(guarded_server):
    status, headers, body = guarded_server.request("POST", "/", b"hi")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    assert json.loads(body)["error_type"] == "unauthorized"
    wrong = {"Authorization": "Bearer not-the-key"}
    status, headers, _ = guarded_server.request("POST", "/", b"hi", wrong)
    assert status == 401 and 'error="invalid_token"' in headers["www-authenticate"]
    status, _, body = guarded_server.request("POST", "/", b"hi", dict(AUTH))
    assert status == 200 and json.loads(body)["input"] == "hi"
    assert guarded_server.request("GET", "/health")[0] == 200
    assert guarded_server.request("GET", "/ready")[0] == 200
    assert guarded_server.request("GET", "/info")[0] == 401


def test_pipelined_requests_over_one_socket_are_answered_in_order(guarded_server):
    requests = (
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Length: 3\r\n\r\none"
        + b"GET /nope HTTP/1.1\r\nHost: x\r\nX-Request-Id: third\r\n\r\n"
        + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=20) as sock:
        sock.sendall(requests)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    answers = parse(bytes(data))
    assert [status for status, _, _ in answers] == [200, 200, 404, 200]
    assert json.loads(answers[1][2])["input"] == "one"
    assert answers[2][1][b"x-request-id"] == b"third"
    assert all(b"server-timing" in headers for _, headers, _ in answers)


def test_a_pipelining_client_that_reads_nothing_gets_few_answers_computed(guarded_server):
    """The kernel took 4 MiB of a connection's whole answers (tcp_wmem's most) before a
    write stalled and its next requests waited unread: some 800 embeddings computed for
    a client that read none, and 4 GB of the kernel's memory at --max-connections 1000.
    Bounded like a stream's (TCP_NOTSENT_LOWAT), the answers computed for it stop at
    what a few hundred KiB hold."""
    text = "x" * 16384  # (each answer holds it twice: ~32 KiB)
    body = json.dumps({"inputs": text}).encode()
    one = (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    answered = 'rawserve_requests_total{method="POST",route="/",status="200"}'

    def count() -> float:
        _, _, page = guarded_server.request("GET", "/metrics")
        found = [line for line in page.decode().splitlines() if line.startswith(answered)]
        return float(found[0].rsplit(" ", 1)[1]) if found else 0.0

    before = count()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # (before connecting)
        sock.connect(("127.0.0.1", guarded_server.port))
        sock.settimeout(0.2)
        requests, sent, end = one * 300, 0, time.monotonic() + 6
        while sent < len(requests) and time.monotonic() < end:
            with suppress(TimeoutError):  # (the server stops reading them)
                sent += sock.send(requests[sent : sent + 65536])
        time.sleep(1)
        computed = count() - before
    # (4 MiB held ~130 of them; 256 KiB and what waits in the server's own buffers, ~12)
    assert 1 <= computed <= 40, computed


def test_head_and_http_1_0_over_a_real_socket(guarded_server):
    status, headers, body = guarded_server.request("HEAD", "/health")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=20) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        data = bytearray()
        while chunk := sock.recv(65536):  # the server closes after answering 1.0
            data += chunk
    [(status, headers, body)] = parse(bytes(data))
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_garbage_and_tls_on_the_plain_port_get_400_then_a_close(guarded_server):
    tls_client_hello = bytes.fromhex("16030100f4010000f00303") + bytes(240)
    for garbage in (tls_client_hello, b"\x00\xff" * 100, b"GET /\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=20) as sock:
            sock.sendall(garbage)
            data = bytearray()
            while chunk := sock.recv(65536):
                data += chunk
        [(status, headers, body)] = parse(bytes(data))
        assert status == 400 and json.loads(body)["error_type"] == "bad_request"


def test_a_refused_large_body_still_lets_the_client_read_its_413(guarded_server):
    """The server answers 413 from Content-Length, then drains the body the client is
    still sending instead of resetting the connection under it."""
    body = b"x" * (2 * 1024 * 1024)  # over the default 1 MiB
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", guarded_server.port), timeout=20) as sock:
        sock.sendall(head + body)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    [(status, headers, body)] = parse(bytes(data))
    assert status == 413 and headers[b"connection"] == b"close"


def test_a_low_open_files_limit_is_raised_so_that_past_the_cap_probes_are_answered():
    """With a soft `ulimit -n` below the cap (1024 on many machines, under the default
    cap of 1000 plus the probes' 32), the server raises it at start-up: idle clients
    holding every connection cannot have a liveness probe reset instead of answered."""
    cap = 300
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * cap:  # only root may raise a hard limit
        pytest.skip(f"the hard open files limit ({hard}) holds too few connections")
    # this process holds `cap` client sockets; a soft limit below that is raised, as the
    # server raises its own
    ours = soft if soft == resource.RLIM_INFINITY else max(soft, 2 * cap)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cap // 2, hard))  # inherited by the server
    try:
        server = RunningServer(["--handler", "tests.handlers:echo", "--max-connections", str(cap)])
        server.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (ours, hard))
    try:
        with server:
            held = [socket.create_connection(("127.0.0.1", server.port), 10) for _ in range(cap)]
            try:
                status, _, body = server.request("GET", "/health")
                assert status == 200, body
            finally:
                for sock in held:
                    sock.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

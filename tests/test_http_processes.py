"""`--http-processes 2`: the real server with two HTTP processes and one serving process,
and every promise of one process kept across them (deadlines, the queue bound, clients
that leave, /metrics, /info, probes, draining, processes that die). Loopback only."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from rawserve.main import SIGNAL_REPEAT_SECONDS
from tests.server import REPO_ROOT, RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

SLEEPY = ["--handler", "tests.handlers:sleepy", "--device", "cpu", "--max-batch-size", "1"]
TWO = ["--http-processes", "2", "--no-warmup"]
JSON = {"Content-Type": "application/json"}
CURL_POST = ["curl", "-s", "-o", "/dev/null", "-H", "Content-Type: application/json", "-d"]


# what a test opened, closed after it even when it fails (left open, a failed test's
# sockets and clients are reported as unclosed in whichever later test collects them)
OPENED: list[Connection] = []
CLIENTS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def closed_after():
    yield
    for connection in OPENED:
        connection.close()
    for client in CLIENTS:
        if client.poll() is None:
            client.kill()
        client.wait(10)
    OPENED.clear()
    CLIENTS.clear()


class Connection:
    """One keep-alive connection: it stays with the HTTP process that accepted it."""

    def __init__(self, server: RunningServer, timeout: float = 30):
        self.http = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
        OPENED.append(self)

    def request(
        self, method: str, path: str, body: object = None, headers: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = None if body is None else json.dumps(body)
        self.http.request(method, path, body=data, headers={**JSON, **(headers or {})})
        response = self.http.getresponse()
        return response.status, dict(response.getheaders()), response.read()

    def pid(self) -> int:
        """The HTTP process this connection talks to."""
        status, _, body = self.request("GET", "/info")
        assert status == 200
        return json.loads(body)["http_pid"]

    def close(self) -> None:
        self.http.close()


def one_connection_each(server: RunningServer, tries: int = 200) -> dict[int, Connection]:
    """A connection to each HTTP process (the kernel spreads new connections)."""
    found: dict[int, Connection] = {}
    for _ in range(tries):
        connection = Connection(server)
        pid = connection.pid()
        if pid in found:
            connection.close()
        else:
            found[pid] = connection
        if len(found) == 2:
            return found
    raise AssertionError(f"{tries} connections all reached the same HTTP process")


def http_pids(server: RunningServer) -> list[int]:
    _, _, body = server.request("GET", "/info")
    return [p["pid"] for p in json.loads(body)["processes"] if p["role"] == "http"]


def metric(server: RunningServer, line_start: str, absent: float | None = None) -> float:
    """The value of the first series of one scrape that starts with `line_start`."""
    _, _, body = server.request("GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    if absent is not None:
        return absent
    raise AssertionError(f"no {line_start} in /metrics")


def wait_until(condition, timeout: float = 30, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def replaced(server: RunningServer, victim: int) -> bool:
    """Whether /info lists two HTTP processes besides `victim`; a connection the kernel had
    queued on the killed process's socket is reset, and asked again."""
    try:
        return len(set(http_pids(server)) - {victim}) == 2
    except ConnectionError:
        return False


def created(connection: Connection) -> int:
    """The `created` /v1/models gives the served model, through this connection."""
    status, _, body = connection.request("GET", "/v1/models")
    assert status == 200
    [model] = json.loads(body)["data"]
    return model["created"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a child of ours (not here) or a zombie
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def busy(
    server: RunningServer, name: str, seconds: float, status: bool = False
) -> subprocess.Popen:
    """Keep the only worker busy for `seconds` with input `name` (from another client);
    `status`: the client writes the answer's status code on its stdout."""
    body = json.dumps({"inputs": name, "parameters": {"sleep": seconds}})
    written = ["-w", "%{http_code}"] if status else []
    client = subprocess.Popen(
        [*CURL_POST, body, *written, f"http://127.0.0.1:{server.port}/"],
        stdout=subprocess.PIPE if status else None,
        text=True,
    )
    CLIENTS.append(client)
    server.wait_for_log(re.compile(re.escape(f"sleeping {seconds} s on ['{name}']")), 30)
    return client


def computed(server: RunningServer, name: str) -> bool:
    return any(f"'{name}'" in line for line in server.read_log() if "sleepy handler" in line)


def queue_one(server: RunningServer, connection: Connection, name: str) -> None:
    """Send one item over `connection` (not waiting for its answer) and wait until it is
    queued behind the busy worker."""
    body = json.dumps({"inputs": name, "parameters": {"sleep": 0.4}})
    connection.http.request("POST", "/", body=body, headers={**JSON, "X-Request-Id": name})
    wait_until(lambda: metric(server, "rawserve_queue_depth") == 1, what="the item queued")


@pytest.fixture(scope="module")
def servers(request):
    """The module's servers its selected tests use, started together: the one most tests
    share, and one of its own for each test that stops or kills its server."""
    with started_as_used(
        request,
        {
            "server": lambda: RunningServer([*SLEEPY, *TWO, "--max-queue", "2"]),
            "draining_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "10"]),
            "orphaned_server": lambda: RunningServer([*SLEEPY, *TWO]),
            "signalled_twice_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "30"]),
            "stalled_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "2"]),
            "idle_draining_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "10"]),
            "short_grace_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "1"]),
            "mid_body_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "10"]),
            "stopped_http_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "20"]),
            "idle_stopping_server": lambda: RunningServer([*SLEEPY, *TWO, "--grace", "20"]),
        },
    ) as get:
        yield get


server = module_server("server")
draining_server = module_server("draining_server")
orphaned_server = module_server("orphaned_server")
signalled_twice_server = module_server("signalled_twice_server")
stalled_server = module_server("stalled_server")
idle_draining_server = module_server("idle_draining_server")
short_grace_server = module_server("short_grace_server")
mid_body_server = module_server("mid_body_server")
stopped_http_server = module_server("stopped_http_server")
idle_stopping_server = module_server("idle_stopping_server")


def test_both_http_processes_answer_and_info_lists_every_process(server):
    connections = one_connection_each(server)
    _, _, body = server.request("GET", "/info")
    info = json.loads(body)
    roles = sorted(p["role"] for p in info["processes"])
    assert roles == ["http", "http", "serving"]
    assert sorted(connections) == sorted(http_pids(server))
    assert info["server_pid"] == server.process.pid
    assert info["event_loop"] in ("uvloop", "asyncio")
    for connection in connections.values():
        status, _, answer = connection.request("POST", "/", {"inputs": "hello"})
        assert status == 200 and json.loads(answer)["input"] == "hello"
        connection.close()


def test_one_metrics_scrape_counts_every_process(server):
    openapi = 'rawserve_requests_total{method="GET",route="/openapi.json"'
    before = metric(server, openapi, absent=0.0)
    connections = one_connection_each(server)
    for connection in connections.values():  # three requests through each process
        for _ in range(3):
            assert connection.request("GET", "/openapi.json")[0] == 200
        connection.close()
    after = metric(server, openapi)
    assert after - before == 6
    # the serving process's series are in the same scrape, its HTTP processes counted
    assert metric(server, 'rawserve_queue_limit{model="tests.handlers:sleepy"}') == 2
    assert metric(server, "rawserve_http_processes_listening") == 2


def test_a_deadline_is_answered_504_on_time_and_the_expired_item_never_computed(server):
    worker = busy(server, "deadline-busy", 4.0)
    started = time.monotonic()
    status, _, _ = server.request(
        "POST",
        "/",
        json.dumps({"inputs": "deadline-expired", "parameters": {"sleep": 0.5}}),
        {**JSON, "X-Request-Timeout": "0.5"},
    )
    assert status == 504 and time.monotonic() - started < 3  # not at the busy one's end
    worker.wait(30)
    assert server.post_json({"inputs": "deadline-after"})[0] == 200  # the worker moved on
    assert not computed(server, "deadline-expired")


def test_the_queue_bound_is_refused_by_every_http_process_without_asking(server):
    worker = busy(server, "full-busy", 3.0)
    connections = one_connection_each(server)
    queued = [
        subprocess.Popen(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-XPOST",
                "-d",
                json.dumps({"inputs": f"q{i}"}),
                f"http://127.0.0.1:{server.port}/",
            ]
        )  # fmt: skip
        for i in range(2)
    ]
    CLIENTS.extend(queued)
    wait_until(lambda: metric(server, "rawserve_queue_depth") == 2, what="two items queued")
    wait_until(
        lambda: all(c.request("GET", "/ready")[0] == 503 for c in connections.values()),
        what="every HTTP process reads the full queue",
    )
    # The serving process stopped: a refusal at the bound and the probes need nothing of it.
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        for connection in connections.values():
            status, headers, body = connection.request("POST", "/", {"inputs": "one too many"})
            assert status == 503 and "Retry-After" in headers
            assert json.loads(body)["error"] == "server busy: queue full"
            assert connection.request("GET", "/health")[0] == 200
            status, _, body = connection.request("GET", "/ready")
            assert status == 503 and json.loads(body)["status"] == "full"
            status, _, body = connection.request("GET", "/ready?full=ok")
            assert status == 200 and json.loads(body)["status"] == "full"
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    for client in [worker, *queued]:
        client.wait(60)
    for connection in connections.values():
        connection.close()


def test_a_client_that_leaves_withdraws_its_item(server):
    before = metric(
        server, 'rawserve_items_dropped_total{model="tests.handlers:sleepy",reason="disconnected"}'
    )
    worker = busy(server, "leave-busy", 2.0)
    leaving = Connection(server)
    leaving.http.request(
        "POST",
        "/",
        body=json.dumps({"inputs": "left-early", "parameters": {"sleep": 0.4}}),
        headers=JSON,
    )
    wait_until(lambda: metric(server, "rawserve_queue_depth") == 1, what="the item queued")
    leaving.close()
    wait_until(lambda: metric(server, "rawserve_queue_depth") == 0, what="the item withdrawn")
    worker.wait(30)
    assert server.post_json({"inputs": "leave-after"})[0] == 200
    assert not computed(server, "left-early")
    after = metric(
        server, 'rawserve_items_dropped_total{model="tests.handlers:sleepy",reason="disconnected"}'
    )
    assert after == before + 1


def test_an_http_process_that_dies_is_replaced_and_its_items_withdrawn(server):
    worker = busy(server, "orphan-busy", 2.0)
    connections = one_connection_each(server)
    victim, survivor = list(connections)
    queue_one(server, connections[victim], "orphan")
    os.kill(victim, signal.SIGKILL)
    server.wait_for_log(re.compile(rf"HTTP process \d \(pid {victim}\) exited"), 30)
    wait_until(lambda: metric(server, "rawserve_queue_depth") == 0, what="the item withdrawn")
    # the operator is told which requests went with it, as with a worker's death
    # (the busy client's request too, where it went to the same HTTP process)
    withdrawn = r"HTTP process \d is gone: \d request\(s\) under way withdrawn \(request "
    server.wait_for_log(re.compile(withdrawn + r"[^)]*\borphan\b[^)]*\)$"), 10)
    wait_until(lambda: replaced(server, victim), what="a new HTTP process listed")
    wait_until(lambda: metric(server, "rawserve_http_processes_listening") == 2)
    assert connections[survivor].request("GET", "/health")[0] == 200
    worker.wait(30)
    assert server.post_json({"inputs": "orphan-after"})[0] == 200
    assert not computed(server, "orphan")
    for connection in connections.values():
        connection.close()
    # the new process names the models' `created` as the others do (it made its own)
    now = one_connection_each(server)
    assert len({created(connection) for connection in now.values()}) == 1
    for connection in now.values():
        connection.close()


def test_an_http_process_sent_sigterm_alone_answers_its_request_exits_and_is_replaced(server):
    """A stop sent to one HTTP process: it answers what it holds and exits within a
    second or so of that (it held its connections the whole grace period, 30 s, waiting
    for a drain of the server's that never came), and is replaced, its exit said to be a
    signal's (it was logged as a death whose requests were withdrawn)."""
    worker = busy(server, "alone-busy", 1.0)
    connections = one_connection_each(server)
    victim, survivor = list(connections)
    connections[victim].http.request(
        "POST", "/", body=json.dumps({"inputs": "alone"}), headers=JSON
    )
    os.kill(victim, signal.SIGTERM)
    began = time.monotonic()
    answer = connections[victim].http.getresponse()
    assert answer.status == 200 and json.loads(answer.read())["input"] == "alone"
    wait_until(lambda: gone(victim), 10, "the HTTP process exited")
    assert time.monotonic() - began < 10  # not the grace period
    # (asked now: idle past the keep-alive timeout, 5 s, its connection would be closed)
    assert connections[survivor].request("GET", "/health")[0] == 200
    server.wait_for_log(re.compile(rf"HTTP process \d \(pid {victim}\) stopped on a signal"), 10)
    assert not [line for line in server.read_log() if f"(pid {victim}) exited" in line]
    wait_until(lambda: replaced(server, victim), what="a new HTTP process listed")
    worker.wait(30)
    for connection in connections.values():
        connection.close()


def test_an_http_process_stopped_alone_past_its_grace_says_so_not_the_serving_process(
    short_grace_server,
):
    """Its request outlasting its grace period, it answered 503 saying "the serving
    process did not answer within the grace period": the serving process was well and
    went on serving; the stop was this process's alone."""
    server = short_grace_server
    connections = one_connection_each(server)
    victim, _ = list(connections)
    body = json.dumps({"inputs": "outlasts", "parameters": {"sleep": 4.0}})
    connections[victim].http.request("POST", "/", body=body, headers=JSON)
    server.wait_for_log(re.compile(re.escape("sleeping 4.0 s on ['outlasts']")), 30)
    os.kill(victim, signal.SIGTERM)
    answer = connections[victim].http.getresponse()
    assert answer.status == 503, answer.read()
    said = server.wait_for_log(re.compile(r"HTTP process \d: stopped alone.*"), 10)
    assert "requests still under way at the end of its grace period" in said[0]
    assert not [line for line in server.read_log() if "did not answer within" in line]
    assert server.post_json({"inputs": "after"})[0] == 200  # the server went on
    for connection in connections.values():
        connection.close()


def test_an_http_process_that_hangs_is_killed_and_replaced_and_its_items_withdrawn(server):
    """A stopped HTTP process is handed about half the new connections, which would hang
    forever: silent past the bound, it is killed and replaced like one that died."""
    worker = busy(server, "hung-busy", 7.0)  # past the bound (5 s): the item stays queued
    connections = one_connection_each(server)
    victim = list(connections)[0]
    queue_one(server, connections[victim], "hung")
    os.kill(victim, signal.SIGSTOP)
    for connection in connections.values():
        connection.close()
    try:
        server.wait_for_log(re.compile(rf"HTTP process \d \(pid {victim}\) silent"), 30)
        server.wait_for_log(re.compile(rf"HTTP process \d \(pid {victim}\) exited"), 30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # not left stopped if still there
            os.kill(victim, signal.SIGCONT)
    wait_until(lambda: metric(server, "rawserve_queue_depth") == 0, what="the item withdrawn")
    wait_until(lambda: replaced(server, victim), what="a new HTTP process listed")
    worker.wait(30)
    for _ in range(20):  # new connections, spread over both processes
        connection = Connection(server, timeout=10)
        assert connection.request("GET", "/health")[0] == 200
        connection.close()
    assert not computed(server, "hung")


def test_sigterm_drains_every_process_within_the_grace_period(draining_server):
    server = draining_server  # --grace 10
    try:
        pids = http_pids(server)
        worker = busy(server, "drain-busy", 1.0)
        started = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.process.wait(15) == 0
        assert time.monotonic() - started < 10
        assert worker.wait(10) == 0
        assert computed(server, "drain-busy")
        wait_until(lambda: all(gone(pid) for pid in pids), 10, "the HTTP processes exited")
    finally:
        server.stop()


def test_a_drain_answers_a_request_on_an_idle_connection_to_any_http_process(
    idle_draining_server,
):
    """A connection left idle stays open through the drain, whichever HTTP process holds
    it, and its next request is answered 503 with `Connection: close`, as with one
    process: a process with no request of its own under way closed its connections at
    once, and a pooled client's next request there got no answer at all."""
    server = idle_draining_server  # --grace 10
    try:
        idle = one_connection_each(server)
        assert len(idle) == 2
        worker = busy(server, "drain-held", 2.0)  # the drain lasts while it runs
        server.signal(signal.SIGTERM)
        server.wait_for_log(re.compile("SIGTERM received"), 10)
        time.sleep(0.3)
        for connection in idle.values():
            status, headers, _ = connection.request("GET", "/ready")
            assert status == 503 and headers.get("Connection") == "close"
        assert worker.wait(10) == 0
        assert server.process.wait(15) == 0
    finally:
        server.stop()


def read_to_the_end(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_a_drain_answers_the_requests_whose_bodies_are_still_coming(mid_body_server):
    """A request whose head was read as the drain began, its body still on its way, is
    answered once the body is in (503, `Connection: close`), in whichever HTTP process:
    the drain waited only for requests the app worked on, so with nothing else running
    every process closed them unanswered (and one process alike)."""
    server = mid_body_server  # --grace 10, nothing running
    body = json.dumps({"inputs": "a body sent in two parts"}).encode()
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    clients = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(6)]
    try:
        for client in clients:
            client.sendall(head + body[:5])
        time.sleep(0.5)  # every head read
        server.signal(signal.SIGTERM)
        server.wait_for_log(re.compile("SIGTERM received"), 10)
        time.sleep(2.5)  # (a drain with nothing to wait for closed them within 1 s)
        for client in clients:
            client.sendall(body[5:])
            answer = read_to_the_end(client)
            assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
            assert b"\r\nconnection: close\r\n" in answer.lower()
        assert server.process.wait(15) == 0
    finally:
        for client in clients:
            client.close()
        server.stop()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_drain_waits_for_a_body_still_coming_and_answers_once_it_is_in(processes):
    """A client still uploading as the drain begins is not answered under its upload,
    nor the server stopped under it: a drain that waited only for the requests the app
    worked on answered 503 at once (a client that reads only once its body is sent saw
    the connection reset)."""
    body = json.dumps({"inputs": "a body sent in two parts"}).encode()
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    argv = [*SLEEPY, "--http-processes", processes, "--no-warmup", "--grace", "10"]
    with RunningServer(argv) as server:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        try:
            client.sendall(head + body[:5])
            time.sleep(0.5)  # its head read
            server.signal(signal.SIGTERM)
            server.wait_for_log(re.compile("SIGTERM received"), 10)
            time.sleep(2.5)  # (a drain with nothing to wait for ended within 1 s)
            client.setblocking(False)
            with pytest.raises(BlockingIOError):
                early = client.recv(1)
                pytest.fail(f"answered before its body came: {early!r}")
            client.setblocking(True)
            assert server.process.poll() is None, "the server stopped under an upload"
            client.sendall(body[5:])
            answer = read_to_the_end(client)
            assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
        finally:
            client.close()
        assert server.process.wait(15) == 0


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_body_that_never_comes_is_answered_503_at_the_end_of_the_drain(processes):
    """A request whose body is still not in when the grace period ends is answered 503
    (`Connection: close`), as the README says of what is left then: it was closed with
    no answer at all."""
    body = json.dumps({"inputs": "a body that never ends"}).encode()
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    with RunningServer([*SLEEPY, "--http-processes", processes, "--grace", "2"]) as server:
        # many, spread over the processes: with two, the HTTP processes wrote their 503s
        # as the serving process killed them (288 of 300 got nothing, a reader found)
        address = ("127.0.0.1", server.port)
        clients = [socket.create_connection(address, timeout=30) for _ in range(60)]
        try:
            for client in clients:
                client.sendall(head + body[:5])
            time.sleep(0.5)  # their heads read
            server.signal(signal.SIGTERM)
            answers = [read_to_the_end(client) for client in clients]  # (the rest never sent)
        finally:
            for client in clients:
                client.close()
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
            assert b"\r\nconnection: close\r\n" in answer.lower()
            assert b"shutting down" in answer
        assert server.process.wait(15) == 0
    log = server.read_log()
    assert not [line for line in log if "did not stop: killing it" in line]
    # (the serving process answered all it had: only bodies that never came were left)
    assert not [line for line in log if "did not answer within the grace period" in line]


def test_a_stopped_http_process_does_not_hold_the_drain_for_its_grace(stopped_http_server):
    """The drain waits for each HTTP process to say it has answered what it holds, but a
    stopped one (SIGSTOP) says nothing: one silent is not waited for (it held a drain with
    nothing under way for its whole grace period: 12 s of a 10 s grace, against 1 s)."""
    server = stopped_http_server  # --grace 20, nothing under way
    stopped = http_pids(server)[0]
    os.kill(stopped, signal.SIGSTOP)
    try:
        started = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        assert time.monotonic() - started < 12, "the drain waited for the stopped process"
    finally:
        if not gone(stopped):
            os.kill(stopped, signal.SIGCONT)
        server.stop()


def test_an_idle_server_stops_at_once_and_kills_no_http_process(idle_stopping_server):
    """With nothing under way, the end of the drain tells each HTTP process to close what
    it holds and exit at once: those that drained on were killed ("did not stop: killing
    it"), a false alarm in the log of every stop."""
    server = idle_stopping_server  # --grace 20, nothing under way
    try:
        server.signal(signal.SIGTERM)
        assert server.process.wait(15) == 0  # (within its grace of 20 s)
    finally:
        server.stop()
    log = server.read_log()
    assert not [line for line in log if "did not stop: killing it" in line], log[-5:]


def test_sigterm_while_the_http_processes_start_drains_instead_of_orphaning_the_workers():
    """A rolling deploy may stop a server that is still starting: the workers already
    run, the HTTP processes are on their way. The stop waits for the start to end, then
    drains as any stop does: exit 0, and every process it started gone."""
    argv = ["--host", "127.0.0.1", "--port", "0", *SLEEPY, *TWO]
    process = subprocess.Popen(
        [sys.executable, "-m", "rawserve", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    try:
        assert process.stderr is not None
        lines = []
        while "worker 0: started" not in (line := process.stderr.readline()):
            assert line, "the server exited:\n" + "".join(lines)
            lines.append(line)
        assert not any("listening on" in line for line in lines)  # still starting
        children = child_pids(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        rest = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
    assert "SIGTERM received" in rest and rest.rstrip().endswith("rawserve INFO stopped"), rest
    wait_until(lambda: all(gone(pid) for pid in children), 30, "every child exited")


def child_pids(pid: int) -> list[int]:
    tasks = f"/proc/{pid}/task"
    pids = []
    for task in os.listdir(tasks):
        with open(f"{tasks}/{task}/children") as listed:
            pids += [int(child) for child in listed.read().split()]
    return pids


def board_path(http_pid: int) -> str:
    """The file of the queue state an HTTP process has mapped (rawserve.shared.board)."""
    with open(f"/proc/{http_pid}/maps") as maps:
        for line in maps:
            if "rawserve-board-" in line:
                return line.split(maxsplit=5)[5].strip()
    raise AssertionError(f"HTTP process {http_pid} maps no board")


def test_the_serving_process_dying_stops_the_http_processes_with_a_clear_line(orphaned_server):
    """kill -9 of the serving process: the HTTP processes and the workers exit by
    themselves, the port is free, and nothing is left in shared memory; a request under
    way is answered 503 (it had no answer, and its access line blamed its client: 499)."""
    server = orphaned_server
    try:
        pids = http_pids(server)
        _, _, body = server.request("GET", "/info")
        workers = json.loads(body)["worker_pids"]
        board = board_path(pids[0])
        assert os.path.exists(board)
        waiting = busy(server, "orphaned", 5.0, status=True)
        server.process.kill()
        assert server.process.wait(10) != 0
        assert waiting.communicate(timeout=10)[0] == "503"
        wait_until(lambda: all(gone(pid) for pid in pids), 30, "the HTTP processes exited")
        server.wait_for_log(re.compile("the serving process is gone; stopping"), 10)
        wait_until(lambda: all(gone(pid) for pid in workers), 30, "the workers exited")
        assert not os.path.exists(board)
    finally:
        for pid in [*pids, *workers]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        server.stop()


def test_a_stop_sent_to_the_group_answers_503_where_the_serving_process_is_stalled(
    stalled_server,
):
    """SIGTERM to every process (a closed terminal's) with the serving process stopped:
    the HTTP processes drain, and what the serving process does not answer by the end of
    the grace period they answer 503 themselves (it was closed unanswered, logged 499)."""
    server = stalled_server  # --grace 2
    pids = http_pids(server)
    try:
        waiting = busy(server, "stalled", 20.0, status=True)
        os.kill(server.process.pid, signal.SIGSTOP)
        for pid in [server.process.pid, *pids]:  # (the serving process's waits)
            os.kill(pid, signal.SIGTERM)
        assert waiting.communicate(timeout=15)[0] == "503"
        wait_until(lambda: all(gone(pid) for pid in pids), 10, "the HTTP processes exited")
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    # resumed, it sees its HTTP processes' exits before its own signal: none is replaced
    assert server.process.wait(15) == 0
    assert not [line for line in server.read_log() if "starting another" in line]
    server.stop()


def test_a_second_signal_exits_at_once_and_leaves_nothing_in_shared_memory(
    signalled_twice_server,
):
    server = signalled_twice_server  # --grace 30
    try:
        pids = http_pids(server)
        board = board_path(pids[0])
        worker = busy(server, "held", 20.0)  # holds the drain
        server.signal(signal.SIGTERM)
        server.wait_for_log(re.compile("SIGTERM received"), 10)
        time.sleep(SIGNAL_REPEAT_SECONDS + 0.2)  # (sooner, it counts as the same stop)
        server.signal(signal.SIGINT)
        assert server.process.wait(10) == 1
        wait_until(lambda: all(gone(pid) for pid in pids), 10, "the HTTP processes exited")
        assert not os.path.exists(board)
        worker.wait(10)
    finally:
        server.stop()


def test_http_processes_are_given_the_settings_and_never_read_the_files_again(tiny_model, tmp_path):
    """Each HTTP process parsed the command line again: a `--chat-template <(...)` (a
    descriptor only the serving process has) stopped the server at its start, and a
    template removed after the start left each replacement of an HTTP process exiting at
    once, for the server's life, one process short (a tester)."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}", "utf-8")
    argv = ["--model", tiny_model("chat"), *TWO, "--chat-template", str(template)]
    server = RunningServer(argv).start()
    try:
        template.unlink()
        victim = http_pids(server)[0]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: replaced(server, victim), what="a new HTTP process listed")
        # greedy: sampled at the default temperature, a random model may end at once
        hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
        for connection in one_connection_each(server).values():
            status, _, body = connection.request("POST", "/v1/chat/completions", hi)
            assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2, body
        assert not [line for line in server.read_log() if "before it listened" in line]
    finally:
        server.stop()


def test_streams_under_way_when_the_serving_process_dies_end_with_an_error_event(tiny_model):
    """Its HTTP processes fail what is under way with a 503 and give the streams a turn
    to say so: they were cut mid-chunk ("Response ended prematurely")."""
    model = tiny_model("long-generation")  # 4,096 positions: a stream that runs on
    server = RunningServer(["--model", model, *TWO]).start()
    try:
        asked = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        reading = subprocess.Popen(
            ["curl", "-sN", "-H", "Content-Type: application/json", "-d", json.dumps(asked)]
            + [f"http://127.0.0.1:{server.port}/v1/completions"],
            stdout=subprocess.PIPE,
            text=True,
        )
        CLIENTS.append(reading)
        first = reading.stdout.readline()  # the stream has begun (its head is sent)
        assert first.startswith("data:"), first
        server.process.kill()
        events = (first + reading.stdout.read()).split("\n\n")  # (until curl exits)
        reading.wait(20)
        reading.stdout.close()
        assert reading.returncode == 0  # a whole chunked answer, not one cut short
        assert events[-2:] == ["data: [DONE]", ""], events[-3:]
        error = json.loads(events[-3].removeprefix("data:"))["error"]
        assert error["message"] == "server shutting down" and error["code"] == "unavailable"
    finally:
        server.stop()


@pytest.mark.timeout(900)  # it starts a dozen servers
def test_the_same_routes_behave_the_same_with_two_http_processes(tiny_model):
    """A representative subset of the end-to-end tests (TLS, CORS, API keys, token streams,
    bad requests, batching), run again with every server they start at two processes. They
    serve the tiny models of this session (`tiny_model` names their folder in the
    environment): the run builds only the kinds not built yet."""
    selection = [
        "tests/test_tls_cors.py",
        "tests/test_end_to_end.py::test_bad_requests_get_clear_4xx",
        "tests/test_end_to_end.py::test_health_ready_and_unknown_routes",
        "tests/test_end_to_end.py::test_busy_worker_batches_and_parameters_never_mix",
        "tests/test_openai_generation.py::test_chat_streamed_matches_the_answer_and_ends_with_done",
        "tests/test_openai_generation.py::test_a_client_that_leaves_a_stream_stops_the_generation",
        "tests/test_openai_generation.py::test_completion_streamed_with_stop_never_sends_the_stop_text",
    ]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *selection],
        cwd=REPO_ROOT,
        env={**os.environ, "RAWSERVE_HTTP_PROCESSES": "2"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

"""Two rawserve replicas behind a real nginx running deploy/nginx.conf, all on loopback.

Traffic is spread over both; a replica that is killed or drains is taken out without
failing more client requests than were in flight; a 503 with Retry-After from an
overloaded replica is retried on the other, and a brief overload of both takes neither
out. nginx is the Debian package (`make test` installs it when it is missing and we are
root); without it these tests are skipped.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.load import exchange
from tests.server import READY, REPO_ROOT, RunningServer


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    for candidate in (found, "/usr/sbin/nginx", "/usr/local/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


NGINX = find_nginx()
DEPLOYED_CONFIG = Path(REPO_ROOT) / "deploy" / "nginx.conf"
UPSTREAM_SERVER = re.compile(r"^(\s*)server 10\.0\.0\.\d+:8000( [^;]*)?;\n", re.MULTILINE)
LISTEN = re.compile(r"^(\s*)listen 8080;", re.MULTILINE)
ACCESS_LOG = re.compile(r"(access_log )/var/log/nginx/\S+")
START_TIMEOUT = 15.0
LOAD_TIME_LIMIT = 60.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NGINX is None,
        reason="nginx is not installed; `make test` installs it with apt-get when run as root",
    ),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def site_config(
    replica_ports: list[int],
    listen_port: int,
    access_log: Path,
    edits: dict[str, str] | None = None,
) -> str:
    """deploy/nginx.conf with its example addresses replaced by loopback ones (and
    `edits`: a test's own settings, each replacing a line of the file)."""
    text = DEPLOYED_CONFIG.read_text()
    for old, new in (edits or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    servers = UPSTREAM_SERVER.findall(text)
    assert len(servers) >= 2, "deploy/nginx.conf lists its replicas as `server 10.0.0.N:8000`"
    indent, parameters = servers[0]
    replicas = "".join(f"{indent}server 127.0.0.1:{p}{parameters};\n" for p in replica_ports)
    text = UPSTREAM_SERVER.sub("", text, count=len(servers) - 1)
    text = UPSTREAM_SERVER.sub(lambda _: replicas, text, count=1)
    text, listens = LISTEN.subn(rf"\1listen 127.0.0.1:{listen_port};", text)
    assert listens == 1
    text, logs = ACCESS_LOG.subn(lambda m: f"{m[1]}{access_log}", text)
    assert logs == 1
    return text


def main_config(root: Path, site: Path) -> str:
    """A foreground, single-process nginx that keeps everything under `root`."""
    temp = {name: root / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return "\n".join(
        [
            "daemon off;",
            "master_process off;",
            f"pid {root / 'nginx.pid'};",
            f"error_log {root / 'error.log'} info;",
            "events { worker_connections 512; }",
            "http {",
            "    access_log off;",
            f"    client_body_temp_path {temp['body']};",
            f"    proxy_temp_path {temp['proxy']};",
            f"    fastcgi_temp_path {temp['fastcgi']};",
            f"    uwsgi_temp_path {temp['uwsgi']};",
            f"    scgi_temp_path {temp['scgi']};",
            f"    include {site};",
            "}",
            "",
        ]
    )


class Nginx:
    def __init__(self, root: Path, replica_ports: list[int], edits: dict[str, str] | None = None):
        self.root = root
        self.port = free_port()
        site = root / "rawserve.conf"
        self.access_log = root / "access.log"
        site.write_text(site_config(replica_ports, self.port, self.access_log, edits))
        self.config = root / "nginx.conf"
        self.config.write_text(main_config(root, site))
        self.command = [NGINX, "-p", str(root), "-c", str(self.config), "-e", str(root / "err")]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Nginx:
        checked = subprocess.run([*self.command, "-t"], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        end = time.monotonic() + START_TIMEOUT
        while True:  # nginx offers no readiness signal but its listening socket
            assert self.process.poll() is None, f"nginx exited: {self.error_log()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                assert time.monotonic() < end, f"nginx did not listen: {self.error_log()}"
                time.sleep(0.02)

    def error_log(self) -> str:
        path = self.root / "error.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Cluster:
    replicas: list[RunningServer]
    nginx: Nginx
    worker_pid: dict[int, int] = field(default_factory=dict)  # worker pid -> replica index

    def replica_of(self, pid: int) -> int:
        return self.worker_pid[pid]


@pytest.fixture
def start_cluster(tmp_path) -> Iterator:
    started: list[RunningServer] = []
    proxies: list[Nginx] = []

    def start(*args: str, edits: dict[str, str] | None = None) -> Cluster:
        base = ["--handler", "tests.handlers:sleepy", "--max-batch-size", "1", "--grace", "5"]
        replicas = [RunningServer([*base, *args]) for _ in range(2)]
        started.extend(replicas)  # stopped at teardown even if a start fails
        for replica in replicas:  # both load at the same time
            replica.start(wait_ready=False)
        for replica in replicas:
            replica.wait_for_log(READY, timeout=120)
        proxy = Nginx(tmp_path, [r.port for r in replicas], edits)
        proxies.append(proxy)
        proxy.start()
        cluster = Cluster(replicas, proxy)
        for index, replica in enumerate(replicas):
            info = json.loads(replica.request("GET", "/info")[2])
            cluster.worker_pid.update({pid: index for pid in info["worker_pids"]})
        return cluster

    yield start
    for proxy in proxies:
        proxy.stop()
    for replica in started:
        if replica.process is not None:
            replica.stop()


@dataclass
class Answer:
    status: int
    replica: int | None  # which replica computed it (from the echoed worker pid)


async def load_through(
    cluster: Cluster,
    count: int,
    concurrency: int,
    sleep: float = 0.0,
    after: int | None = None,
    action=None,
) -> list[Answer]:
    """POST `count` requests to nginx over `concurrency` keep-alive connections.

    With `after` and `action`: call `action()` once `after` answers have arrived, while
    the other requests are still running.
    """
    answers: list[Answer] = []
    acted_at: list[int] = []  # how many answers had arrived when `action` was done
    reached = asyncio.Event()
    body = json.dumps({"inputs": "x", "parameters": {"sleep": sleep}}).encode()
    headers = [("Content-Type", "application/json")]
    remaining = iter(range(count))

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.nginx.port)
        conn = h11.Connection(h11.CLIENT)
        try:
            for _ in remaining:
                status, data = await exchange(reader, writer, "POST", "/", body, headers, conn)
                pid = json.loads(data).get("pid") if status == 200 else None
                answers.append(Answer(status, None if pid is None else cluster.replica_of(pid)))
                if after is not None and len(answers) >= after:
                    reached.set()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.nginx.port)
                    conn = h11.Connection(h11.CLIENT)
                else:
                    conn.start_next_cycle()
        finally:
            writer.close()

    async def act() -> None:
        await reached.wait()
        await asyncio.to_thread(action)
        acted_at.append(len(answers))

    async with asyncio.timeout(LOAD_TIME_LIMIT):
        tasks = [client() for _ in range(concurrency)]
        if action is not None:
            tasks.append(act())
        await asyncio.gather(*tasks)
    if action is not None:
        assert acted_at and acted_at[0] < count - concurrency, "the action came too late"
    return answers


def test_traffic_is_spread_over_both_replicas(start_cluster):
    cluster = start_cluster("--max-queue", "16")
    answers = asyncio.run(load_through(cluster, 40, concurrency=2))
    assert [a.status for a in answers] == [200] * 40
    per_replica = [sum(a.replica == i for a in answers) for i in (0, 1)]
    assert min(per_replica) >= 10, per_replica


def post_raw(cluster: Cluster, body: bytes, path: str = "/") -> tuple[int, dict[str, str], dict]:
    """One POST of `body` through nginx: its status, headers and JSON document."""
    connection = http.client.HTTPConnection("127.0.0.1", cluster.nginx.port, timeout=30)
    try:
        connection.request("POST", path, body, {"Content-Type": "text/plain"})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def test_nginxs_own_errors_are_json_and_rawserves_413_reaches_the_client(start_cluster):
    """Through this file, a body just past rawserve's --max-body-bytes got nginx's HTML
    413 (rawserve's JSON one, naming the option, never reached a client), and no replica
    reachable was nginx's HTML 502: clients that read JSON (openai, TEI's, TGI's) failed
    on the page."""
    cluster = start_cluster()
    status, _, body = post_raw(cluster, b"x" * (1536 * 1024))  # past 1 MiB: rawserve's
    assert status == 413 and "--max-body-bytes" in body["error"], body
    status, headers, body = post_raw(cluster, b"x" * (3 * 1024 * 1024))  # nginx's
    assert status == 413 and body["error_type"] == "payload_too_large", body
    assert headers["X-Request-Id"]
    for replica in cluster.replicas:
        replica.stop()
    status, headers, body = post_raw(cluster, b"hello")
    assert status == 503 and body["error_type"] == "unavailable", body
    assert headers["Retry-After"] == "1" and headers["X-Request-Id"]
    # OpenAI's routes in OpenAI's shape: its SDK read no message from the bare string
    status, _, body = post_raw(cluster, b"hello", "/v1/completions")
    assert status == 503 and body["error"]["message"].startswith("no replica could take")
    status, _, body = post_raw(cluster, b"x" * (3 * 1024 * 1024), "/v1/embeddings")
    assert status == 413 and body["error"]["code"] == "payload_too_large", body
    # TEI's /embeddings is OpenAI's /v1/embeddings: its errors are OpenAI's, nginx's too
    status, _, body = post_raw(cluster, b"x" * (3 * 1024 * 1024), "/embeddings")
    assert status == 413 and body["error"]["code"] == "payload_too_large", body
    status, _, body = post_raw(cluster, b"hello", "/embeddings")
    assert status == 503 and body["error"]["message"].startswith("no replica could take")
    for path in ("/classify", "/score"):  # vLLM's, whose errors are its OpenAI routes'
        status, _, body = post_raw(cluster, b"hello", path)
        assert status == 503 and body["error"]["message"].startswith("no replica could take")


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """`request` sent as it is; the answer's status, headers (lowercase) and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (x.partition(":") for x in lines)}
    return int(status_line.split()[1]), headers, body


def test_nginxs_other_errors_are_json_and_readable_by_a_page_and_http_1_0_is_answered(
    start_cluster,
):
    """A review of this file found: an HTTP/1.0 probe without Host got rawserve's 400
    (nginx dropped the empty Host it passed on); no replica answering in time was
    nginx's HTML 504, a header line past 8k its HTML 400 (rawserve takes 16 KiB); and
    nginx's own errors carried no CORS headers, so a page could not read them."""
    origin = "https://app.example"
    cluster = start_cluster(
        edits={
            "proxy_read_timeout 310s;": "proxy_read_timeout 1s;",
            f'# "{origin}"  $http_origin;': f'"{origin}"  $http_origin;',
        }
    )
    port = cluster.nginx.port
    status, _, _ = raw_exchange(port, b"GET /health HTTP/1.0\r\n\r\n")
    assert status == 200
    long_line = b"X-Long: " + b"a" * 10_000 + b"\r\n"
    status, _, _ = raw_exchange(
        port, b"GET /health HTTP/1.1\r\nHost: a\r\n" + long_line + b"Connection: close\r\n\r\n"
    )
    assert status == 200  # rawserve's to judge: its head limit is 16 KiB
    # what nginx refuses itself (a second review: a request line it could not read was
    # an HTML 500, a redirect to a named location needing a URI), in the target's dialect
    too_long = b"X-Long: " + b"a" * 17_000 + b"\r\n"
    for request, refused in [
        (
            b"GET /health HTTP/1.1\r\nHost: a\r\nOrigin: "
            + origin.encode()
            + b"\r\n"
            + too_long
            + b"\r\n",
            400,
        ),
        (b"GET /v1/models?" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: a\r\n\r\n", 414),
        (b"G@T / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        (b"TRACE / HTTP/1.1\r\nHost: a\r\n\r\n", 405),
        (b"TRACE /v1/models HTTP/1.1\r\nHost: a\r\n\r\n", 405),  # OpenAI's shape
        (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        (b"GET / HTTP/3.0\r\nHost: a\r\n\r\n", 505),
    ]:
        status, headers, body = raw_exchange(port, request)
        assert (status, headers["content-type"]) == (refused, "application/json"), body
        error = json.loads(body)["error"]  # OpenAI's where its target was read
        assert isinstance(error, dict) is request.startswith(b"TRACE /v1/"), body
        message = error["message"] if isinstance(error, dict) else error
        assert message.startswith("nginx refused the request"), body
        if b"Origin" in request:
            assert headers["access-control-allow-origin"] == origin
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/", b"x" * (3 * 1024 * 1024), {"Origin": origin})
    response = connection.getresponse()
    assert (
        response.status == 413 and json.loads(response.read())["error_type"] == "payload_too_large"
    )
    assert response.getheader("Access-Control-Allow-Origin") == origin
    assert response.getheader("Access-Control-Expose-Headers") == "Retry-After, X-Request-Id"
    connection.close()
    for replica in cluster.replicas:  # hung: the kernel takes connections, none answers
        os.kill(replica.process.pid, signal.SIGSTOP)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", "/", b"x", {"Origin": origin})
        response = connection.getresponse()
        body = json.loads(response.read())
        assert response.status == 504 and body["error_type"] == "timeout", body
        assert response.getheader("Access-Control-Allow-Origin") == origin
        assert response.getheader("X-Request-Id")
        connection.close()
    finally:
        for replica in cluster.replicas:
            os.kill(replica.process.pid, signal.SIGCONT)


def test_nginx_and_rawserve_log_one_id_for_each_request(start_cluster):
    """This file passed a client's X-Request-Id on as sent; rawserve refuses one with a
    space or past 128 characters and logs an id of its own, so nginx's log and
    rawserve's named the request differently."""
    cluster = start_cluster()
    given_ids = ["client-id-1", "a b", "x" * 129, "x" * 128]
    echoed = []
    for given in given_ids:
        connection = http.client.HTTPConnection("127.0.0.1", cluster.nginx.port, timeout=30)
        try:
            connection.request("POST", "/", b"hi", {"X-Request-Id": given})
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            echoed.append(response.getheader("X-Request-Id"))
        finally:
            connection.close()
    assert echoed[0] == "client-id-1" and echoed[3] == "x" * 128
    assert all(re.fullmatch(r"[0-9a-f]{32}", id_) for id_ in echoed[1:3]), echoed

    def logged_by_nginx() -> list[str]:  # its line too comes once the answer has gone
        return re.findall(r" id=(\S+) ", cluster.nginx.access_log.read_text())

    wait_until(lambda: len(logged_by_nginx()) == len(echoed), timeout=10)
    assert logged_by_nginx() == echoed

    def logged_by_rawserve(id_: str) -> bool:  # a line is logged just after its answer
        return any(id_ in line for r in cluster.replicas for line in r.read_log())

    for id_ in echoed:
        wait_until(lambda id_=id_: logged_by_rawserve(id_), timeout=10)


def test_a_503_with_retry_after_from_an_overloaded_replica_is_retried_on_the_other(
    start_cluster,
):
    cluster = start_cluster("--max-queue", "2")
    busy = cluster.replicas[0]

    def post_to_busy(sleep: float) -> tuple[int, dict[str, str], bytes]:
        body = json.dumps({"inputs": "direct", "parameters": {"sleep": sleep}})
        return busy.request("POST", "/", body, {"Content-Type": "application/json"})

    with ThreadPoolExecutor(3) as pool:
        # Overload replica 0 directly: one request computing, two queued (its bound).
        occupying = [pool.submit(post_to_busy, 2.0)]
        wait_until(lambda: ready_status(busy) == "ready" and in_flight(busy) == 1)
        occupying += [pool.submit(post_to_busy, 0.0) for _ in range(2)]
        wait_until(lambda: ready_status(busy) == "full")
        status, headers, _ = post_to_busy(0.0)
        assert status == 503 and float(headers["retry-after"]) >= 1

        answers = asyncio.run(load_through(cluster, 8, concurrency=1))
        assert [a.status for a in answers] == [200] * 8
        assert {a.replica for a in answers} == {1}
        assert [done.result()[0] for done in occupying] == [200] * 3
    # nginx did send a request to the overloaded replica, which refused it: retried
    assert sample(busy, "rawserve_items_dropped_total", reason="rejected") >= 2


def test_a_brief_overload_of_every_replica_takes_none_of_them_out(start_cluster):
    """nginx counts a 503 it retries as a failed attempt: with `max_fails=1`, a retried
    503 from each replica (a full queue, for a moment) took both out for `fail_timeout`,
    and nginx answered its own 502, without Retry-After, even once both were idle again."""
    cluster = start_cluster("--max-queue", "1")

    def post_direct(replica: RunningServer, sleep: float) -> int:
        body = json.dumps({"inputs": "direct", "parameters": {"sleep": sleep}})
        return replica.request("POST", "/", body, {"Content-Type": "application/json"})[0]

    with ThreadPoolExecutor(4) as pool:
        occupying = []
        for replica in cluster.replicas:  # each: one request computing, one queued (full)
            occupying.append(pool.submit(post_direct, replica, 2.0))
            wait_until(lambda r=replica: in_flight(r) == 1)
            occupying.append(pool.submit(post_direct, replica, 0.0))
            wait_until(lambda r=replica: ready_status(r) == "full")
        # Each request is tried on both (nginx does not count the last try's 503 as a
        # failure: it takes a second request to have one counted against each replica).
        for _ in range(3):
            status, headers = post_through(cluster)
            assert status == 503 and float(headers["retry-after"]) >= 1  # rawserve's
        assert [done.result() for done in occupying] == [200] * 4
    for replica in cluster.replicas:  # each refused at least one of nginx's tries
        assert sample(replica, "rawserve_items_dropped_total", reason="rejected") >= 1
        wait_until(lambda r=replica: ready_status(r) == "ready")
    # idle again: served at once, not `no live upstreams` until fail_timeout ends
    answers = asyncio.run(load_through(cluster, 4, concurrency=1))
    assert [a.status for a in answers] == [200] * 4


def post_through(cluster: Cluster) -> tuple[int, dict[str, str]]:
    connection = http.client.HTTPConnection("127.0.0.1", cluster.nginx.port, timeout=30)
    try:
        body = json.dumps({"inputs": "x"})
        connection.request("POST", "/", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    """Poll a replica (a client gets no event for a server's state) until `condition`."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition did not hold in time"
        time.sleep(0.02)


def ready_status(replica: RunningServer) -> str:
    return json.loads(replica.request("GET", "/ready")[2])["status"]


def in_flight(replica: RunningServer) -> float:
    return sample(replica, "rawserve_items_in_flight")


def sample(replica: RunningServer, name: str, **labels: str) -> float:
    text = replica.request("GET", "/metrics")[2].decode()
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and labels.items() <= found.labels.items():
                return found.value  # (other labels, such as the model's name, aside)
    return 0.0


@pytest.mark.parametrize("how", ["killed", "draining"])
def test_a_replica_that_goes_away_is_taken_out_without_failing_requests(start_cluster, how):
    cluster = start_cluster("--max-queue", "64")
    leaving = cluster.replicas[0]
    concurrency = 4

    def take_out() -> None:
        if how == "killed":
            leaving.process.kill()
        else:
            leaving.signal(signal.SIGTERM)

    answers = asyncio.run(
        load_through(cluster, 120, concurrency, sleep=0.005, after=20, action=take_out)
    )
    failed = [a.status for a in answers if a.status != 200]
    assert len(failed) <= concurrency, failed  # at most the requests in flight
    assert len(answers) == 120
    assert {a.replica for a in answers[:20]} == {0, 1}
    assert {a.replica for a in answers[-20:]} == {1}  # nginx stopped sending to it
    if how == "draining":
        assert leaving.process.wait(30) == 0  # it finished its work and exited cleanly

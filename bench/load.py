"""A load generator on raw asyncio sockets: closed loop, open loop, and a health prober.

- Closed loop: N clients, each on its own keep-alive connection, send a request as soon as
  their previous answer arrived (throughput at a concurrency).
- Open loop: requests arrive at a fixed Poisson rate whatever the server does (overload);
  each takes an idle connection or opens a new one.
- Health prober: `GET /health` at a fixed interval on its own connection, alongside either,
  from a process of its own (its figures must not include this process's own delays).

Requests are prebuilt bytes and answers are parsed by hand (status line, Content-Length),
so the client spends a few microseconds per request: `client_cpu` in every result says how
much of a core it used, and `python -m bench.load --handler-check` measures it against an
echo server. Loopback only; every run stops by itself after `duration` seconds.

    python -m bench.load --port 8000 --clients 64 --duration 10
    python -m bench.load --port 8000 --rate 900 --duration 10 --timeout-header 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import math
import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import described
from bench.workloads import RAW_TEXT, TEXT_SETS, BodyFormat, texts

HOST = "127.0.0.1"  # loopback only, by design
MAX_OPEN_LOOP_CONNECTIONS = 2048
DRAIN_SECONDS = 5.0  # how long answers still in flight are awaited after the run
CONNECT_ERROR = -1  # status recorded when a request got no answer (refused, reset)


Answered = Callable[[int, int, bool], None]  # (status, body bytes, keep-alive)


class Connection(asyncio.Protocol):
    """One HTTP/1.1 client connection sending prebuilt requests, one at a time.

    `send()` hands the answer to a callback straight from `data_received` (no task, no
    future: the open loop sends thousands a second); `request()` awaits it instead.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.on_answer: Answered | None = None
        self.closed = False
        self.keep_alive = True
        self.retry_after: float | None = None  # the last answer's wait, in seconds

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._answer(CONNECT_ERROR, 0, False)  # closed before the answer

    def send(self, data: bytes, on_answer: Answered) -> None:
        """Send one request; `on_answer(status, size, keep_alive)` gets its answer
        (status CONNECT_ERROR if the connection ends first)."""
        if self.transport is None or self.closed:
            raise ConnectionError("the connection is closed")
        self.on_answer = on_answer
        self.retry_after = None
        self.transport.write(data)

    async def request(self, data: bytes) -> tuple[int, int]:
        """Send one request; (status, body bytes) of the answer."""
        waiter: asyncio.Future[tuple[int, int, bool]] = asyncio.get_running_loop().create_future()
        self.send(data, lambda *answer: waiter.done() or waiter.set_result(answer))
        status, size, self.keep_alive = await waiter
        if status == CONNECT_ERROR:
            raise ConnectionError("connection closed before the answer")
        return status, size

    def _answer(self, status: int, size: int, keep_alive: bool) -> None:
        on_answer, self.on_answer = self.on_answer, None
        if on_answer is not None:
            on_answer(status, size, keep_alive)

    def _complete(self) -> None:
        if self.on_answer is None:
            return
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(self.buffer[:head_end]).lower()
        start = head.find(b"\r\ncontent-length:")
        if start < 0:  # every server measured here sends Content-Length
            self._answer(CONNECT_ERROR, 0, False)
            self.close()
            return
        line_end = head.find(b"\r\n", start + 2)
        length = int(head[start + 17 : line_end if line_end >= 0 else None])
        end = head_end + 4 + length
        if len(self.buffer) < end:
            return
        status = int(head[9:12])
        keep_alive = b"\r\nconnection: close" not in head
        self.retry_after = said_retry_after(head) if status == 503 else None
        del self.buffer[:end]
        self._answer(status, length, keep_alive)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


def said_retry_after(head: bytes) -> float | None:
    """The seconds a (lower-cased) answer head asks to wait: its Retry-After-Ms where it
    says one (not rounded up to a whole second), else its Retry-After."""
    for name, scale in ((b"\r\nretry-after-ms:", 1000), (b"\r\nretry-after:", 1)):
        start = head.find(name)
        if start >= 0:
            line_end = head.find(b"\r\n", start + 2)
            return float(head[start + len(name) : line_end if line_end >= 0 else None]) / scale
    return None


async def connect(port: int) -> Connection:
    loop = asyncio.get_running_loop()
    _, connection = await loop.create_connection(Connection, HOST, port)
    return connection


def build_request(
    body: bytes,
    *,
    method: str = "POST",
    path: str = "/",
    content_type: str = "text/plain; charset=utf-8",
    extra_headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    if method == "POST":
        lines += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in extra_headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def build_requests(
    items: Sequence[str], body_format: BodyFormat, timeout_header: float | None = None
) -> list[bytes]:
    headers = [] if timeout_header is None else [("X-Request-Timeout", f"{timeout_header:g}")]
    return [
        build_request(
            body_format.body(text),
            path=body_format.path,
            content_type=body_format.content_type,
            extra_headers=headers,
        )
        for text in items
    ]


HEALTH_REQUEST = build_request(b"", method="GET", path="/health")


# --- results --------------------------------------------------------------------------


@dataclass
class Samples:
    """What the run saw: one entry per answered (or failed) request, times in seconds."""

    sent: list[float] = field(default_factory=list)  # since the run started
    latency: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    # (answered at, since the run started; seconds asked to wait) of the refusals saying it
    retry_after: list[tuple[float, float]] = field(default_factory=list)

    def add(self, sent: float, latency: float, status: int, size: int) -> None:
        self.sent.append(sent)
        self.latency.append(latency)
        self.status.append(status)
        self.size.append(size)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100), nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def latency_summary(latencies: Sequence[float]) -> dict[str, float | None]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 3)

    return {
        "p50_ms": ms(percentile(latencies, 50)),
        "p90_ms": ms(percentile(latencies, 90)),
        "p99_ms": ms(percentile(latencies, 99)),
        "max_ms": ms(max(latencies, default=None)),
    }


@dataclass
class LoadResult:
    mode: str  # "closed" or "open"
    duration: float
    samples: Samples
    client_cpu: float  # seconds of CPU the load generator used
    clients: int | None = None
    rate: float | None = None
    deadline: float | None = None  # the X-Request-Timeout sent, seconds
    dropped: int = 0  # open loop: arrivals with no connection to send them on
    health: Samples | None = None

    def summary(self) -> dict[str, Any]:
        samples = self.samples
        ok = [lat for lat, st in zip(samples.latency, samples.status, strict=True) if st == 200]
        statuses = Counter(samples.status)
        summary: dict[str, Any] = {
            "mode": self.mode,
            "clients": self.clients,
            "rate": self.rate,
            "duration_s": round(self.duration, 3),
            "requests": len(samples.status),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "throughput": round(len(ok) / self.duration, 2),
            **latency_summary(ok),
            "client_cpu_share": round(self.client_cpu / self.duration, 3),
        }
        if self.deadline is not None:
            good = [lat for lat in ok if lat <= self.deadline]
            summary["goodput"] = round(len(good) / self.duration, 2)
            summary["late_200"] = len(ok) - len(good)
            summary["late_200_max_ms"] = round(1000 * max(ok, default=0.0), 3)
        rejected = [
            lat for lat, st in zip(samples.latency, samples.status, strict=True) if st == 503
        ]
        if rejected:
            summary["503"] = latency_summary(rejected)
        if self.mode == "open":
            summary["dropped_by_client"] = self.dropped
        if self.health is not None:
            summary["health"] = {
                "requests": len(self.health.status),
                "ok": self.health.status.count(200),
                **latency_summary(self.health.latency),
            }
        return summary


# --- the runs -------------------------------------------------------------------------


async def closed_loop(
    port: int,
    requests: Sequence[bytes],
    clients: int,
    duration: float,
    *,
    health_interval: float | None = None,
    deadline: float | None = None,
    max_requests: int | None = None,
) -> LoadResult:
    """`clients` connections, each sending its next request when the last is answered.

    Stops after `duration` seconds, or once `max_requests` requests have been sent.
    """
    loop = asyncio.get_running_loop()
    samples = Samples()
    order = itertools.cycle(range(len(requests)))
    budget = itertools.count(1)
    limit = max_requests if max_requests is not None else math.inf
    cpu_start = time.process_time()
    start = loop.time()
    stop_at = start + duration

    async def client(index: int) -> None:
        connection: Connection | None = None
        try:
            while loop.time() < stop_at and next(budget) <= limit:
                if connection is None or connection.closed or not connection.keep_alive:
                    if connection is not None:
                        connection.close()
                    connection = await connect(port)
                data = requests[next(order)]
                sent = loop.time()
                try:
                    status, size = await connection.request(data)
                except ConnectionError:
                    status, size = CONNECT_ERROR, 0
                    connection.close()
                    connection = None
                samples.add(sent - start, loop.time() - sent, status, size)
        finally:
            if connection is not None:
                connection.close()

    prober = (
        loop.create_task(probe_health_elsewhere(port, health_interval, duration))
        if health_interval
        else None
    )
    tasks = [loop.create_task(client(i)) for i in range(clients)]
    await _finish(tasks, stop_at + DRAIN_SECONDS)
    health = await prober if prober is not None else None
    elapsed = min(loop.time(), stop_at) - start
    if max_requests is not None and len(samples.status) >= max_requests:
        ends = zip(samples.sent, samples.latency, strict=True)
        elapsed = max(sent + latency for sent, latency in ends)
    return LoadResult(
        "closed",
        elapsed,
        _window(samples, duration),
        time.process_time() - cpu_start,
        clients=clients,
        deadline=deadline,
        health=health,
    )


async def open_loop(
    port: int,
    requests: Sequence[bytes],
    rate: float,
    duration: float,
    *,
    deadline: float | None = None,
    health_interval: float | None = None,
    seed: int = 0,
) -> LoadResult:
    """Poisson arrivals at `rate` per second for `duration` seconds, whatever the answers."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    samples = Samples()
    idle: list[Connection] = []
    open_count = 0
    dropped = 0
    order = itertools.cycle(range(len(requests)))
    cpu_start = time.process_time()
    start = loop.time()
    stop_at = start + duration

    outstanding = 0  # sent (or connecting) and not answered yet
    sending = True
    all_answered = asyncio.Event()

    def answered(connection: Connection, sent: float, status: int, size: int, keep: bool) -> None:
        nonlocal open_count, outstanding
        samples.add(sent - start, loop.time() - sent, status, size)
        if connection.retry_after is not None:
            samples.retry_after.append((loop.time() - start, connection.retry_after))
        if status != CONNECT_ERROR and keep and not connection.closed:
            idle.append(connection)
        else:
            connection.close()
            open_count -= 1
        outstanding -= 1
        if not outstanding and not sending:
            all_answered.set()

    def send(connection: Connection, data: bytes, sent: float) -> None:
        try:
            connection.send(data, functools.partial(answered, connection, sent))
        except ConnectionError:
            answered(connection, sent, CONNECT_ERROR, 0, False)

    async def connect_and_send(data: bytes, sent: float) -> None:
        try:
            connection = await connect(port)
        except OSError:
            answered(Connection(), sent, CONNECT_ERROR, 0, False)  # one that never opened
            return
        send(connection, data, sent)

    prober = (
        loop.create_task(probe_health_elsewhere(port, health_interval, duration))
        if health_interval
        else None
    )
    connecting: set[asyncio.Task] = set()
    next_arrival = start
    while True:
        next_arrival += rng.expovariate(rate)
        if next_arrival >= stop_at:
            break
        delay = next_arrival - loop.time()
        if delay > 0.0005:  # sleep only when it is worth it; late arrivals go at once
            await asyncio.sleep(delay)
        while idle and idle[-1].closed:  # the server closed it while it was idle
            idle.pop()
            open_count -= 1
        data = requests[next(order)]
        sent = max(next_arrival, loop.time())  # sent early (within 0.5 ms): time from now
        if idle:
            outstanding += 1
            send(idle.pop(), data, sent)
            continue
        if open_count >= MAX_OPEN_LOOP_CONNECTIONS:
            dropped += 1
            continue
        open_count += 1
        outstanding += 1
        task = loop.create_task(connect_and_send(data, sent))
        connecting.add(task)
        task.add_done_callback(connecting.discard)
    sending = False
    if outstanding:
        try:
            await asyncio.wait_for(all_answered.wait(), stop_at + DRAIN_SECONDS - loop.time())
        except TimeoutError:
            pass  # what is still unanswered is not counted
    await _finish(list(connecting), loop.time())
    health = await prober if prober is not None else None
    for connection in idle:
        connection.close()
    return LoadResult(
        "open",
        duration,
        samples,
        time.process_time() - cpu_start,
        rate=rate,
        deadline=deadline,
        dropped=dropped,
        health=health,
    )


async def probe_health(
    port: int, interval: float, stop_at: float, start: float, samples: Samples
) -> None:
    """GET /health every `interval` seconds on one connection, until `stop_at`."""
    loop = asyncio.get_running_loop()
    connection: Connection | None = None
    next_probe = loop.time() + interval
    try:
        while next_probe < stop_at:
            await asyncio.sleep(max(0.0, next_probe - loop.time()))
            next_probe += interval
            if connection is None or connection.closed or not connection.keep_alive:
                connection = await connect(port)
            sent = loop.time()
            try:
                status, size = await connection.request(HEALTH_REQUEST)
            except ConnectionError:
                status, size = CONNECT_ERROR, 0
                connection = None
            samples.add(sent - start, loop.time() - sent, status, size)
    finally:
        if connection is not None:
            connection.close()


async def probe_health_elsewhere(port: int, interval: float, duration: float) -> Samples:
    """`probe_health` from a process of its own, so the figures are the server's latency
    and not this load generator's own event loop, busy with the answers of the load."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.load",
        "--port",
        str(port),
        "--probe-health",
        str(interval),
        "--duration",
        str(duration),
        stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    out, _ = await process.communicate()
    samples = Samples()
    for sent, latency, status in json.loads(out or b"[]"):
        samples.add(sent, latency, status, 0)
    return samples


async def _probe_health_main(port: int, interval: float, duration: float) -> None:
    loop = asyncio.get_running_loop()
    samples = Samples()
    start = loop.time()
    await probe_health(port, interval, start + duration, start, samples)
    json.dump(list(zip(samples.sent, samples.latency, samples.status, strict=True)), sys.stdout)


async def _finish(tasks: list[asyncio.Task], until: float) -> None:
    """Wait for `tasks` until the loop time `until`; cancel what is left then."""
    if not tasks:
        return
    loop = asyncio.get_running_loop()
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, until - loop.time()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _window(samples: Samples, duration: float) -> Samples:
    """The requests sent within the run (closed loop: the last ones may end after it)."""
    kept = Samples()
    for sent, latency, status, size in zip(
        samples.sent, samples.latency, samples.status, samples.size, strict=True
    ):
        if sent < duration:
            kept.add(sent, latency, status, size)
    return kept


async def warm_up(port: int, requests: Sequence[bytes], seconds: float, clients: int = 8) -> None:
    """A short closed-loop run whose figures are thrown away (caches, allocator, threads)."""
    await closed_loop(port, requests, clients, seconds)


async def wait_until_serving(
    port: int, request: bytes, timeout: float, alive: Callable[[], bool] = lambda: True
) -> float:
    """Send `request` until it is answered 200, then, for rawserve, wait until every
    worker is serving; the seconds the first answer took.

    The first answer comes from the first worker ready; the others still load and warm
    up on the same cores, and a point measured then measures the start (a lone client
    at 2.5x its time on two CPU workers). Raises TimeoutError after `timeout` seconds,
    or as soon as `alive()` says the server process has exited.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    last = "no answer"
    while loop.time() - start < timeout:
        if not alive():
            raise TimeoutError(f"the server on port {port} exited before answering")
        try:
            connection = await connect(port)
            try:
                status, _ = await asyncio.wait_for(connection.request(request), timeout)
            finally:
                connection.close()
            if status == 200:
                answered = loop.time() - start
                while await asyncio.to_thread(workers_starting, port):
                    if loop.time() - start > timeout or not alive():
                        raise TimeoutError(f"the workers on port {port} did not all start")
                    await asyncio.sleep(0.2)
                return answered
            last = f"status {status}"
        except (TimeoutError, ConnectionError, OSError) as exc:
            last = type(exc).__name__
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the server on port {port} did not answer 200 ({last})")


def workers_starting(port: int) -> int:
    """How many of the server's workers `/info` says are not serving yet (loading,
    warming up, waiting to start); 0 for a server without rawserve's `/info`."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/info", timeout=10) as answer:
            info = json.load(answer)
    except (OSError, ValueError):
        return 0
    if not isinstance(info, dict):
        return 0
    models = [info, *info.get("models", [])] if isinstance(info.get("models"), list) else [info]
    states = [
        worker.get("state")
        for model in models
        if isinstance(model, dict)
        for worker in model.get("workers", [])
        if isinstance(worker, dict)
    ]
    return sum(state in ("waiting", "loading", "warming") for state in states)


# --- command line ---------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=described(__doc__))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--texts", choices=TEXT_SETS, default="short")
    parser.add_argument("--json-params", help='send JSON bodies with these parameters, e.g. "{}"')
    parser.add_argument("--clients", type=int, default=64, help="closed loop: concurrency")
    parser.add_argument("--rate", type=float, help="open loop: arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds (at most 120)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds, not counted")
    parser.add_argument("--timeout-header", type=float, help="X-Request-Timeout to send (s)")
    parser.add_argument("--health-every", type=float, help="probe GET /health every S seconds")
    parser.add_argument("--probe-health", type=float, help="only probe /health every S seconds")
    args = parser.parse_args(argv)
    duration = min(args.duration, 120.0)
    if args.probe_health:
        asyncio.run(_probe_health_main(args.port, args.probe_health, duration))
        return 0
    body_format = RAW_TEXT if args.json_params is None else BodyFormat(json.loads(args.json_params))
    requests = build_requests(texts(args.texts), body_format, args.timeout_header)

    async def run() -> LoadResult:
        await wait_until_serving(args.port, requests[0], 120)
        if args.warmup > 0:
            await warm_up(args.port, requests, args.warmup)
        if args.rate:
            return await open_loop(
                args.port,
                requests,
                args.rate,
                duration,
                deadline=args.timeout_header,
                health_interval=args.health_every,
            )
        return await closed_loop(
            args.port,
            requests,
            args.clients,
            duration,
            health_interval=args.health_every,
            deadline=args.timeout_header,
        )

    result = asyncio.run(run())
    json.dump(result.summary(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

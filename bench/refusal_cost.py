"""What one refusal costs the server in Python: a `POST /` answered 503 because the queue
is full, measured in process.

The real protocol (h11), the real app, scheduler and metrics, a full queue, and a
transport that only counts bytes; requests arrive one at a time on keep-alive
connections, each answered in the pass that read it (as under overload), while the
queue holds `--queue` items (--max-queue, full). Prints the microseconds per refusal
(best of `--rounds`), with the access log on (written to /dev/null, as formatted as on
stderr) and off (`--no-access-log`).

    python -m bench.refusal_cost --requests 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from bench import described
from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.ops.metrics import Metrics
from rawserve.protocol import HttpProtocol, ProtocolSettings, ServerState
from rawserve.serving.core import SchedulerCore
from rawserve.serving.driver import Scheduler
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState, WorkerStatus
from rawserve.shared.logs import setup_logging
from rawserve.shared.messages import ModelLimits

BODY = json.dumps({"inputs": "The movie was good and the music was great."}).encode()
REQUEST = (
    b"POST / HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
CONNECTIONS = 64  # requests take turns on this many keep-alive connections


class CountingTransport(asyncio.Transport):
    """Keeps nothing: counts what the server writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.refusals = 0  # responses that are 503s
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self.refusals += bytes(data[:12]) == b"HTTP/1.1 503"

    def writelines(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        for piece in pieces:
            self.write(piece)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0


class ReadyWorkers:
    """The executor's face the routes read: one ready worker, never free."""

    ready = True
    healthy = True
    task = "feature-extraction"
    loaded = None  # what a loaded worker said of its model: nothing the refusal reads

    def idle_workers(self) -> int:
        return 0

    def empty_workers(self) -> int:
        return 0

    limits = ModelLimits()

    def batch_cap(self) -> int | None:
        return None

    limits = ModelLimits()  # an echo: nothing is cut, nothing generated

    def concurrency(self) -> int:
        return 1

    def rows_when_ready(self) -> int:
        return 1

    def abandon(self, future, items=None) -> None:
        pass

    def submit(
        self,
        inputs: Any,
        params: Any,
        control: Any = None,
        request_ids: Any = (),
        admitted: Any = (),
        on_part: Any = None,
    ) -> Any:
        raise AssertionError("a full queue submits nothing")

    def load_state(self) -> tuple[LoadState, float | None]:
        return LoadState.LOADING, None  # (never asked: the worker is ready)

    def back_in(self) -> float | None:
        return None  # (never asked: the worker is ready)

    def status(self) -> list[WorkerStatus]:
        return []

    def open_stream(self, on_token: Callable[..., None]) -> int:
        raise AssertionError("not streaming")

    def close_stream(self, stream_id: int) -> None:
        pass


def full_server(loop: asyncio.AbstractEventLoop, queue: int) -> tuple[App, ServerState]:
    workers = ReadyWorkers()
    metrics = Metrics()
    core = SchedulerCore(max_queue=queue)
    scheduler = Scheduler(core, workers, loop=loop, metrics=metrics.for_model("bench"))
    for _ in range(queue):  # the queue is full from now on
        core.admit([core.new_item("queued", {}, 1e18, 0.0)])
    core.cost_model.observe(100, 0.01)  # a measured speed: Retry-After from the queue
    model = ServedModel("bench", ModelService(scheduler, workers), {})
    return App(ServedModels([model]), metrics=metrics), ServerState(metrics=metrics)


def per_refusal(requests: int, loop: asyncio.AbstractEventLoop, queue: int = 256) -> float:
    """Seconds of Python per refused request, over `requests` of them."""
    app, state = full_server(loop, queue)
    settings = ProtocolSettings()
    connections = []
    for _ in range(CONNECTIONS):
        protocol = HttpProtocol(app, settings, state, loop=loop)
        transport = CountingTransport()
        protocol.connection_made(transport)
        connections.append((protocol, transport))
    connections[0][0].data_received(REQUEST)  # warm: the first answer fills caches
    started = time.perf_counter()
    for index in range(requests):
        connections[index % CONNECTIONS][0].data_received(REQUEST)
    seconds = time.perf_counter() - started
    # every request must have been refused in the pass that read it, on an open connection:
    # otherwise this would time something else (an error page, a closed connection)
    refused = sum(transport.refusals for _, transport in connections)
    assert refused == requests + 1, f"{refused} refusals for {requests + 1} requests"
    assert all(not transport.closed for _, transport in connections), "a refusal closed"
    return seconds / requests


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.refusal_cost", description=described(__doc__)
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--queue", type=int, default=256, help="--max-queue, full")
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    results = {}
    with open(os.devnull, "w") as devnull:
        for access_log in (True, False):
            setup_logging("info", "text", access_log=access_log, stream=devnull)
            best = min(per_refusal(args.requests, loop, args.queue) for _ in range(args.rounds))
            results["access log on" if access_log else "access log off"] = round(1e6 * best, 1)
    logging.shutdown()
    print(json.dumps({"microseconds_per_refusal": results, **vars(args)}))


if __name__ == "__main__":
    main()

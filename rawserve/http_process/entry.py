"""An HTTP process's life (`--http-processes` N > 1): started by the serving process
with the `spawn` method (a fresh interpreter that imports this module and calls
`run_http_process`), it is given the settings the serving process parsed (read again, the
command line named files gone since, or readable only there: a `--chat-template
<(...)`), listens on the server's port beside
the other HTTP processes (SO_REUSEPORT: the kernel spreads connections between them),
serves every route through the protocol and the API with each model's face a client of
the serving process (rawserve.http_process.remote), tells the serving process that its
event loop turns (`say_alive`: one found silent is killed and replaced), and stops when
the serving process says drain, or at once (exit code 1) when the serving process is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.config import ServerConfig
from rawserve.http.errors import ServiceUnavailable
from rawserve.http.limits import ServerState
from rawserve.http.tls import server_context
from rawserve.http_process.front import FINAL_WRITE_SECONDS, listen, requests_answered
from rawserve.http_process.remote import Link, RemoteServing
from rawserve.ops import loops
from rawserve.ops.metrics import CONTENT_TYPE, Metrics, render_families
from rawserve.ops.stop_signals import stop_signals
from rawserve.protocol import HttpProtocol
from rawserve.shared.board import Board
from rawserve.shared.logs import setup_logging
from rawserve.shared.memory import fix_mmap_threshold

log = logging.getLogger("rawserve")

# how long an HTTP process stopped by a signal waits for the serving process to say drain
# too (a stop sent to the group) before it takes the signal for its own alone
ALONE_SECONDS = 1.0
# how often this process says it is alive; the serving process kills one silent for
# seconds (rawserve.serving.fleet.SILENT_SECONDS), so this is a small part of that
ALIVE_SECONDS = 0.5
SERVING_GONE = "HTTP process %d (pid %d): the serving process is gone; stopping"


@dataclass(frozen=True)
class ModelSpec:
    """A served model as an HTTP process knows it: its names and its facts for /info."""

    name: str
    aliases: tuple[str, ...]
    facts: Mapping[str, Any]


@dataclass(frozen=True)
class HttpProcessSpec:
    """What the serving process tells an HTTP process (plain data: it is pickled)."""

    config: ServerConfig  # the serving process's, but for its TLS context (`tls_files`)
    index: int
    port: int  # the port the serving process reserved (its --port, or the one it got)
    board: str  # the path of the published queue state (rawserve.shared.board)
    models: tuple[ModelSpec, ...]
    # --ssl-certfile and --ssl-keyfile, loaded here (a TLS context cannot be pickled)
    tls_files: tuple[str, str | None] | None = None

    @classmethod
    def of(cls, config: ServerConfig, **fields: Any) -> HttpProcessSpec:
        tls = config.tls
        files = (tls.certfile, tls.keyfile) if tls else None
        return cls(dataclasses.replace(config, tls=None), tls_files=files, **fields)


class ProcessMetrics(Metrics):
    """This process's metrics; a scrape answers for every process of the server."""

    def __init__(self) -> None:
        super().__init__()
        self.link: Link | None = None

    async def scrape(self) -> tuple[bytes, str]:
        """The whole server's metrics; 503 when the serving process does not answer (a
        failed scrape, not counters that seem to fall)."""
        assert self.link is not None
        families = await self.link.scrape()
        if families is None:
            raise ServiceUnavailable("the serving process did not answer: no metrics now")
        return render_families(families), CONTENT_TYPE


def say_alive(send: Callable[[tuple[str]], None], every: float = ALIVE_SECONDS) -> None:
    """Send ("alive",) now and every `every` seconds from a timer of the running event
    loop: a loop that is stopped (SIGSTOP) or stuck in a call says nothing, while one busy
    with long passes (a big answer's JSON) still says it between two. No work per request."""
    loop = asyncio.get_running_loop()

    def beat() -> None:
        send(("alive",))
        loop.call_later(every, beat)

    beat()


def run_http_process(spec: HttpProcessSpec, sock: socket.socket) -> None:
    """The entry function of an HTTP process (`sock`: its end of the channel)."""
    config = spec.config
    setup_logging(config.log_level, config.log_format, access_log=config.access_log)
    sys.exit(loops.run(serve_http(spec, sock), config.loop))


async def first_of(events: list[asyncio.Event], timeout: float) -> None:
    """Wait until one of `events` is set, or `timeout` passes."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()


async def answered_unless_closing(
    state: ServerState, closing: asyncio.Event, timeout: float
) -> bool:
    """`requests_answered` within `timeout`, cut short (False) once the serving process
    ends the drain (`closing`): it kills what is still there FINAL_WRITE_SECONDS later,
    so what waits for a body then is answered 503 at once (`close_all`). (Waited to its
    own end, the same moment as the kill, 288 of 300 requests whose bodies never came got
    no answer at all.)"""
    answered = asyncio.ensure_future(requests_answered(state, timeout))
    closed = asyncio.ensure_future(closing.wait())
    await asyncio.wait([answered, closed], return_when=asyncio.FIRST_COMPLETED)
    closed.cancel()
    if not answered.done():
        answered.cancel()
        return False
    return answered.result()


async def serve_http(spec: HttpProcessSpec, sock: socket.socket) -> int:
    config = spec.config
    try:
        tls = server_context(*spec.tls_files) if spec.tls_files else None
    except ValueError as exc:  # (read at start: a file changed or removed since)
        log.error("HTTP process %d: --ssl-certfile/--ssl-keyfile: %s", spec.index, exc)
        return 2
    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    lost = asyncio.Event()
    closing = asyncio.Event()  # the serving process's drain is over: close what is open
    told = asyncio.Event()  # the serving process said drain (not only a signal of ours)
    grace = config.grace

    def stop(seconds: float) -> None:
        nonlocal grace
        grace = seconds
        drain.set()
        if seconds <= 0:  # (what `HttpProcesses.close` sends)
            closing.set()

    def on_drain(seconds: float) -> None:
        told.set()
        stop(seconds)

    try:
        board = Board(spec.board, len(spec.models))
    except FileNotFoundError:  # removed by the others: the serving process died meanwhile
        log.error(SERVING_GONE, spec.index, os.getpid())
        return 1
    metrics = ProcessMetrics()
    link = Link(board, metrics.families, on_drain, lost.set)
    metrics.link = link
    link.facts = [dict(model.facts) for model in spec.models]  # the serving process updates them
    counts = [metrics.for_model(model.name) for model in spec.models]
    served = [
        ServedModel(
            model.name,
            RemoteServing(link, index, counts[index]),
            link.facts[index],
            aliases=model.aliases,
            longest_deadline=config.app.max_timeout,
            count_stream_error=counts[index].stream_error,
        )
        for index, model in enumerate(spec.models)
    ]
    app = App(ServedModels(served), config.app, metrics=metrics)
    app.operations.processes = lambda: link.processes
    app.operations.refresh = link.refresh
    state = ServerState(metrics=metrics)
    settings = config.http
    await link.connect(sock)
    if lost.is_set():
        log.error(SERVING_GONE, spec.index, os.getpid())
        return 1
    if drain.is_set():  # a replacement started as the server stopped: listened to now,
        # the port would take connections only to reset them as the drain closes it
        log.debug("HTTP process %d: the server is stopping; not listening", spec.index)
        return 0
    server = await listen(
        config,
        lambda: HttpProtocol(app, settings, state, loop=loop, tls=tls),
        spec.port,
        reuse_port=True,
    )
    metrics.start(loop)
    for signum in stop_signals():  # a stop sent to the whole group (a closed terminal's)
        loop.add_signal_handler(signum, stop, config.grace)
    say_alive(link.send)
    link.send(("listening", os.getpid()))
    fix_mmap_threshold()
    gc.collect()
    gc.freeze()
    log.debug("HTTP process %d (pid %d) listening", spec.index, os.getpid())

    await first_of([drain, lost], math.inf)
    server.close()
    if lost.is_set():
        log.error(SERVING_GONE, spec.index, os.getpid())
        link.board.remove_if_orphaned()  # its owner died without removing it (kill -9)
        app.start_draining()  # (a request on a connection still open: 503, as at a stop)
        # the requests under way are failed with a 503 (`Link.lost`): time to write it
        await requests_answered(state, FINAL_WRITE_SECONDS)
        state.close_all()
        return 1
    app.start_draining()
    # the serving process answers what is left with 503 once the grace period is over;
    # one that has not by then (stopped, stuck) cannot: they are answered 503 here (they
    # were closed unanswered, logged as their clients' leaving, 499)
    if not await answered_unless_closing(state, closing, grace + FINAL_WRITE_SECONDS):
        # (not where only bodies still coming are left, at the drain's end: the serving
        # process says that; nor once it ended the drain)
        if not closing.is_set() and (link.pending or not told.is_set()):
            # (stopped alone, the server goes on: its work simply outlasted our grace)
            log.warning(
                "HTTP process %d: %s; answering what is left 503",
                spec.index,
                "the serving process did not answer within the grace period"
                if told.is_set()
                else "stopped alone, with requests still under way at the end of its grace period",
            )
        link.refuse_pending()
        await answered_unless_closing(state, closing, FINAL_WRITE_SECONDS)
        if busy := state.busy_tasks():  # the 503s of those just refused, written
            await asyncio.wait(busy, timeout=FINAL_WRITE_SECONDS / 2)
        link.send(("drained",))
    else:
        # what it holds is answered (a body still coming, its 503 included): the serving
        # process, which sees only the requests it was handed, waits for this word
        link.send(("drained",))
        # its own answered, the other processes' may not be: its idle connections stay
        # open (a request there is answered 503, as with one process) until the serving
        # process says the server's drain is over (they were closed at once, and a
        # pooled client's next request on one got no answer at all). A stop sent to this
        # process alone (no drain said within ALONE_SECONDS) ends here: the server goes
        # on, and its clients' new connections reach the other processes (it held them
        # the whole grace period, and was taken for a process that died)
        await first_of([told, lost], ALONE_SECONDS)
        if told.is_set():
            await first_of([closing, lost], grace + FINAL_WRITE_SECONDS)
        await requests_answered(state, FINAL_WRITE_SECONDS)
    state.close_all()
    await metrics.stop()
    if link.channel is not None:
        link.channel.close()
    return 0

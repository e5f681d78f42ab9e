"""Who speaks HTTP: the serving process itself (`OneProcess`) or, with --http-processes
N > 1, a fleet of HTTP processes of its own (`HttpProcesses`); either is the server's
`Front`, which main.py starts, drains and closes the same way.

An entry point beside main.py (the one other module that may import rawserve.protocol
is http_process/entry.py): it builds the listening side from the models main.py built,
and owns the port reserved for the HTTP processes. What it needs of a model is
`ServedParts`; it knows nothing of how they were built.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.config import ServerConfig
from rawserve.http.limits import ServerState
from rawserve.http_process.entry import HttpProcessSpec, ModelSpec, run_http_process
from rawserve.http_process.front import (
    FINAL_WRITE_SECONDS,
    dual_stack,
    listen,
    requests_answered,
)
from rawserve.ops.metrics import Metrics, merge_families
from rawserve.protocol import HttpProtocol
from rawserve.serving import ModelService, Scheduler
from rawserve.serving import WorkerPool as Executor
from rawserve.serving.bridge import Bridge, BridgedModel, PublishingBackend
from rawserve.serving.fleet import Fleet, HttpProcessFailed
from rawserve.shared.board import Board, SharedMemoryError

log = logging.getLogger("rawserve")


class ServedParts(Protocol):
    """What a front needs of one served model (main.py's `ModelParts`)."""

    @property
    def executor(self) -> Executor: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def service(self) -> ModelService: ...
    @property
    def served(self) -> ServedModel: ...
    @property
    def facts(self) -> dict[str, object]: ...


class OneProcess:
    """HTTP served by the serving process itself (--http-processes 1): no hop between."""

    def __init__(self, app: App, state: ServerState, server: asyncio.Server):
        self.app = app
        self.state = state
        self.server = server
        self.port: int = server.sockets[0].getsockname()[1]

    @classmethod
    async def start(
        cls, config: ServerConfig, models: Sequence[ServedParts], metrics: Metrics
    ) -> OneProcess:
        loop = asyncio.get_running_loop()
        app = App(ServedModels([model.served for model in models]), config.app, metrics=metrics)
        state = ServerState(metrics=metrics)
        settings, tls = config.http, config.ssl_context
        server = await listen(
            config, lambda: HttpProtocol(app, settings, state, loop=loop, tls=tls), config.port
        )
        return cls(app, state, server)

    def describe(self, config: ServerConfig) -> str:
        return f"one process, event loop {config.loop}"

    def facts_changed(self) -> None:
        """Nothing to send: /info reads the models' facts where they are kept."""

    def start_draining(self, grace: float) -> None:
        self.app.start_draining()
        self.server.close()

    async def requests_answered(self, timeout: float) -> bool:
        return await requests_answered(self.state, timeout)

    def close(self) -> None:
        self.server.close()
        self.state.close_all()

    async def closed(self) -> None:
        pass

    async def announce(self) -> None:
        pass

    def kill(self) -> None:
        pass


class HttpProcesses:
    """HTTP served by --http-processes N processes of their own, which reach the models
    through the bridge; the port is reserved here (SO_REUSEPORT, never listening) and
    each HTTP process listens on it."""

    def __init__(self, fleet: Fleet, bridge: Bridge, board: Board, reserved: ReservedPort):
        self.fleet = fleet
        self.bridge = bridge
        self.board = board
        self.reserved = reserved
        self.port: int = reserved.port

    @classmethod
    async def start(
        cls,
        config: ServerConfig,
        models: Sequence[ServedParts],
        metrics: Metrics,
    ) -> HttpProcesses | None:
        reserved = reserve_port(config.host, config.port)  # first: nothing to undo if taken
        port = reserved.port
        try:
            board = Board.create(len(models))
        except SharedMemoryError:  # (the caller says why and stops: the port is let go)
            reserved.close()
            raise
        bridge = Bridge(
            [
                BridgedModel(
                    model.service,
                    retry_after=model.scheduler.full_retry_after,
                    facts=model.facts,
                )
                for model in models
            ],
            board,
            own_families=metrics.families,
            merge=merge_families,
            serving_pid=os.getpid(),
        )
        for model in models:  # a batch leaving a queue is published at once
            model.scheduler.backend = PublishingBackend(model.executor, bridge.publish_soon)

        def spec(index: int) -> HttpProcessSpec:
            described = tuple(  # as /info would say it now (a layout trial may change it)
                ModelSpec(model.served.name, model.served.aliases, dict(model.facts))
                for model in models
            )
            return HttpProcessSpec.of(
                config, index=index, port=port, board=board.path, models=described
            )

        fleet = Fleet(config.http_processes, run_http_process, spec, bridge)
        metrics.count_http_processes(fleet.listening)
        bridge.start()
        try:
            await fleet.start()
        except (HttpProcessFailed, OSError) as exc:
            # an OSError: no process left for one (ulimit -u), which the port is not to
            # blame for (the server's "cannot listen on" line)
            failed = isinstance(exc, HttpProcessFailed)
            log.error("%s", exc if failed else f"an HTTP process could not be started ({exc})")
            fleet.kill()
            await bridge.stop()
            board.remove()
            reserved.close()
            return None
        return cls(fleet, bridge, board, reserved)

    def describe(self, config: ServerConfig) -> str:
        return (
            f"{config.http_processes} HTTP processes (pids "
            f"{', '.join(map(str, self.fleet.pids()))}), event loop {config.loop}"
        )

    async def announce(self) -> None:
        await self.bridge.announce()

    def facts_changed(self) -> None:
        """The HTTP processes' /info says the models' facts as they are now."""
        self.bridge.send_facts()

    def start_draining(self, grace: float) -> None:
        self.fleet.stopping = True
        self.bridge.drain(grace)

    async def requests_answered(self, timeout: float) -> bool:
        """Every HTTP process's requests answered (each keeps its idle connections open
        until `close`, as one process does)."""
        return await self.bridge.requests_answered(timeout)

    def close(self) -> None:
        self.fleet.stopping = True
        self.bridge.drain(0.0)  # those still there close what they hold and exit

    async def closed(self) -> None:
        await self.fleet.stop(FINAL_WRITE_SECONDS)
        await self.bridge.stop()
        self.board.remove()
        self.reserved.close()

    def kill(self) -> None:
        self.fleet.kill()
        self.board.remove()  # the process exits at once: nothing else would remove it


Front = OneProcess | HttpProcesses  # who speaks HTTP: the serving process, or its fleet


@dataclass
class ReservedPort:
    """The port the HTTP processes listen on, held by the serving process: a socket bound
    to it that never listens, and (on Linux) the port's claim among rawserve servers."""

    bound: socket.socket
    claim: socket.socket | None

    @property
    def port(self) -> int:
        return int(self.bound.getsockname()[1])

    def close(self) -> None:
        self.bound.close()
        if self.claim is not None:
            self.claim.close()


def reserve_port(host: str, port: int) -> ReservedPort:
    """A socket bound to (`host`, `port`) with SO_REUSEPORT that never listens: it holds
    the port (the one the system picks for port 0) for the HTTP processes to listen on.

    SO_REUSEPORT is set once bound: a port another server's HTTP processes listen on is
    then refused as in use instead of shared with it (the kernel would split the clients
    between two servers). SO_REUSEADDR, as a listener has it: connections left in
    TIME_WAIT by a server just stopped do not hold the port. But two sockets with
    SO_REUSEADDR bind one port while neither listens: two servers started at the same
    instant both came up on it and split its clients. So the port is also claimed by
    name (`claim_port`), which only one process holds."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    reserved = socket.socket(family, kind, proto)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack(host):  # the port for IPv4 too, as the HTTP processes listen on it
            reserved.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        reserved.bind(address)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        claim = claim_port(reserved.getsockname())
    except OSError:
        reserved.close()
        raise
    return ReservedPort(reserved, claim)


def claim_port(address: Any) -> socket.socket | None:
    """A Unix socket bound to a name in Linux's abstract namespace made of the bound
    `address`: EADDRINUSE where another server holds it. The name is no file (nothing to
    clean up: it goes with the process, however it ends) and, like a port, belongs to the
    network namespace. None elsewhere (no such namespace)."""
    if not sys.platform.startswith("linux"):
        return None
    host, port = address[0], address[1]
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0rawserve port {host} {port}")
    except OSError:
        claim.close()
        raise OSError(errno.EADDRINUSE, "Address already in use") from None
    return claim

"""The HTTP processes of `--http-processes` N > 1, as the serving process keeps them:
started with the `spawn` method (fresh interpreters: nothing of this process's state,
threads or workers' pipes leaks into them), each given its end of a socket pair that
the bridge serves, replaced when one dies (the bridge withdraws its requests first),
killed and so replaced when one falls silent (stopped, or its event loop stuck: the
kernel would go on handing it new connections that hang), and stopped at the end of the
drain.

The entry function is given by constructor (it lives with the HTTP side, which the
serving side never imports); so is the plain-data description of each process.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from rawserve.serving.bridge import Bridge, Peer

log = logging.getLogger("rawserve")

START_SECONDS = 60.0  # how long a new HTTP process may take to listen
RESTART_PAUSE = 1.0  # a process that died this soon after starting is restarted after a pause
# Replacements that exit before they listen, one after another (a file they read gone, the
# board removed), are tried again after pauses that double, up to this many seconds: not
# a new interpreter every second and a half for the server's life
LONGEST_RESTART_PAUSE = 30.0
# Each HTTP process says "alive" every half second from its event loop
# (rawserve.http_process.entry.say_alive). One not heard at more than SILENT_SECONDS /
# WATCH_SECONDS looks in a row (the first may come just after it spoke: at that many
# looks, it may have been silent one look less) is stopped or stuck, and killed. A busy
# loop still speaks between two passes, and one pass of 5 s would be over a gigabyte of
# an answer's JSON (orjson).
# Looks are counted, not the time since the last "alive": this process's own loop held
# up does not make every HTTP process look silent at once.
SILENT_SECONDS = 5.0
WATCH_SECONDS = 0.5


def restart_pause(failures: int, lived: float) -> float:
    """Seconds before an HTTP process that exited is replaced: none for one that served a
    while; `failures` exits before listening in a row: pauses that double."""
    if failures:
        return min(RESTART_PAUSE * 2 ** (failures - 1), LONGEST_RESTART_PAUSE)
    return RESTART_PAUSE if lived < RESTART_PAUSE else 0.0


class HttpProcessFailed(RuntimeError):
    """An HTTP process could not start listening (`exited`: it exited first, which the
    fleet's watch of its exit has logged)."""

    def __init__(self, message: str, exited: bool):
        super().__init__(message)
        self.exited = exited


class Fleet:
    def __init__(
        self,
        count: int,
        target: Callable[[Any, socket.socket], None],
        spec: Callable[[int], Any],
        bridge: Bridge,
    ):
        self.count = count
        self.target = target
        self.spec = spec
        self.bridge = bridge
        self.processes: dict[int, BaseProcess] = {}
        self.peers: dict[int, Peer] = {}  # each listening process's end of its channel
        self.stopping = False
        self._started: dict[int, float] = {}
        self._failed_starts: dict[int, int] = {}  # exits before listening, in a row
        self._listened: set[BaseProcess] = set()  # those that listened, until they exit
        self._ever_listened: set[int] = set()  # the indices of those that listened once
        self._context = multiprocessing.get_context("spawn")

    async def start(self) -> None:
        """Start every HTTP process and wait until each listens; HttpProcessFailed (or
        the OSError of a process not started) if none can. Where some listen, the server
        serves on them, answering /ready already, and the others are started again as a
        replacement is (aborted, a start answered /ready 200, then exited 1)."""
        loop = asyncio.get_running_loop()
        starts = [self._start_one(index) for index in range(self.count)]
        results = await asyncio.gather(*starts, return_exceptions=True)
        failures = {index: failed for index, failed in enumerate(results) if failed is not None}
        for failure in failures.values():
            if not isinstance(failure, (HttpProcessFailed, OSError)):
                raise failure
        if len(failures) == self.count:
            raise next(iter(failures.values()))
        for index, failure in failures.items():
            if isinstance(failure, HttpProcessFailed) and failure.exited:
                continue  # (logged by _on_exit, which starts another)
            log.error("%s; serving on the others meanwhile", failure)
            if isinstance(failure, OSError):  # none started, to exit and be replaced
                loop.call_later(RESTART_PAUSE, self._restart_later, index)
        loop.call_later(WATCH_SECONDS, self._watch)

    async def _start_one(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        process = self._context.Process(
            target=self.target,
            args=(self.spec(index), theirs),
            name=f"rawserve-http-{index}",
            daemon=True,  # never outlives the serving process
        )
        try:
            process.start()
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.processes[index] = process
        self._started[index] = time.monotonic()
        peer = await self.bridge.attach(index, process.pid or 0, ours)
        exited = loop.create_future()
        loop.add_reader(process.sentinel, self._on_exit, index, process, exited)
        listening = loop.create_task(peer.listening.wait())
        await asyncio.wait(
            [listening, exited], timeout=START_SECONDS, return_when="FIRST_COMPLETED"
        )
        if not listening.done():
            listening.cancel()
            if exited.done():
                raise HttpProcessFailed(f"HTTP process {index} exited before it listened", True)
            process.kill()  # stuck: its exit is seen by _on_exit
            raise HttpProcessFailed(f"HTTP process {index} could not start listening", False)
        if self.processes.get(index) is process:  # (not one that exited at once)
            self.peers[index] = peer
            self._listened.add(process)
            self._failed_starts[index] = 0
            self._ever_listened.add(index)

    def _on_exit(self, index: int, process: BaseProcess, exited: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        process.join()  # its sentinel is ready: it has exited
        if not exited.done():
            exited.set_result(None)
        listened = process in self._listened  # (one killed as silent, too)
        self._listened.discard(process)
        if self.processes.get(index) is process:
            del self.processes[index]
            self.peers.pop(index, None)  # its replacement is watched once it listens
        if self.stopping:
            return
        if listened and process.exitcode == 0:
            # it stopped on a signal, its requests answered: one sent to it alone, or to
            # the group, whose signal to us may come later (a serving process stopped,
            # then resumed, sees its children's exits first): replaced after a pause, by
            # which that signal has stopped the server
            loop.call_later(RESTART_PAUSE, self._replace_stopped, index, process.pid)
            return
        failures = 0 if listened else self._failed_starts.get(index, 0) + 1
        self._failed_starts[index] = failures
        lived = time.monotonic() - self._started.get(index, 0.0)
        pause = restart_pause(failures, lived)
        log.warning(
            "HTTP process %d (pid %s) exited with code %s%s; starting another%s",
            index,
            process.pid,
            process.exitcode,
            ": its requests are withdrawn"
            if listened
            else f" before it listened ({failures} in a row)",
            f" in {pause:.2g} s" if pause else "",
        )
        loop.call_later(pause, self._restart_later, index)

    def _watch(self) -> None:
        """Kill each HTTP process silent for SILENT_SECONDS: its exit is seen by
        `_on_exit`, which has its requests withdrawn and another started."""
        if self.stopping:
            return
        for index, peer in list(self.peers.items()):
            peer.silent_looks += 1  # (the bridge sets it back to 0 at each "alive")
            if peer.silent_looks > round(SILENT_SECONDS / WATCH_SECONDS):
                process = self.processes[index]
                log.error(
                    "HTTP process %d (pid %s) silent for %.0f s (stopped, or its event "
                    "loop stuck): killing it",
                    index,
                    process.pid,
                    SILENT_SECONDS,
                )
                del self.peers[index]
                process.kill()
        asyncio.get_running_loop().call_later(WATCH_SECONDS, self._watch)

    def _replace_stopped(self, index: int, pid: int | None) -> None:
        if self.stopping:
            return
        log.warning("HTTP process %d (pid %s) stopped on a signal; starting another", index, pid)
        self._restart_later(index)

    def _restart_later(self, index: int) -> None:
        asyncio.get_running_loop().create_task(self._restart(index))

    async def _restart(self, index: int) -> None:
        if self.stopping:
            return
        again = " again" if index in self._ever_listened else ""  # (not one never started)
        try:
            await self._start_one(index)
        except HttpProcessFailed as exc:
            if not exc.exited:  # (an exit is logged by _on_exit, which tries again)
                log.error("%s", exc)
        except OSError as exc:  # out of file descriptors or processes: none started to exit
            log.error(
                "HTTP process %d could not be started (%s); trying again in %.0f s",
                index,
                exc,
                RESTART_PAUSE,
            )
            loop = asyncio.get_running_loop()
            loop.call_later(RESTART_PAUSE, self._restart_later, index)
        else:
            if (process := self.processes.get(index)) is not None and index in self.peers:
                # (said once it is back: after failed starts, nothing said it had come)
                log.info("HTTP process %d (pid %s) listening%s", index, process.pid, again)

    def listening(self) -> int:
        """The HTTP processes listening now (one being replaced, or that cannot start
        again, is not)."""
        return len(self._listened)

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes.values() if process.pid]

    async def wait_exited(self, timeout: float) -> bool:
        """Until every HTTP process has exited (or `timeout` passes)."""
        self.stopping = True
        until = time.monotonic() + timeout
        while self.processes and time.monotonic() < until:
            await asyncio.sleep(0.05)
        return not self.processes

    async def stop(self, timeout: float) -> None:
        """Wait for the HTTP processes to exit; kill those still there after `timeout`."""
        if not await self.wait_exited(timeout):
            for process in list(self.processes.values()):
                log.warning("HTTP process %s did not stop: killing it", process.pid)
                process.kill()
            await self.wait_exited(1.0)

    def kill(self) -> None:
        self.stopping = True
        for process in list(self.processes.values()):
            process.kill()

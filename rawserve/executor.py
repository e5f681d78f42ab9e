"""The parent side of the model worker processes: spawn, pipes, supervision.

Its face is ProcessPoolExecutor-like: `submit(inputs, params)` returns an asyncio future
of the batch's `BatchResult`, `shutdown()` stops the workers. Each worker is a `spawn`ed
process running `rawserve.worker.worker_main`; a reader thread per worker blocks on the
pipe so the event loop never does. This module knows nothing of HTTP and never imports
torch (the worker does, in its own process).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from rawserve.errors import ServiceUnavailable
from rawserve.messages import (
    Batch,
    BatchResult,
    Shutdown,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
)
from rawserve.worker import worker_main

log = logging.getLogger("rawserve.executor")

RESTART_BACKOFF_FIRST = 0.5  # seconds before the first restart of a dead worker
RESTART_BACKOFF_MAX = 30.0
STOP_TIMEOUT = 10.0  # seconds a worker gets to exit before it is killed


class WorkerCrashed(Exception):
    """The worker process died while it held a batch."""


class WorkerState(enum.Enum):
    LOADING = "loading"
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"
    STOPPED = "stopped"


class WorkerHandle:
    """One worker process, its pipe, and the batch it is computing."""

    def __init__(self, index: int, config: WorkerConfig):
        self.index = index
        self.config = config
        self.state = WorkerState.DEAD
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Any = None
        self.batch_future: asyncio.Future[BatchResult] | None = None
        self.batch_id: int | None = None
        self.ready: WorkerReady | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.backoff = RESTART_BACKOFF_FIRST

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


class Executor:
    """Runs batches on one worker process per device."""

    def __init__(
        self,
        config: WorkerConfig,
        devices: Sequence[str] = ("auto",),
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._loop = loop
        self.clock = clock
        self._context = multiprocessing.get_context("spawn")
        self.workers = [
            WorkerHandle(index, replace(config, device=device))
            for index, device in enumerate(devices)
        ]
        self._batch_ids = itertools.count()
        self._closing = False
        self._first_load: asyncio.Future[WorkerReady] | None = None
        self.on_idle: Callable[[], None] | None = None  # set by the scheduler

    # --- the face the scheduler and the app use ---------------------------------------

    def start(self) -> None:
        self._loop = self._loop or asyncio.get_running_loop()
        self._first_load = self._loop.create_future()
        for worker in self.workers:
            self._spawn(worker)

    async def wait_ready(self) -> WorkerReady:
        """Wait for the first worker to load; raises RuntimeError if loading failed."""
        assert self._first_load is not None, "start() first"
        return await asyncio.shield(self._first_load)

    @property
    def ready(self) -> bool:
        return any(w.state in (WorkerState.IDLE, WorkerState.BUSY) for w in self.workers)

    @property
    def task(self) -> str | None:
        loaded = next((w.ready for w in self.workers if w.ready), None)
        return loaded.task if loaded else None

    def idle_workers(self) -> int:
        return sum(w.state is WorkerState.IDLE for w in self.workers)

    def submit(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> asyncio.Future:
        worker = next((w for w in self.workers if w.state is WorkerState.IDLE), None)
        if worker is None:
            raise ServiceUnavailable("no model worker is free")
        batch = Batch(next(self._batch_ids), tuple(inputs), dict(params))
        future = self._loop.create_future()
        worker.state = WorkerState.BUSY
        worker.batch_future = future
        worker.batch_id = batch.batch_id
        try:
            worker.conn.send(batch)
        except (OSError, ValueError) as exc:  # the pipe broke: the reader will see the exit
            log.warning("worker %d: could not send a batch: %s", worker.index, exc)
        return future

    def describe(self) -> list[dict[str, Any]]:
        """State of each worker, for /info."""
        return [
            {
                "index": w.index,
                "device": w.ready.device if w.ready else w.config.device,
                "dtype": w.ready.dtype if w.ready else w.config.dtype,
                "state": w.state.value,
                "pid": w.pid,
                "restarts": w.restarts,
            }
            for w in self.workers
        ]

    async def shutdown(self, wait: bool = True) -> None:
        """Ask every worker to exit; kill those that do not within STOP_TIMEOUT."""
        self._closing = True
        for worker in self.workers:
            if worker.conn is not None and worker.state is not WorkerState.DEAD:
                try:
                    worker.conn.send(Shutdown())
                except (OSError, ValueError):
                    pass
        await asyncio.gather(
            *(asyncio.to_thread(self._stop_process, w, wait) for w in self.workers)
        )
        for worker in self.workers:
            worker.state = WorkerState.STOPPED
            self._fail_batch(worker, ServiceUnavailable("server shutting down"))

    # --- process lifecycle ------------------------------------------------------------

    def _spawn(self, worker: WorkerHandle) -> None:
        parent_conn, child_conn = self._context.Pipe()
        process = self._context.Process(
            target=worker_main,
            args=(child_conn, worker.config, worker.index),
            name=f"rawserve-worker-{worker.index}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        worker.process, worker.conn = process, parent_conn
        worker.state = WorkerState.LOADING
        worker.ready = None
        worker.started_at = self.clock()
        log.info(
            "worker %d: started (pid %d, device %s)",
            worker.index,
            process.pid,
            worker.config.device,
        )
        threading.Thread(
            target=self._read_pipe,
            args=(worker, parent_conn, process),
            name=f"rawserve-reader-{worker.index}",
            daemon=True,
        ).start()

    def _read_pipe(self, worker: WorkerHandle, conn: Any, process: Any) -> None:
        """Reader thread: block on the pipe, hand each message to the event loop."""
        try:
            while True:
                message = conn.recv()
                self._loop.call_soon_threadsafe(self._on_message, worker, message)
        except (EOFError, OSError):
            pass
        process.join(timeout=STOP_TIMEOUT)
        if process.exitcode is None:
            process.kill()
            process.join()
        try:
            self._loop.call_soon_threadsafe(self._on_exit, worker, process)
        except RuntimeError:  # the loop is already closed: nothing left to tell
            pass

    def _on_message(self, worker: WorkerHandle, message: Any) -> None:
        if isinstance(message, BatchResult):
            if message.batch_id != worker.batch_id:
                log.warning("worker %d: dropped a stale result", worker.index)
                return
            future = worker.batch_future
            worker.batch_future = worker.batch_id = None
            if worker.state is WorkerState.BUSY:
                worker.state = WorkerState.IDLE
            worker.backoff = RESTART_BACKOFF_FIRST  # it works: forget earlier crashes
            if future is not None and not future.done():
                future.set_result(message)
            self._notify_idle()
        elif isinstance(message, WorkerReady):
            worker.ready = message
            worker.state = WorkerState.IDLE
            log.info(
                "worker %d: %s model ready on %s in %.1f s",
                worker.index,
                message.task,
                message.device,
                message.load_seconds,
            )
            if self._first_load and not self._first_load.done():
                self._first_load.set_result(message)
            self._notify_idle()
        elif isinstance(message, WorkerLoadFailed):
            log.error("worker %d: could not load the model: %s", worker.index, message.message)
            if self._first_load and not self._first_load.done():
                self._first_load.set_exception(RuntimeError(message.message))
                self._closing = True  # a model that never loaded will not load on retry

    def _on_exit(self, worker: WorkerHandle, process: Any) -> None:
        if process is not worker.process:
            return
        was_loading = worker.state is WorkerState.LOADING
        worker.state = WorkerState.DEAD
        self._fail_batch(worker, WorkerCrashed(f"worker exited with code {process.exitcode}"))
        if self._closing:
            return
        log.error(
            "worker %d: process %d exited with code %s%s; restarting in %.1f s",
            worker.index,
            process.pid,
            process.exitcode,
            " while loading" if was_loading else "",
            worker.backoff,
        )
        worker.restarts += 1
        self._loop.call_later(worker.backoff, self._respawn, worker)
        worker.backoff = min(worker.backoff * 2, RESTART_BACKOFF_MAX)

    def _respawn(self, worker: WorkerHandle) -> None:
        if not self._closing and worker.state is WorkerState.DEAD:
            self._spawn(worker)

    def _fail_batch(self, worker: WorkerHandle, error: Exception) -> None:
        future = worker.batch_future
        worker.batch_future = worker.batch_id = None
        if future is not None and not future.done():
            future.set_exception(error)

    def _notify_idle(self) -> None:
        if self.on_idle is not None:
            self.on_idle()

    @staticmethod
    def _stop_process(worker: WorkerHandle, wait: bool) -> None:
        process = worker.process
        if process is None:
            return
        process.join(timeout=STOP_TIMEOUT if wait else 0.5)
        if process.exitcode is None:
            process.kill()
            process.join()

"""The worker's receiving thread: it reads the server's pipe while the model runs.

The server may send a worker its next batch before the current one is answered (two in
flight on a GPU: rawserve.serving.pool), so that the model starts batch N+1 the moment
batch N is done instead of after a round trip through the server. This thread takes
each message off the pipe as it comes and queues it, unpickled, for the model thread:
the server's send never waits on a busy model (a batch larger than the OS pipe's buffer
would otherwise hold the server's event loop until the worker read it), and the next
batch is in memory when the model needs it.

A batch can also be prepared ahead (`prepare`: on a GPU, its tokenizing, and its tensors
pinned for the copy to the device) by a second thread, between this one and the model's:
the model thread then finds batch N+1 tokenized when batch N is done, instead of
tokenizing it while the GPU waits. The preparing thread passes every message on in the
order read; a batch whose preparation fails goes on unprepared (the model thread runs it
whole, and says what failed).

Only the model thread runs the model and writes results, one batch after another, each
result written before the next batch starts: so when a worker dies, every batch it
finished has been answered, and the batch it was running is the oldest one the server
still waits for (what a crash retries or quarantines stays exact).

Worker process only; standard library.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rawserve.shared.messages import Batch, Cancel, Shutdown
from rawserve.worker.library_panics import panics_as_errors

log = logging.getLogger("rawserve.worker")

CLOSED = Shutdown()  # what the model thread gets once the server's end is gone


@dataclass
class Received:
    """When a batch came off the pipe, and what its preparation made of it."""

    at: float  # time.perf_counter()
    prepared: Any = None  # None: nothing prepared, or the preparation failed
    prepare_seconds: float = 0.0


class Feeder:
    """Reads `batches` on a thread of its own; `next()` gives the messages in order, and
    `drain()` all those already here. With `timed` (the one-batch-at-a-time loop),
    `received(batch_id)` tells when a batch arrived (each batch's record is kept until it
    is asked for: that loop asks for all), and `running_cancelled()` whether the server
    still wants the batch running. With `prepare`, each batch is passed to it on a second
    thread before the model thread gets it, and `received` also gives what it made."""

    def __init__(
        self,
        batches: Connection,
        prepare: Callable[[Batch], Any] | None = None,
        *,
        timed: bool = False,
    ):
        self._batches = batches
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._read, name="rawserve-feeder", daemon=True)]
        self._prepare = prepare
        self._timed = timed or prepare is not None
        self._received: dict[int, Received] = {}
        # messages read off the pipe, and those the model thread took: each counted by
        # one thread only, so they need no lock
        self._messages_read = 0
        self._messages_taken = 0
        # the batches the server no longer wants (read here, passed on as messages too),
        # and the batch the model thread took last: what `running_cancelled` compares
        self._cancelled: set[int] = set()
        self._cancel_lock = threading.Lock()
        self._running: int | None = None
        if prepare is not None:  # the reader hands each message to the preparing thread
            self._read_into: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self._threads.append(
                threading.Thread(target=self._prepare_each, name="rawserve-prepare", daemon=True)
            )
        else:
            self._read_into = self._queue

    def start(self) -> Feeder:
        for thread in self._threads:
            thread.start()
        return self

    def received(self, batch_id: int) -> Received:
        """How the batch the model thread just got arrived (taken once)."""
        return self._received.pop(batch_id, None) or Received(time.perf_counter())

    def next(self) -> Any:
        """The next message from the server (a `Shutdown` once its end is closed)."""
        message = self._queue.get()
        self._messages_taken += 1
        if isinstance(message, Batch):
            self._running = message.batch_id
            with self._cancel_lock:  # the cancels of the batches before it are moot
                self._cancelled = {i for i in self._cancelled if i >= message.batch_id}
        return message

    def running_cancelled(self) -> bool:
        """Whether the server no longer wants the batch the model thread took last (its
        clients left, or their deadlines passed): a generation stops at its next token."""
        return self._running in self._cancelled

    def waiting(self) -> bool:
        """Whether a message is here that the model thread has not taken (queued, or
        being prepared)."""
        return self._messages_read > self._messages_taken

    def drain(self) -> list[Any]:
        """Every message already queued, in order, without waiting (the continuous loop
        takes new batches and cancels between decoding steps)."""
        messages = []
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                self._messages_taken += len(messages)
                return messages

    def _read(self) -> None:
        while True:
            try:
                message = self._batches.recv()
            except Exception as exc:  # noqa: BLE001 - the worker stops either way
                # EOFError, OSError: the server is gone. Anything else (out of memory
                # unpickling a large batch, say): the pipe's stream is lost past this
                # message, and the batch in it with it; the worker ends, so the server
                # restarts it and runs its batches again at once, instead of waiting on it
                # until --batch-timeout.
                if not isinstance(exc, (EOFError, OSError)):
                    log.exception("a message from the server cannot be read: the worker stops")
                self._messages_read += 1
                self._read_into.put(CLOSED)
                return
            if self._timed and isinstance(message, Batch):
                self._received[message.batch_id] = Received(time.perf_counter())
            # (the continuous loop reads its cancels as messages and never asks: a set of
            # them, trimmed only by `next()`, grew for as long as it stayed busy)
            if self._timed and isinstance(message, Cancel):
                with self._cancel_lock:
                    self._cancelled.add(message.batch_id)
            self._messages_read += 1
            self._read_into.put(message)
            if isinstance(message, Shutdown):
                return

    def _prepare_each(self) -> None:
        assert self._prepare is not None
        while True:
            message = self._read_into.get()
            if isinstance(message, Batch):
                started = time.perf_counter()
                received = self._received[message.batch_id]
                try:
                    with panics_as_errors():
                        received.prepared = self._prepare(message)
                except Exception:  # noqa: BLE001 - the model thread runs it unprepared
                    log.debug("batch %d not prepared", message.batch_id, exc_info=True)
                received.prepare_seconds = time.perf_counter() - started
            self._queue.put(message)  # after its preparation
            if isinstance(message, Shutdown):
                return

"""The worker's receiving thread: it reads the server's pipe while the model runs.

The server may send a worker its next batch before the current one is answered (two in
flight on a GPU: rawserve.serving.pool), so that the model starts batch N+1 the moment
batch N is done instead of after a round trip through the server. This thread takes
each message off the pipe as it comes and queues it, unpickled, for the model thread:
the server's send never waits on a busy model (a batch larger than the OS pipe's buffer
would otherwise hold the server's event loop until the worker read it), and the next
batch is in memory when the model needs it.

Only the model thread runs the model and writes results, one batch after another, each
result written before the next batch starts: so when a worker dies, every batch it
finished has been answered, and the batch it was running is the oldest one the server
still waits for (what a crash retries or quarantines stays exact).

Worker process only; standard library.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

from rawserve.shared.messages import Shutdown

CLOSED = Shutdown()  # what the model thread gets once the server's end is gone


class Feeder:
    """Reads `batches` on a thread of its own; `next()` gives the messages in order, and
    `drain()` all those already here."""

    def __init__(self, batches: Connection):
        self._batches = batches
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, name="rawserve-feeder", daemon=True)

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def next(self) -> Any:
        """The next message from the server (a `Shutdown` once its end is closed)."""
        return self._queue.get()

    def drain(self) -> list[Any]:
        """Every message already queued, in order, without waiting (the continuous loop
        takes new batches and cancels between decoding steps)."""
        messages = []
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                return messages

    def _read(self) -> None:
        while True:
            try:
                message = self._batches.recv()
            except (EOFError, OSError):  # the server is gone
                self._queue.put(CLOSED)
                return
            self._queue.put(message)
            if isinstance(message, Shutdown):
                return

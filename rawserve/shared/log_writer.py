"""The log's lines written to stderr by a thread of their own.

A process that writes its log on the thread that serves (the event loop, a worker's model
thread) stops serving whenever stderr stops being read: a log shipper that stalls, a
terminal paused with Ctrl-S, a pipe into a reader that hangs. Once the pipe's buffer (64
KiB, some 400 access lines) is full, every write blocks: no answer, no `/health`, not even
the drain a SIGTERM asks for. Here a write only appends to a buffer and returns; a thread
writes what has gathered, in one call, and flushes. While nothing reads, the buffer holds
up to `limit` characters; lines past it are dropped and counted, and a warning says how
many once the reader is back. Never imports h11 or torch.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from typing import TextIO

BUFFER_LIMIT = 8 * 2**20  # characters held while nothing reads (about 50,000 access lines)
EXIT_WAIT = 2.0  # seconds the last lines are given at exit, should stderr still be stalled


class BackgroundWriter:
    """A text stream for `logging.StreamHandler` whose `write` never blocks: the text goes
    to `stream` from a daemon thread, in the order written."""

    def __init__(self, stream: TextIO, limit: int = BUFFER_LIMIT):
        self.stream = stream
        self.limit = limit
        self._pending: deque[str] = deque()
        self._size = 0  # characters pending
        self._dropped = 0  # lines dropped since the reader was last seen
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()  # nothing pending, nothing being written
        self._idle.set()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rawserve-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def name(self) -> str:  # what StreamHandler's repr shows
        return getattr(self.stream, "name", repr(self.stream))

    def write(self, text: str) -> int:
        with self._lock:
            if self._size + len(text) > self.limit:
                self._dropped += text.count("\n") or 1
                return len(text)
            self._pending.append(text)
            self._size += len(text)
            self._idle.clear()
        if not self._wake.is_set():  # (a busy loop writes many lines before the thread runs)
            self._wake.set()
        return len(text)

    def flush(self) -> None:
        """Nothing: the thread flushes what it writes."""

    def wait_written(self, timeout: float) -> bool:
        """Wait until every line written so far has reached the stream (False: it did
        not within `timeout` seconds, stderr is stalled)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = EXIT_WAIT) -> None:
        """Write what is pending (for up to `timeout` seconds), then stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                text = "".join(self._pending)
                self._pending.clear()
                self._size = 0
                dropped, self._dropped = self._dropped, 0
            if text:
                try:
                    self.stream.write(text)
                    self.stream.flush()
                except Exception:  # noqa: BLE001 - a closed or broken stderr: lines lost
                    pass
            if dropped:  # a line of the log's own format, written next time round
                logging.getLogger("rawserve").warning(
                    "%d log lines were dropped: nothing read the log (stderr) for a while",
                    dropped,
                )
            with self._lock:
                if not self._pending:
                    self._idle.set()
                    if self._closing:
                        return


_writers: dict[int, BackgroundWriter] = {}


def background(stream: TextIO) -> BackgroundWriter:
    """The one writer of `stream` in this process (logging set up again reuses it)."""
    writer = _writers.get(id(stream))
    if writer is None or writer.stream is not stream:
        writer = _writers[id(stream)] = BackgroundWriter(stream)
    return writer


def wait_written(timeout: float) -> None:
    """Before an exit that skips `atexit` (`os._exit`): the lines pending get `timeout`
    seconds to reach their stream."""
    for writer in list(_writers.values()):
        writer.wait_written(timeout)

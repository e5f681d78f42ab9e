"""The log's lines written to stderr without ever blocking the thread that logs.

A process that writes its log on the thread that serves (the event loop, a worker's model
thread) stops serving whenever stderr stops being read: a log shipper that stalls, a
terminal paused with Ctrl-S, a pipe into a reader that hangs. Once the pipe's buffer (64
KiB, some 400 access lines) is full, every write blocks: no answer, no `/health`, not even
the drain a SIGTERM asks for. Here a line is written in place only while stderr can take
it at once (poll says so: the usual case, which costs no thread hand-off); otherwise it
goes to a buffer that a thread of its own writes out, in order, as the reader takes it.
While nothing reads, the buffer holds up to `limit` characters; lines past it are dropped
and counted, and a warning says how many once the reader is back. Every write is whole
lines of at most PIPE_BUF bytes (a longer line alone), which a pipe takes in one piece:
the server's other processes (HTTP processes, workers) write the same stderr, and a
longer write, cut where the pipe was full, had their lines land inside one of its lines.
Never imports h11 or torch.
"""

from __future__ import annotations

import atexit
import logging
import select
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TextIO

BUFFER_LIMIT = 8 * 2**20  # characters held while nothing reads (about 50,000 access lines)
# A line this long or shorter is written in place when poll says the stream can take it
# (a pipe then has room for PIPE_BUF bytes; a character is at most 4 bytes in UTF-8)
IN_PLACE_CHARS = select.PIPE_BUF // 4
# After each write the thread lets lines gather this long: a slow reader's lines go out
# many at a time, not each with a wake-up that takes the GIL from the loop.
GATHER_SECONDS = 0.005
EXIT_WAIT = 2.0  # seconds the last lines are given at exit, should stderr still be stalled


class BackgroundWriter:
    """A text stream for `logging.StreamHandler` whose `write` never blocks: the text goes
    to `stream` in place where it can take it at once, else from a daemon thread, in the
    order written."""

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
        self._poll = ready_poll(stream)  # None: no descriptor to ask, the thread writes all
        self._thread = threading.Thread(target=self._run, name="rawserve-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def name(self) -> str:  # what StreamHandler's repr shows
        return getattr(self.stream, "name", repr(self.stream))

    def write(self, text: str) -> int:
        with self._lock:
            if self._idle.is_set() and len(text) <= IN_PLACE_CHARS and self._can_take():
                self.stream.write(text)  # (an error is the handler's, as before)
                self.stream.flush()
                return len(text)
            if self._size + len(text) > self.limit:
                self._dropped += text.count("\n") or 1
                return len(text)
            self._pending.append(text)
            self._size += len(text)
            if self._idle.is_set():
                self._idle.clear()
        if not self._wake.is_set():  # (a busy loop writes many lines before the thread runs)
            self._wake.set()
        return len(text)

    def _can_take(self) -> bool:
        """Whether the stream takes a short line now without blocking (or fails at once:
        a reader gone)."""
        return self._poll is not None and bool(self._poll.poll(0))

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
                    for piece in whole_pieces(text):
                        self.stream.write(piece)
                        self.stream.flush()
                except Exception:  # noqa: BLE001 - a closed or broken stderr: lines lost
                    pass
            if not self._closing:
                time.sleep(GATHER_SECONDS)  # the next lines gather meanwhile
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


def whole_pieces(text: str, most: int = select.PIPE_BUF) -> Iterator[str]:
    """`text` as pieces of whole lines of at most `most` bytes each in UTF-8 (a longer
    line alone)."""
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        length = len(line.encode("utf-8", "replace"))
        if piece and size + length > most:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += length
    if piece:
        yield "".join(piece)


def ready_poll(stream: TextIO) -> select.poll | None:
    """A poll of `stream`'s descriptor for room to write; None where it has none."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.StringIO, a closed stream
        return None
    poll = select.poll()
    poll.register(descriptor, select.POLLOUT)
    return poll


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

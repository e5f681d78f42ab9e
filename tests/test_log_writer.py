"""The log written to stderr by a thread: a write never blocks, lines stay in order, a
reader gone for long loses the lines past the buffer (counted), and exit writes the rest."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import select
import threading
import time

import pytest

from rawserve.shared.log_writer import BackgroundWriter


class StalledStream(io.StringIO):
    """A stderr nobody reads until `reader_back` is set: its writes block."""

    def __init__(self) -> None:
        super().__init__()
        self.reader_back = threading.Event()
        self.blocked = threading.Event()  # a write is waiting for the reader

    def write(self, text: str) -> int:
        if not self.reader_back.is_set():
            self.blocked.set()
            self.reader_back.wait()
        return super().write(text)


def test_writes_return_while_the_reader_is_away_and_arrive_in_order():
    stream = StalledStream()
    writer = BackgroundWriter(stream)
    for number in range(1000):
        writer.write(f"line {number}\n")  # would block here, were it written in place
    assert stream.blocked.wait(5)
    assert stream.getvalue() == ""
    stream.reader_back.set()
    assert writer.wait_written(5)
    assert stream.getvalue() == "".join(f"line {number}\n" for number in range(1000))
    writer.close()


class FlushedPieces(io.StringIO):
    """A stream that keeps what each flush sent (one write(2) to a pipe each)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []
        self._since = 0

    def flush(self) -> None:
        self.pieces.append(self.getvalue()[self._since :])
        self._since = len(self.getvalue())


def test_a_backlog_goes_out_in_whole_lines_a_pipe_takes_in_one_piece():
    """The server's processes share stderr: written whole, a backlog was cut where the
    pipe was full, and another process's line landed inside one of its lines (a JSON log
    with spliced lines, with --http-processes 2 and a log shipper reading slowly)."""
    stream = FlushedPieces()
    writer = BackgroundWriter(stream)  # (no descriptor: the thread writes everything)
    lines = [f'{{"line": {number}, "text": "{"é" * (number % 50)}"}}\n' for number in range(2000)]
    lines.append("x" * (2 * select.PIPE_BUF) + "\n")  # longer than a pipe takes whole
    for line in lines:
        writer.write(line)
    assert writer.wait_written(5)
    writer.close()
    assert "".join(stream.pieces) == "".join(lines)
    assert all(piece.endswith("\n") for piece in stream.pieces)
    longer = [p for p in stream.pieces if len(p.encode()) > select.PIPE_BUF]
    assert longer == [lines[-1]]  # alone


def test_lines_past_the_buffer_are_dropped_and_counted_once_the_reader_is_back(caplog):
    stream = StalledStream()
    writer = BackgroundWriter(stream, limit=100)
    writer.write("first\n")  # taken by the thread, which then waits for the reader
    assert stream.blocked.wait(5)
    kept = [f"kept {number:02d}\n" for number in range(12)]  # 96 characters: within
    for line in kept:
        writer.write(line)
    for _ in range(7):
        writer.write("dropped\n")
    with caplog.at_level(logging.WARNING, logger="rawserve"):
        stream.reader_back.set()
        assert writer.wait_written(5)
    assert stream.getvalue() == "first\n" + "".join(kept)
    assert [record.getMessage() for record in caplog.records] == [
        "7 log lines were dropped: nothing read the log (stderr) for a while"
    ]
    writer.close()


def test_close_writes_what_is_pending_and_gives_up_on_a_stalled_reader():
    stream = io.StringIO()
    writer = BackgroundWriter(stream)
    writer.write("stopped\n")
    writer.close()
    assert stream.getvalue() == "stopped\n"
    assert not writer._thread.is_alive()

    stalled = StalledStream()
    writer = BackgroundWriter(stalled)
    writer.write("never read\n")
    writer.close(timeout=0.1)  # the exit is not held up for good
    assert writer._thread.is_alive()
    stalled.reader_back.set()
    writer._thread.join(5)
    assert stalled.getvalue() == "never read\n"


@pytest.mark.parametrize("error", [BrokenPipeError, ValueError])
def test_a_broken_stderr_loses_lines_but_not_the_writer(error):
    """A closed stderr (ValueError) or a reader that exited (EPIPE): the lines are lost,
    the process goes on, and a reader back later gets what comes after."""

    class Broken(io.StringIO):
        broken = True

        def write(self, text: str) -> int:
            if self.broken:
                raise error("the reader is gone")
            return super().write(text)

    stream = Broken()
    writer = BackgroundWriter(stream)
    writer.write("lost\n")
    assert writer.wait_written(5)
    stream.broken = False
    writer.write("after\n")
    assert writer.wait_written(5)
    assert stream.getvalue() == "after\n"
    writer.close()


def test_a_pipe_with_room_is_written_in_place_and_a_full_one_through_the_thread():
    """Lines go straight into a pipe that has room (no hand-off to the thread); once the
    pipe is full they wait in the buffer, and reach the reader, in order, as it reads."""
    read_end, write_end = os.pipe()
    with open(write_end, "w") as stream, open(read_end, "rb", buffering=0) as reader:
        writer = BackgroundWriter(stream)
        writer.write("in place\n")
        assert writer.wait_written(0)  # written before `write` returned: nothing pending
        assert reader.read(100) == b"in place\n"
        os.set_blocking(write_end, False)
        filler = b"x" * 4096
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(write_end, filler)  # the pipe full, as a reader that stalled
        os.set_blocking(write_end, True)
        lines = [f"line {number}\n" for number in range(100)]
        for line in lines:
            writer.write(line)  # returns at once: the pipe is full
        assert not writer.wait_written(0.05)
        received, end = b"", time.monotonic() + 10
        while not received.endswith(b"line 99\n") and time.monotonic() < end:
            if select.select([reader], [], [], 1)[0]:  # (never a read that blocks for good)
                received += reader.read(65536)
        assert received.lstrip(b"x").decode() == "".join(lines)
        assert writer.wait_written(5)
        writer.close()

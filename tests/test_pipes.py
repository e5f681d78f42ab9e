"""Worker → server messages over a one-way pipe: framing, any split, end of file."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.serving.pool import WorkerPool
from rawserve.serving.refusals import Reason, Refused
from rawserve.serving.status import WorkerState
from rawserve.shared.messages import NO_CONTROL, BatchResult, FailureKind, ItemFailure, WorkerConfig
from rawserve.shared.pipes import FIRST_BUFFER, KEEP_BUFFER, MessageReader, MessageWriter

MESSAGES = [
    BatchResult(7, (np.arange(12, dtype=np.float32).reshape(1, 3, 4), {"label": "a"}), 0.5),
    ItemFailure(FailureKind.INPUT, "bad input"),
    {"text": "é" * 1000},
    BatchResult(8, tuple(np.ones((1, 13, 384), np.float32) for _ in range(32)), 0.1),
]


def frames(messages=MESSAGES) -> bytes:
    """The bytes a worker writes for `messages` (to a file: a pipe would block when full)."""
    with tempfile.TemporaryFile() as file:
        writer = MessageWriter(file.fileno())
        for message in messages:
            writer.send(message)
        file.seek(0)
        return file.read()


def same(got, expected) -> bool:
    if isinstance(expected, BatchResult):
        return got.batch_id == expected.batch_id and all(
            np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b
            for a, b in zip(got.outputs, expected.outputs, strict=True)
        )
    return got == expected


def read_in_pieces(stream: bytes, cuts: list[int]) -> tuple[list, MessageReader]:
    """Write `stream` to a pipe piece by piece, reading what has come after each piece."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    reader, got = MessageReader(), []
    points = sorted({min(cut, len(stream)) for cut in cuts} | {0, len(stream)})
    try:
        for start, end in zip(points, points[1:], strict=False):
            piece = memoryview(stream)[start:end]
            while piece:  # a pipe holds 64 KB: read as it fills
                piece = piece[os.write(write, piece[: 64 * 1024]) :]
                got += reader.read(read)
        os.close(write)
        got += reader.read(read)
    finally:
        os.close(read)
    return got, reader


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(min_value=1, max_value=900_000), max_size=30))
def test_any_split_of_the_byte_stream_gives_the_same_messages(cuts):
    got, reader = read_in_pieces(frames(), cuts)
    assert len(got) == len(MESSAGES) and all(map(same, got, MESSAGES))
    assert reader.closed and reader.pending_bytes == 0


def no_memory() -> None:
    raise MemoryError


class TooLargeToHold:
    """A message the server has no memory to unpickle."""

    def __reduce__(self):
        return no_memory, ()


def test_a_message_that_cannot_be_held_ends_the_reading_but_not_what_came_before():
    """The server out of memory for a worker's message: the reading stops there (the
    stream is cut inside it), saying why and how large it was, and the messages before
    it in the same read are handed on (they were lost with it)."""
    stream = frames([MESSAGES[0], TooLargeToHold(), MESSAGES[1]])
    got, reader = read_in_pieces(stream, [])
    assert len(got) == 1 and same(got[0], MESSAGES[0])
    assert isinstance(reader.failure, MemoryError) and reader.closed
    assert reader.message_bytes == len(frames([TooLargeToHold()])) - 8
    assert reader.read(-1) == []  # nothing more is read (not even from a closed fd)


def test_a_message_that_cannot_be_held_closes_the_reader_in_the_read_that_failed():
    """The pool looks at `closed` right after `failure` to stop watching the pipe: left
    open, the reader was read again, and the same message failed and was said again."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.write(write, frames([TooLargeToHold()]))  # (the worker's end still open)
    reader = MessageReader()
    try:
        assert reader.read(read) == []
        assert isinstance(reader.failure, MemoryError) and reader.closed
    finally:
        os.close(read)
        os.close(write)


def test_a_large_messages_buffer_is_let_go_once_it_is_read():
    """A message past KEEP_BUFFER is read into a buffer of its own: kept, the server held
    each worker's largest message (a long generation's outputs) for good."""
    large = {"outputs": b"x" * (3 * KEEP_BUFFER)}
    got, reader = read_in_pieces(frames([large, MESSAGES[1]]), [])
    assert got == [large, MESSAGES[1]]
    assert len(reader._buffer) == FIRST_BUFFER


class Pipe:
    def send(self, message) -> None:
        pass


class KilledProcess:
    exitcode: int | None = None
    pid = 1

    def kill(self) -> None:
        self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        pass


class Replies:
    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        os.close(self.fd)


async def test_a_worker_whose_message_the_server_cannot_hold_is_restarted_its_answers_kept(
    caplog,
):
    """A result read just before a message the server has no memory for answers its batch
    (it was lost, and its batch ran again as if it had crashed the worker), and the
    worker is stopped, to be restarted, with one line that says why (no traceback: the
    worker is not at fault)."""
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], loop=asyncio.get_running_loop())
    worker = pool.workers[0]
    worker.state, worker.conn = WorkerState.IDLE, Pipe()
    answered = pool.submit(["a"], {}, NO_CONTROL)
    assert worker.job is not None
    result = BatchResult(worker.job.batch_id, ({"label": "a"},), 0.1)
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.write(write, frames([result, TooLargeToHold()]))
    os.close(write)
    process = KilledProcess()
    with caplog.at_level(logging.ERROR, "rawserve.executor"):
        pool._on_readable(worker, Replies(read), MessageReader(), process)
        await asyncio.gather(*pool._tasks)
    assert answered.result().outputs == ({"label": "a"},)
    assert process.exitcode == -9
    [line] = caplog.records
    assert line.getMessage() == (
        f"worker 0: no memory to read its message of {len(frames([TooLargeToHold()])) - 8} "
        "bytes; restarting it"
    )
    assert line.exc_info is None


class UnpicklablePipe:
    """A pipe whose send fails as pickling does, before a byte is written."""

    def __init__(self, error: BaseException):
        self.error = error

    def send(self, message) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RecursionError("maximum recursion depth exceeded while pickling"), Reason.MODEL_FAILED),
        (MemoryError(), Reason.OUT_OF_MEMORY),
    ],
)
async def test_a_batch_that_cannot_be_pickled_is_refused_and_its_worker_left_free(error, reason):
    """A batch whose pickling failed (a RecursionError: an input nested a thousand deep)
    was left the worker's job: the worker looked busy until --batch-timeout killed it as
    hung, and the batch, sent again after the restart, failed again, every time."""
    pool = WorkerPool(WorkerConfig(model="unused"), ["cpu"], loop=asyncio.get_running_loop())
    worker = pool.workers[0]
    worker.state, worker.conn = WorkerState.IDLE, UnpicklablePipe(error)
    answered = pool.submit(["a"], {}, NO_CONTROL)
    with pytest.raises(Refused) as refused:
        await answered
    assert refused.value.refusal.reason is reason
    assert worker.job is None and worker.state is WorkerState.IDLE and not pool._retries
    worker.conn = Pipe()  # the next batch is sent as any other
    pool.submit(["b"], {}, NO_CONTROL)
    assert worker.job is not None and worker.job.inputs == ("b",)


def test_nothing_to_read_is_not_the_end():
    read, write = os.pipe()
    os.set_blocking(read, False)
    reader = MessageReader()
    assert reader.read(read) == [] and not reader.closed
    os.close(write)
    assert reader.read(read) == [] and reader.closed
    os.close(read)


def test_a_message_cut_short_stays_pending():
    stream = frames()
    got, reader = read_in_pieces(stream[:-1], [])
    assert len(got) == len(MESSAGES) - 1
    assert reader.pending_bytes == len(stream) - 1 - len(frames(MESSAGES[:-1]))

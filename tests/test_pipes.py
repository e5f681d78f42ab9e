"""Worker → server messages over a one-way pipe: framing, any split, end of file."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.shared.messages import BatchResult, FailureKind, ItemFailure
from rawserve.shared.pipes import MessageReader, MessageWriter

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

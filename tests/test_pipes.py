"""Worker → server messages over a one-way pipe: framing, splitting, end of file."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.messages import BatchResult, FailureKind, ItemFailure
from rawserve.pipes import MessageReader, MessageWriter

MESSAGES = [
    BatchResult(7, (np.arange(12, dtype=np.float32).reshape(1, 3, 4), {"label": "a"}), 0.5),
    ItemFailure(FailureKind.INPUT, "bad input"),
    {"text": "é" * 1000},
    BatchResult(8, tuple(np.ones((1, 13, 384), np.float32) for _ in range(32)), 0.1),
]


def frames() -> bytes:
    """The bytes a worker writes for MESSAGES (to a file: a pipe would block when full)."""
    with tempfile.TemporaryFile() as file:
        writer = MessageWriter(file.fileno())
        for message in MESSAGES:
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


def test_messages_read_back_whole_and_in_order_from_a_real_pipe():
    read, write = os.pipe()
    os.set_blocking(read, False)
    reader, writer, got = MessageReader(), MessageWriter(write), []
    for message in MESSAGES[:3]:  # each under the pipe's buffer: no reader needed meanwhile
        writer.send(message)
    os.close(write)
    while data := os.read(read, 1 << 20):
        got += reader.feed(data)
    os.close(read)
    assert len(got) == 3 and all(map(same, got, MESSAGES[:3]))
    assert reader.pending_bytes == 0


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(min_value=1, max_value=200_000), max_size=30))
def test_any_split_of_the_byte_stream_gives_the_same_messages(cuts):
    stream = frames()
    points = sorted({min(cut, len(stream)) for cut in cuts} | {0, len(stream)})
    reader, got = MessageReader(), []
    for start, end in zip(points, points[1:], strict=False):
        got += reader.feed(stream[start:end])
    assert len(got) == len(MESSAGES) and all(map(same, got, MESSAGES))
    assert reader.pending_bytes == 0


def test_a_message_cut_short_stays_pending():
    stream = frames()
    reader = MessageReader()
    assert reader.feed(stream[:-1]) != [] and reader.pending_bytes > 0

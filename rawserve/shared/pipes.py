"""Messages from a worker to the server over a one-way OS pipe, read by the event loop.

A worker writes each message as an 8-byte length and a pickle (protocol 5: numpy
outputs go as their raw bytes). The server reads the pipe's non-blocking end from the
event loop (`loop.add_reader`) straight into a reusable buffer per worker, so a result
reaches the loop without a thread hop, a large one never blocks it, and reading
allocates nothing per message (fresh megabyte-sized reads fragment the heap). A message
larger than `KEEP_BUFFER` gets a buffer of its own, dropped once it is read.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any

LENGTH = struct.Struct("!Q")
FIRST_BUFFER = 64 * 1024  # bytes
KEEP_BUFFER = 1024 * 1024  # a buffer up to this size is kept for the next messages


class MessageWriter:
    """The worker's end: blocking writes of whole messages."""

    def __init__(self, fd: int):
        self.fd = fd
        # what writes a message: a runner whose answers are a user's may restrict it
        self.pickler: type[pickle.Pickler] = pickle.Pickler

    def encode(self, message: Any) -> bytes:
        if self.pickler is pickle.Pickler:
            return pickle.dumps(message, protocol=5)
        buffer = io.BytesIO()
        self.pickler(buffer, protocol=5).dump(message)
        return buffer.getvalue()

    def send(self, message: Any) -> None:
        payload = self.encode(message)
        data = memoryview(LENGTH.pack(len(payload)) + payload)
        while data:
            written = os.write(self.fd, data)
            data = data[written:]


class MessageReader:
    """The server's end: reads what a non-blocking fd has, returns the whole messages."""

    def __init__(self) -> None:
        self._buffer = bytearray(FIRST_BUFFER)
        self._filled = 0  # bytes of the current message (length included) read so far
        self.closed = False  # the writer's end is closed: no more messages
        # why nothing more can be read (no memory for a message, or one that cannot be
        # unpickled): the stream is cut inside it; `closed` is then set too
        self.failure: Exception | None = None

    def read(self, fd: int) -> list[Any]:
        """Every message that can be completed from `fd` now, without blocking.

        Sets `closed` at end of file. A message that cannot be held or unpickled ends the
        reading: `failure` says why, `closed` is set, and the messages before it are
        returned (a worker's answers read in the same pass are not lost with it).
        """
        messages: list[Any] = []
        try:
            self._read_into(fd, messages)
        except Exception as exc:  # noqa: BLE001 - handed to the caller as `failure`
            self.failure, self.closed = exc, True
        return messages

    def _read_into(self, fd: int, messages: list[Any]) -> None:
        while not self.closed:
            end = self._message_end()
            if len(self._buffer) < end:
                grown = bytearray(end)
                grown[: self._filled] = memoryview(self._buffer)[: self._filled]
                self._buffer = grown
            try:
                count = os.readv(fd, [memoryview(self._buffer)[self._filled : end]])
            except BlockingIOError:
                break
            if count == 0:
                self.closed = True
                break
            self._filled += count
            if self._filled == end and end > LENGTH.size:
                with memoryview(self._buffer)[LENGTH.size : end] as payload:
                    messages.append(pickle.loads(payload))
                self._filled = 0
                if len(self._buffer) > KEEP_BUFFER:
                    self._buffer = bytearray(FIRST_BUFFER)

    @property
    def message_bytes(self) -> int | None:
        """The size of the message being read (None: its length is not read yet)."""
        return self._message_end() - LENGTH.size if self._filled >= LENGTH.size else None

    def _message_end(self) -> int:
        """How many bytes the current message takes, its length first."""
        if self._filled < LENGTH.size:
            return LENGTH.size
        (size,) = LENGTH.unpack_from(self._buffer)
        return LENGTH.size + size

    @property
    def pending_bytes(self) -> int:
        """Bytes of a message not complete yet."""
        return self._filled

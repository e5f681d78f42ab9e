"""Messages from a worker to the server over a one-way OS pipe, read by the event loop.

A worker writes each message as an 8-byte length and a pickle (protocol 5: numpy
outputs go as their raw bytes). The server reads the pipe's non-blocking end from the
event loop (`loop.add_reader`) and cuts whole messages out of what has arrived, so a
result reaches the loop without a thread hop in between and a large one never blocks it.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

LENGTH = struct.Struct("!Q")
READ_CHUNK = 1 << 20  # bytes read per readiness event


class MessageWriter:
    """The worker's end: blocking writes of whole messages."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=5)
        data = memoryview(LENGTH.pack(len(payload)) + payload)
        while data:
            written = os.write(self.fd, data)
            data = data[written:]


class MessageReader:
    """The server's end: bytes in as they arrive, whole messages out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """The messages completed by `data` (pickle errors propagate: a broken pipe)."""
        buffer = self._buffer
        buffer += data
        messages = []
        start = 0
        while len(buffer) - start >= LENGTH.size:
            (size,) = LENGTH.unpack_from(buffer, start)
            end = start + LENGTH.size + size
            if len(buffer) < end:
                break
            messages.append(pickle.loads(memoryview(buffer)[start + LENGTH.size : end]))
            start = end
        if start:
            del buffer[:start]
        return messages

    @property
    def pending_bytes(self) -> int:
        """Bytes of a message not complete yet."""
        return len(self._buffer)

"""A duplex message channel between an HTTP process and the serving process, over one
end of a socket pair, driven by the event loop.

Messages are plain data (tuples of str, numbers, frozen dataclasses, enums). `send`
only queues a message; the queue is written once per event-loop pass, as one frame
(an 8-byte length and one pickle of the pass's messages), so a busy pass costs one
write and one pickle, not one syscall per item. The transport buffers what the peer has
not read yet. `on_messages` is called with each frame's messages, in order;
`on_closed` once the peer is gone (its end closed: it exited or died).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

LENGTH = struct.Struct("!Q")

log = logging.getLogger("rawserve.channel")


class Channel(asyncio.Protocol):
    def __init__(
        self,
        on_messages: Callable[[list[Any]], None],
        on_closed: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
    ):
        self.on_messages = on_messages
        self.on_closed = on_closed
        self.loop = loop
        self.transport: asyncio.WriteTransport | None = None
        self.closed = False
        self._outbox: list[Any] = []
        self._buffer = bytearray()
        # Until `over` has returned, the owner does not hold the channel that answering
        # needs: what the peer sent at once waits here (the loop may read before).
        self._owned = False
        self._waiting: list[list[Any]] = []

    @classmethod
    async def over(
        cls,
        sock: socket.socket,
        on_messages: Callable[[list[Any]], None],
        on_closed: Callable[[], None],
    ) -> Channel:
        """A channel over a connected socket (one end of a `socket.socketpair()`)."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        channel = cls(on_messages, on_closed, loop)
        await loop.connect_accepted_socket(lambda: channel, sock)
        loop.call_soon(channel._owner_holds_it)
        return channel

    def _owner_holds_it(self) -> None:
        self._owned = True
        for messages in self._waiting:
            self.on_messages(messages)
        self._waiting = []
        if self.closed:  # (the peer left meanwhile: told after what it sent)
            self.on_closed()

    def send(self, message: Any) -> None:
        """Queue `message`; the pass's messages are written together when it ends."""
        if self.closed:
            return
        if not self._outbox:
            self.loop.call_soon(self.flush)
        self._outbox.append(message)

    def flush(self) -> None:
        if not self._outbox or self.transport is None or self.closed:
            return
        outbox, self._outbox = self._outbox, []
        try:
            self._write(outbox)
        except Exception:  # noqa: BLE001 - out of memory, or one message that cannot be pickled
            # The pass's messages together cannot be written: each goes alone, and one that
            # fails even alone is dropped (its run ends at its deadline), not the channel,
            # nor the others of its pass (left in the outbox, they were never written, nor
            # anything sent after them).
            for message in outbox:
                try:
                    self._write([message])
                except MemoryError:
                    log.error("out of memory: a message to the other process is dropped")
                except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
                    log.error(
                        "a message to the other process is dropped: it cannot be pickled (%s: %s)",
                        type(exc).__name__,
                        exc,
                    )

    def _write(self, messages: list[Any]) -> None:
        assert self.transport is not None
        payload = pickle.dumps(messages, protocol=5)
        self.transport.write(LENGTH.pack(len(payload)) + payload)

    def close(self) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.close()

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.WriteTransport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        frames = []
        while len(buffer) - start >= LENGTH.size:
            (size,) = LENGTH.unpack_from(buffer, start)
            end = start + LENGTH.size + size
            if len(buffer) < end:
                break
            frames.append(pickle.loads(buffer[start + LENGTH.size : end]))
            start = end
        if start:
            del buffer[:start]
        for messages in frames:
            if self._owned:
                self.on_messages(messages)
            else:
                self._waiting.append(messages)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            if self._owned:
                self.on_closed()

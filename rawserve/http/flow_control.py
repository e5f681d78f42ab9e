"""Flow control for one connection: pause/resume reading, wait while writing is paused,
and give up on a peer that reads nothing for too long.

Reading is paused when requests pile up faster than they are answered (pipelining) or the
peer does not read its answers; writing producers wait on `drain()` while the transport's
write buffer is over its high-water mark (`pause_writing`/`resume_writing`), and if it
stays there for `write_timeout` seconds, `on_stalled` is called (the connection is cut);
the same once the transport closes with bytes still to send (`closing`), however few.
Pause and resume are idempotent, so callers need not track who paused what. Knows
nothing of HTTP; `Transport` says what a connection uses of its transport, which need not
be an `asyncio.Transport` (uvloop's are not).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import sys
import termios
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Protocol

# What the kernel may hold of a stream's bytes unsent (TCP_NOTSENT_LOWAT): past it, a
# write waits in the transport, where `pause_writing` sees it. Without it the kernel's send
# buffer (grown up to tcp_wmem's 4 MiB) took ~30,000 tokens for a client that read none,
# and the stream's bound on unread tokens never tripped: the worker ran on for nobody.
STREAM_UNSENT_BYTES = 16 * 1024
# ... and of whole answers: past it, a pipelining client that reads none of its answers
# stalls the writes, and its next requests wait unread. Without it the kernel took 4 MiB
# a connection (tcp_wmem's most): some 800 embeddings computed for a client that read
# none, and 4 GB of the kernel's memory at the default --max-connections.
ANSWER_UNSENT_BYTES = 256 * 1024
# What a TLS transport holds before writing pauses, as a plain one does (its own mark is
# 512 KB): above it, a client that reads none of an answer stalled no write, and was not
# cut at --write-timeout (`tls_write_buffer`)
TLS_WRITE_BUFFER_BYTES = 64 * 1024


def unsent_in_kernel(transport: Transport | None) -> int:
    """Bytes written to the socket that its peer has not yet taken (Linux's SIOCOUTQ:
    unsent and unacknowledged); 0 where that cannot be asked. An answer the kernel's send
    buffer holds whole is no longer the transport's."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int.from_bytes(queued, sys.byteorder, signed=True)


class ReadingSwitch(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Transport(ReadingSwitch, Protocol):
    """What a connection uses of its transport: asyncio's, uvloop's, or a test's fake."""

    def write(self, data: bytes, /) -> None: ...
    def can_write_eof(self) -> bool: ...
    def write_eof(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...
    def get_extra_info(self, name: str, default: Any = None, /) -> Any: ...
    def get_write_buffer_size(self) -> int: ...
    def is_closing(self) -> bool: ...


def tls_write_buffer(transport: Any) -> None:
    """A TLS transport's writing pauses where a plain one's does."""
    limits = getattr(transport, "set_write_buffer_limits", None)
    if limits is not None:
        limits(high=TLS_WRITE_BUFFER_BYTES)


def reset_on_close(transport: Transport | None) -> None:
    """Make this connection's close a reset (SO_LINGER 0): what the kernel holds unsent
    goes with it. (Closed normally with megabytes unsent for a client that reads none,
    the socket stayed in the kernel with them, probing a closed window for minutes.)"""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    with suppress(OSError):  # (closed meanwhile, or not a socket that lingers)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def has_failed(transport: Transport | None) -> bool:
    """Whether the kernel holds an error for this connection (its peer reset it), which
    nothing reads while reading is paused. Read, the error is cleared: the caller gives
    the connection up."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
    except (OSError, ValueError):  # (closed meanwhile: uvloop's ValueError)
        return False


def bound_unsent(transport: Transport | None, most: int) -> None:
    """Let the kernel hold at most `most` unsent bytes of this connection's. Where the
    option is missing (not TCP, not Linux or macOS), the kernel's buffer bounds them alone."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or option is None:
        return
    # (a Unix socket has no TCP options; a closed one, no descriptor: uvloop's ValueError)
    with suppress(OSError, ValueError):
        sock.setsockopt(socket.IPPROTO_TCP, option, most)


class FlowControl:
    def __init__(
        self,
        transport: ReadingSwitch,
        loop: asyncio.AbstractEventLoop,
        write_timeout: float,
        on_stalled: Callable[[], None],
        unsent: Callable[[], int] | None = None,
    ):
        """`unsent` says how many bytes still wait to be written (by default, what the
        transport's write buffer holds)."""
        self._transport = transport
        self._unsent_bytes = unsent
        self._loop = loop
        self._write_timeout = write_timeout
        self._on_stalled = on_stalled
        # armed while writing is paused, and while the transport closes with bytes to send
        self._stall_timer: asyncio.TimerHandle | None = None
        self._unsent_at_arm = 0  # what waited to be written when it was armed
        self._closing = False
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    async def drain(self) -> None:
        """Return once the transport can take more data (at once when it can)."""
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    # The transport calls these two when its write buffer crosses the water marks.
    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()
        self._arm_stall_timer()

    def resume_writing(self) -> None:
        self._stop_stall_timer()
        if self._closing:  # the rest must go too: a fresh write timeout for it
            self._arm_stall_timer()
        if self.write_paused:
            self.write_paused = False
            self._writable.set()

    def release(self) -> None:
        """The connection is gone: wake every waiting producer so it can see that."""
        self._stop_stall_timer()
        self.write_paused = False
        self._writable.set()

    def closing(self) -> None:
        """The transport closes once what waits in it is written, for as long as that
        takes: a peer that reads none of it for the write timeout is cut off then too,
        paused or not (else its socket stays open while it does not read)."""
        self._closing = True
        self._arm_stall_timer()

    def _arm_stall_timer(self) -> None:
        if self._stall_timer is None:
            self._unsent_at_arm = self._unsent()
            self._stall_timer = self._loop.call_later(self._write_timeout, self._stalled)

    def _stalled(self) -> None:
        """The write timeout passed while writing waited: a peer that has taken some of
        what waited meanwhile reads, slowly, and is given another (timed from its arming
        alone, a client reading a 31 MB answer at 0.7 MB/s was cut off at 21 MB); one that
        has taken none is cut off."""
        self._stall_timer = None
        if self._unsent() < self._unsent_at_arm:
            self._arm_stall_timer()
            return
        self._on_stalled()

    def _unsent(self) -> int:
        if self._unsent_bytes is not None:
            return self._unsent_bytes()
        sizer = getattr(self._transport, "get_write_buffer_size", None)
        return sizer() if sizer is not None else 0

    def _stop_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

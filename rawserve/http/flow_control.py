"""Flow control for one connection: pause/resume reading, and wait while writing is paused.

Reading is paused when requests pile up faster than they are answered (pipelining) or the
peer does not read its answers; writing producers wait on `drain()` while the transport's
write buffer is over its high-water mark (`pause_writing`/`resume_writing`). Pause and
resume are idempotent, so callers need not track who paused what. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio


class FlowControl:
    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
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

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()

    def release(self) -> None:
        """The connection is gone: wake every waiting producer so it can see that."""
        self.write_paused = False
        self._writable.set()

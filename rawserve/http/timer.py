"""One deadline per connection, on one lazily re-armed loop timer.

A connection always has at most one deadline (idle, head, body, linger). Arming a loop
timer for each phase would push and cancel three timers per request; instead an armed
timer stays, and when it fires before a deadline that has since moved later, it re-arms
itself for the new one. Knows nothing of HTTP: it calls `on_expiry` when the deadline
passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

TIMER_SLACK = 0.001  # seconds a timer may fire early (the loop clock's resolution)


class ConnectionTimer:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]):
        self._loop = loop
        self._on_expiry = on_expiry
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0  # when `_handle` fires
        self._deadline: float | None = None  # None: nothing is due

    def set(self, delay: float) -> None:
        """The deadline is `delay` seconds from now (replacing any other)."""
        self._deadline = self._loop.time() + delay
        if self._handle is not None and self._handle_at > self._deadline:
            self._handle.cancel()  # it would fire too late for the new deadline
            self._handle = None
        if self._handle is None:
            self._arm(self._deadline)

    def clear(self) -> None:
        """No deadline; an armed timer finds nothing to do when it fires."""
        self._deadline = None

    def stop(self) -> None:
        """No deadline and no armed timer: the connection is done."""
        self._deadline = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, when: float) -> None:
        self._handle_at = when
        self._handle = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._handle = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() + TIMER_SLACK < deadline:
            self._arm(deadline)  # the deadline moved on since this timer was armed
            return
        self._deadline = None
        self._on_expiry()

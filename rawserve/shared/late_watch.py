"""Runs waiting for an answer, each late at a time of its own, under one loop timer.

Both processes wait on many runs at once: the serving process on the items of every
admitted request (late at its deadline: 504), an HTTP process on its requests to the
serving process (late a second past it: the serving process is stuck). An
`asyncio.timeout` per run cost ~5 µs of CPU a request (a `Timeout`, a timer handle and the
task's cancel bookkeeping); here a run costs a dict entry, and the timer moves only for a
run late earlier than every other one (under steady load it fires about once per request
timeout, finding none late). Plain asyncio: no part of either process.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable


class LateWatch:
    """Calls `on_late(run_id)` once a watched run is still not forgotten at its time."""

    def __init__(self, on_late: Callable[[int], None], clock: Callable[[], float] = time.monotonic):
        self.on_late = on_late
        self.clock = clock
        self.late_at: dict[int, float] = {}  # by run id
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def watch(self, run_id: int, late_at: float) -> None:
        self.late_at[run_id] = late_at
        if late_at < self._timer_at:
            self._set_timer(late_at)

    def forget(self, run_id: int) -> None:
        """The run is over (the timer stays: it finds nothing late when it fires)."""
        self.late_at.pop(run_id, None)

    def close(self) -> None:
        """Stop the timer (the runs still watched are never called late)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _set_timer(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        delay = max(0.0, at - self.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        # (a loop's timer may fire a little before the clock reads its time, as uvloop's
        # does: then nothing is late yet, and the timer is set again)
        self._timer, self._timer_at = None, math.inf
        now = self.clock()
        late = [run_id for run_id, at in self.late_at.items() if at <= now]
        for run_id in late:
            del self.late_at[run_id]
            self.on_late(run_id)
        if self.late_at:
            self._set_timer(min(self.late_at.values()))

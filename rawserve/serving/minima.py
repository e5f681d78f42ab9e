"""The earliest deadline and the oldest arrival among one key's queued items, without a
scan of the queue.

The scheduler looks at both on every pass of its loop, and a pass follows every batch
of arrivals: with a GPU's queue (thousands of items) a scan of each per pass cost more
than the rest of the pass. Two heaps keep them instead. An item leaves the queue from
anywhere (sent in a batch, withdrawn, expired), so its heap entries are dropped lazily:
skipped once they surface (the item is no longer `queued`), and the heaps are rebuilt
from the queue once stale entries outnumber the live ones, so that an item that left is
not held long. Pure data structure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

# stale entries allowed beyond the live ones before the heaps are rebuilt
REBUILD_SLACK = 64


class Queued(Protocol):
    deadline: float
    arrived: float
    seq: int  # unique: ties in time never compare the items themselves
    queued: bool


ItemT = TypeVar("ItemT", bound=Queued)


class QueueMinima(Generic[ItemT]):
    def __init__(self) -> None:
        self._deadlines: list[tuple[float, int, ItemT]] = []
        self._arrivals: list[tuple[float, int, ItemT]] = []

    def add(self, item: ItemT) -> None:
        heapq.heappush(self._deadlines, (item.deadline, item.seq, item))
        heapq.heappush(self._arrivals, (item.arrived, item.seq, item))

    def earliest_deadline(self) -> ItemT:
        """The queued item with the earliest deadline (the queue must not be empty)."""
        return _live_top(self._deadlines)

    def oldest(self) -> ItemT:
        """The queued item that arrived first (the queue must not be empty)."""
        return _live_top(self._arrivals)

    def expired(self, now: float) -> list[ItemT]:
        """The queued items whose deadline is `now` or earlier, taken off the deadline
        heap: the caller removes them from the queue."""
        found = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)[2]
            if item.queued:
                found.append(item)
        return found

    def after_removal(self, queue: Sequence[ItemT]) -> None:
        """An item left `queue` (the key's items still queued): rebuild the heaps from it
        when stale entries have piled up."""
        if len(self._arrivals) > 2 * len(queue) + REBUILD_SLACK:
            self._deadlines = [(item.deadline, item.seq, item) for item in queue]
            self._arrivals = [(item.arrived, item.seq, item) for item in queue]
            heapq.heapify(self._deadlines)
            heapq.heapify(self._arrivals)


def _live_top(heap: list[tuple[float, int, ItemT]]) -> ItemT:
    while not heap[0][2].queued:
        heapq.heappop(heap)
    return heap[0][2]

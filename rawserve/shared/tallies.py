"""Latencies counted into a histogram's buckets where they are measured, and sent as counts.

A continuous generation worker times every token it makes (thousands a second on a GPU);
sending each time to the server, or observing each into prometheus_client there, would
cost the serving process, which answers every request, more than the counting. So the
worker counts them into fixed buckets (`Tally`), sends the counts with its pass counts
(rawserve.shared.messages.GenerationPasses) now and then, and the server adds them up
(rawserve.ops.metrics) as the histograms Prometheus scrapes. Both sides take their bucket
bounds from here.

Standard library only: the worker and the serving process import it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# From a request's admission to the step that prefilled it, and to its first token: the
# milliseconds of a GPU's replayed step (fine: a lone first token took 3.8 ms on an H200,
# one of 16 streams 10.2) up to the seconds of a deep queue
WAIT_BUCKETS = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0065, 0.008, 0.01, 0.0125,
    0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0, 300.0,  # (a request waits up to its --max-timeout)
)  # fmt: skip
# Between two tokens of one sequence: a step (~1 ms replayed on a GPU), or a step and
# the prefills beside it
INTER_TOKEN_BUCKETS = (
    0.00025, 0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.0025, 0.003, 0.004,
    0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,  # (a CPU's step beside long prefills)
)  # fmt: skip


@dataclass(frozen=True)
class Counts:
    """A histogram's observations since the last ones sent: per bucket (not cumulative;
    the last one beyond the largest bound) and their sum in seconds."""

    buckets: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.buckets)


class Tally:
    """Observations counted into the buckets of `bounds` (an observation equal to a bound
    counts in its bucket, as Prometheus's `le` says)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self._buckets = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, seconds: float, times: int = 1) -> None:
        """`times` observations of `seconds` (rows that made a token in one step share
        the gap since their last: counted at once)."""
        self._buckets[bisect_left(self.bounds, seconds)] += times
        self._total += seconds * times

    def taken(self) -> Counts | None:
        """The counts so far, and zeroed; None where there are none."""
        if not any(self._buckets):
            return None
        counts = Counts(tuple(self._buckets), self._total)
        self._buckets = [0] * (len(self.bounds) + 1)
        self._total = 0.0
        return counts

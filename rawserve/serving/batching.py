"""Which queued items share the next model call, and what a model call costs.

Pure decisions with no clock and no I/O, used by the scheduling core (`serving.core`):

- `choose_batch` picks the items of one batch key that go together. The queue's head
  always goes (so nothing starves). In cost-aware mode the others are those of the
  head's call in the cheapest plan for the queue (`plan_partners`: lengths grouped
  when padding costs more than a call's fixed part, mixed when it costs less), once the
  cost model has measured both parts; until then nothing is known to be cheaper than
  one call, and everything goes together.
  The batch's padded cost (longest x items) stays under the token budget, and items
  close to their deadline join whatever their length.
- `CostModel` predicts a call's seconds from its padded cost, fitted on the batches
  measured so far; the scheduler uses it to admit, to refuse work that cannot finish
  in time, and to estimate `Retry-After`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

# Weight that the cost model keeps of its past per new measurement.
COST_MEMORY = 0.95
# Calls measured before the model's speed is trusted to refuse work: the first call of a
# fresh worker can be many times slower than the rest (cold caches, a busy machine), and
# one such sample alone made a server refuse a burst it would have served in a second.
CALLS_TO_TRUST = 2
# The cheapest plan looks at the items of this many full batches nearest their deadline.
PLAN_WINDOW = 4


class Costed(Protocol):
    cost: int
    deadline: float


ItemT = TypeVar("ItemT", bound=Costed)


@dataclass(frozen=True)
class BatchLimits:
    max_size: int = 32
    max_tokens: int | None = None  # bound on the padded cost: longest item x items
    group_lengths: bool = True  # cost-aware: the cheapest plan's calls; else queue order


def padded_cost(costs: Iterable[int]) -> int:
    """What a padded batch costs the model: its longest item times its number of items."""
    costs = list(costs)
    return max(costs, default=0) * len(costs)


def choose_batch(
    queue: Sequence[ItemT],
    limits: BatchLimits,
    urgent: Callable[[ItemT], bool] = lambda item: False,
    cost_model: CostModel | None = None,
) -> list[ItemT]:
    """The items of `queue` (in the scheduler's order) that go in one model call.

    The first item always goes, even when it alone is over the token budget. Then, in
    queue order (count mode) or closest length first (cost-aware mode, urgent items
    first), every item that keeps the batch within its bounds joins. In cost-aware mode,
    once the cost model has measured a call's fixed part and its cost per token
    (`CostModel.fitted`), an item that is not urgent joins only when it is part of the
    head's call in the cheapest plan (`plan_partners`): splitting what waits into
    several calls must be measurably cheaper than one call.
    """
    if not queue:
        return []
    head = queue[0]
    batch = [head]
    longest = head.cost
    partners: set[int] | None = None
    if limits.group_lengths and cost_model is not None and cost_model.fitted:
        partners = plan_partners(queue[: PLAN_WINDOW * limits.max_size], limits, cost_model)
    if limits.group_lengths:
        rest = queue[1:]
        hurry = [item for item in rest if urgent(item)]
        hurried = set(map(id, hurry))
        others = sorted(
            (item for item in rest if id(item) not in hurried),
            key=lambda item: abs(item.cost - head.cost),
        )  # stable: equally close items stay in queue order
        candidates = [(item, True) for item in hurry] + [(item, False) for item in others]
    else:
        candidates = [(item, True) for item in queue[1:]]
    for item, any_length in candidates:
        if len(batch) >= limits.max_size:
            break
        new_longest = max(longest, item.cost)
        if limits.max_tokens and new_longest * (len(batch) + 1) > limits.max_tokens:
            if not limits.group_lengths:
                break  # count mode keeps strict queue order
            continue
        if not any_length and partners is not None and id(item) not in partners:
            continue
        batch.append(item)
        longest = new_longest
    return batch


def plan_partners(queue: Sequence[ItemT], limits: BatchLimits, model: CostModel) -> set[int]:
    """The ids of the items that share the head's model call in the cheapest plan.

    The plan serves all of `queue` in model calls of items adjacent in length order,
    and minimizes the summed predicted time, `fixed + per_token x longest x items` per
    call (dynamic programming over the sorted lengths). When the fixed cost of a call
    dominates it takes big mixed batches; when padding dominates it groups lengths.
    """
    head = queue[0]
    order = sorted(queue, key=lambda item: item.cost)
    count = len(order)
    fixed, per_token = model.fixed, model.per_token
    best = [0.0] + [math.inf] * count  # best[j]: the cheapest plan for order[:j]
    cut = [0] * (count + 1)  # where the last call of that plan starts
    for end in range(1, count + 1):
        longest = order[end - 1].cost
        for size in range(1, min(limits.max_size, end) + 1):
            if size > 1 and limits.max_tokens and longest * size > limits.max_tokens:
                break
            total = best[end - size] + fixed + per_token * longest * size
            if total <= best[end]:  # on a tie, the bigger call
                best[end], cut[end] = total, end - size
    end = count
    while end > 0:
        start = cut[end]
        members = order[start:end]
        if any(item is head for item in members):
            return {id(item) for item in members}
        end = start
    return {id(head)}


class CostModel:
    """Seconds of a model call as `fixed + per_token * padded_cost`, from measurements.

    Exponentially weighted least squares over the recent batches, so the fit follows a
    machine whose speed drifts. Until one batch is measured it predicts nothing (None):
    the scheduler then admits everything rather than guess.
    """

    def __init__(self, memory: float = COST_MEMORY):
        self.memory = memory
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.fixed = 0.0
        self.per_token = 0.0
        self.padding = 1.0  # padded / unpadded tokens of recent calls
        self._fitted = False
        self.calls = 0  # calls measured

    @property
    def measured(self) -> bool:
        return self._w > 0

    @property
    def trusted(self) -> bool:
        """Enough calls are measured for the speed to be a reason to refuse work."""
        return self.calls >= CALLS_TO_TRUST

    @property
    def fitted(self) -> bool:
        """Both parts are measured (calls of different sizes): predictions for other sizes,
        and plans that split work into several calls, rest on more than one point."""
        return self._fitted

    def observe(self, cost: int, seconds: float, tokens: int | None = None) -> None:
        """One model call: its padded cost, its seconds, and its unpadded tokens."""
        m = self.memory
        if tokens:
            self.padding += (1 - m) * (cost / tokens - self.padding)
        x, y = float(max(cost, 1)), max(seconds, 0.0)
        self.calls += 1
        self._w = m * self._w + 1
        self._x = m * self._x + x
        self._y = m * self._y + y
        self._xx = m * self._xx + x * x
        self._xy = m * self._xy + x * y
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        slope = (self._xy / self._w - mean_x * mean_y) / var if var > (0.05 * mean_x) ** 2 else None
        self._fitted = slope is not None and slope >= 0
        if slope is None or slope < 0:  # one size measured so far: assume proportional
            self.fixed, self.per_token = 0.0, mean_y / mean_x
        else:
            self.fixed, self.per_token = mean_y - slope * mean_x, slope
            if self.fixed < 0:
                self.fixed, self.per_token = 0.0, mean_y / mean_x

    def predict(self, cost: int) -> float | None:
        """Seconds of one model call of this padded cost, or None before any measurement."""
        if not self.measured:
            return None
        return self.fixed + self.per_token * cost

    def drain_seconds(self, costs: Sequence[int], max_size: int, workers: int = 1) -> float | None:
        """The seconds to compute `costs` in full batches, padded as recent batches were."""
        return self.drain_seconds_of(len(costs), sum(costs), max_size, workers)

    def drain_seconds_of(
        self, items: int, total_cost: int, max_size: int, workers: int = 1
    ) -> float | None:
        """`drain_seconds` of `items` items whose costs add up to `total_cost`."""
        if not self.measured:
            return None
        calls = math.ceil(items / max_size)
        padded = self.padding * total_cost
        return (calls * self.fixed + self.per_token * padded) / max(workers, 1)

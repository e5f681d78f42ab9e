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
- `CostModel` predicts a call's seconds from its items and padded cost (a fixed part,
  a part per item and one per token), fitted on the batches measured so far; the
  scheduler uses it to admit, to refuse work that cannot finish in time, to size
  batches and to estimate `Retry-After`.
"""

from __future__ import annotations

import math
from collections import deque
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
    # a deadline's bound: the seconds a call may take past its fixed part, at the cost
    # model's prices of an item and of a padded token (None: no deadline bounds it)
    max_seconds: float | None = None
    per_item: float = 0.0
    per_token: float = 0.0

    def widest(self, longest: int) -> int:
        """The most items a call whose longest item costs `longest` may hold (one at
        least: a batch's first item goes whatever its cost)."""
        most = self.max_size
        if self.max_tokens and longest > 0:
            most = min(most, self.max_tokens // longest)
        price = self.per_item + self.per_token * longest  # each item's share of the call
        if self.max_seconds is not None and price > 0 and self.max_seconds / price < most:
            most = int(self.max_seconds / price)  # (compared first: a tiny price's is inf)
        return max(1, most)


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
    if limits.max_size == 1:  # a continuous worker's one-item batches: nothing to plan
        return [head]
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
        if len(batch) + 1 > limits.widest(new_longest):
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
    and minimizes the summed predicted time, `fixed + (per_item + per_token x longest)
    x items` per call (dynamic programming over the sorted lengths). When the fixed cost
    of a call dominates it takes big mixed batches; when padding dominates it groups
    lengths.

    The cheapest call ending at item `stop` starts at the `start` that minimizes
    `best[start] - price x start` (`price`: per item of a call whose longest item is
    `stop - 1`) over the starts the limits allow: a window that only moves right as
    `stop` grows (the widest call narrows as items get longer). That minimum is kept in
    a monotonic deque. A start dropped there has a later one at most as dear, and stays
    so: the price only rises with the length (the cost model's parts are never
    negative), and a rise favours later starts. So a
    decision costs about the queue's length, not the queue times the batch size (which
    took a GPU's defaults, 1,024 items planned in batches of 256, ~25 ms of the loop).
    """
    head = queue[0]
    order = sorted(queue, key=lambda item: item.cost)
    count = len(order)
    fixed, per_item, per_token = model.fixed, model.per_item, model.per_token
    best = [0.0] + [math.inf] * count  # best[j]: the cheapest plan for order[:j]
    cut = [0] * (count + 1)  # where the last call of that plan starts
    starts: deque[tuple[float, int]] = deque()  # (best[j] - price x j, j), rising
    price = math.nan

    def offer(start: int) -> None:
        value = best[start] - price * start
        # On a tie, the later start: the smaller call at the end of the sorted order, so
        # that the calls before it, the head's among them, are the full ones. (The bigger
        # last call left the head, first among items of its length, the remainder: queued
        # items of one length, 740 in calls of 256, went 228 at a time.)
        while starts and starts[-1][0] >= value:
            starts.pop()
        starts.append((value, start))

    for stop in range(1, count + 1):
        longest = order[stop - 1].cost
        widest = limits.widest(longest)  # the most items in a call ending here
        if per_item + per_token * longest != price:  # a longer item: rank them anew
            price = per_item + per_token * longest
            kept = [start for _, start in starts]
            starts.clear()
            for start in kept:
                offer(start)
        offer(stop - 1)
        while starts[0][1] < stop - widest:
            starts.popleft()
        start = starts[0][1]
        best[stop] = best[start] + fixed + price * (stop - start)
        cut[stop] = start
    end = count  # the plan's calls, last first, cover the queue: one holds the head
    while not any(item is head for item in order[cut[end] : end]):
        end = cut[end]
    return {id(item) for item in order[cut[end] : end]}


class CostModel:
    """Seconds of a model call as `fixed + per_item * items + per_token * padded_cost`,
    learned from the calls the worker pool actually runs, on whatever device it runs.

    The parts differ by device, and each matters there: on a GPU a call costs mostly its
    fixed part and grows little with its size (8.5 ms for one short text, ~18 ms for
    256, measured on an H100), on a CPU it grows steeply with its padded tokens. The fit
    is exponentially weighted least squares over the recent calls, so it follows a
    machine whose speed drifts.

    Under steady load every call has the same size, and the recent calls alone can no
    longer tell the parts apart: the shape learned before (how much is fixed, how much
    per item and per token) is then kept and only scaled to the calls' measured time,
    so a GPU's large fixed part is not forgotten (taking it all as per-token made a
    lone small request look as slow as a full batch). Until one call is measured it
    predicts nothing (None): the scheduler then admits everything rather than guess.
    """

    def __init__(self, memory: float = COST_MEMORY):
        self.memory = memory
        # weighted sums of 1, items (a), padded tokens (p), seconds (y) and their products
        self._w = self._a = self._p = self._y = 0.0
        self._aa = self._pp = self._ap = self._ay = self._py = 0.0
        self.fixed = 0.0
        self.per_item = 0.0
        self.per_token = 0.0
        self.padding = 1.0  # padded / unpadded tokens of recent calls
        self._fitted = False  # the parts were told apart (calls of different sizes)
        self.calls = 0  # calls measured
        self.largest = 0  # the largest padded cost of a call measured

    @property
    def measured(self) -> bool:
        return self._w > 0

    @property
    def trusted(self) -> bool:
        """Enough calls are measured for the speed to be a reason to refuse work."""
        return self.calls >= CALLS_TO_TRUST

    @property
    def fitted(self) -> bool:
        """The parts are measured (calls of different sizes, now or before): predictions
        for other sizes, and plans that split work into several calls, rest on more than
        one point."""
        return self._fitted

    def observe(
        self, cost: int, seconds: float, tokens: int | None = None, items: float = 1
    ) -> None:
        """One model call: its padded cost, its seconds, its unpadded tokens and items."""
        m = self.memory
        if tokens:
            self.padding += (1 - m) * (cost / tokens - self.padding)
        a, p, y = float(max(items, 1)), float(max(cost, 1)), max(seconds, 0.0)
        self.calls += 1
        self.largest = max(self.largest, cost)
        self._w = m * self._w + 1
        self._a = m * self._a + a
        self._p = m * self._p + p
        self._y = m * self._y + y
        self._aa = m * self._aa + a * a
        self._pp = m * self._pp + p * p
        self._ap = m * self._ap + a * p
        self._ay = m * self._ay + a * y
        self._py = m * self._py + p * y
        self._fit()

    def _fit(self) -> None:
        w = self._w
        mean_a, mean_p, mean_y = self._a / w, self._p / w, self._y / w
        var_a = self._aa / w - mean_a * mean_a
        var_p = self._pp / w - mean_p * mean_p
        cov_ap = self._ap / w - mean_a * mean_p
        cov_ay = self._ay / w - mean_a * mean_y
        cov_py = self._py / w - mean_p * mean_y
        # a part is measured once its size varies by more than 5% of its mean
        a_varies = var_a > (0.05 * mean_a) ** 2
        p_varies = var_p > (0.05 * mean_p) ** 2
        slopes: tuple[float, float] | None = None  # (per item, per token)
        det = var_a * var_p - cov_ap * cov_ap
        if a_varies and p_varies and det > 0.05 * var_a * var_p:  # apart: both parts
            per_item = (cov_ay * var_p - cov_py * cov_ap) / det
            per_token = (cov_py * var_a - cov_ay * cov_ap) / det
            if per_item >= 0 and per_token >= 0:
                slopes = (per_item, per_token)
            elif per_item < 0:  # the items' part is noise (or both are): the tokens alone
                slopes = (0.0, max(cov_py / var_p, 0.0))
            else:
                slopes = (max(cov_ay / var_a, 0.0), 0.0)
        elif p_varies:  # the tokens alone: the items move with them, or stay
            # items that stay (full batches) keep the part learned of them: folded into
            # the fixed part, it was counted again for a call of fewer items (a lone
            # request predicted ~25% too slow)
            per_item = 0.0 if a_varies or not self._fitted else self.per_item
            slopes = (per_item, cov_py / var_p) if cov_py >= 0 else None
        elif a_varies:  # the tokens stay (calls filled to a token budget): so does their part
            per_token = self.per_token if self._fitted else 0.0
            slopes = (cov_ay / var_a, per_token) if cov_ay >= 0 else None
        if slopes is not None:
            fixed = mean_y - slopes[0] * mean_a - slopes[1] * mean_p
            if fixed >= 0:
                self.fixed, (self.per_item, self.per_token) = fixed, slopes
                self._fitted = True
                return
            slopes = None
        # One size measured: keep the shape learned before, scaled to what the calls
        # take now; with none learned yet, assume the time proportional to the tokens.
        shape = self.fixed + self.per_item * mean_a + self.per_token * mean_p
        if self._fitted and shape > 0:
            scale = mean_y / shape
            self.fixed, self.per_item, self.per_token = (
                self.fixed * scale,
                self.per_item * scale,
                self.per_token * scale,
            )
        else:
            self.fixed, self.per_item, self.per_token = 0.0, 0.0, mean_y / mean_p

    def predict(self, cost: int, items: float = 1) -> float | None:
        """Seconds of one model call of `items` items and this padded cost, or None
        before any measurement. Before the parts are told apart, no call is taken to cost
        more than the largest measured, as `drain_seconds_of` takes none (with one short
        call measured, the first burst's batches were each predicted seconds long, and
        their clients told by Retry-After to come back in 25-45 s to a queue that emptied
        in 50 ms)."""
        if not self._fitted:
            cost = min(cost, max(self.largest, 1))
        return self.extrapolate(cost, items)

    def extrapolate(self, cost: int, items: float = 1) -> float | None:
        """`predict`, past the largest call measured too."""
        if not self.measured:
            return None
        return self.fixed + self.per_item * items + self.per_token * cost

    def drain_seconds(self, costs: Sequence[int], max_size: int, workers: int = 1) -> float | None:
        """The seconds to compute `costs` in full batches, padded as recent batches were."""
        return self.drain_seconds_of(len(costs), sum(costs), max_size, workers)

    def drain_seconds_of(
        self, items: int, total_cost: int, max_size: int, workers: int = 1
    ) -> float | None:
        """`drain_seconds` of `items` items whose costs add up to `total_cost`. Before the
        parts are told apart, no call is taken to cost more than the largest measured: from
        one size alone a fixed cost a call cannot be told from a cost a token, and taking
        it all as per token made 16 requests of 32 long texts, after 20 of one short text
        each, look a hundred times as slow as they were (refused as unable to make their
        deadlines)."""
        if not self.measured:
            return None
        calls = math.ceil(items / max_size)
        padded = self.padding * total_cost
        if not self._fitted:
            padded = min(padded, calls * max(self.largest, 1))
        seconds = calls * self.fixed + self.per_item * items + self.per_token * padded
        return seconds / max(workers, 1)

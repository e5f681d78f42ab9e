"""How long a sequence on a continuous worker's rows takes, learned from those before it:
the new tokens it will likely make (`AnswerLengths`) at the seconds a token takes while so
many rows share the decoding steps (`SequencePace`).

A generation asks for at most so many new tokens (`max_tokens`, else the model's default)
and most end before that, at their end of sequence or a stop. Its time on a continuous
worker's rows is its steps at the rows' pace, so the scheduler predicts it from the tokens
it will likely make: as many as nine in ten recent answers stayed within, all it asks
where a tenth or more ran to their cap. Until enough answers are seen, its length is not
known, and is no reason to refuse it. Predicted from the average of whole sequences
instead, short answers made a full one look short: of a flood of 1 s chats asking 200
tokens, most admitted ran to their 504.
Predicted from all it asks, a chat naming 4,096 tokens for an answer of 300 would be
refused on a busy GPU for a time it never takes.
"""

from __future__ import annotations

import collections
import math

from rawserve.serving.batching import CostModel

# the share of answers a sequence's likely length is taken to cover
LIKELY_QUANTILE = 0.9
KEPT = 256  # the answers a length is read from, the latest
# answers that say something of a length before it is read from them: until then a
# sequence's own length is no reason to refuse or hold it (it is not known)
SEEN_ENOUGH = 20
REREAD = 16  # answers between two readings of a length (a reading walks the answers kept)
# the answers a length must rest on: past the point where fewer ran (the others cut at
# their caps before it), one or two that ended there say nothing of the rest
AT_RISK_AT_LEAST = 3


class AnswerLengths:
    """The new tokens a generation likely makes, from the ends of those before it.

    Each answer is kept as what it asked and what it made. One that ended early (its end
    of sequence, a stop) had its natural length; one that ran to its cap, or was stopped
    (its deadline, its client gone), was at least as long as it made. The share of
    answers longer than each length is read from both, as survival is from cases followed
    for different times (Kaplan and Meier's estimate): a prompt asking 5 tokens, always
    reaching them, says nothing of how long a chat asking 4,096 runs (counted as a full
    answer for every ask, chats asking 4,096 for answers of a few hundred were refused
    whenever anything ran), and a sequence stopped at its deadline after 100 tokens ran
    at least that long (left out, under overload the answers that ended were the short
    ones, and the likely length looked the shorter the more sequences ran to their 504)."""

    def __init__(self) -> None:
        self._answers: collections.deque[tuple[int, int]] = collections.deque(maxlen=KEPT)
        self._quantile: int | None = None  # as last read; None: past every answer seen
        self._unread = 0  # answers since

    def likely(self, asked: int) -> int | None:
        """The new tokens a sequence asking for `asked` likely makes: as many as
        LIKELY_QUANTILE of answers stay within, or all it asks where more run longer.
        None while fewer than SEEN_ENOUGH answers are seen (nothing is assumed)."""
        within = self.within()
        if within is None:
            return None
        return asked if within == math.inf else min(asked, int(within))

    def within(self) -> float | None:
        """The new tokens LIKELY_QUANTILE of answers stay within: infinite where more run
        to their caps than the rest end, None while fewer than SEEN_ENOUGH are seen."""
        if len(self._answers) < SEEN_ENOUGH:
            return None
        # read again every REREAD answers, or at each while few are kept
        if self._unread >= REREAD or (self._unread and len(self._answers) < 2 * SEEN_ENOUGH):
            self._quantile = self._read_quantile()
            self._unread = 0
        return math.inf if self._quantile is None else float(self._quantile)

    def _read_quantile(self) -> int | None:
        """The shortest length LIKELY_QUANTILE of answers stay within, None where more
        than the rest ran past every length an answer ended at, or where that length
        rests on fewer than AT_RISK_AT_LEAST answers (24 cut at a cap of 2 tokens and one
        that ended at 3 made 3 tokens the likely length of an answer asking 255)."""
        # by length: at each, the answers that ran as far (at risk), of which some ended
        # there and the others were cut there (they ran at least as far)
        reached = collections.Counter(made for _, made in self._answers)
        ended = collections.Counter(made for cap, made in self._answers if made < cap)
        at_risk, longer = len(self._answers), 1.0
        for made in sorted(reached):
            if ended[made]:
                longer *= 1 - ended[made] / at_risk
                # (a hair over: 1 - 0.9 is 0.09999999999999998)
                if longer <= 1 - LIKELY_QUANTILE + 1e-9:
                    return made if at_risk >= AT_RISK_AT_LEAST else None
            at_risk -= reached[made]
        return None

    def ended(self, asked: int, made: int) -> None:
        """A sequence asking for `asked` ended having made `made` (none: it failed, or
        ended at once, which says nothing of the others)."""
        if made > 0 and asked > 0:
            self._keep(asked, min(made, asked))

    def stopped(self, made: int) -> None:
        """A sequence was stopped having made `made`: it was at least that long, as one
        that ran to a cap of `made`."""
        if made > 0:
            self._keep(made, made)

    def _keep(self, cap: int, made: int) -> None:
        self._answers.append((cap, made))
        self._unread += 1


# the steps of a sequence beside its new tokens: its wait to join the rows at a step's end,
# its prefill (beside other joiners'); fitted to sequences timed on a 2-core CPU
STEPS_BESIDE = 4


class SequencePace:
    """Seconds of a sequence making `made` new tokens while `rows` sequences share the
    decoding steps on average (itself among them): its steps (`made` and STEPS_BESIDE) at
    the seconds a step takes beside so many rows, `fixed + per_row * rows`, a line fitted
    to the sequences that ran (a `CostModel`, its items the rows), and read no further
    than the most rows measured. Until the rows have varied, a step is taken to take the
    same time beside any number of them (rather than refuse a burst on a GPU at the pace
    of a lone sequence times the rows).

    A step's time grows with the rows it decodes: on a 2-core CPU a token took 1-2 ms
    beside a few rows and ~10 ms beside 120; on a GPU it grows little until the rows are
    in the hundreds. Learned as one pace whatever the rows (the pace of whole
    sequences), a pace measured beside few rows admitted sequences beside many that
    could not end in time, and one measured beside many refused, under light load,
    sequences that would have ended long before their deadlines. Timed by their tokens
    (the prompt's counted as the new ones), short answers after long prompts made every
    token look cheap: on sequences timed under overload, predictions were off by a median
    factor of 1.34 that way, 1.22 by steps (and 1.60 as one pace of whole sequences)."""

    def __init__(self) -> None:
        self._per_step = CostModel()
        # the most rows measured beside a sequence, on average: the line is read no
        # further (drawn from sequences beside 1-3 rows, a GPU's burst of 256 was
        # refused at 20 times the time a step took)
        self.most_rows = 1.0

    @property
    def trusted(self) -> bool:
        """Enough sequences are measured for their pace to be a reason to refuse one."""
        return self._per_step.trusted

    def observe(self, made: int, rows: float, seconds: float) -> None:
        """A sequence made `made` new tokens in `seconds` beside `rows` rows on average."""
        rows = max(rows, 1.0)
        self._per_step.observe(1, seconds / _steps(made), items=rows)
        self.most_rows = max(self.most_rows, rows)

    def predict(self, made: int, rows: float) -> float | None:
        """The seconds of a sequence making `made` new tokens beside `rows` rows, or None
        before any sequence is measured."""
        per_step = self.step_seconds(rows)
        return None if per_step is None else _steps(made) * per_step

    def step_seconds(self, rows: float) -> float | None:
        """The seconds a decoding step takes beside `rows` rows (as far as the most
        measured), or None before any sequence is measured."""
        return self._per_step.predict(1, items=min(max(rows, 1.0), self.most_rows))


def _steps(made: int) -> int:
    """The decoding steps of a sequence making `made` new tokens, with those beside them."""
    return max(made, 0) + STEPS_BESIDE

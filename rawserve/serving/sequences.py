"""How long a sequence on a continuous worker's rows takes, learned from those before it:
the new tokens it will likely make (`AnswerLengths`) at the seconds a token takes while so
many rows share the decoding steps (`SequencePace`).

A generation asks for at most so many new tokens (`max_tokens`, else the model's default)
and most end before that, at their end of sequence or a stop. Its time on a continuous
worker's rows is its steps at the rows' pace, so the scheduler predicts it from the tokens
it will likely make: as many as nine in ten recent answers stayed within, all it asks
where a tenth or more ran to their cap (answers stopped at their deadline past the
length taken count so; left out, under overload the answers that ended were the short
ones). Predicted from the average of whole sequences instead, short answers made a full
one look short: of a flood of 1 s chats asking 200 tokens, most admitted ran to their 504.
Predicted from all it asks, a chat naming 4,096 tokens for an answer of 300 would be
refused on a busy GPU for a time it never takes.
"""

from __future__ import annotations

import bisect
import collections

from rawserve.serving.batching import CostModel

# the share of answers a sequence's likely length is taken to cover: where more ran to
# their cap, a new one is taken to run to its own
LIKELY_QUANTILE = 0.9
# weight of the past in the share that ran to their cap (~20 answers); it starts at all:
# nothing is assumed to end early before it is seen to
SHARE_MEMORY = 0.95
KEPT = 256  # the early ends a quantile is read from, the latest


class AnswerLengths:
    """The new tokens a generation likely makes, from the ends of those before it."""

    def __init__(self) -> None:
        self.capped_share = 1.0
        self._early: collections.deque[int] = collections.deque()  # oldest first
        self._sorted: list[int] = []  # the same, in order: its quantile is read at once

    def likely(self, asked: int) -> int:
        """The new tokens a sequence asking for `asked` likely makes."""
        early = 1.0 - self.capped_share  # the share of answers that end early
        if early <= LIKELY_QUANTILE or not self._sorted:  # the quantile is a full answer
            return asked
        ordered = self._sorted
        return min(asked, ordered[int(LIKELY_QUANTILE / early * (len(ordered) - 1))])

    def ended(self, asked: int, made: int) -> None:
        """A sequence asking for `asked` ended having made `made` (none: it failed, or
        ended at once, which says nothing of the others)."""
        if made <= 0 or asked <= 0:
            return
        capped = made >= asked
        self._count(capped)
        if not capped:
            if len(self._early) == KEPT:
                oldest = self._early.popleft()
                del self._sorted[bisect.bisect_left(self._sorted, oldest)]
            self._early.append(made)
            bisect.insort(self._sorted, made)

    def stopped(self, asked: int, made: int) -> None:
        """A sequence asking for `asked` was stopped (its deadline passed, its client left)
        having made `made`. Past the tokens it was taken to make, it ran long: counted as
        one that ran to its cap (stopped ones are the long ones; left out, the answers that
        ended were the short ones, and under overload the likely length looked the shorter
        the more sequences ran to their 504). Before that, it says nothing."""
        if asked > 0 and made >= self.likely(asked) and made > 0:
            self._count(True)

    def _count(self, capped: bool) -> None:
        self.capped_share += (1 - SHARE_MEMORY) * (float(capped) - self.capped_share)


# the steps of a sequence beside its new tokens: its wait to join the rows at a step's end,
# its prefill (beside other joiners'); fitted to sequences timed on a 2-core CPU
STEPS_BESIDE = 4


class SequencePace:
    """Seconds of a sequence making `made` new tokens while `rows` sequences share the
    decoding steps on average (itself among them): its steps (`made` and STEPS_BESIDE) at
    the seconds a step takes beside so many rows, `fixed + per_row * rows`, a line fitted
    to the sequences that ran (a `CostModel`, its items the rows). Until the rows have
    varied, a step is taken to take the same time beside any number of them (rather
    than refuse a burst on a GPU at the pace of a lone sequence times the rows).

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

    @property
    def trusted(self) -> bool:
        """Enough sequences are measured for their pace to be a reason to refuse one."""
        return self._per_step.trusted

    def observe(self, made: int, rows: float, seconds: float) -> None:
        """A sequence made `made` new tokens in `seconds` beside `rows` rows on average."""
        self._per_step.observe(1, seconds / _steps(made), items=max(rows, 1.0))

    def predict(self, made: int, rows: float) -> float | None:
        """The seconds of a sequence making `made` new tokens beside `rows` rows, or None
        before any sequence is measured."""
        per_step = self._per_step.predict(1, items=max(rows, 1.0))
        return None if per_step is None else _steps(made) * per_step


def _steps(made: int) -> int:
    return max(made, 0) + STEPS_BESIDE

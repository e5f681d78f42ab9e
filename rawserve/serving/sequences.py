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

from rawserve.serving.batching import CostModel

# the share of answers a sequence's likely length is taken to cover
LIKELY_QUANTILE = 0.9
KEPT = 256  # the answers a length is read from, the latest
# answers that say something of a length before it is read from them: until then a
# sequence's own length is no reason to refuse or hold it (it is not known)
SEEN_ENOUGH = 20
REREAD = 16  # answers between two readings of a length (a reading walks the answers kept)


class AnswerLengths:
    """The new tokens a generation likely makes, from the ends of those before it.

    Each answer is kept as what it asked and what it made. One that ended early (its end
    of sequence, a stop) had its natural length; one that ran to its cap, or was stopped
    (its deadline, its client gone), was at least as long as what it made. For a new
    sequence asking for `asked`, the answers that ended early count their length, those
    that ran to a cap at least as long count as full, and those that ran to a shorter cap
    say nothing of it: a prompt asking 5 tokens, always reaching them, made chats asking
    4,096 look full (counted as one share of capped answers for every ask, 2,351 of 2,487
    chats were refused in a simulated mix). Stopped ones count so too: left out, under
    overload the answers that ended were the short ones, and the likely length looked the
    shorter the more sequences ran to their 504."""

    def __init__(self) -> None:
        self._answers: collections.deque[tuple[int, int]] = collections.deque(maxlen=KEPT)
        self._read: dict[int, int | None] = {}  # per ask: its likely length, as last read
        self._unread = 0  # answers since

    def likely(self, asked: int) -> int | None:
        """The new tokens a sequence asking for `asked` likely makes: as many as
        LIKELY_QUANTILE of the answers that say something of it stayed within. None while
        fewer than SEEN_ENOUGH say something (nothing is assumed before it is seen)."""
        # read again every REREAD answers, or at each while few are kept (cheaply)
        if self._unread >= REREAD or (self._unread and len(self._answers) < 2 * SEEN_ENOUGH):
            self._read.clear()
            self._unread = 0
        if asked not in self._read:
            self._read[asked] = self._read_likely(asked)
        return self._read[asked]

    def _read_likely(self, asked: int) -> int | None:
        lengths = [
            min(made, asked)
            for cap, made in self._answers
            if made < cap or cap >= asked  # ended early, or ran to a cap as long
        ]
        if len(lengths) < SEEN_ENOUGH:
            return None
        lengths.sort()
        return lengths[int(LIKELY_QUANTILE * (len(lengths) - 1))]

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
        per_step = self._per_step.predict(1, items=min(max(rows, 1.0), self.most_rows))
        return None if per_step is None else _steps(made) * per_step


def _steps(made: int) -> int:
    return max(made, 0) + STEPS_BESIDE

"""When a continuous loop's sequences get their tokens, counted for the server's metrics.

Three latencies a user of a generation server watches (vLLM and TGI export the same):
- the queue: from a request's admission to the start of the loop step that prefilled it
  (the scheduler's queue, the pipe to the worker, the step under way, a wait for a free
  row, for its grammar or, with `--join-wait-steps`, for company; a long prompt's, to its
  last chunk's step);
- the first token: from its admission to its first new token;
- between tokens: each gap between two tokens of one sequence.

The times are the worker's: a token is made when its forward pass is done, before its
text crosses to the client. Every row of a decoding step gets its token at the same
moment, and most rows got their last one at the step before: those share one gap,
counted once for all of them, so a step costs a few operations whatever its rows.

Worker process only; standard library.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from rawserve.shared.messages import GenerationPasses
from rawserve.shared.tallies import INTER_TOKEN_BUCKETS, WAIT_BUCKETS, Tally
from rawserve.worker.continuous import Generation


class TokenTimes:
    """The loop tells it when a sequence was admitted (`admitted`), when a step begins
    (`step_begins`), each new token (`token`, after the sequence holds it) and the end of
    each forward pass (`pass_ends`); `taken` gives the counts so far."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # the server's admission clock: time.monotonic, in every process
        self.queue = Tally(WAIT_BUCKETS)
        self.first_token = Tally(WAIT_BUCKETS)
        self.inter_token = Tally(INTER_TOKEN_BUCKETS)
        self._admitted: dict[Generation, float] = {}  # until its first token
        self._first_at: dict[Generation, float] = {}  # its first token's time, till its second
        self._step_began = 0.0
        self._last_step_at: float | None = None  # when the last decoding step's tokens came
        # this pass's tokens: first ones, second ones (timed from their first), and those
        # of rows that made one at the last decoding step too
        self._firsts: list[Generation] = []
        self._seconds: list[Generation] = []
        self._stepped = 0

    def admitted(self, generation: Generation, at: float | None) -> None:
        """`generation` was admitted `at` (None: not known; timed from now)."""
        self._admitted[generation] = self.clock() if at is None else at

    def forget(self, generation: Generation, again: Generation | None = None) -> None:
        """`generation` ended without finishing (failed), or was queued `again` from its
        prompt: the new one keeps its admission, if it had not made its first token."""
        admitted = self._admitted.pop(generation, None)
        self._first_at.pop(generation, None)
        if again is not None and admitted is not None:
            self._admitted[again] = admitted

    def step_begins(self) -> None:
        self._step_began = self.clock()

    def token(self, generation: Generation) -> None:
        made = len(generation.tokens)
        if made == 1:
            self._firsts.append(generation)
        elif made == 2 and generation in self._first_at:
            self._seconds.append(generation)
        else:
            self._stepped += 1

    def pass_ends(self) -> None:
        """A forward pass's tokens are all told: they were made now."""
        if not (self._firsts or self._seconds or self._stepped):
            return
        now = self.clock()
        for generation in self._firsts:
            admitted = self._admitted.pop(generation, None)
            if admitted is not None:  # (None: started again after running out of memory)
                self.queue.observe(max(0.0, self._step_began - admitted))
                self.first_token.observe(max(0.0, now - admitted))
            self._first_at[generation] = now
        for generation in self._seconds:
            self.inter_token.observe(now - self._first_at.pop(generation))
        if self._stepped and self._last_step_at is not None:
            self.inter_token.observe(now - self._last_step_at, self._stepped)
        if self._seconds or self._stepped:  # a decoding step (a prefill makes first tokens)
            self._last_step_at = now
        self._firsts.clear()
        self._seconds.clear()
        self._stepped = 0

    def taken(self, passes: GenerationPasses) -> GenerationPasses:
        """`passes` with the counts so far (zeroed here); the sequences that ended are
        forgotten (a cancelled one never made its first token)."""
        for held in (self._admitted, self._first_at):
            for generation in [g for g in held if g.done]:
                del held[generation]
        return replace(
            passes,
            queue=self.queue.taken(),
            first_token=self.first_token.taken(),
            inter_token=self.inter_token.taken(),
        )

"""Supervision of the model workers, decided without I/O: restarts and their backoff,
crash counting, what becomes of a batch whose worker died, poison quarantine, health,
and when a model with no worker serving should be served again.

Like the scheduling core, these are plain synchronous objects driven by an injected
clock, so every decision is tested with a fake one (tests/test_supervision.py); the
worker pool (`rawserve.serving.pool`) does the I/O and asks them what to do.

A crash proves nothing about an input (an operator's `kill -9` and the OOM killer look
alike), so crashes are counted, not guessed at: the items of a batch whose worker died
are retried one by one, and an input that took a worker down while running alone
`QUARANTINE_STRIKES` times is answered with a failure and quarantined (by content hash,
for `QUARANTINE_SECONDS`): refused without being run. An input remembered, but not
quarantined, runs alone whenever it comes again, so that its next crash is counted.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rawserve.serving.status import LoadState, WorkerState
from rawserve.shared.messages import FailureKind, ItemFailure

RESTART_BACKOFF_FIRST = 0.5  # seconds before the first restart of a dead worker
RESTART_BACKOFF_MAX = 30.0
MAX_FAILED_RESTARTS = 5  # restarts in a row that die while loading: the process is unhealthy
# deaths in a row at work, without one answered batch (poison alone is rarely so many)
MAX_CRASHES = 10
# a worker ready this long before it died had worked: its restart backs off afresh (as a
# service manager forgets a unit's failures once it has run a while)
STABLE_SECONDS = 60.0
POISON_MEMORY = 4096  # content hashes of inputs that crashed a worker, least recent dropped
QUARANTINE_STRIKES = 2  # crashes while running alone before an input is refused
QUARANTINE_SECONDS = 3600.0  # how long a crash is remembered (and a quarantine lasts)
# Until a restart is timed, one is expected to take this share of the first start, which
# pays what a restart may not: cold file caches, the server starting beside it (a first
# start took 1.2 to 2 times as long as the restarts after it on a loaded 2-core machine).
FIRST_START_SHARE = 0.5
# A process of a worker that has loaded before, still loading after this many times its
# slowest load (and at least LOAD_HANG_FLOOR seconds), is taken as hung and killed: a
# stopped one (SIGSTOP, a stall) otherwise left the model "restarting" for good while
# /health said 200, and nothing restarted it
LOAD_HANG_FACTOR = 10.0
LOAD_HANG_FLOOR = 60.0

CRASHED_ALONE = ItemFailure(FailureKind.INTERNAL, "this input crashed the model worker")
REFUSED_POISON = ItemFailure(
    FailureKind.INPUT,
    "this input crashed the model worker before, or ran past its --batch-timeout, and is refused",
)
CRASHED_MID_STREAM = ItemFailure(
    FailureKind.INTERNAL, "the model worker crashed while streaming this answer"
)
STOPPED_MID_STREAM = ItemFailure(  # (SIGSTOP, a debugger: no crash of the model's)
    FailureKind.INTERNAL,
    "the model worker was stopped from outside while streaming this answer, and killed",
)
NOT_RUN = ItemFailure(  # nobody waits for it any more: not run again after a crash
    FailureKind.INTERNAL, "this input was not run again after a crash: nobody waits for it"
)
TIMED_OUT = ItemFailure(
    FailureKind.INTERNAL, "the model did not finish this batch within the batch timeout"
)
# What items no finished model call answered (lost with their worker, or never run):
# a batch of only these is no batch the model ran, for its size and time histograms
NOT_COMPUTED = (
    REFUSED_POISON,
    NOT_RUN,
    CRASHED_ALONE,
    CRASHED_MID_STREAM,
    STOPPED_MID_STREAM,
    TIMED_OUT,
)


@dataclass
class _Crashes:
    count: int  # crashes while running alone
    expires: float  # when they are forgotten
    remembered: bool = False  # a first run's first crash alone came before them, uncounted
    # (count 0, not remembered: a suspect, in a batch of several that crashed, not run again)
    suspected: int = 0  # in how many such batches it was, a suspect


class PoisonMemory:
    """Inputs (with their parameters, by content hash) that crashed a worker while
    running alone: one crash is remembered, `strikes` of them, each within `seconds` of
    the one before, put the input in quarantine until the memory of its last crash
    expires. Bounded: past `size` entries the least recently seen is dropped."""

    def __init__(
        self,
        size: int = POISON_MEMORY,
        *,
        strikes: int = QUARANTINE_STRIKES,
        seconds: float = QUARANTINE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.size = size
        self.strikes = strikes
        self.seconds = seconds
        self.clock = clock
        self._entries: OrderedDict[str, _Crashes] = OrderedDict()

    @staticmethod
    def key(value: Any, params: Mapping[str, Any]) -> str:
        text = json.dumps([value, dict(params)], sort_keys=True, default=repr)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def crashed(self, key: str) -> bool:
        """Count a crash of this input running alone; True when it is now quarantined."""
        entry = self._entry(key)
        count = entry.count + 1 if entry is not None else 1
        self._keep(key, count, remembered=entry is not None and entry.remembered)
        return count >= self.strikes

    def crashed_first(self, key: str) -> bool:
        """Count a crash of this input on its first run, alone (not run again after a
        crash); True when it is now quarantined. The first such crash is remembered, not
        counted: where it runs again, its run again's crash is the first counted (two
        outside kills, the OOM killer's, never make an input poison), and where it is not
        (its deadline passed, its client left), the next send's is. Counted only where it
        ran again, a poison input sent with deadlines shorter than a restart took a
        worker down at every request and was never refused; three crashes alone
        quarantine an input now, however its deadlines fall. A suspect's is its first
        (`suspect`: a batch's crash counts for none of its inputs)."""
        entry = self._entry(key)
        if entry is not None and (entry.count or entry.remembered):
            return self.crashed(key)
        self._keep(key, 0, remembered=True)
        return False

    def suspect(self, key: str) -> None:
        """Remember an input of a batch of several that crashed its worker, not run again
        alone (nobody waited for it any more): it runs alone when it comes again, where a
        crash of it counts as a first run's crash alone does (`crashed_first`); the
        batch's counts for none of its inputs. Run in batches and never alone, a poison
        input sent with deadlines shorter than a restart took a worker down at every
        batch and was never counted. Each such batch is counted (`runs_alone_anywhere`)."""
        entry = self._entry(key)
        if entry is None or not (entry.count or entry.remembered):
            suspected = 1 if entry is None else entry.suspected + 1
            self._keep(key, 0, remembered=False, suspected=suspected)

    def runs_alone_anywhere(self, key: str) -> bool:
        """Whether the input runs alone on a continuous worker too, which takes no new
        sequence until its rows are done: it crashed a worker alone before, or was in two
        crashed batches of several. One such batch makes each of its inputs a suspect (an
        outside kill's too), and draining the worker for each then cost a 3-token prompt
        8-10 s, not 0.2; never drained for, a poison prompt batched beside others took the
        worker down at every send."""
        entry = self._entry(key)
        return entry is not None and bool(entry.count or entry.remembered or entry.suspected > 1)

    def cleared(self, key: str) -> None:
        """The input ran alone and was answered: a suspect, or an input whose one crash
        alone is remembered (an outside kill's, say), is forgotten; one counted stays. An
        input that crashes only some of the times it runs alone (sampled generation, a
        race) would otherwise be forgiven at each answer and never refused (tried: 12
        deaths in 6 requests); the price is that outside kills of two sends of one input
        in a row count, and a third quarantines it (a prompt streamed, or sent with
        deadlines shorter than a restart, is not run again to be forgiven between)."""
        entry = self._entry(key)
        if entry is not None and not entry.count:
            del self._entries[key]

    def holds(self, key: str) -> bool:
        """Whether the input is remembered at all: quarantined, crashed or a suspect."""
        return self._entry(key) is not None

    def _keep(self, key: str, count: int, *, remembered: bool, suspected: int = 0) -> None:
        """Remember the input's crashes from now on, the least recently seen dropped past
        `size`."""
        self._entries[key] = _Crashes(count, self.clock() + self.seconds, remembered, suspected)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def left(self, key: str) -> int:
        """How many more crashes alone quarantine the input."""
        entry = self._entry(key)
        return self.strikes - (0 if entry is None else entry.count)

    def times(self, key: str) -> int:
        """How many times the input crashed a worker running alone, as remembered."""
        entry = self._entry(key)
        return 0 if entry is None else entry.count + entry.remembered

    def __contains__(self, key: str) -> bool:
        """Whether the input is quarantined (refused without being run)."""
        entry = self._entry(key)
        if entry is None:
            return False
        self._entries.move_to_end(key)
        return entry.count >= self.strikes

    def _entry(self, key: str) -> _Crashes | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires <= self.clock():
            del self._entries[key]
            return None
        return entry

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class WorkerRecord:
    """What supervision remembers of one worker across its processes."""

    restarts: int = 0
    failed_restarts: int = 0  # in a row, died before it was ready
    crashes: int = 0  # in a row, died at work after it was ready, without answering a batch
    # the wait before its next restart (read when made: tests shorten it)
    backoff: float = field(default_factory=lambda: RESTART_BACKOFF_FIRST)
    restart_at: float = 0.0  # when its next process is spawned, once it died
    ready_at: float | None = None  # when its process was last ready
    # how long its processes took from their start to ready: its first, its fastest restart
    first_start: float | None = None
    fastest_restart: float | None = None

    @property
    def expected_start(self) -> float | None:
        """How long its next process should take to be ready (None: none started yet)."""
        if self.fastest_restart is not None:
            return self.fastest_restart
        return None if self.first_start is None else FIRST_START_SHARE * self.first_start


class LostBatch(enum.Enum):
    """What becomes of the batch a dead worker held."""

    FAIL_MID_STREAM = "fail_mid_stream"  # tokens reached a client: a rerun would repeat them
    RETRY_ALONE = "retry_alone"  # run each of its items alone, ahead of the queue
    RUN_AGAIN_ALONE = "run_again_alone"  # a lone item crashed it: one more strike, once more
    QUARANTINED = "quarantined"  # a lone item crashed it its last time: refuse it
    FAIL = "fail"  # a lone item hung it: answered as failed, not run again


@dataclass(frozen=True)
class Held:
    """The batch a worker held when it died, as supervision needs to know it."""

    streamed: bool = False  # tokens of it reached a client
    # its poison key when it was an item run alone (retried so; or, hung, any lone item)
    lone_key: str | None = None
    # its poison key when it was one item alone on its first run (`crashed_first`)
    first_key: str | None = None


@dataclass(frozen=True)
class ExitDecision:
    restart_in: float  # seconds until the worker's next process is spawned
    lost: LostBatch | None  # None: it held no batch


class Supervisor:
    """The supervision decisions for the workers of one model."""

    def __init__(
        self,
        workers: int,
        *,
        max_failed_restarts: int = MAX_FAILED_RESTARTS,
        max_crashes: int = MAX_CRASHES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.records = [WorkerRecord() for _ in range(workers)]
        self.max_failed_restarts = max_failed_restarts
        self.max_crashes = max_crashes
        self.clock = clock
        self.poison = PoisonMemory(clock=clock)

    def load_limit(self, index: int) -> float | None:
        """Seconds after which a process of worker `index` that has not loaded is hung
        (None: none of its processes has loaded yet, and a first load takes what it
        takes: a download, a large model)."""
        record = self.records[index]
        loads = [s for s in (record.first_start, record.fastest_restart) if s is not None]
        return max(LOAD_HANG_FLOOR, LOAD_HANG_FACTOR * max(loads)) if loads else None

    def loaded(self, index: int, start_seconds: float) -> None:
        """A worker's process loaded the model (and warmed up) `start_seconds` after it
        started: its failed loads are forgiven."""
        record = self.records[index]
        record.failed_restarts = 0
        record.ready_at = self.clock()
        if not record.restarts:
            record.first_start = start_seconds
        elif record.fastest_restart is None or start_seconds < record.fastest_restart:
            record.fastest_restart = start_seconds

    def answered(self, index: int) -> None:
        """A worker answered a batch: it works, so earlier crashes are forgotten."""
        record = self.records[index]
        record.backoff = RESTART_BACKOFF_FIRST
        record.crashes = 0

    def exited(
        self, index: int, *, while_loading: bool, held: Held | None, at_work: bool = False
    ) -> ExitDecision:
        """A worker's process died holding `held` (its batch), or otherwise `at_work`
        (a continuous worker's running sequences; killed as hung at a batch): count it,
        say when to restart it and what becomes of the batch. A death at work (holding a
        batch or `at_work`) counts toward `healthy`; one with nothing to do says
        nothing of the device or the inputs (an operator's kill, the OOM killer: ten of
        them on an idle server turned /health 503 while the worker was back and
        serving). One after the worker had been ready STABLE_SECONDS restarts it at
        the first backoff."""
        record = self.records[index]
        lost = None if held is None else self.lost(held)
        if while_loading:
            record.failed_restarts += 1
        else:
            if held is not None or at_work:
                record.crashes += 1
            ready_at = record.ready_at
            if ready_at is not None and self.clock() - ready_at >= STABLE_SECONDS:
                record.backoff = RESTART_BACKOFF_FIRST
        record.ready_at = None
        record.restarts += 1
        record.restart_at = self.clock() + record.backoff
        decision = ExitDecision(record.backoff, lost)
        record.backoff = min(record.backoff * 2, RESTART_BACKOFF_MAX)
        return decision

    def lost(self, held: Held) -> LostBatch:
        """What becomes of a batch a dead worker held (`exited` decides it for the batch it
        ran; a continuous worker's other batches are decided here, one by one). A lone
        item's crash counts toward its quarantine whether or not its tokens reached its
        client (streamed, it is not run again: its client would get them twice)."""
        if held.first_key is not None and self.poison.crashed_first(held.first_key):
            return LostBatch.QUARANTINED
        if held.lone_key is not None and self.poison.crashed(held.lone_key):
            return LostBatch.QUARANTINED
        if held.streamed:  # (counted all the same: a poison prompt streamed was never refused)
            return LostBatch.FAIL_MID_STREAM
        return LostBatch.RETRY_ALONE if held.lone_key is None else LostBatch.RUN_AGAIN_ALONE

    def hung(self, held: Held, items: int) -> LostBatch:
        """What becomes of a batch of `items` its worker was killed for as hung
        (`--batch-timeout`): several run again alone, as after a crash, so that one input
        that hangs fails none beside it. One alone (`held.lone_key`: its key, whether or
        not it was retried) fails, not run again: that would hold a worker as long again.
        It counts as a crash alone does: the same input hung twice is quarantined (it held
        its worker each time, and ten in a row made /health 503)."""
        if items > 1 and not held.streamed:
            return LostBatch.RETRY_ALONE
        if items == 1 and held.lone_key is not None and self.poison.crashed(held.lone_key):
            return LostBatch.QUARANTINED
        return LostBatch.FAIL

    def is_poison(self, value: Any, params: Mapping[str, Any]) -> bool:
        """Whether an input is quarantined (refused without being run)."""
        return bool(self.poison) and PoisonMemory.key(value, params) in self.poison

    def remembered(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """Each input's poison key where the memory holds it (quarantined, or to run
        alone), else None. Hashing every input costs more than the rest of a submit: it is
        skipped while no input has crashed a worker yet."""
        if not self.poison:
            return [None] * len(inputs)
        keys = (PoisonMemory.key(value, params) for value in inputs)
        return [key if self.poison.holds(key) else None for key in keys]

    @property
    def healthy(self) -> bool:
        """False once every worker keeps dying: it failed to load too many times in a row,
        or died at work too many times in a row without answering a batch (a broken
        device)."""
        return any(
            r.failed_restarts < self.max_failed_restarts and r.crashes < self.max_crashes
            for r in self.records
        )

    @property
    def restarted(self) -> bool:
        return any(r.restarts for r in self.records)

    def back_at(self, index: int) -> float | None:
        """When worker `index`, dead, should serve again: once its restart's backoff is
        over, in its expected start time (None: no guess founded)."""
        record = self.records[index]
        expected = record.expected_start
        return None if expected is None else record.restart_at + expected

    def serving_again_at(self, workers: Sequence[tuple[WorkerState, float]]) -> float | None:
        """While no worker serves: the soonest one should again, each dead one once its
        backoff is over and each starting one from its start, in its expected start time
        (`workers`: each worker's state and its process's start time). Nothing
        is expected (math.inf) while every worker keeps dying (`healthy` is False). None
        while a worker serves, or where no guess is founded: a worker that never started
        (the first load), or none on its way (stopped)."""
        if any(state.serving for state, _ in workers):
            return None
        if not self.healthy:
            return math.inf
        soonest = math.inf
        for record, (state, started_at) in zip(self.records, workers, strict=True):
            if state is WorkerState.STOPPED:
                continue
            expected = record.expected_start
            if expected is None or state is WorkerState.WAITING:
                return None
            began = record.restart_at if state is WorkerState.DEAD else started_at
            soonest = min(soonest, began + expected)
        return None if soonest == math.inf else soonest


def load_state(
    starting: Sequence[tuple[WorkerState, float]],
    restarted: bool,
    now: float,
    healthy: bool = True,
) -> tuple[LoadState, float | None]:
    """While no worker is ready: loading, warming, restarting or, once every worker keeps
    dying (`healthy` False), unhealthy, and for how many seconds the longest load has run
    (None when no worker is loading). `starting` holds the state and start time of each
    worker on its way to serving."""
    if not healthy:
        state = LoadState.UNHEALTHY
    elif restarted:
        state = LoadState.RESTARTING
    elif starting and all(s is WorkerState.WARMING for s, _ in starting):
        state = LoadState.WARMING
    else:
        state = LoadState.LOADING
    if not starting:
        return state, None
    return state, now - min(started for _, started in starting)

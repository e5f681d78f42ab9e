"""The scheduling core: the queue and every decision about it, with no I/O and no clock.

`SchedulerCore` admits work, builds the next batch, drops what expired and says when to
look again, all as plain synchronous functions of `now`, so it is tested with a fake
clock and simulated at random (tests/test_scheduler_simulation.py).

The queue is served in fair-share order, not first come first served: each request's
items get consecutive turns from the current one (start-time fair queueing, one turn per
item, more for an item that costs several batches), so a request of 256 inputs
interleaves with the single inputs that arrive after it instead of going wholly before
them. Deadlines still rule where they bind: an item
close to its deadline leads the next batch or joins it, requests that batches slower
than measured put at risk go first, earliest deadline first, an expired one is dropped,
and no batch is made that would come back after a member's deadline. The async driver that
runs it against the worker pool is `rawserve.serving.driver.Scheduler`. Never imports
asyncio's server side, h11, torch or the pool.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import math
import operator
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rawserve.serving.batching import (
    PLAN_WINDOW,
    BatchLimits,
    CostModel,
    choose_batch,
    padded_cost,
)
from rawserve.serving.face import ItemResult
from rawserve.serving.minima import QueueMinima
from rawserve.serving.sequences import AnswerLengths, SequencePace
from rawserve.shared.messages import NO_CONTROL, Control
from rawserve.tasks import batch_key, estimate_tokens, model_tokens

URGENT_BATCHES = 2.0  # an item this many batch-times from its deadline joins any batch
# A batch is sent only to items whose deadline is this many predicted batch-times away:
# model calls vary, and an answer that comes back late is compute wasted.
DEADLINE_MARGIN = 1.25
# Work is admitted only when the work ahead of it, at the measured speed, leaves this much
# slack before its deadline: an item admitted at the edge reaches the head of the queue
# with no time left, and the batch that could still save it is a small one (less done per
# second, more left to expire: under overload the queue spiralled into batches of one).
ADMIT_MARGIN = DEADLINE_MARGIN
# A continuous worker's running sequences' ends are judged again when a step's time
# beside the rows running has changed by more than this fraction since they last were.
REPACE_CHANGE = 0.05
RATE_SMOOTHING = 0.2  # weight of the newest window in the service-rate average
# The service rate is counted over windows of this many seconds with work in flight
# (batches that end together would make a shorter one a spike)
RATE_WINDOW = 1.0
CALIBRATION_SMOOTHING = 0.3  # weight of the newest token count in the estimate's scale
BY_DEADLINE = operator.attrgetter("deadline")
CANDIDATE_WINDOW = 64  # items of a key's queue a batch is chosen from, at the least
OUTLIER_FACTOR = 4.0  # a measured batch counts as at most this many times its prediction
# the requests at risk of their deadlines are judged again at most this often (seconds):
# a walk over the queue, where the speed it judges by moves slowly
RISK_INTERVAL = 0.05
NO_BOUNDS = (-1, -math.inf)  # the bounds of an empty queue's turns and deadlines


@dataclass(eq=False)
class WorkItem:
    """One input waiting for (or inside) a model call."""

    input: Any
    params: Mapping[str, Any]
    control: Control
    key: str
    deadline: float
    arrived: float
    cost: int  # estimated tokens
    seq: int
    new_tokens: int = 0  # the most a generation may add (its `cost` counts them); else 0
    rows: int = 1  # the rows a generation decodes at each step (its beams, its sequences)
    fewest_new_tokens: int = 0  # those it makes whatever the model writes (`fewest_new_tokens`)
    # admitted by an idle continuous worker: sent whatever its time, as it was admitted
    taken_whatever_its_time: bool = False
    future: asyncio.Future[ItemResult] | None = None
    queued: bool = False
    turn: int = 0  # its place in the fair-share order, set when it is admitted
    turns: int = 1  # the turns it takes (it starts at its turn's first): `_turns`
    request: int = -1  # its request's first item's seq, set at admission (a list is one)
    listed: bool = False  # one of a list's items (a request of several)
    batch: asyncio.Future[Any] | None = None  # the model call it is part of, once sent
    request_id: str = ""  # its request's, for the worker's log lines ("": none)
    # why its run ended while a worker held it ("expired", "disconnected"): counted under
    # that as dropped if the pool then never runs it (a retry after a crash left waiting)
    left: str = ""
    # its own model call's start, size and seconds, where its part of a batch ran apart
    # (run again after a crash): its timing, rather than the batch's first call's
    call: tuple[float, int, float] | None = None

    def sort_key(self) -> tuple[int, float, int]:
        """Fair-share turn first; within a turn, earliest deadline first."""
        return (self.turn, self.deadline, self.seq)


def _request_of(items: Sequence[WorkItem]) -> tuple[str, float] | None:
    """The request `items` are of, as `_sole_request` tells it; None where it has no id."""
    if not items or not items[0].request_id:
        return None
    return items[0].request_id, items[0].deadline


def _take_turns_from(turn: int, items: Sequence[WorkItem]) -> None:
    """Give `items` consecutive turns after `turn`, each as many as it takes."""
    for item in items:
        turn += item.turns
        item.turn = turn


def _bounds(items: Sequence[WorkItem]) -> tuple[int, float]:
    """The last turn and the latest deadline of `items`."""
    return max(item.turn for item in items), max(item.deadline for item in items)


def _made_cost(item: WorkItem, made: int) -> int:
    """The cost of what `item` ran, having made `made` new tokens: its prompt and those.
    A sequence that ended early (its end of sequence, a stop) is timed for the tokens it
    made, not the most it asked: timed for those, the short answers of a chat model made
    a full one look short, and sequences admitted to run past their deadline filled the
    rows (of a flood of 1 s chats, 600 of 763 sent ran to their 504)."""
    unmade = max(item.new_tokens - made, 0) * item.rows
    return max(item.cost - unmade, 1)


def _told(batch: Sequence[WorkItem], made: Sequence[int] | None) -> Sequence[int] | None:
    """`made`, where the worker told it of every item of `batch`; else None."""
    return made if made is not None and len(made) == len(batch) else None


def _ran(
    batch: Sequence[WorkItem], flight: InFlight, made: Sequence[int] | None
) -> tuple[int, int]:
    """The padded and unpadded cost of what `batch` (sent as `flight`) ran: with the
    new tokens its generations `made` (`_told`), where the worker says, else all they
    asked."""
    if made is None:
        return flight.cost, flight.tokens
    costs = [_made_cost(item, count) for item, count in zip(batch, made, strict=True)]
    return padded_cost(costs), sum(costs)


def _most_made(batch: Sequence[WorkItem], made: Sequence[int] | None) -> int:
    """The most new tokens a sequence of `batch` made, where the worker says (`made`,
    `_told`), else the most one asked for."""
    if made is not None:
        return max(made)
    return max(item.new_tokens for item in batch)


class QueueFull(Exception):
    """Refused at admission: the queue bound is hit. Retry in `retry_after` seconds."""

    reason = "queue full"

    def __init__(self, retry_after: float):
        super().__init__(self.reason)
        self.retry_after = retry_after


class DeadlineUnreachable(QueueFull):
    """Refused at admission: the work queued ahead would outlast the request's deadline."""

    reason = "the work queued ahead would outlast the request's deadline"


class OwnTimeUnreachable(DeadlineUnreachable):
    """Refused at admission by a busy continuous worker: the sequence's own new tokens
    (those it will likely make), at the pace beside the rows it would share, would not
    end by its deadline, with no work ahead of it to blame (a row may be free for it)."""

    reason = (
        "at the pace of the sequences running now, the new tokens it asks for would not all "
        "come before its deadline: ask for fewer, or retry when it is less busy"
    )


class NeverAdmissible(Exception):
    """Refused at admission for good: more items than the queue can ever hold."""

    def __init__(self, items: int, most: int, max_queue: int):
        # (past the queue, the rows of workers that take one item at a time: the number
        # said is the one that holds, the option the one a deployer sets)
        rows = most - max_queue
        running = f" and the {rows} rows its workers run" if rows else ""
        super().__init__(
            f"{items} inputs in one request; this server takes at most {most} "
            f"(--max-queue {max_queue}{running})"
        )
        self.items = items
        self.most = most


@dataclass
class InFlight:
    sent: float
    items: int
    cost: int  # padded cost
    tokens: int  # unpadded
    predicted: float  # seconds, 0 before any measurement (re-judged: `_repace`)
    row_seconds: float = 0.0  # the core's `_row_seconds` when it was sent
    # a continuous worker's sequence: the rows its end was last judged beside (None:
    # a batch, or a prompt only scored, whose time does not follow the rows), and when
    # its row frees at the latest (its deadline ends it at the next step)
    paced_rows: int | None = None
    freed_by: float = math.inf

    @property
    def end(self) -> float:
        return self.sent + self.predicted


@dataclass(frozen=True)
class InFlightWait:
    """What the batches in flight leave of the workers' time: `then(work)` is the
    seconds until `work` (seconds shared out among the workers, as the cost model's
    drains give them) is done behind them. Where each batch runs on a worker of its own,
    work goes to whichever worker frees first, the idle ones at once (a water level
    over their free times): shared out as a whole, one worker's 4.5 s batch made a
    short request with a 2 s deadline a 503 while the other worker sat idle."""

    shared: float  # the batches' seconds left, shared out among the workers
    free_in: list[float] | None = None  # each worker's seconds till free, rising

    def then(self, work: float) -> float:
        if not self.free_in:
            return self.shared + work
        total = work * len(self.free_in)
        taken = level = 0.0
        for filled, free in enumerate(self.free_in, 1):
            taken += free
            level = (total + taken) / filled
            if filled < len(self.free_in) and level <= self.free_in[filled]:
                break  # (the workers free later than this take none of it)
        return level


@dataclass
class Decision:
    """What the driver does now: answer these 504, send these batches, look again then."""

    expired: list[WorkItem]
    batches: list[list[WorkItem]]
    wake_at: float | None


# The most new tokens (or rows) a count is taken for: more than any model's positions,
# and few enough that their squares stay far from a float's range in the cost model
# (a max_new_tokens of 1e300 overflowed its fit and left every later request a 504).
MOST_COUNTED = 1 << 20


def decoding(params: Mapping[str, Any], new_tokens: int = 0, beams: int = 1) -> tuple[int, int]:
    """The new tokens a generation may add and the rows it decodes at each step: what it
    asked (among its parameters or in the Inference API's `generate_parameters`), else the
    model's own defaults (`new_tokens`, `beams`: its generation config's or the
    pipeline's). A beam search decodes its beams, and at least the sequences it returns:
    counted as one row, a summary of 8 beams took one turn and one item's share of the
    deadline for 8 times the decoding. A chat naming no `max_tokens` runs to the model's
    default length: counted as no new tokens, it looked like a short encoder call."""
    asked = _asked(params)
    most = _count(asked.get("max_new_tokens"), -1)
    if most < 0:  # transformers 4's total length, else the model's default
        most = _count(asked.get("max_length"), 0) or new_tokens
    rows = max(
        _count(asked.get("num_beams"), 0) or beams, _count(asked.get("num_return_sequences"), 1)
    )
    return most, rows


def fewest_new_tokens(params: Mapping[str, Any], most: int) -> int:
    """The new tokens a generation asking for at most `most` makes whatever the model
    writes: its `min_new_tokens` (its end of sequence and its stop sequences held back
    till then), all of them with `ignore_eos` where no stop sequence may end it sooner;
    none with a grammar (which says itself when the end may come). (Timed by the likely
    length of others' answers, 4,000 tokens asked with `ignore_eos`, as benchmark clients
    send them, were taken for 22 and held a row to their 504.)"""
    asked = _asked(params)
    if asked.get("grammar") is not None:
        return 0
    if asked.get("ignore_eos") is True and not asked.get("stop"):
        return most
    return min(_count(asked.get("min_new_tokens"), 0), most)


def _asked(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """A request's parameters, with those in the Inference API's `generate_parameters`,
    which win, as the worker reads them (it runs what they ask)."""
    nested = params.get("generate_parameters")
    return {**params, **nested} if isinstance(nested, Mapping) else params


def _count(value: Any, default: int) -> int:
    """A count a request names, or `default` where it names none (or none a generation
    would take: a handler's parameters are its own, checked by no route), at most
    MOST_COUNTED."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    if not math.isfinite(value) or value != int(value):
        return default
    return min(int(value), MOST_COUNTED)


@dataclass
class SchedulerCore:
    """The queue and the batching rules; no I/O, no clock of its own."""

    max_queue: int = 256
    max_batch_size: int = 32
    max_batch_delay: float = 0.0  # seconds a free worker may wait, from the oldest item
    max_batch_tokens: int | None = None
    group_lengths: bool = True  # cost-aware batching: similar lengths share a batch
    workers: int = 1
    # `workers` once every worker is ready (one restarting counted as its peers): what
    # bounds a request for good (`most_admitted`); 0: as `workers`
    rows_when_ready: int = 0
    # the rows (batches of one) the workers could still take after the driver's last
    # look had sent what it sends: none of a dead or restarting worker
    free_rows: int = 0
    # of those workers, the ones that run no sequence (after the same look): a sequence
    # sent now runs alone on one
    empty_workers: int = 0
    cost_model: CostModel = field(default_factory=CostModel)
    # a continuous worker's sequences: the tokens they likely make, their seconds a token
    answer_lengths: AnswerLengths = field(default_factory=AnswerLengths)
    pace: SequencePace = field(default_factory=SequencePace)
    batch_cap: int | None = None  # the workers' own, lower after out-of-memory errors
    # --batch-timeout: a batch predicted to run past it is not made (`_limits_for`)
    max_call_seconds: float | None = None
    _queues: dict[str, list[WorkItem]] = field(default_factory=dict)
    _minima: dict[str, QueueMinima[WorkItem]] = field(default_factory=dict)  # per key
    _size: int = 0
    _queued_cost: int = 0  # the queued items' costs, summed as they come and go
    _queued_new_tokens: int = 0  # the new tokens they ask, summed so
    _queued_fewest: int = 0  # and those they make whatever the model writes
    # at least the latest turn and deadline queued (exact since the queue was last empty)
    _queued_bounds: tuple[int, float] = NO_BOUNDS
    _seq: itertools.count = field(default_factory=itertools.count)
    _in_flight: dict[int, InFlight] = field(default_factory=dict)
    _in_flight_predicted: float = 0.0  # their predicted seconds, summed as they come and go
    # when each is predicted back (sent + predicted), kept sorted: a continuous worker has
    # a batch in flight per row, and admission reads when the next rows free at every
    # request (sorted afresh each time, 128 rows took a tenth of an overloaded server)
    _in_flight_ends: list[float] = field(default_factory=list)
    _paced_rows: int = 1  # the rows the running sequences' ends were last judged beside
    # the batches in flight counted over time (their number times the seconds), to when:
    # a sequence's rows beside it on average are the growth of this over its time
    _row_seconds: float = 0.0
    _rows_counted_to: float | None = None
    # Items answered a second while the model had work in flight, every worker's
    # together (smoothed over RATE_WINDOW windows): the replica's service rate under load,
    # for reports. (One batch's items over its time was one worker's rate, and a
    # continuous worker's one sequence's, not the replica's.)
    items_per_second: float | None = None
    _busy_seconds: float = 0.0  # with anything in flight, counted with the rows
    _window_items: int = 0  # answered in the window under way
    _window_from: float = 0.0  # its start, in busy seconds
    tokens_per_estimate: float = 1.0  # real tokens per estimated token, learned from workers
    # an input's estimated tokens, as its task weighs it (an image: by its pixels)
    estimate: Callable[[Any], int] = estimate_tokens
    max_input_tokens: int | None = None  # the model reads no more (it truncates): cost cap
    # what a generation naming no length or beams makes (the model's defaults, ModelLimits)
    default_new_tokens: int = 0
    default_beams: int = 1
    _turn: int = 0  # the fair-share turn being served: the latest turn sent to a worker
    # the queued items of requests at risk of their deadlines, earliest deadline first,
    # which go before the fair turns (`_judge_risk`), and when they were last judged
    _at_risk: deque[WorkItem] = field(default_factory=deque)
    _risk_judged: float = -math.inf
    _listed: int = 0  # queued items of lists (only lists are judged at risk)
    # the sequence taken to learn how long answers run, where they ran past every length
    # (`_probes_length`), while it is queued or running
    _length_probe: WorkItem | None = None
    # the request whose items alone are queued or running, if any (None: none, or
    # several): its `n` choices come one admission each, and the first must not make the
    # rows busy for the others. Told by its id and its deadline: a client's X-Request-Id
    # may name many requests, but not with one deadline to the nanosecond
    _sole_request: tuple[str, float] | None = None

    def __len__(self) -> int:
        return self._size

    def queued_tokens(self) -> int:
        """Estimated tokens waiting (each item's cost), read by the metrics at scrape time."""
        return self._queued_cost

    @property
    def max_size(self) -> int:
        """Items per batch: --max-batch-size, or fewer where the backend caps it."""
        return min(self.max_batch_size, self.batch_cap or self.max_batch_size)

    @property
    def bound(self) -> int:
        """The most items queued at once: `max_queue`, and as many more as one-item
        workers' free rows take at the next look (`free_rows`, a continuous worker's;
        they wait for nobody). Counted against the bound, a burst read in one pass of
        the event loop was refused "queue full" beside free rows (a queue of 8 and 8
        free rows took 9 of a burst of 20)."""
        if self.max_size != 1:
            return self.max_queue
        return self.max_queue + self.free_rows

    @property
    def most_admitted(self) -> int:
        """The most items one request may ever be admitted with: the queue, and the rows
        of workers that take one item at a time (all of them: `bound` counts them only
        while free; a worker restarting counted as ready: it will take its rows again).
        A request past it can never be taken; one within it may wait."""
        rows = max(self.workers, self.rows_when_ready)
        return self.max_queue + (rows if self.max_size == 1 else 0)

    @property
    def limits(self) -> BatchLimits:
        return BatchLimits(self.max_size, self.max_batch_tokens, self.group_lengths)

    def new_item(
        self,
        value: Any,
        params: Mapping[str, Any],
        deadline: float,
        now: float,
        control: Control = NO_CONTROL,
        request_id: str = "",
    ) -> WorkItem:
        cost = max(1, round(self.estimate(value) * self.tokens_per_estimate))
        # what the model reads of it: cut at its limit, read once per label, per window
        cost = model_tokens(value, params, cost, self.max_input_tokens)
        # a generation also costs a decoding step per new token it asks for: the measured
        # seconds per token then admit, refuse and size by the work asked, not by the prompt
        new_tokens, rows = decoding(params, self.default_new_tokens, self.default_beams)
        cost += new_tokens * rows
        key = batch_key(params)
        if control != NO_CONTROL:  # a stream never shares a batch; nor do two routes
            key += repr(control)
        return WorkItem(
            input=value,
            params=params,
            control=control,
            key=key,
            deadline=deadline,
            arrived=now,
            cost=cost,
            seq=next(self._seq),
            new_tokens=new_tokens,
            rows=rows,
            fewest_new_tokens=fewest_new_tokens(params, new_tokens),
            request_id=request_id,
        )

    # --- admission ----------------------------------------------------------------------

    def admit(self, items: Sequence[WorkItem], now: float | None = None) -> None:
        """Queue all of `items` or none of them (a list request is admitted whole), each
        with the next fair-share turn from the one being served.

        Raises NeverAdmissible for more items than the queue holds, QueueFull over the
        queue bound, and DeadlineUnreachable (given `now`) when the work queued ahead,
        at the measured speed, would end after the items' deadline (never when nothing
        is queued ahead: the items' own cost alone is no reason to send them away), or
        OwnTimeUnreachable where a continuous worker's pace refuses sequences for their
        own length, not for the work ahead.
        """
        most = self.most_admitted  # (a request no bound could take)
        if len(items) > most:
            raise NeverAdmissible(len(items), most, self.max_queue)
        if self._size + len(items) > self.bound:
            raise QueueFull(self.retry_after(now))
        # the turn after the one being served: an input a batch left behind (unlike its
        # partners in length) keeps the turn it had, and later arrivals go after it, not
        # before it by their earlier deadlines until it is urgent (9.3 s of a 10 s wait)
        for item in items:
            item.turns = self._turns(item)
            item.request = items[0].seq
            item.listed = len(items) > 1
        _take_turns_from(self._turn, items)
        misses = now is not None and bool(items) and self._misses_deadline(items, now)
        listed = len(items) > 1  # (a single costs those queued one item: it takes its turn)
        if now is not None and not misses and listed and self._delays_admitted(items, now):
            # fair turns yield to deadlines kept: behind every queued turn, a list delays
            # no one (interleaved, lists of 32 with 0.25 s deadlines each pushed the ones
            # before them past theirs: 504s for requests admitted, 200s for later ones)
            _take_turns_from(max(self._turn, self._queued_bounds[0]), items)
            misses = self._misses_deadline(items, now)
        request = _request_of(items)
        alone = not (self._in_flight or self._size)
        probe = False
        if now is not None and misses:
            deadline = min(item.deadline for item in items)
            if not self._continuous(items) or now + self._own_seconds(items) <= deadline:
                raise DeadlineUnreachable(self.retry_after(now))
            probe = self._probes_length(items)
            if not probe:
                raise OwnTimeUnreachable(self.retry_after(now))
            self._length_probe = items[0]
        # an idle continuous worker takes a request whatever its sequences' time (they may
        # end early), and sends every one of them so (a list of three was taken, and its
        # third waited beside free rows for the request's 504)
        idle = probe or (self._continuous(items) and not self._rows_busy(items))
        for item in items:
            item.taken_whatever_its_time = idle
        self._sole_request = request if alone or request == self._sole_request else None
        self._enqueue(items)

    def requeue(self, batch: Sequence[WorkItem], now: float) -> None:
        """A batch the workers could not take after all goes back to the queue, its items
        with their turns (a worker was taken since the pass looked: by an input that must
        run alone, which holds a continuous worker's new sequences until it has)."""
        self.forget_batch(batch, now)
        self._enqueue(batch)

    def _enqueue(self, items: Sequence[WorkItem]) -> None:
        for item in items:
            queue = self._queues.get(item.key)
            if queue is None:
                queue = self._queues[item.key] = []
                self._minima[item.key] = QueueMinima()
            # under steady load a new item's turn is the latest: it goes at the end
            if not queue or queue[-1].sort_key() < item.sort_key():
                queue.append(item)
            else:
                bisect.insort(queue, item, key=WorkItem.sort_key)
            item.queued = True
            self._minima[item.key].add(item)
            self._queued_cost += item.cost
            self._queued_new_tokens += item.new_tokens
            self._queued_fewest += item.fewest_new_tokens
        self._size += len(items)
        self._listed += sum(item.listed for item in items)
        last_turn, latest = _bounds(items)
        self._queued_bounds = (
            max(self._queued_bounds[0], last_turn),
            max(self._queued_bounds[1], latest),
        )

    def _misses_deadline(self, items: Sequence[WorkItem], now: float) -> bool:
        """Whether the work ahead of `items` (queued items with an earlier or equal turn and
        deadline, and the batches in flight) would make them miss their deadline, at the
        measured speed, when alone they would not (both with ADMIT_MARGIN). Items that
        cannot make it even alone are let through: the estimate is no proof, and no retry
        would help them (one that cannot go in time waits, and expires unsent). Nor is
        anything refused before the speed is trusted (`CostModel.trusted`)."""
        if self._continuous(items):
            return self.pace.trusted and self._waits_too_long_for_a_row(items, now)
        if not self.cost_model.trusted:
            return False
        deadline = min(item.deadline for item in items)
        own = [item.cost for item in items]
        max_size, workers = self.max_size, self.workers
        # Behind everything queued they would still make it (what is ahead is a part of
        # the queue; alone, then, too). Most admissions end here; only a deep queue is
        # looked into.
        if self._queue_ends_by(deadline, now, len(own), sum(own)):
            return False
        alone = self.cost_model.drain_seconds(own, max_size, workers)
        assert alone is not None  # measured, as trusted
        if now + ADMIT_MARGIN * alone > deadline:  # as with nothing ahead: not its cause
            return False
        ahead = [i.cost for i in self._queued_ahead(*_bounds(items))]
        with_ahead = self.cost_model.drain_seconds(ahead + own, max_size, workers)
        assert with_ahead is not None  # measured, as `alone` was
        return now + ADMIT_MARGIN * self._in_flight_wait(now).then(with_ahead) > deadline

    def _delays_admitted(self, items: Sequence[WorkItem], now: float) -> bool:
        """Whether `items`, in the turns they were given, would make a queued request
        whose items go after the first of them miss its deadline where without them it
        would have made it, at the measured speed, with ADMIT_MARGIN (as `_misses_deadline`
        judges the newcomers; a request with an item that would miss anyway is not
        theirs to keep). In O(keys) where everything queued, the newcomers too, ends
        before the earliest deadline queued; else in a pass over the items they go before."""
        if self._continuous(items) or not self.cost_model.trusted or not self._size:
            return False
        max_size, workers = self.max_size, self.workers
        if self._queue_in_time(now, len(items), sum(item.cost for item in items)):
            return False
        in_flight = self._in_flight_wait(now)
        first = min(item.sort_key() for item in items)
        behind = sorted(
            (
                queued
                for queue in self._queues.values()
                for queued in queue[bisect.bisect_right(queue, first, key=WorkItem.sort_key) :]
            ),
            key=WorkItem.sort_key,
        )
        # ahead of each item behind: every queued item not behind, those behind before
        # it, and (with the newcomers) the newcomers before it
        count = self._size - len(behind)
        cost = self._queued_cost - sum(item.cost for item in behind)
        newcomers = sorted(items, key=WorkItem.sort_key)
        before = before_cost = 0  # the newcomers before the item
        late: set[int] = set()  # requests with an item late even without the newcomers
        made_late: set[int] = set()  # requests with an item the newcomers would make late
        for queued in behind:
            while before < len(newcomers) and newcomers[before].sort_key() < queued.sort_key():
                before_cost += newcomers[before].cost
                before += 1
            count += 1
            cost += queued.cost
            without = self.cost_model.drain_seconds_of(count, cost, max_size, workers)
            assert without is not None
            if now + ADMIT_MARGIN * in_flight.then(without) > queued.deadline:
                late.add(queued.request)
                continue
            with_them = self.cost_model.drain_seconds_of(
                count + before, cost + before_cost, max_size, workers
            )
            assert with_them is not None
            if now + ADMIT_MARGIN * in_flight.then(with_them) > queued.deadline:
                made_late.add(queued.request)
        return bool(made_late - late)

    def _queue_in_time(self, now: float, count: int = 0, cost: int = 0) -> bool:
        """Whether everything queued, and `count` more items costing `cost`, ends before
        the earliest deadline queued: then no queued request can be late, in O(keys)."""
        earliest = min(minima.earliest_deadline().deadline for minima in self._minima.values())
        return self._queue_ends_by(earliest, now, count, cost)

    def _queue_ends_by(self, when: float, now: float, count: int = 0, cost: int = 0) -> bool:
        """Whether everything queued, and `count` more items costing `cost`, ends by
        `when` behind the batches in flight, at the measured speed with ADMIT_MARGIN."""
        everything = self.cost_model.drain_seconds_of(
            self._size + count, self._queued_cost + cost, self.max_size, self.workers
        )
        assert everything is not None  # measured, as trusted
        # the batches in flight take at most their whole predicted time: when even that
        # leaves room, what is left of it need not be summed (in O(1): a continuous
        # worker has hundreds of one-item batches in flight)
        most = self._in_flight_predicted / max(self.workers, 1)
        if now + ADMIT_MARGIN * (most + everything) <= when:
            return True
        return now + ADMIT_MARGIN * self._in_flight_wait(now).then(everything) <= when

    def _probes_length(self, items: Sequence[WorkItem]) -> bool:
        """Whether `items`, refused for their own time, are rather taken to learn how long
        answers run: where more than a tenth of those kept ran to their caps (or to their
        deadlines), a sequence is timed by all it asks, and refused beside any busy row
        while it asks more than its deadline allows; refused, it never says that it would
        have ended early. One sequence at a time, that may end early, is taken whatever
        its time while more than half the rows stay free. (Beside a job whose answers ran
        to their cap of 20 tokens on two rows, 42 of 44 chats asking 2,000 tokens in 1.5 s,
        ending at 2-6, were refused; taken one at a time, 2,837 were answered, 3 refused.)"""
        probe = self._length_probe
        if probe is not None and (probe.queued or probe.seq in self._in_flight):
            return False
        if len(items) != 1 or self.answer_lengths.within() != math.inf:
            return False
        rows_taken = len(self._in_flight) + self._size + 1
        # (one that must make tokens whatever it writes says nothing of how long answers run)
        return not items[0].fewest_new_tokens and 2 * rows_taken < self.workers

    def _continuous(self, items: Sequence[WorkItem]) -> bool:
        """Whether `items` are sequences on a continuous worker's rows."""
        return self.max_size == 1 and all(item.new_tokens for item in items)

    def _own_seconds(self, items: Sequence[WorkItem]) -> float:
        """The seconds `items`' sequences, each on a row of its own, are judged to need
        at admission (`_own_time`), beside the rows that will likely run then: those
        running, the queued ones and theirs, as many as there are rows."""
        rows = min(len(self._in_flight) + self._size + len(items), self.workers)
        return self._own_time(items, rows)

    def _own_time(self, items: Sequence[WorkItem], rows: float) -> float:
        """The seconds `items`' sequences are judged to need beside `rows` rows: the
        longest predicted time of the tokens they will likely make, with DEADLINE_MARGIN
        (as admission and the send both judge it: admitted by its time alone, one whose
        row freed as predicted could no longer be sent, and waited queued for its 504).
        Nothing for a stream (it is sent what is made in time), for one taken whatever its
        time, or for one whose likely length is not known yet."""
        if any(item.control != NO_CONTROL or item.taken_whatever_its_time for item in items):
            return 0.0
        seconds = 0.0
        for item in items:
            made = self._likely_made(item)
            if made is not None:
                seconds = max(seconds, self.pace.predict(made, rows) or 0.0)
        return DEADLINE_MARGIN * seconds

    def _likely_made(self, item: WorkItem) -> int | None:
        """The new tokens `item`'s sequence will likely make: as others' answers say, but
        no fewer than it makes whatever the model writes; None where neither says."""
        likely = self.answer_lengths.likely(item.new_tokens)
        if likely is None:
            return item.fewest_new_tokens or None
        return max(likely, item.fewest_new_tokens)

    def _flight_seconds(self, batch: Sequence[WorkItem], rows: float) -> float:
        """The predicted time of `batch`'s sequences, sent beside `rows` rows: of the
        tokens they will likely make, else (not known yet) of all they ask."""
        return max(
            self.pace.predict(self._likely_made(item) or item.new_tokens, rows) or 0.0
            for item in batch
        )

    def _waits_too_long_for_a_row(self, items: Sequence[WorkItem], now: float) -> bool:
        """`_misses_deadline` for sequences on a continuous worker's rows. A sequence runs
        on a row of its own, a step at a time, its own predicted time whole (the rows share
        out the queue, not a sequence); it starts when a row is free for it: at once while
        rows are free, else once as many rows have freed as sequences are queued ahead of
        it, the running ones freeing theirs as predicted. (Counted as the queue's work
        shared out among the rows, a 128-token answer looked as if it took a 128th of its
        time: admitted behind full rows, it waited for one, and ended in 504 after holding
        it for seconds.) One that could not end in time at the pace beside the rows that
        will run with it is refused too (`_own_seconds`): more rows would go no faster (on
        a CPU, slower), and its retry may find the worker less busy. (Taken while half
        the rows were free, on a loaded 2-core machine most held a row to their 504.) With
        nothing running or queued, it is taken whatever its time (`_rows_busy`)."""
        if not self._rows_busy(items):
            return False
        own = self._own_seconds(items)
        turn, latest = _bounds(items)
        deadline = min(item.deadline for item in items)
        return self._too_late_for_rows(len(items), own, deadline, turn, latest, now)

    def _too_late_for_rows(
        self,
        rows: int,
        own: float,
        deadline: float,
        turn: int,
        latest: float,
        now: float,
    ) -> bool:
        """Whether sequences needing `rows` rows and `own` seconds on them, due at
        `deadline`, whose last turn is `turn` and latest deadline `latest`, would end
        after it behind the queued sequences that go before them (with ADMIT_MARGIN on
        the wait for the rows), the rows busy (`_rows_busy`). The wait grows with the
        sequences ahead, and so does the miss: behind the whole queue they may still
        make it (most admissions end there, in O(1)); else, where every queued one goes
        before them (under steady overload with one timeout, the common case), they miss
        it, known in O(1) too (a deep queue is not walked at each refusal); else those
        ahead are counted."""

        def misses(ahead: int) -> bool:
            return now + ADMIT_MARGIN * self._row_wait(ahead, rows, now) + own > deadline

        if not misses(self._size):
            return False
        last_turn, latest_deadline = self._queued_bounds
        if last_turn <= turn and latest_deadline <= latest:  # every queued one goes first
            return True
        return misses(sum(1 for _ in self._queued_ahead(turn, latest)))

    def _rows_busy(self, items: Sequence[WorkItem] = ()) -> bool:
        """Whether sequences on a continuous worker's rows may be refused for the wait for
        a row or their own time: not with nothing running or queued (no row shared: their
        own time is no reason; they may end early), nor with a worker running none and
        nothing queued to go first (one sequence on one worker of two had the next refused
        by its own time, the other worker idle), nor (`items`, being admitted) with only
        their own request's other sequences (its `n` choices, each admitted on its own:
        on an idle server the second was refused 503, busy, where n=1 was taken)."""
        if not (self._in_flight or self._size):
            return False
        if self.empty_workers and not self._size:  # (they go to it, alone)
            return False
        request = _request_of(items)
        return request is None or request != self._sole_request

    def _row_wait(self, queued_ahead: int, rows: int, now: float) -> float:
        """Seconds until `rows` rows of a continuous worker are free for sequences with
        `queued_ahead` sequences queued before them, the running ones freeing theirs as
        predicted, then rows freeing at their average pace: what admission reads, a
        bound rather than a likely wait (`_likely_row_wait`), since the queued ones start
        only once every running one has ended, each at the running ones' average time
        (the long ones: short ones leave first). (Read as the likely wait, in a simulated
        overload whose rows slowed by a quarter once their pace was learned, 5-10
        admitted requests expired queued against none.) With none running yet, the queued
        ones on the free rows start together and end first, at a queued sequence's time
        (a burst of 16 on 8 free rows, read in one pass before the first send, was
        admitted whole, as if nothing were ahead: 7 expired queued, where 8 more a pass
        later were refused)."""
        running = len(self._in_flight)
        needed = queued_ahead + rows - max(self.workers - running, 0)  # rows to free first
        if needed <= 0:
            return 0.0
        ends = self._expected_ends(now)
        if needed <= len(ends):
            return max(0.0, ends[needed - 1] - now)
        if not ends:  # (a burst read before the first send: the first rows run queued ones,
            # starting together, and free together, a lap at a time)
            return (1 + (needed - 1) // max(self.workers, 1)) * self._queued_sequence_seconds()
        pace = self._in_flight_predicted / running
        later = needed - len(ends)
        return max(0.0, ends[-1] - now) + later * pace / max(self.workers, 1)

    def _likely_row_wait(self, queued_ahead: int, now: float) -> float:
        """Seconds until a row of a continuous worker is likely free for a sequence with
        `queued_ahead` sequences queued before it: the rows free as the running ones end
        (`_expected_ends`), and each then runs queued sequences one after another, in
        turn, each taking a queued sequence's likely time (`_queued_sequence_seconds`).
        What a refusal says (Retry-After): read as admission's bound (`_row_wait`), it
        said 1.5 times the wait in a simulated overload, 1.9 times where half the answers
        ended early, and 3 to 6 times the queue's drain on a server."""
        running = len(self._in_flight)
        free = max(self.workers - running, 0)
        if queued_ahead < free:
            return 0.0
        ends = self._expected_ends(now)
        if not ends and not free:  # (no worker's rows: none to wait for)
            return 0.0
        laps, row = divmod(queued_ahead, free + len(ends))
        first = now if row < free else ends[row - free]
        return max(0.0, first - now) + laps * self._queued_sequence_seconds()

    def _queued_sequence_seconds(self) -> float:
        """The likely seconds of a queued sequence on a row, the rows full: of the new
        tokens the queued ones ask on average, as many as answers likely make, and no
        fewer than they make whatever the model writes (`ignore_eos`, `min_tokens`: a
        queue of those, where answers were learned to end early, was timed as answers of
        a few tokens, and told clients to come back in a second for a 6-12 s wait). In
        O(1): read at every refusal under overload."""
        if not self._size:
            return 0.0
        asked = round(self._queued_new_tokens / self._size)
        likely = self.answer_lengths.likely(asked)
        made = max(asked if likely is None else likely, round(self._queued_fewest / self._size))
        return self.pace.predict(made, self.workers) or 0.0

    def _expected_ends(self, now: float) -> list[float]:
        """When the running sequences likely end, in order: as predicted, but for those
        past their predicted end (their rows slower than measured, a CPU shared with
        other work), each taken to run late again by as long as it has so far (a step at
        least), and no later than its row frees by its deadline. (Taken to be free at
        once, rows that ran on for seconds admitted requests that waited for them to
        their 504.)"""
        ends = self._in_flight_ends
        overdue = bisect.bisect_right(ends, now)
        if not overdue:
            return ends
        step = self.pace.step_seconds(len(self._in_flight)) or 0.0
        late = [
            min(now + max(now - flight.end, step), flight.freed_by)
            for flight in self._in_flight.values()
            if flight.end <= now
        ]
        return sorted(late + ends[overdue:])

    def refuses_any_sequence(self, deadline: float, now: float) -> bool:
        """Whether a sequence due at `deadline` (sent to a continuous worker's rows)
        would be refused now for the wait for its row alone, whatever it asks: what a
        request's head is checked for before its body is read. Its own time counts as
        nothing and only the queued sequences that go before any new one count ahead
        (their turn at most the next one, their deadline no later), so a request refused
        here would be refused as `_waits_too_long_for_a_row` reads it whole: under
        overload most requests are, and reading, templating and tokenizing each first
        took a third of the server's time from the rows. Only for a model that generates
        (its requests make new tokens by default; one asking none, a prompt only scored,
        is refused with them, as busy); never on a batching worker."""
        if not self._generates_on_rows() or not self._rows_busy():
            return False
        return self._too_late_for_rows(1, 0.0, deadline, self._turn + 1, deadline, now)

    def _generates_on_rows(self) -> bool:
        """A continuous worker's rows for a model that generates, their pace measured."""
        return self.max_size == 1 and bool(self.default_new_tokens) and self.pace.trusted

    def _queued_ahead(self, last_turn: int, latest: float) -> Iterator[WorkItem]:
        """The queued items that go before items whose last turn is `last_turn` and latest
        deadline `latest`: an earlier or equal turn and deadline."""
        for queue in self._queues.values():
            for queued in queue:
                if queued.turn <= last_turn and queued.deadline <= latest:
                    yield queued

    def _judge_risk(self, now: float) -> None:
        """Which queued requests go first (`_at_risk`): those that, served in fair turns at
        the speed measured now, would end after their deadlines (with ADMIT_MARGIN), and
        that served earliest deadline first among them still make them. Admission keeps
        every request it takes in time at the speed it measured; batches slower than that
        make the ones it took at the edge late, and in fair turns lists interleave, so
        that they all end together, all late, where one after another most would make
        it (lists of 32 due 1 s after they came, 5 ms apart, on two workers whose calls
        took 10 % longer than measured: 15 of 17 admitted late; earliest deadline first
        among those at risk, 2). Requests that cannot make it either way keep their turns."""
        self._risk_judged = now
        self._at_risk.clear()
        if not self.cost_model.trusted or not self._size or self._queue_in_time(now):
            return  # (most looks end here)
        max_size, workers = self.max_size, self.workers
        in_flight = self._in_flight_wait(now)

        def late(count: int, cost: int, deadline: float) -> bool:
            drain = self.cost_model.drain_seconds_of(count, cost, max_size, workers)
            assert drain is not None
            return now + ADMIT_MARGIN * in_flight.then(drain) > deadline

        queued = list(heapq.merge(*self._queues.values(), key=WorkItem.sort_key))
        ends: dict[int, tuple[int, int]] = {}  # the turns up to each request's last item
        cost = 0
        for count, item in enumerate(queued, 1):
            cost += item.cost
            ends[item.request] = (count, cost)
        at_risk: dict[int, list[WorkItem]] = {}
        for item in sorted(queued, key=BY_DEADLINE):  # (a request's items in turn order)
            request = at_risk.get(item.request)
            if request is not None:
                request.append(item)
            elif item.request in ends and late(*ends.pop(item.request), item.deadline):
                at_risk[item.request] = [item]
        count = cost = 0
        for items in at_risk.values():  # earliest deadline first, while each makes its own
            own = sum(item.cost for item in items)
            if not late(count + len(items), cost + own, items[0].deadline):
                self._at_risk += items
                count, cost = count + len(items), cost + own

    def _first_at_risk(self, key: str, now: float) -> list[WorkItem]:
        """The items of `key` that go first, being of requests at risk (`_judge_risk`),
        earliest deadline first: at most a few batches of them."""
        while self._at_risk and not self._at_risk[0].queued:  # (sent or gone)
            self._at_risk.popleft()
        first: list[WorkItem] = []
        for item in self._at_risk:
            if len(first) >= PLAN_WINDOW * self.max_size:
                break
            if item.queued and item.key == key and self._can_finish(item, now):
                first.append(item)
        return first

    def _in_flight_wait(self, now: float) -> InFlightWait:
        """What the batches in flight leave of each worker's time (`InFlightWait`)."""
        ends = self._in_flight_ends
        first = bisect.bisect_right(ends, now)  # the ones not due yet
        workers = max(self.workers, 1)
        if len(ends) > workers:  # (a worker's next batch sent ahead, or a worker's rows)
            left = math.fsum(ends[first:]) - now * (len(ends) - first)
            return InFlightWait(max(0.0, left) / workers)
        busy = [end - now for end in ends[first:]]
        return InFlightWait(math.fsum(busy) / workers, [0.0] * (workers - len(busy)) + busy)

    def retry_after(self, now: float | None = None) -> float:
        """Seconds until the current queue has likely drained, at the measured speed; on
        a continuous worker's rows, until a row is likely free for a sequence queued
        behind them all (the queue's work shared out among the rows told a client to
        come back in 2 s where the rows were busy for 30)."""
        if now is not None and self._generates_on_rows():
            return max(1.0, self._likely_row_wait(self._size, now))
        # O(1): a full queue refuses every request with this, under overload
        drain = self.cost_model.drain_seconds_of(
            self._size, self._queued_cost, self.max_size, self.workers
        )
        if drain is None:
            return 1.0
        if now is not None:
            drain = self._in_flight_wait(now).then(drain)
        return max(1.0, drain)

    # --- the queue ----------------------------------------------------------------------

    def remove(self, item: WorkItem) -> None:
        """Take an item out of the queue (withdrawn, expired); harmless if already out."""
        if not item.queued:
            return
        queue = self._queues[item.key]
        queue.pop(bisect.bisect_left(queue, item.sort_key(), key=WorkItem.sort_key))
        item.queued = False
        self._removed(item.key, queue, [item])

    def _take(self, queue: list[WorkItem], batch: list[WorkItem], window: int) -> None:
        """Take a batch out of its key's queue: the members among its first `window`
        items (where a batch is chosen) in one pass over those, not a search and a
        shift of the list each; a member from beyond them (the earliest deadline) alone."""
        for item in batch:
            item.queued = False
        front = queue[:window]
        kept = [item for item in front if item.queued]
        queue[:window] = kept
        if len(front) - len(kept) < len(batch):  # some were further back
            for item in batch:
                index = bisect.bisect_left(queue, item.sort_key(), key=WorkItem.sort_key)
                if index < len(queue) and queue[index] is item:
                    del queue[index]
        self._removed(batch[0].key, queue, batch)

    def _removed(self, key: str, queue: list[WorkItem], items: Sequence[WorkItem]) -> None:
        """The books after `items` left `key`'s `queue`."""
        self._size -= len(items)
        self._queued_cost -= sum(item.cost for item in items)
        self._queued_new_tokens -= sum(item.new_tokens for item in items)
        self._queued_fewest -= sum(item.fewest_new_tokens for item in items)
        self._listed -= sum(item.listed for item in items)
        if not self._size:
            self._queued_bounds = NO_BOUNDS
        if queue:
            self._minima[key].after_removal(queue)
        else:
            del self._queues[key], self._minima[key]

    def drop_expired(self, now: float) -> list[WorkItem]:
        """Remove and return the queued items whose deadline has passed, each once (an
        item queued again, a batch the pool could not take, has an entry of its first
        stay beside its new one: it was answered and counted twice)."""
        found = [item for minima in self._minima.values() for item in minima.expired(now)]
        expired = list({id(item): item for item in found}.values())
        for item in expired:
            self.remove(item)
        return expired

    # --- batching -----------------------------------------------------------------------

    def decide(self, now: float, free_workers: int) -> Decision:
        """One look at the queue: what expired, what to send now to the `free_workers`
        (each batch marked in flight), when to look again.

        Keys are tried in fair-share order of their heads; a key's batch goes when it is
        full or when its oldest item has waited `max_batch_delay`. Its head is the item
        whose turn comes first, unless one is close to its deadline: the earliest such
        deadline leads. Expired items never go, nor (once the cost model is trusted)
        inputs that cannot be computed before their deadline even alone: they stay
        queued until they expire, unless no model call runs and none can (`_probe`).
        A generation goes while its deadline is ahead.
        """
        expired = self.drop_expired(now)
        batches: list[list[WorkItem]] = []
        # The keys in fair-share order of their heads, in a heap for the whole pass: a
        # key whose batch is not ready stays so for the pass (same queue, same `now`),
        # and one that gave a batch goes back with its new head. (Sorting every key for
        # every batch made a pass quadratic: 256 one-item batches of 256 keys took 34 ms.)
        order = [(queue[0].sort_key(), key) for key, queue in self._queues.items()]
        heapq.heapify(order)
        while order and len(batches) < free_workers:
            _, key = heapq.heappop(order)
            batch = self._batch_from(self._queues[key], now)
            if batch is None:
                continue
            batches.append(batch)
            if key in self._queues:
                heapq.heappush(order, (self._queues[key][0].sort_key(), key))
        if free_workers and not batches:
            probe = self._probe(now)
            batches += [probe] if probe is not None else []
        return Decision(expired, batches, self.next_wakeup(now, free_workers - len(batches)))

    def _probe(self, now: float) -> list[WorkItem] | None:
        """With no model call running and nothing queued that the estimate lets finish
        in time, the cheapest item still in time runs alone: held, every item would wait
        beside idle workers for its 504, and the estimate that holds them would never be
        measured again (one slow first call, 3 s where the next took 10 ms, kept every
        request with a 1 s deadline queued for good). Its time corrects the estimate,
        or confirms it at the cost of one item on a worker that had nothing to do."""
        if self._in_flight or not self._queues:
            return None
        queued = [(item, queue) for queue in self._queues.values() for item in queue]
        if any(self._can_finish(item, now) for item, _ in queued):
            return None  # (they go when their batch's wait ends)
        alive = [(item, queue) for item, queue in queued if item.deadline > now]
        if not alive:
            return None
        item, queue = min(alive, key=lambda pair: (pair[0].cost, pair[0].sort_key()))
        return self._send(queue, [item], 0, now)

    def _batch_from(self, queue: list[WorkItem], now: float) -> list[WorkItem] | None:
        """One key's batch (marked in flight), or None to wait: `decide`'s rules for `queue`.

        The batch is chosen among the first items in turn order (a window a few batches
        long) and the item with the earliest deadline wherever it waits: a pass over a
        deep queue costs the same as over a short one (a queue of 256 for 256 one-item
        batches took 112 ms a pass when every batch looked at every item)."""
        window_size = max(CANDIDATE_WINDOW, PLAN_WINDOW * self.max_size)
        window = queue[:window_size]
        viable = [item for item in window if self._can_finish(item, now)]
        if first := self._first_at_risk(queue[0].key, now):  # they go now, whatever the wait
            hurried = set(map(id, first))
            # partners due no sooner than they are: the batch's time is bounded by theirs
            # (a single due in 0.5 s joined six due in 2 s, in a call predicted at 0.71 s)
            due = min(item.deadline for item in first)
            partners = [i for i in viable if id(i) not in hurried and i.deadline >= due]
            viable = first + partners
            limits = self._limits_for(due, now)

            def urgent(item: WorkItem) -> bool:
                return id(item) in hurried or self._is_urgent(item, now)

            batch = choose_batch(viable, limits, urgent, self.cost_model)
            return self._send(queue, batch, window_size, now)
        minima = self._minima[queue[0].key]
        earliest = minima.earliest_deadline()
        soonest = min((item.deadline for item in viable), default=float("inf"))
        if earliest.deadline < soonest and self._can_finish(earliest, now):
            viable.append(earliest)
        if not viable and len(window) < len(queue):  # none of the first can make it
            viable = [item for item in queue if self._can_finish(item, now)]
        if not viable:
            return None
        pressing = min(viable, key=BY_DEADLINE)
        if pressing is not viable[0] and self._is_urgent(pressing, now):
            viable.remove(pressing)
            viable.insert(0, pressing)
        limits = self._limits_for(pressing.deadline, now)
        batch = choose_batch(
            viable, limits, lambda item: self._is_urgent(item, now), self.cost_model
        )
        waiting = now < self._wait_ends(minima)
        if waiting and not self._is_full(batch, len(viable), limits):
            return None
        return self._send(queue, batch, window_size, now)

    def _send(
        self, queue: list[WorkItem], batch: list[WorkItem], window: int, now: float
    ) -> list[WorkItem]:
        """`batch` out of its key's queue and in flight (`_take` has the `window`)."""
        self._take(queue, batch, window)
        self._turn = max(self._turn, self._served_turn(batch, queue))
        cost = padded_cost(item.cost for item in batch)
        rows, freed_by = None, math.inf
        if self._continuous(batch):
            rows = len(self._in_flight) + 1
            # (a sequence asking 4,000 tokens with 3 s left frees its row in 3 s: judged
            # by its tokens, 128 such rows answered a request fitting beside them 503,
            # told to come back in 250 s)
            step = self.pace.step_seconds(rows) or 0.0
            freed_by = max(item.deadline for item in batch) + step
            predicted = min(self._flight_seconds(batch, rows), max(0.0, freed_by - now))
        else:
            predicted = self.cost_model.predict(cost, len(batch)) or 0.0
        tokens = sum(item.cost for item in batch)
        self._count_rows(now)
        flight = InFlight(
            now, len(batch), cost, tokens, predicted, self._row_seconds, rows, freed_by
        )
        self._in_flight[batch[0].seq] = flight
        self._in_flight_predicted += predicted
        bisect.insort(self._in_flight_ends, flight.end)
        if rows is not None:
            self._repace(now)
        return batch

    def _repace(self, now: float) -> None:
        """Judge the running sequences' ends again at the pace of a step beside the rows
        running now, where it has changed by more than REPACE_CHANGE since they were last
        judged: what is left of each takes as many steps as judged, each as long as a
        step beside the rows now. (Each end was judged once, at its send: on a CPU, where
        a step's time grows with the rows, a wave of 128 sequences joining one at a time
        was predicted to end 15 times too soon, and a request admitted behind rows that
        could not free in time waited for its 504. Where rows leave, the rest end sooner.)"""
        rows = len(self._in_flight)
        step = self.pace.step_seconds(rows)
        judged = self.pace.step_seconds(self._paced_rows)
        if not rows or step is None or not judged or abs(step - judged) <= REPACE_CHANGE * judged:
            return
        self._paced_rows = rows
        for flight in self._in_flight.values():
            if flight.paced_rows is None or flight.paced_rows == rows:
                continue
            then = self.pace.step_seconds(flight.paced_rows)
            if then and flight.end > now:  # (one overdue is due now: its steps are unknown)
                end = min(now + (flight.end - now) * step / then, flight.freed_by)
                flight.predicted = end - flight.sent
            flight.paced_rows = rows
        self._in_flight_ends = sorted(flight.end for flight in self._in_flight.values())
        self._in_flight_predicted = math.fsum(f.predicted for f in self._in_flight.values())

    def _turns(self, item: WorkItem) -> int:
        """The fair-share turns an item takes: one, or one per full batch of the model's
        longest inputs it costs (a question-answering context of hundreds of windows, a
        zero-shot text with a hundred labels). At one turn each, short requests that came
        after a few such items waited for all of them (a tester: 9-17 s behind contexts
        of 2.3-3.7 s each, where one was about two batches' time)."""
        if self.max_input_tokens is None:
            return 1
        return max(1, -(-item.cost // (self.max_input_tokens * self.max_size)))

    @staticmethod
    def _served_turn(batch: list[WorkItem], queue: list[WorkItem]) -> int:
        """The turn a batch brings the queue to: its last, or the first left behind in its
        key's queue (`queue`, after the batch left it), whichever is earlier. Partners of
        a like length are taken from further back in the turns; counted as served, they
        put the next arrivals behind every turn they skipped (a single text waited for
        225 of a 256-item list's texts, of mixed lengths, where it should have waited
        for a handful). An item of several turns brings it to its first: the next
        arrivals go before its like queued behind it."""
        last = max(item.turn - item.turns + 1 for item in batch)  # where its turns start
        return min(last, queue[0].turn) if queue else last

    def _limits_for(self, deadline: float, now: float) -> BatchLimits:
        """The bounds of a batch: the configured ones, and (once the cost model is
        trusted) the seconds a call may take to come back before `deadline`, the
        earliest deadline among the candidates, so that every member is safe. Trusted,
        not fitted: under steady load every call has the same size, the model never
        sees two sizes, and without the bound batches went out too late to return in
        time (late answers and 504s at 3x overload). Each item costs its share of the
        call, `per_item` and `per_token` for each padded token: charged as a budget of
        tokens at both prices each, a call of 40-token items whose cost was all per item
        held 3 where 200 fit, and its requests, admitted at full batches' speed, got 504."""
        limits = self.limits
        model = self.cost_model
        if not model.trusted:
            return limits
        if model.per_item + model.per_token <= 0:
            # a call's fixed cost only is known (calls of one item, as a hung batch's items
            # make run again): each item taken at it, as far as the batch timeout goes (read
            # as a batch costing one item's, a batch of 18 was killed at every burst)
            if self.max_call_seconds is None or model.fixed <= 0:
                return limits
            seconds = self.max_call_seconds / DEADLINE_MARGIN
            return replace(limits, max_seconds=seconds, per_item=model.fixed)
        seconds = (deadline - now) / DEADLINE_MARGIN
        if self.max_call_seconds is not None:  # nor past the batch timeout: its worker
            # would be killed as hung (0.25 s an item and a 2 s timeout: every burst's
            # batch of 15 was, its items then run one by one)
            seconds = min(seconds, self.max_call_seconds / DEADLINE_MARGIN)
        seconds -= model.fixed
        return replace(
            limits, max_seconds=seconds, per_item=model.per_item, per_token=model.per_token
        )

    def _is_full(self, batch: list[WorkItem], candidates: int, limits: BatchLimits) -> bool:
        """No more items could join: the size bound or the token budget is reached."""
        if len(batch) + 1 > limits.widest(max(item.cost for item in batch)):
            return True
        return not limits.group_lengths and len(batch) < candidates

    def _can_finish(self, item: WorkItem, now: float) -> bool:
        """Whether the item alone could be answered by its deadline. A stream is given
        its chance (it sends what it makes until its deadline).

        A sequence on a continuous worker's rows is judged by the tokens it will likely
        make at the pace of a step beside the rows running with it (`_own_time`): one
        that cannot end by its deadline waits queued for its 504 rather than hold a row
        to it, slowing the rows beside it. With no row running, or admitted by an idle
        worker, it is sent whatever its time: alone, it is no reason to keep an idle
        worker idle (it may end early).
        (Sent whatever its time while half the rows were free, on a 2-core CPU sequences
        beside 64 rows took ~1 s for 150 tokens, and most of a flood of 1 s chats held
        rows to their 504s.)

        On a batching worker, a generation (or a prompt only scored on a continuous
        worker's rows, `_scored_on_rows`) is given its chance while half the workers are
        free: it may end at its first new token. Past that, an item that cannot end by
        its deadline at the measured speed waits for its 504. Nor is an item larger than
        any call measured: its time is an extrapolation from smaller calls, whose fixed
        costs it counts as if per token (a question-answering context of 440 windows,
        predicted past its 30 s deadline from short questions, waited for its 504 where
        it ran in 2.7 s)."""
        if item.deadline <= now:
            return False
        if item.control != NO_CONTROL and (item.new_tokens or self._scored_on_rows(item)):
            return True
        if self._continuous([item]):
            if not self.pace.trusted or not self._in_flight:
                return True
            return item.deadline > now + self._own_time([item], len(self._in_flight) + 1)
        if not self.cost_model.trusted:  # one call says little
            return True
        if (item.new_tokens or self._scored_on_rows(item)) and (
            len(self._in_flight) < self.workers / 2
        ):
            return True
        if item.cost > self.cost_model.largest:  # past every call measured: a guess
            return True  # run it once; its time is then measured
        alone = self.cost_model.predict(item.cost) or 0.0
        return item.deadline > now + DEADLINE_MARGIN * alone

    def _scored_on_rows(self, item: WorkItem) -> bool:
        """Whether `item` is a prompt only scored (max_new_tokens 0: echo, loglikelihood)
        on a continuous worker, where it is scored between the rows' steps: its cost is
        all prompt tokens, timed at the rows' pace of whole sequences (seconds a decoded
        token), so predicted far past what it takes (a tester's 4,000-token prompts, 0.2 s
        alone, waited on an idle worker for their 504s, and none ran to say otherwise)."""
        return self.max_size == 1 and item.params.get("max_new_tokens") == 0

    def _is_urgent(self, item: WorkItem, now: float) -> bool:
        if self._continuous([item]):
            alone = self._own_time([item], len(self._in_flight) + 1) / DEADLINE_MARGIN
        else:
            alone = self.cost_model.predict(item.cost) or 0.0
        return alone > 0 and item.deadline - now <= URGENT_BATCHES * alone

    def _wait_ends(self, minima: QueueMinima[WorkItem]) -> float:
        """When a free worker stops waiting for a key's batch to fill: `max_batch_delay`
        after its oldest item, or sooner, when half the time its most pressing item was
        given has passed. A delay longer than a request's deadline otherwise spent all of
        it beside an idle worker (a 504 with nothing else queued). Once speeds are known,
        a batch whose token budget leaves no room for another item goes before that
        (`_is_full`): an item that needs more than half its time goes when it comes."""
        delay_ends = minima.oldest().arrived + self.max_batch_delay
        if self.max_batch_delay <= 0:  # no wait to shorten (the default)
            return delay_ends
        pressing = minima.earliest_deadline()
        return min(delay_ends, pressing.arrived + (pressing.deadline - pressing.arrived) / 2)

    def next_wakeup(self, now: float, free_workers: int = 1) -> float | None:
        """When the queue next needs a look: a deadline, or (for a free worker) a batch
        delay running out. Times already past are left out: with no free worker the
        driver waits for one instead of spinning."""
        times = []
        for minima in self._minima.values():
            if free_workers > 0:
                times.append(self._wait_ends(minima))
            times.append(minima.earliest_deadline().deadline)
        return min((t for t in times if t > now), default=None)

    def finish_batch(
        self, batch: Sequence[WorkItem], now: float, made: Sequence[int] | None = None
    ) -> float:
        """A batch came back: learn its speed; returns the seconds it took as learned
        (an outlier capped; 0 for a batch not in flight). `made`: the new tokens each of
        its generations made, where the worker says (see `_made_cost`)."""
        made = _told(batch, made)
        self._count_rows(now)
        flight = self._pop_in_flight(batch, now)
        if flight is None:
            return 0.0
        ran = max(now - flight.sent, 1e-6)
        if made is not None:
            for item, count in zip(batch, made, strict=True):
                if not item.fewest_new_tokens:  # (one held from its end says nothing of it)
                    self.answer_lengths.ended(item.new_tokens, count)
        cost, tokens = _ran(batch, flight, made)
        # a freak batch (a worker restart, retries) must not skew the speeds: it counts as
        # at most OUTLIER_FACTOR times the time predicted of what it ran (of the tokens a
        # generation made: a full answer taken to be short is no freak)
        expected = flight.predicted if cost == flight.cost else self.cost_model.predict(cost)
        if not self.cost_model.fitted:  # (a prediction capped at the largest call measured:
            # a larger call's own time, clamped only as far as its tokens could take it,
            # is what teaches the parts apart)
            expected = self.cost_model.extrapolate(cost, flight.items)
        seconds = min(ran, OUTLIER_FACTOR * expected) if expected else ran
        self.cost_model.observe(cost, seconds, tokens, flight.items)
        if ran > flight.predicted and self._listed and now >= self._risk_judged + RISK_INTERVAL:
            self._judge_risk(now)  # (slower than predicted: those admitted at the edge)
        if self._continuous(batch) and (made is None or any(made)):  # (none: it failed)
            self._observe_pace(batch, flight, made, now)
        self._window_items += len(batch)  # toward the service rate
        return seconds

    def _close_rate_window(self) -> None:
        """The service rate of the window under way, once RATE_WINDOW long: called as the
        clock moves on, so that every batch that came back at one instant is in it (two
        workers' batches back together, split, made one window twice the other)."""
        busy = self._busy_seconds - self._window_from
        if busy < RATE_WINDOW:
            return
        rate = self._window_items / busy
        if self.items_per_second is None:
            self.items_per_second = rate
        else:
            self.items_per_second += RATE_SMOOTHING * (rate - self.items_per_second)
        self._window_items, self._window_from = 0, self._busy_seconds

    def calibrate(self, batch: Sequence[WorkItem], token_counts: Sequence[int]) -> None:
        """Real token counts of a batch's inputs (sampled by the worker) teach the
        estimate its scale, so that costs and `--max-batch-tokens` mean model tokens."""
        estimated = sum(self.estimate(item.input) for item in batch)
        if len(token_counts) != len(batch) or not estimated or not sum(token_counts):
            return
        ratio = sum(token_counts) / estimated
        self.tokens_per_estimate += CALIBRATION_SMOOTHING * (ratio - self.tokens_per_estimate)

    def stopped_batch(
        self, batch: Sequence[WorkItem], now: float, made: Sequence[int] | None = None
    ) -> None:
        """A batch stopped before its end, nobody waiting for it any more (a continuous
        worker's sequence past its deadline, or its client gone). What it ran says
        little to the cost model, unless it ran past its predicted time: that time is
        then the least it takes, and is learned as such. (Forgotten, only the sequences
        that ended in time taught the model, the fast ones; under overload its pace
        looked the better the more sequences missed, and it admitted the more that
        would.) `made`, as `finish_batch`'s: the cost is then that of the tokens made,
        and a sequence's pace is learned from them whatever its end (the stopped ones are
        the slow ones), as the answers' likely length learns of the ones that ran long."""
        made = _told(batch, made)
        if made is not None:
            for item, count in zip(batch, made, strict=True):
                if not item.fewest_new_tokens:
                    self.answer_lengths.stopped(count)
        self._count_rows(now)
        flight = self._pop_in_flight(batch, now)
        if flight is None:
            return
        cost, tokens = _ran(batch, flight, made)
        ran = max(now - flight.sent, 1e-6)
        if self._continuous(batch) and made is not None and any(made):
            self._observe_pace(batch, flight, made, now)
        least = self.cost_model.predict(cost, flight.items)
        if least and ran > least:
            self.cost_model.observe(cost, min(ran, OUTLIER_FACTOR * least), tokens, flight.items)

    def forget_batch(self, batch: Sequence[WorkItem], now: float) -> None:
        """A batch failed in the worker pool: it is no longer in flight (from `now`, for
        the rows counted over time), and says nothing."""
        self._count_rows(now)
        self._pop_in_flight(batch, now)

    def _observe_pace(
        self, batch: Sequence[WorkItem], flight: InFlight, made: Sequence[int] | None, now: float
    ) -> None:
        """Teach the sequences' pace the time of `batch`'s sequence, sent as `flight`,
        back `now` having made `made` (at most OUTLIER_FACTOR times its predicted time)."""
        rows, most = self._rows_beside(flight, now), _most_made(batch, made)
        ran = max(now - flight.sent, 1e-6)
        paced = self.pace.predict(most, rows)
        self.pace.observe(most, rows, min(ran, OUTLIER_FACTOR * paced) if paced else ran)

    def _count_rows(self, now: float) -> None:
        """Count the batches in flight up to `now` (and the time with any), before their
        number changes."""
        counted_to = self._rows_counted_to
        if counted_to is not None and now > counted_to:
            self._close_rate_window()  # (what was answered up to `counted_to`)
            self._row_seconds += len(self._in_flight) * (now - counted_to)
            if self._in_flight:
                self._busy_seconds += now - counted_to
        if counted_to is None or now > counted_to:
            self._rows_counted_to = now

    def _rows_beside(self, flight: InFlight, now: float) -> float:
        """The batches in flight, on average, while `flight` ran (itself among them)."""
        most = max(self.workers, len(self._in_flight) + 1)
        seconds = now - flight.sent
        if seconds < 1e-6:  # (or a clock that went back): the rows now
            return float(min(len(self._in_flight) + 1, most))
        return min(max(1.0, (self._row_seconds - flight.row_seconds) / seconds), most)

    def _pop_in_flight(self, batch: Sequence[WorkItem], now: float) -> InFlight | None:
        """`batch`'s flight, no longer in flight (from `now`: the rest's ends are judged
        again then)."""
        flight = self._in_flight.pop(batch[0].seq, None)
        if flight is not None:
            ends = self._in_flight_ends
            del ends[bisect.bisect_left(ends, flight.end)]
            # (back to exactly zero when none is left: the sum's rounding never builds up)
            left = self._in_flight_predicted - flight.predicted
            self._in_flight_predicted = max(0.0, left) if self._in_flight else 0.0
            if flight.paced_rows is not None:
                self._repace(now)
        return flight

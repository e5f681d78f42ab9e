"""The worker pool: the I/O shell around the model worker processes.

Spawns one `spawn`ed process per device running `rawserve.worker.process.worker_main`,
sends it batches on a multiprocessing pipe and reads its replies from a one-way pipe of
its own without blocking (`rawserve.shared.pipes`; a whole message is handed on as soon
as it has arrived), reaps it when it exits and dispatches the batches the scheduler
hands it: `submit(inputs, params)` returns an asyncio future of the batch's
`BatchResult`, `shutdown()` stops the workers.

What to do when a worker dies (restart when, retry which items, quarantine what) is
decided by the pure supervision core (`rawserve.serving.supervision`); this module only
carries it out. A batch running longer than `batch_timeout` gets its worker killed (on
a continuous generation worker, whose sequences run as long as their deadlines allow,
only once the worker has also gone `batch_timeout` without ending a forward pass: hung,
not busy with a long generation); a static batch's items then run again alone (one
alone is answered with a failure, and counted against its input as a crash alone is).
The worker's
effective batch cap (lowered after out-of-memory errors) is learned from its results and
offered to the scheduler through `batch_cap()`.

A GPU worker holds two batches: the one it computes and the next, sent before the first
is answered, so that the GPU starts the next batch at once instead of idling through the
round trip (result to the server, the next batch formed, sent and read). The worker runs
them in order and answers each before starting the next (rawserve.worker.feeder), so the
batch a dead worker was running is the one it held first; the one behind it never
started and runs again whole. Starting and joining the processes: rawserve.serving.processes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from rawserve.serving.cores import CoreShare
from rawserve.serving.handles import Job, PartAnswered, WorkerHandle
from rawserve.serving.processes import (
    exit_watch,
    join_or_kill,
    start_process,
    take_exit_code,
)
from rawserve.serving.refusals import Reason, Refused, out_of_memory, shutting_down, unsendable
from rawserve.serving.reports import PoolReports
from rawserve.serving.status import WorkerState
from rawserve.serving.streams import TokenStreams
from rawserve.serving.supervision import (
    CRASHED_ALONE,
    CRASHED_MID_STREAM,
    MAX_FAILED_RESTARTS,
    NOT_RUN,
    REFUSED_POISON,
    STOPPED_MID_STREAM,
    TIMED_OUT,
    Held,
    LostBatch,
    PoisonMemory,
    Supervisor,
)
from rawserve.shared.board import SharedMemoryError
from rawserve.shared.logs import requests_named
from rawserve.shared.messages import (
    NO_CONTROL,
    PROGRESS_EVERY,
    Batch,
    BatchResult,
    Cancel,
    Control,
    GenerationPasses,
    Progress,
    Shutdown,
    TokenChunk,
    TokenChunks,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
    WorkerWarming,
)
from rawserve.shared.pipes import MessageReader
from rawserve.shared.process_state import is_stopped

log = logging.getLogger("rawserve.executor")  # the name operators filter on, kept

STOP_TIMEOUT = 10.0  # seconds a worker whose pipe closed gets to exit before it is killed
REAP_POLL_SECONDS = 0.05  # how often that exit is looked for where no thread can wait for it
EXIT_TIMEOUT = 2.0  # seconds an idle worker gets to exit at shutdown before it is killed
BATCH_TIMEOUT = 120.0  # seconds a batch may run before its worker is killed
# A worker holding two batches is sent its second this long before the running one is
# expected to end: a share of its batches' time, at least a few milliseconds (the pipe
# and the worker's receiving thread take well under one).
SECOND_LEAD_SHARE = 0.25
SECOND_LEAD_SECONDS = 0.002
RUN_MEMORY = 0.8  # weight a worker's batch time average keeps of its past per batch
# seconds a lone item on every core holds the model's other CPU workers back, at most:
# past it (a worker stopped from outside or hung, with --batch-timeout far off, or a long
# input) they take the queue, a thread too many meanwhile, rather than stay idle (a
# stopped worker's one item kept the other idle, and every request 504, for 120 s)
MOST_HOLD_SECONDS = 2.0
# A continuous worker running rows tells of each decoding step, or of its life at least
# every PROGRESS_EVERY seconds: one silent for this long is stalled (stopped from outside,
# wedged), and a new sequence goes to a worker that is heard, where one has room (a stopped
# worker was given half of them, each waiting for its 504, until the batch timeout)
STALLED_AFTER = 2 * PROGRESS_EVERY


class DropCounter(Protocol):
    """What the pool counts (rawserve.ops.metrics.ModelMetrics): inputs refused as poison,
    and a generation worker's forward passes."""

    def drop(self, reason: str, count: int = 1) -> None: ...

    def count_passes(self, passes: GenerationPasses) -> None: ...


class WorkerPool(PoolReports):
    """Runs batches on one worker process per device, and keeps the workers alive."""

    def __init__(
        self,
        config: WorkerConfig,
        devices: Sequence[str] = ("auto",),
        *,
        batch_timeout: float = BATCH_TIMEOUT,
        share_cores: bool = False,
        max_failed_restarts: int = MAX_FAILED_RESTARTS,
        on_idle: Callable[[], None] | None = None,
        metrics: DropCounter | None = None,
        core_share: CoreShare | None = None,
        overlap: bool | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`on_idle` is called whenever a worker may have become free (the scheduler's
        wake-up); `metrics` counts the inputs refused as poison; `core_share` is shared by
        the pools of every served model (each its own when not given); `overlap`: two
        batches in flight on every worker (True), none (False), or by device (None:
        `overlaps`)."""
        self._loop = loop
        self.overlap = overlap
        self.clock = clock
        self.batch_timeout = batch_timeout
        # CPU workers split the cores evenly (rawserve.serving.cores)
        self.share_cores = share_cores
        self.core_share = core_share or CoreShare()
        self._all_cores: WorkerHandle | None = None  # running a lone item on every core
        self._all_cores_since = 0.0
        self._hold_ends: asyncio.TimerHandle | None = None  # when it holds them no longer
        self._context = multiprocessing.get_context("spawn")
        # what to do when a worker dies is the supervisor's to say; this pool does it
        self.max_failed_restarts = max_failed_restarts
        self.workers: list[WorkerHandle] = []
        self._place(config, devices)
        # served before the scheduler's next batch: inputs run again alone after a crash,
        # batches run again whole (held behind one that crashed), sequences run again
        # side by side, inputs run alone for the poison memory
        self._retries: deque[Job] = deque()
        self._batch_ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._first_load: asyncio.Future[WorkerReady] | None = None
        self.on_idle = on_idle
        # told, when a death leaves no worker serving, when one should serve again (the
        # scheduler answers at once the requests due before then)
        self.on_down: Callable[[float], None] | None = None
        # told, when a worker dies, of the batches whose items wait to run again on it
        # alone and when it should be back (those the restart would outlast are answered
        # at once)
        self.on_pinned: Callable[[Collection[asyncio.Future[BatchResult]], float], None] | None
        self.on_pinned = None
        self.metrics = metrics
        self.streams = TokenStreams()  # streamed generations and who takes their tokens
        self.last_ready: WorkerReady | None = None  # what a worker last said of the model
        self.preparing_since: float | None = None  # see `preparing`

    def _place(self, config: WorkerConfig, devices: Sequence[str]) -> None:
        """A worker handle a device, each with its supervisor's record."""
        self.supervisor = Supervisor(
            len(devices), max_failed_restarts=self.max_failed_restarts, clock=self.clock
        )
        self.core_share.workers = [w for w in self.core_share.workers if w not in self.workers]
        self.workers = [
            WorkerHandle(index, replace(config, device=device), record)
            for (index, device), record in zip(
                enumerate(devices), self.supervisor.records, strict=True
            )
        ]
        self.core_share.workers += [w for w in self.workers if w.config.device == "cpu"]

    def relayout(self, config: WorkerConfig, devices: Sequence[str]) -> None:
        """Workers of `config` on `devices` instead, before any starts (the CPU layout
        settled by its trial while the server already listens)."""
        assert self._first_load is None, "relayout() before start()"
        self._place(config, devices)

    def preparing(self) -> None:
        """The model's first load begins now, before its workers start (a first start's
        layout trial loads and times it first): /ready counts the load's seconds from here."""
        self.preparing_since = self.clock()

    # --- what the scheduler and the serving face use ---------------------------------------

    def start(self) -> None:
        self._loop = self._loop or asyncio.get_running_loop()
        self._first_load = self._loop.create_future()
        for worker in self.workers:
            try:
                self._spawn(worker)
            except SharedMemoryError:
                raise  # no worker can start without it: the server stops, saying so
            except OSError as exc:  # out of file descriptors or processes, for now
                self._spawn_failed(worker, exc)

    async def wait_ready(self) -> WorkerReady:
        """Wait for the first worker to load; raises RuntimeError if loading failed."""
        assert self._first_load is not None, "start() first"
        return await asyncio.shield(self._first_load)

    def idle_workers(self) -> int:
        """How many batches could be sent now (`WorkerHandle.room`): none while retries
        any worker may run wait for an idle one (they go first), and none to a worker
        whose own retries wait for it (those of its crash)."""
        if self._holding_cores() or self._retries_for_any():
            return 0
        return sum(w.room() for w in self._unreserved())

    def empty_workers(self) -> int:
        """How many continuous workers run no sequence and take one now: a sequence sent
        now runs alone on one (`submit` sends to an idle worker first)."""
        if self._holding_cores() or self._retries_for_any():
            return 0
        return sum(1 for w in self._unreserved() if w.sequences and not w.running.rows and w.room())

    def _home(self, retry: Job) -> int | None:
        """The worker a retry waits for: the one it was lost with, while that one's
        restarts succeed; any (None) once one has failed, so that its retries do not wait
        out their deadlines beside a worker that serves (a tester's: 504 at 15 s, while
        the other worker answered in 0.3 s)."""
        home = next((w for w in self.workers if w.index == retry.home), None)
        if home is None or home.record.failed_restarts or home.load_failure:
            return None  # (a failed load: from its word, not the exit seconds later)
        return home.index

    def _retries_for_any(self) -> bool:
        """Retries any worker may run wait (they go first, before the queue)."""
        return any(self._home(retry) is None for retry in self._retries)

    def _unreserved(self) -> list[WorkerHandle]:
        """The workers no retry waits for (after a crash, its inputs run again alone on
        the worker that crashed, once it is back)."""
        if not self._retries:
            return self.workers
        reserved = {self._home(retry) for retry in self._retries}
        return [w for w in self.workers if w.index not in reserved]

    def batch_cap(self) -> int | None:
        """The most items a `submit` should carry now (None: no limit of the workers'): one
        for a continuous worker, whose rows each take one sequence."""
        caps = [1 if w.sequences else w.batch_cap for w in self.workers if w.sequences or w.room()]
        return min((cap for cap in caps if cap), default=None)

    def concurrency(self) -> int:
        """How many batches the workers run side by side: one each, or a continuous
        worker's sequences (the scheduler's estimates divide the work by it)."""
        return sum(w.sequences or 1 for w in self.workers)

    def rows_when_ready(self) -> int:
        """`concurrency` once every worker is ready: one loading or restarting counted as
        its peers' most rows (they load one model alike), so that what fits then is not
        refused for good (413) while one restarts (`SchedulerCore.most_admitted`)."""
        most = max((w.sequences for w in self.workers), default=0)
        return sum(w.sequences or most or 1 for w in self.workers)

    def submit(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        control: Control = NO_CONTROL,
        request_ids: Sequence[str] = (),
        admitted: Sequence[float] = (),
        on_part: PartAnswered | None = None,
    ) -> asyncio.Future[BatchResult]:
        # the scheduler may send a second batch in the same breath as a lone item that
        # took every core: it runs on a free worker anyway (briefly one thread too many)
        free = self._unreserved()
        if not free or self._retries_for_any():
            raise Refused.because(Reason.NO_WORKER, "no model worker is free")
        worker = self._next_idle(free, despite_hold=True) or max(free, key=self._claim)
        if not worker.room():
            raise Refused.because(Reason.NO_WORKER, "no model worker is free")
        future = self._running_loop.create_future()
        whole = Job(
            tuple(inputs),
            params,
            control,
            future,
            next(self._batch_ids),
            request_ids=tuple(request_ids),
            admitted=tuple(admitted),
            on_part=on_part,
        )
        keys = self.supervisor.remembered(inputs, params)
        if not any(keys):  # (the common case: no input of it crashed a worker before)
            self._send(worker, whole)
            return future
        # (a continuous worker takes no new sequence until its rows are done and it ran
        # the input alone: only for those more likely to be poison)
        anywhere = self.poison.runs_alone_anywhere
        alone, rest = self._sorted_by_memory(
            whole, range(len(inputs)), keys, lambda key: not worker.sequences or anywhere(key)
        )
        if rest:
            self._send(worker, whole.part(rest, next(self._batch_ids)))
        if alone:  # (a continuous worker's: on it, the others serving the queue meanwhile)
            self._run_alone(whole, alone, worker.index if worker.sequences else None)
        return future

    def _sorted_by_memory(
        self,
        job: Job,
        indices: Sequence[int],
        keys: Sequence[str | None],
        runs_alone: Callable[[str], bool],
    ) -> tuple[list[int], list[int]]:
        """The inputs of `job` at `indices`, whose poison memory `keys` are, sorted: the
        quarantined ones refused here; those to run alone (remembered, and `runs_alone`
        says so); the rest, to run batched."""
        remembered = [(i, key) for i, key in zip(indices, keys, strict=True) if key]
        refused = [i for i, key in remembered if key in self.poison]
        if refused:
            self._refuse_poison(job, refused)
        alone = [i for i, key in remembered if i not in refused and runs_alone(key)]
        return alone, [i for i in indices if i not in refused and i not in alone]

    def _refuse_poison(self, job: Job, refused: list[int]) -> None:
        """Answer the inputs of `job` at `refused`, quarantined, without running them."""
        say_of(job, refused, "refused %d input(s) that crashed or hung a worker before%s")
        if self.metrics is not None:
            self.metrics.drop("poison", len(refused))
        job.answer_unrun(refused, REFUSED_POISON)

    def _run_alone(self, job: Job, alone: list[int], home: int | None = None) -> None:
        """Run each input of `job` at `alone`, remembered but not quarantined, alone, on
        the first idle worker, before what the scheduler sends next (as a retry after a
        crash is), or on `home` once it is idle (a continuous worker's rows done: the
        others serve meanwhile, where every worker held new requests back for it): a
        crash of it then tells of that input, as a first run's crash alone does;
        answered, it is forgotten (`PoisonMemory.cleared`)."""
        said = "running %d input(s) alone%s: a worker died running each before, alone or in a "
        say_of(job, alone, said + "batch (alone, its crash tells of it)")
        for index in alone:
            part = job.part([index], next(self._batch_ids))
            self._retries.append(replace(part, isolated=True, home=home))
        self._send_retries()

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int:
        """A new stream id; give it in a batch's `Control` to get its tokens as they come."""
        return self.streams.open(on_token)

    def close_stream(self, stream_id: int) -> None:
        """Forget a stream; a worker still generating for it stops at its next token."""
        if not self.streams.close(stream_id):
            return
        for worker in self.workers:  # only the worker running that stream id reacts
            if job := worker.running.streaming(stream_id):
                self._cancel(worker, job)
            elif worker.cancelled_stream is not None:
                worker.cancelled_stream.value = stream_id

    def abandon(
        self, future: asyncio.Future[BatchResult], items: Collection[int] | None = None
    ) -> None:
        """Nobody waits for the batch behind `future` any more (its clients left, or their
        deadlines passed), or for its `items` (their places in it): a continuous worker
        frees their rows at its next step. A batch run whole is told so too, once nobody
        waits for any of it: a generation stops at its next token (`generate` ran a
        non-streamed one to its max_tokens, long past its 504, while every request queued
        behind it met its own); other tasks run on, but a lone item that took every core
        holds them no longer: the other workers take the queue. None of them runs again
        after a crash: the retries waiting are dropped (run past their deadlines, they
        were computed for nobody while the queue waited behind them)."""
        dropped = [retry for retry in self._retries if retry.forget(future, items)]
        for retry in dropped:
            self._retries.remove(retry)
            self._suspect(retry, range(len(retry.inputs)), retry.died_with)
            not_run(retry)
        for worker in self.workers:
            for running in worker.running.forget(future, items):
                self._cancel(worker, running)
            queued = worker.queued
            if queued is not None and queued.forget(future, items):
                self._cancel(worker, queued)  # (sent: it runs, stopped, but never again)
            job = worker.job
            if job is not None and job.forget(future, items):
                self._cancel(worker, job)
                if worker is self._all_cores:
                    self._pump()
        if dropped:
            self._pump()  # the queue no longer waits behind them

    def died_with(self, future: asyncio.Future[BatchResult], place: int) -> int:
        """How many items the worker that died running the item at `place` of the batch
        `future` (its retry waits) ran as it died; 0 where none did, or it was stopped
        from outside. (Its batch-mates may have run apart, and died apart.)"""
        held = (r for r in self._retries if r.future is future and r.holds(place))
        return max((r.died_with for r in held), default=0)

    def _cancel(self, worker: WorkerHandle, job: Job) -> None:
        if job.cancelled or worker.conn is None:
            return
        job.cancelled = True
        try:
            worker.conn.send(Cancel(job.batch_id))
        except (OSError, ValueError):  # the pipe broke: the reader will see the exit
            pass

    async def shutdown(self, wait: bool = True) -> None:
        """Answer what is still held (503), and stop every worker.

        A busy worker cannot read a request to exit until its batch ends, and a loading
        one may take minutes: both are killed at once (the caller's grace period is
        over). An idle one is asked to exit and given `EXIT_TIMEOUT` seconds (none
        without `wait`), then killed: the shutdown ends within that bound.
        """
        self._closing = True
        stopping = shutting_down()
        while self._retries:
            self._retries.popleft().answer(error=stopping)
        for worker in self.workers:
            if worker.process is None or worker.state is WorkerState.DEAD:
                continue
            if worker.state is WorkerState.IDLE and worker.conn is not None:
                try:
                    worker.conn.send(Shutdown())
                except (OSError, ValueError):
                    pass
            else:
                worker.process.kill()
            self._take_all(worker, error=stopping)
        timeout = EXIT_TIMEOUT if wait else 0.0
        exiting = [(w, w.process) for w in self.workers if w.process]
        killed = await asyncio.gather(
            *(self._join_or_kill(process, timeout) for _, process in exiting)
        )
        for (worker, _), was_killed in zip(exiting, killed, strict=True):
            if was_killed and wait:  # (an idle worker exits at once, unless a thread of
                # its own code, a handler's say, is still running and holds it)
                log.warning("worker %s: did not exit within %.0f s; killed", worker.label, timeout)
        for worker in self.workers:
            worker.state = WorkerState.STOPPED

    def kill(self) -> None:
        """Kill every worker at once (a second signal: no time for manners)."""
        self._closing = True
        for worker in self.workers:
            if worker.process is not None and worker.process.exitcode is None:
                worker.process.kill()

    # --- dispatch ---------------------------------------------------------------------

    @property
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    def _claim(self, worker: WorkerHandle) -> tuple[bool, int]:
        """How strongly a busy worker claims a new batch: one with room that is heard
        first, then the most room (a stalled one only where no other has room)."""
        room = worker.room()
        return room > 0 and not self._stalled(worker), room

    def _stalled(self, worker: WorkerHandle) -> bool:
        """Whether a continuous worker running rows has been silent past STALLED_AFTER."""
        silent = self.clock() - worker.heard_at
        return bool(worker.sequences and worker.running.rows) and silent > STALLED_AFTER

    def _next_idle(
        self, among: list[WorkerHandle], *, despite_hold: bool = False
    ) -> WorkerHandle | None:
        if self._holding_cores() and not despite_hold:
            return None
        return next((w for w in among if w.state is WorkerState.IDLE and not w.gone), None)

    def overlaps(self, ready: WorkerReady) -> bool:
        """Whether a worker that just loaded holds two batches. Yes on a GPU: it computes
        apart from the CPU, whose threads meanwhile receive the next batch. No on a CPU:
        the default layout gives every core a worker, so a batch sent early would only
        wait for the cores, and would be given its threads (core sharing) before the
        batch ahead of it ends; bench/RESULTS.md has the measurement."""
        if self.overlap is not None:
            return self.overlap
        return ready.device.startswith("cuda")

    def _holding_cores(self) -> bool:
        """A lone item runs on every core: the other CPU workers wait until it is done,
        until nobody waits for it (a hung or slow batch answered 504 must not keep the
        others idle for as long as it runs), or MOST_HOLD_SECONDS at most."""
        holder = self._all_cores
        return (
            holder is not None
            and holder.state is WorkerState.BUSY
            and not (holder.job is not None and holder.job.abandoned)
            and self.clock() - self._all_cores_since < MOST_HOLD_SECONDS
        )

    def _hold(self, worker: WorkerHandle) -> None:
        """`worker`'s lone item takes every core; the queue is looked at again when its
        hold ends by itself (no answer or new request may come meanwhile)."""
        self._all_cores, self._all_cores_since = worker, self.clock()
        if self._hold_ends is not None:
            self._hold_ends.cancel()
        if self._loop is not None:  # (started)
            self._hold_ends = self._loop.call_later(MOST_HOLD_SECONDS, self._pump)

    def _send(self, worker: WorkerHandle, job: Job) -> None:
        state = worker.state
        if worker.sequences and not worker.running.rows:  # (idle, it said nothing: its
            worker.heard_at = self.clock()  # silence counts from its first row)
        if worker.job is None or worker.sequences:
            worker.state = WorkerState.BUSY
            self._start(worker, job)
        else:  # behind the running batch: it starts when that one is answered
            worker.queued, worker.queued_at = job, self.clock()
        try:
            threads = self._threads_for(worker, len(job.inputs))
            batch = Batch(
                job.batch_id,
                job.inputs,
                dict(job.params),
                threads,
                job.control,
                job.request_ids,
                job.admitted,
            )
            assert worker.conn is not None, "spawned workers have a pipe"
            worker.conn.send(batch)
        except (OSError, ValueError) as exc:  # the pipe broke: the reader will see the exit
            log.warning("worker %s: could not send a batch: %s", worker.label, exc)
        except MemoryError:  # pickling comes first: nothing reached the worker
            log.error("worker %s: no memory to send it a batch of %d: refused",
                      worker.label, len(job.inputs))  # fmt: skip
            self._take_back(worker, job, state, out_of_memory())
        except Exception as exc:  # noqa: BLE001 - its pickling failed: nothing reached it
            log.error("worker %s: could not send it a batch of %d: refused", worker.label,
                      len(job.inputs), exc_info=exc)  # fmt: skip
            self._take_back(worker, job, state, unsendable())

    def _take_back(
        self, worker: WorkerHandle, job: Job, state: WorkerState, error: Refused
    ) -> None:
        """A batch the server could not write to its worker (no memory, or an input nested
        past what pickling takes): refused, and the worker left as it was, where it looked
        busy with nothing to do until --batch-timeout killed it as hung (and a retry of it
        after the restart failed again, and again)."""
        if worker.queued is job:
            self._take_queued(worker, error=error)
            return
        if worker.job is job:
            self._take_job(worker, error=error)
        else:  # a continuous worker's
            worker.running.pop(job.batch_id)
            self._detach(job, error)
        worker.state = state

    def _threads_for(self, worker: WorkerHandle, size: int) -> int | None:
        """With `share_cores`, CPU workers (of every served model) split the cores evenly,
        except that a batch of one item with no other CPU worker busy gets every core
        (low-load latency) and holds them: no other CPU worker of this model starts until
        it is done, since OpenMP threads that outnumber the cores stall each other. Another
        model's workers are not held back (one model never waits for another's work). A
        continuous worker keeps its even share: its one-item batches join a running batch,
        so holding every core would keep every new sequence out until all the running ones
        are done, and taking every core without holding them kept them while another
        worker started (threads outnumbering the cores: first tokens 100 ms late). A
        handler's lone item gets every core's threads too (torch's, where the handler runs
        torch: twice as fast on two cores) but holds no other worker back: its own code
        may make its time (a 2 s call kept the other worker idle, and the next request
        waited 4 s)."""
        if not self.share_cores or worker.config.device != "cpu":
            return None
        if worker.sequences:
            return self.core_share.even_share()
        threads, every_core = self.core_share.threads_for(worker, size)
        if worker.config.handler:
            return threads
        if every_core:
            self._hold(worker)
        elif self._all_cores is worker:
            self._all_cores = None
        return threads

    def _pump(self) -> None:
        """Give free workers the retries first, then tell the scheduler who is free."""
        self._send_retries()
        if self.idle_workers():
            self._notify_idle()

    def _start(self, worker: WorkerHandle, job: Job) -> None:
        """`job` is a batch `worker` computes now: its batch timeout runs from here."""
        if worker.sequences:
            worker.running.add(job)
        else:
            worker.job = job
            self._hold_second(worker, job)
        job.watchdog = self._running_loop.call_later(
            self.batch_timeout, self._on_batch_timeout, worker, job
        )

    def _hold_second(self, worker: WorkerHandle, job: Job) -> None:
        """A worker that holds two batches takes its second once the running one is near
        its end (its recent batches' time, less a lead for the next batch to reach it and
        be tokenized by the worker's preparing thread): formed at once, from the few
        requests queued as the first one started, the second batch costs a GPU as much as
        a full one (its cost hardly grows with its items) while the requests arriving
        meanwhile wait behind it. Until a batch has been timed, the second is taken at
        once."""
        lead = max(SECOND_LEAD_SHARE * worker.run_seconds, SECOND_LEAD_SECONDS)
        lead += worker.prepare_seconds
        hold = worker.run_seconds - lead
        worker.second_open = not (worker.overlap and hold > 0)
        if not worker.second_open:
            self._running_loop.call_later(hold, self._open_second, worker, job)
        elif worker.overlap:  # room behind it at once: what is queued may go now
            self._notify_idle()

    def _open_second(self, worker: WorkerHandle, job: Job) -> None:
        if worker.job is job:  # (a batch since started holds its own time)
            worker.second_open = True
            self._pump()

    def _take_queued(self, worker: WorkerHandle, *, error: Exception | None = None) -> Job | None:
        """Detach the batch waiting behind the worker's job; fail it with `error` if given."""
        job, worker.queued = worker.queued, None
        if job is not None and error is not None:
            job.answer(error=error)
        return job

    def _take_job(self, worker: WorkerHandle, *, error: Exception | None = None) -> Job | None:
        """Detach the worker's job (stopping its watchdog); fail it with `error` if given."""
        job, worker.job = worker.job, None
        return self._detach(job, error)

    def _take_all(self, worker: WorkerHandle, *, error: Exception) -> None:
        """Fail every batch the worker holds with `error`."""
        self._take_job(worker, error=error)
        self._take_queued(worker, error=error)
        for job in worker.running.take_all():
            self._detach(job, error)

    def _detach(self, job: Job | None, error: Exception | None = None) -> Job | None:
        """Stop a batch's watchdog; fail it with `error` if given."""
        if job is not None:
            if job.watchdog is not None:
                job.watchdog.cancel()
            if error is not None:
                job.answer(error=error)
        return job

    def _send_retries(self) -> None:
        self._refuse_quarantined()
        while (found := self._next_retry()) is not None:
            worker, retry = found
            self._retries.remove(retry)
            self._send(worker, retry)

    def _refuse_quarantined(self) -> None:
        """Refuse at once (422) the retries of an input quarantined as they waited: copies
        of it (a list of it three times: each copy took the worker down again, five
        deaths), which need no worker to be refused (they waited for a restart, or their
        deadline's 503). A death's pump runs it before the scheduler is told who is down."""
        poisoned = [
            retry
            for retry in self._retries
            if len(retry.inputs) == 1 and self.supervisor.is_poison(retry.inputs[0], retry.params)
        ]
        for retry in poisoned:
            self._retries.remove(retry)
            self._refuse_poison(retry, [0])

    def _next_retry(self) -> tuple[WorkerHandle, Job] | None:
        """A worker and the first retry it may run now (its own, or anyone's): on an idle
        worker, or (run together) beside a continuous worker's other sequences."""
        if not self._retries or self._holding_cores():  # (the common case: none, at once)
            return None
        for worker in self.workers:
            if worker.gone:
                continue
            mine = (r for r in self._retries if self._home(r) in (None, worker.index))
            retry = next(mine, None)
            if retry is None:
                continue
            beside = retry.together and worker.sequences and worker.room()
            if worker.state is WorkerState.IDLE or beside:
                return worker, retry
        return None

    def _retry_alone(self, job: Job, home: int | None, *, died_with: int = 0) -> None:
        """After a crash, run each item of the lost batch alone, ahead of the queue, on the
        worker that crashed once it is back (`home`; those nobody waits for any more are
        not run): on another, the input that crashed it would take that one down too,
        and every worker was restarting at once (a handler's poison input, two workers:
        41 of 60 requests in the 11 s after it answered 503). After a hang, on any
        (`home` None). `died_with`: the items its worker ran as it died."""
        for index, value in enumerate(job.inputs):
            if index in job.gone:
                self._suspect(job, [index], died_with)
                job.answer_unrun([index], NOT_RUN)
            else:
                key = PoisonMemory.key(value, job.params)
                retry = job.part([index], next(self._batch_ids), key, rerun=True)
                self._retries.append(replace(retry, home=home, died_with=died_with))

    def _suspect(self, job: Job, indices: Iterable[int], died_with: int) -> None:
        """The inputs of `job` at `indices` are not run again after their worker died
        running `died_with` items: where it ran several, any may have crashed it, and each
        runs alone when it comes again (`PoisonMemory.suspect`)."""
        if died_with > 1:
            for index in indices:
                self.poison.suspect(PoisonMemory.key(job.inputs[index], job.params))

    def _run_again_whole(self, job: Job) -> None:
        """A batch a dead worker held behind the one it ran never started: it runs again
        whole, ahead of the queue, but for the items nobody waits for any more, and for
        those the poison memory knows by now, as `submit` sorts a batch's: refused where
        quarantined, else run alone. (Run again whole, an input that had crashed the
        worker alone ran batched and took it down once more: four deaths, not three.)"""
        if job.abandoned:
            not_run(job)
            return
        if job.gone:
            job.answer_unrun(sorted(job.gone), NOT_RUN)
        wanted = [i for i in range(len(job.inputs)) if i not in job.gone]
        keys = self.supervisor.remembered([job.inputs[i] for i in wanted], job.params)
        if not job.gone and not any(keys):  # (the common case)
            self._retries.append(replace(job, watchdog=None, waited=0.0, rerun=True))
            return
        alone, rest = self._sorted_by_memory(job, wanted, keys, lambda key: True)
        if rest:
            self._retries.append(job.part(rest, next(self._batch_ids), rerun=True))
        for index in alone:
            part = job.part([index], next(self._batch_ids), rerun=True)
            self._retries.append(replace(part, isolated=True))

    def _watch(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = self._running_loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_batch_timeout(self, worker: WorkerHandle, job: Job) -> None:
        # A loop that stalled past the timeout (the serving process stopped, or starved
        # of the CPU) runs its timers before it reads its pipes: what the worker sent
        # meanwhile, its answer perhaps, is read first (it was dropped as stale, its
        # healthy worker killed for a hang, and its input refused as a poison one)
        if worker.holds(job) and worker.read_sent is not None:
            worker.read_sent()
        if not worker.holds(job) or worker.stopped:
            return  # (killed as stopped: its exit decides its work)
        if worker.sequences:  # it hangs only if it has ended no pass for as long
            quiet_until = worker.heard_at + PROGRESS_EVERY + self.batch_timeout
            if quiet_until > self.clock():
                job.watchdog = self._running_loop.call_later(
                    quiet_until - self.clock(), self._on_batch_timeout, worker, job
                )
                return
        if worker.process is not None and is_stopped(worker.process.pid or 0):
            # stopped from outside, not hung at its input: killed as an operator's kill -9
            # is, its work run again as a crash's (a lone batch so stopped was answered 500
            # and counted toward its input's quarantine: two host stalls refused a
            # monitoring probe's fixed text for an hour)
            log.error(
                "worker %s: its process %s is stopped (SIGSTOP, a debugger), its batch held "
                "over %g s%s; killing it: its work runs again on the first worker free (a "
                "stream already begun ends with an error)",
                worker.label,
                worker.pid,
                self.batch_timeout,
                job_requests(job),
                extra=request_named(job),
            )
            worker.stopped = True
            worker.process.kill()
            return
        # said once: each of a continuous worker's sequences has a watchdog, and all of
        # them fire as it hangs
        if worker.state is not WorkerState.DEAD:
            if worker.sequences:  # (one line for them all: it names no one sequence)
                hung = f"no decoding step ended for {self.batch_timeout:g} s, with "
                hung += f"{worker.running.rows} sequence(s) running"
                named = None
            else:
                hung = f"a batch of {len(job.inputs)} ran over {self.batch_timeout:g} s"
                hung += job_requests(job)
                named = request_named(job)
            log.error(
                "worker %s: %s; killing process %s", worker.label, hung, worker.pid, extra=named
            )
        # A continuous worker's sequences stay held: its exit decides them as a crash's
        # (`_on_exit`), side by side again, then alone. Each answered 500 here, 6 whole
        # answers with 114 s of their deadlines left failed where a kill -9 ran them again.
        if not worker.sequences:
            self._detach(worker.running.pop(job.batch_id) or self._take_job(worker))
            self._after_hang(worker, job)
        elif worker.state is WorkerState.DEAD:
            return  # (killed at its first sequence's watchdog)
        worker.state = WorkerState.DEAD  # until the reader sees it exit and restarts it
        worker.hung = True  # (a batch's work is detached already: a death at work)
        if worker.process is not None:
            worker.process.kill()

    def _after_hang(self, worker: WorkerHandle, job: Job, items: int = 0) -> None:
        """Carry out what supervision decides (`Supervisor.hung`) for a batch its worker is
        killed for: its items run again alone on any worker, not only this one once it is
        back (a hang takes no worker down with it: behind the one that hangs again, on its
        worker alone, the others waited out a second batch timeout and a restart for their
        504s, another worker idle); or it fails, its input quarantined at its last hang.
        `items`: the items the worker ran with it (a continuous worker's sequences; 0: the
        batch's own)."""
        items = items or len(job.inputs)
        alone = items == 1
        key = lone_key(job) if alone else None
        decision = self.supervisor.hung(Held(job.streamed, key), items)
        if decision is LostBatch.RETRY_ALONE:
            if waited := len(job.inputs) - len(job.gone):  # (else none runs again)
                log.warning(
                    "worker %s: its %d items run again alone%s; one that hangs alone is "
                    "refused after %d such hangs",
                    worker.label,
                    waited,
                    job_requests(job),
                    self.poison.strikes,
                    extra=request_named(job),
                )
            self._suspect(job, sorted(job.gone), items)  # (not run again: which was it?)
            self._retry_alone(job, None)
            return
        if decision is LostBatch.QUARANTINED:  # counted as a crash's is
            self._say_quarantined(worker, job, "hung")
            if self.metrics is not None:
                self.metrics.drop("poison")
        job.answer(BatchResult(job.batch_id, (TIMED_OUT,) * len(job.inputs), 0.0))

    # --- process lifecycle ------------------------------------------------------------

    def _spawn(self, worker: WorkerHandle) -> None:
        process, replies_in = start_process(self._context, worker)
        worker.state = WorkerState.LOADING
        worker.queued, worker.overlap, worker.sequences = None, False, 0
        worker.hung = worker.hung_loading = worker.stopped = False
        worker.gone = False
        worker.second_open, worker.run_seconds, worker.prepare_seconds = True, 0.0, 0.0
        worker.ready = worker.load_failure = None
        worker.batch_cap = None
        worker.started_at = self.clock()
        log.info(
            "worker %s: started (pid %d, device %s)",
            worker.label,
            process.pid,
            worker.config.device,
        )
        reader = MessageReader()
        watched = (worker, replies_in, reader, process)
        self._running_loop.add_reader(replies_in.fileno(), self._on_readable, *watched)

        def read_sent() -> None:  # (ahead of the loop's turn for its pipe)
            if not replies_in.closed:
                self._on_readable(*watched)

        worker.read_sent = read_sent
        # Its exit, too: a process it started (a handler's fork, `os.system`) holds the
        # pipe's write end after it dies, and no end of file came: every request waited
        # for its deadline, then the dead worker stayed "loading" until that child ended.
        # (By a pidfd: the process's sentinel is a pipe such a child holds as well.)
        if (exit_fd := exit_watch(process)) is not None:
            self._running_loop.add_reader(exit_fd, self._on_exited, *watched, exit_fd)
        if (limit := self.supervisor.load_limit(worker.index)) is not None:
            self._running_loop.call_later(limit, self._on_load_timeout, worker, process, limit)

    def _on_load_timeout(self, worker: WorkerHandle, process: BaseProcess, limit: float) -> None:
        """A restart still loading long past its loads before is hung (stopped, stalled):
        killed, its death counts as a failed load (five in a row: /health 503)."""
        if process is not worker.process or worker.state is not WorkerState.LOADING:
            return  # (it loaded, or died and was replaced)
        log.error(
            "worker %s: not loaded after %.0f s, where its loads before took a tenth of that "
            "or less: taken as hung, killed and restarted",
            worker.label,
            limit,
        )
        worker.hung_loading = True
        process.kill()

    def _on_readable(
        self,
        worker: WorkerHandle,
        replies: Connection,
        reader: MessageReader,
        process: BaseProcess,
    ) -> None:
        """The worker's pipe has bytes (or its end): hand each whole message on."""
        fd = replies.fileno()
        messages = reader.read(fd)
        for message in messages:
            self._on_message(worker, message)
        if reader.failure is not None:  # a pipe we cannot read on is a dead worker
            self._unreadable(worker, reader)
            process.kill()
        if reader.closed:  # end of file: the worker has exited (or is about to)
            self._gone(worker, replies, process)

    def _on_exited(
        self,
        worker: WorkerHandle,
        replies: Connection,
        reader: MessageReader,
        process: BaseProcess,
        exit_fd: int,
    ) -> None:
        """The worker's process has exited: what it sent before is read, then it is gone
        as at the pipe's end of file (which a child of its may hold back)."""
        self._running_loop.remove_reader(exit_fd)
        os.close(exit_fd)
        take_exit_code(process)  # (a join would wait on a pipe such a child holds)
        if replies.closed:  # its end of file came first
            return
        self._on_readable(worker, replies, reader, process)
        if not replies.closed:
            self._gone(worker, replies, process)

    def _gone(self, worker: WorkerHandle, replies: Connection, process: BaseProcess) -> None:
        """The worker's pipe is done with: stop reading it, and reap the process."""
        worker.gone = worker.gone or process is worker.process
        self._running_loop.remove_reader(replies.fileno())
        replies.close()
        self._watch(self._reap(worker, process))

    def _unreadable(self, worker: WorkerHandle, reader: MessageReader) -> None:
        """Say in one line why the worker's next message could not be read: the server
        had no memory for it (the worker is not at fault; its batch runs again), or it
        could not be unpickled (a bug: the traceback is given)."""
        if isinstance(reader.failure, MemoryError):
            log.error(
                "worker %s: no memory to read its message of %s bytes; restarting it",
                worker.label,
                reader.message_bytes,
            )
            return
        log.error(
            "worker %s: unreadable message; restarting it",
            worker.label,
            exc_info=reader.failure,
        )

    async def _reap(self, worker: WorkerHandle, process: BaseProcess) -> None:
        """Wait for a worker whose pipe has closed to exit (killing it if it lingers)."""
        await self._join_or_kill(process, STOP_TIMEOUT)
        self._on_exit(worker, process)

    async def _join_or_kill(self, process: BaseProcess, timeout: float) -> bool:
        """`join_or_kill` in a thread; where none can start (the server at its memory
        limit), its exit looked for from the event loop now and then. (The error once
        ended the wait: a dead worker was never restarted and looked busy for good, every
        request 504 while /health and /ready said ok.)"""
        try:
            return await asyncio.to_thread(join_or_kill, process, timeout)
        except RuntimeError:  # "can't start new thread"
            log.warning("no thread to wait for process %s in: waiting on the loop", process.pid)
        loop = self._running_loop
        deadline = loop.time() + timeout
        while process.exitcode is None and loop.time() < deadline:
            await asyncio.sleep(REAP_POLL_SECONDS)
        return join_or_kill(process, 0)  # reaped by now, or killed

    def _on_message(self, worker: WorkerHandle, message: Any) -> None:
        worker.heard_at = self.clock()
        if isinstance(message, Progress):
            return  # only a sign of life
        if isinstance(message, GenerationPasses):
            if self.metrics is not None:
                self.metrics.count_passes(message)
            return
        if isinstance(message, TokenChunks):
            for chunk in message.chunks:
                self._on_token(worker, chunk)
        elif isinstance(message, TokenChunk):
            self._on_token(worker, message)
        elif isinstance(message, BatchResult):
            self._on_result(worker, message)
        elif isinstance(message, WorkerWarming):
            worker.state = WorkerState.WARMING
            log.info(
                "worker %s: model loaded in %.1f s; warming up",
                worker.label,
                message.load_seconds,
            )
        elif isinstance(message, WorkerReady):
            self._on_ready(worker, message)
        elif isinstance(message, WorkerLoadFailed):
            self._on_load_failed(worker, message)

    def _on_ready(self, worker: WorkerHandle, ready: WorkerReady) -> None:
        """The worker has loaded (and warmed up) its model: it takes batches from now."""
        worker.ready = self.last_ready = ready
        worker.sequences = ready.sequences
        worker.overlap = not ready.sequences and self.overlaps(ready)
        worker.state = WorkerState.IDLE
        self.supervisor.loaded(worker.index, self.clock() - worker.started_at)
        warmed = ready.warmup_seconds
        log.info(
            "worker %s: %s model ready on %s (engine %s) in %.1f s%s",
            worker.label,
            ready.task,
            worker.device,
            ready.engine.value,
            ready.load_seconds + (warmed or 0.0),
            f" (warm-up {warmed:.2f} s)" if warmed is not None else "",
        )
        if self._first_load and not self._first_load.done():
            if warmed is not None and warmed > self.batch_timeout and not ready.sequences:
                # (else ready, then each batch as large killed as hung: 500s and restarts)
                log.warning(
                    "worker %s: its warm-up batch took %.2f s, longer than --batch-timeout "
                    "(%g s): every batch that runs as long is killed as hung; raise "
                    "--batch-timeout",
                    worker.label,
                    warmed,
                    self.batch_timeout,
                )
            self._first_load.set_result(ready)
        self._pump()

    def _on_load_failed(self, worker: WorkerHandle, failed: WorkerLoadFailed) -> None:
        log.error("worker %s: could not load the model: %s", worker.label, failed.message)
        worker.load_failure = failed.message
        if self._first_load and not self._first_load.done():
            self._first_load.set_exception(RuntimeError(failed.message))
            self._closing = True  # a model that never loaded will not load on retry
            return
        self._pump()  # what its crash left waiting for it goes to any worker now

    def _on_token(self, worker: WorkerHandle, chunk: TokenChunk) -> None:
        job = worker.running.streaming(chunk.stream_id) or worker.job
        if job is not None:
            job.streamed = True
        self.streams.deliver(chunk)

    def _on_result(self, worker: WorkerHandle, result: BatchResult) -> None:
        job = worker.job
        if worker.sequences and worker.hung:  # its sequences are decided at its exit
            job = None
        elif worker.sequences:  # a continuous worker answers its batches in any order
            job = self._detach(worker.running.pop(result.batch_id))
        elif job is not None and result.batch_id == job.batch_id:
            worker.run_seconds = remembered(worker.run_seconds, result.compute_seconds)
            worker.prepare_seconds = remembered(worker.prepare_seconds, result.prepare_seconds)
            self._take_job(worker)
            behind = self._take_queued(worker)
            if behind is not None:  # the worker started it as it sent this result
                behind.waited = self.clock() - worker.queued_at
                self._start(worker, behind)
        if job is None or job.batch_id != result.batch_id:
            log.warning("worker %s: dropped a stale result", worker.label)
            return
        if worker.state is WorkerState.BUSY and worker.job is None and not worker.running:
            worker.state = WorkerState.IDLE
        self.supervisor.answered(worker.index)  # it works: forget earlier crashes
        if result.effective_batch_cap != worker.batch_cap:
            log.warning(
                "worker %s: effective batch cap now %s (out of memory earlier)",
                worker.label,
                result.effective_batch_cap or "the configured maximum",
            )
            worker.batch_cap = result.effective_batch_cap
        job.answer(replace(result, waited=job.waited) if job.waited else result)
        if job.isolated or job.poison_key is not None:  # (it ran alone, and did not crash)
            self.poison.cleared(lone_key(job))
        if not self._closing:
            self._pump()

    def _on_exit(self, worker: WorkerHandle, process: BaseProcess) -> None:
        if process is not worker.process:
            return
        was_loading = worker.state.starting
        worker.state = WorkerState.DEAD
        if self._closing:
            self._take_all(worker, error=shutting_down())
            return
        job = self._take_job(worker)
        behind = self._take_queued(worker)
        # (a worker stopped from outside was no input's doing: no strike toward quarantine)
        strikes = not worker.stopped
        sequences = worker.running.take_all()  # a continuous worker ran them all at once
        # what it ran as it died (one item alone: a crash that tells of that input)
        died_with = len(sequences) + (len(job.inputs) if job else 0) if strikes else 0
        held = None if job is None else held_by(job, died_with)
        was_healthy = self.supervisor.healthy
        decision = self.supervisor.exited(
            worker.index,
            while_loading=was_loading,
            held=held,
            at_work=bool(sequences) or worker.hung,
        )
        if was_healthy and not self.supervisor.healthy and not self._first_load_pending:
            self._say_unhealthy(worker)
        if job is not None and decision.lost is not None:
            self._carry_out(worker, job, decision.lost, died_with)
        for lost in sequences:
            self._detach(lost)
        together = self._together(sequences)
        home = home_of(worker)
        for lost in sequences:
            if lost in together:  # (a Job is equal to itself alone)
                again = replace(
                    lost, watchdog=None, rerun=True, home=home, together=True, died_with=died_with
                )
                self._retries.append(again)
            elif worker.hung and not (lost.abandoned or lost.cancelled):
                self._after_hang(worker, lost, len(sequences))
            else:
                decided = self.supervisor.lost(held_by(lost, died_with))
                self._carry_out(worker, lost, decided, died_with)
        if together:
            log.warning(
                "worker %s: its %d sequences run again side by side once it is back (alone, "
                "should it die with them again)",
                worker.label,
                len(together),
            )
        if behind is not None:  # it never started (see the module's docstring)
            self._run_again_whole(behind)
        ours = server_kill(worker, process.exitcode, was_loading)
        cause = worker.load_failure or f"its worker process {ours or exit_words(process.exitcode)}"
        gave_up = was_loading and self._start_failed(worker, cause)
        if ours is not None:
            how = ours
        elif worker.load_failure and process.exitcode == 0:  # ("code 0" read as success)
            how = "stopped, as its load failed"
        else:
            how = exit_words(process.exitcode) + (" while loading" if was_loading else "")
        running = [request for lost in sequences for request in lost.request_ids]
        log.error(  # (SIGKILL's hint: a worker the kernel's OOM killer took was not said)
            "worker %s: process %d %s%s%s%s; %s",
            worker.label,
            process.pid,
            how,
            f" holding a batch of {len(job.inputs)}{job_requests(job)}" if job else "",
            f" and one of {len(behind.inputs)} behind it" if behind else "",
            f" running {len(sequences)} sequences{requests_named(running)}" if sequences else "",
            "not restarted" if gave_up else f"restarting in {decision.restart_in:.1f} s",
            extra=request_named(job),
        )
        self._running_loop.call_later(decision.restart_in, self._respawn, worker)
        self._pump()  # another worker may be free for the batch that never started
        self._tell_down()
        self._tell_pinned(worker)

    @staticmethod
    def _together(held: list[Job]) -> list[Job]:
        """The sequences a continuous worker lost at its first death with them that run
        again side by side on it, once it is back (whether it runs new ones beside them
        too); none where fewer than two may, and never those that must not (streamed,
        nobody waits, retried already): the others are decided one by one. Each alone,
        one after another, held the queue back for all of them together (15 sequences:
        23 s with nothing new served, on a machine where they took 0.9 s side by side);
        a second death of the worker with them runs each alone, so that a poison input is
        still named."""
        again = [
            job
            for job in held
            if not (job.streamed or job.abandoned or job.cancelled)
            and job.poison_key is None
            and not job.together
        ]
        return again if len(again) >= 2 else []

    def _carry_out(
        self, worker: WorkerHandle, job: Job, lost: LostBatch, died_with: int = 0
    ) -> None:
        """Do what supervision decided for the batch a dead worker held as it died running
        `died_with` items; nothing for one nobody waits for any more (it is not run
        again)."""
        if died_with == 1 and lost in (LostBatch.RETRY_ALONE, LostBatch.FAIL_MID_STREAM):
            self._say_counted(worker, job)  # (counted as it was decided)
        if lost is LostBatch.FAIL_MID_STREAM:  # (not run again: its client has tokens of it)
            self._suspect(job, range(len(job.inputs)), died_with)
        if job.abandoned or job.cancelled:
            if lost is LostBatch.QUARANTINED:
                self._say_quarantined(worker, job, "crashed")
            elif lost is LostBatch.RETRY_ALONE:
                self._suspect(job, range(len(job.inputs)), died_with)
            not_run(job)
            return
        if lost is LostBatch.FAIL_MID_STREAM:
            lost_by = STOPPED_MID_STREAM if worker.stopped else CRASHED_MID_STREAM
            outputs = (lost_by,) * len(job.inputs)
            job.answer(BatchResult(job.batch_id, outputs, 0.0))
        elif lost is LostBatch.RETRY_ALONE:
            self._retry_alone(job, home_of(worker), died_with=died_with)
        elif lost is LostBatch.RUN_AGAIN_ALONE:
            assert job.poison_key is not None  # (it ran alone again)
            self._say_crashed_alone(worker, job, job.poison_key, "running it alone once more; ")
            home = home_of(worker)
            again = replace(job, watchdog=None, rerun=True, home=home, died_with=died_with)
            self._retries.append(again)
        else:
            self._say_quarantined(worker, job, "crashed")
            if self.metrics is not None:
                self.metrics.drop("poison")
            job.answer(BatchResult(job.batch_id, (CRASHED_ALONE,), 0.0))

    def _say_counted(self, worker: WorkerHandle, job: Job) -> None:
        """Say a first run's crash alone where it counted (its input's first is remembered
        only): the count toward its quarantine, which no run again may say."""
        key = lone_key(job)
        if self.poison.left(key) < self.poison.strikes:
            self._say_crashed_alone(worker, job, key)

    def _say_crashed_alone(self, worker: WorkerHandle, job: Job, key: str, then: str = "") -> None:
        times = self.poison.times(key)
        log.warning(
            "worker %s: an input running alone crashed the worker%s (%s now; %squarantined at %d)",
            worker.label,
            job_requests(job),
            times_said(times),
            then,
            times + self.poison.left(key),
            extra=request_named(job),
        )

    def _say_quarantined(self, worker: WorkerHandle, job: Job, how: str) -> None:
        log.error(
            "worker %s: one input %s the worker %d times on its own%s; it is refused for "
            "the next %.0f s",
            worker.label,
            how,
            self.poison.times(lone_key(job)),
            job_requests(job),
            self.poison.seconds,
            extra=request_named(job),
        )

    def _respawn(self, worker: WorkerHandle) -> None:
        if self._closing or worker.state is not WorkerState.DEAD:
            return
        try:
            self._spawn(worker)
        except OSError as exc:  # out of file descriptors or processes, for now
            self._spawn_failed(worker, exc)

    def _spawn_failed(self, worker: WorkerHandle, exc: OSError) -> None:
        """The system refused the worker a process: a failed start, tried again after
        its backoff (`_respawn` starts a dead worker only)."""
        worker.state = WorkerState.DEAD
        decision = self.supervisor.exited(worker.index, while_loading=True, held=None)
        cause = f"could not start its worker process ({exc})"
        gave_up = self._start_failed(worker, cause)
        log.error(
            "worker %s: %s; %s",
            worker.label,
            cause,
            "not tried again" if gave_up else f"trying again in {decision.restart_in:.1f} s",
        )
        self._running_loop.call_later(decision.restart_in, self._respawn, worker)
        self._tell_down()  # later than it said

    def _start_failed(self, worker: WorkerHandle, cause: str) -> bool:
        """A worker's process died, or could not start, before it was ready (`cause`:
        why, as the worker said it where it did); whether the pool gives up. Once every
        worker keeps failing so before any was ever ready, the first load fails with that
        cause: the server stops saying why, as for a model its worker says it cannot load
        (restarted, each failed the same way and the server said "loading" for good). A
        worker that keeps failing while another serves, or may yet, is said once, and
        tried again."""
        failed = worker.record.failed_restarts
        first_load = self._first_load
        if first_load is not None and not first_load.done() and not self.supervisor.healthy:
            first_load.set_exception(RuntimeError(f"{cause}, {failed} times in a row"))
            self._closing = True
            return True
        if failed == self.max_failed_restarts:  # (another worker may serve, or soon)
            log.error(
                "worker %s: its last %d starts failed (%s); it keeps being tried again",
                worker.label,
                failed,
                cause,
            )
        return False

    @property
    def _first_load_pending(self) -> bool:
        return self._first_load is not None and not self._first_load.done()

    def _say_unhealthy(self, worker: WorkerHandle) -> None:
        """Every worker keeps dying: /health turns 503, which a liveness probe acts on
        (the crash lines alone did not say why a pod was restarted)."""
        model = f"model {worker.config.name!r}" if worker.config.name else "the model"
        record = worker.record
        why = (
            f"its last {record.failed_restarts} starts failed"
            if record.failed_restarts >= self.max_failed_restarts
            else f"it died {record.crashes} times in a row at work without answering a batch"
        )
        log.error(
            "%s is unhealthy: every worker of it keeps dying (worker %s: %s); /health "
            "answers 503 (a liveness probe restarts the server), and its workers are still "
            "restarted",
            model,
            worker.label,
            why,
        )

    def _tell_pinned(self, worker: WorkerHandle) -> None:
        """Tell `on_pinned` which batches wait to run again on the dead `worker` alone
        (on another, what killed it would take that one down too) and when it should be
        back: those due before then waited for their 504s while another worker sat
        idle, or came back first."""
        back = self.supervisor.back_at(worker.index)
        if self.on_pinned is None or back is None:
            return
        # (with no worker serving, `_tell_down` said when the first is back: those that
        # wait for this one, back later, are told its own time)
        pinned = {retry.future for retry in self._retries if retry.home == worker.index}
        if pinned:
            self.on_pinned(pinned, back)

    def _tell_down(self) -> None:
        """With no worker serving, tell `on_down` when one should again."""
        back = self.serving_again_at()
        if back is not None and self.on_down is not None:
            self.on_down(back)

    def _notify_idle(self) -> None:
        if self.on_idle is not None:
            self.on_idle()


def lone_key(job: Job) -> str:
    """The poison memory's key of a batch of one: its input's, with its parameters."""
    return job.poison_key or PoisonMemory.key(job.inputs[0], job.params)


def held_by(job: Job, died_with: int) -> Held:
    """A batch a worker died holding, as supervision weighs it: its poison key where it
    was one item that worker ran alone (`died_with`: the items it ran as it died; 0 where
    it was stopped from outside, no input's doing), as a run again after a crash or as a
    first run (`Held.first_key`)."""
    if died_with == 0:
        return Held(job.streamed)
    if job.poison_key is not None:
        return Held(job.streamed, job.poison_key)
    if died_with == 1:
        return Held(job.streamed, first_key=lone_key(job))
    return Held(job.streamed)


def say_of(job: Job, indices: list[int], said: str) -> None:
    """Warn `said` of the inputs of `job` at `indices`: how many (its %d), and their
    requests (its %s)."""
    named = [job.request_ids[i] for i in indices if job.request_ids]
    log.warning(said, len(indices), requests_named(named), extra=request_field(named))


def home_of(worker: WorkerHandle) -> int | None:
    """Where the work a dead worker held runs again: on that worker once it is back (an
    input that crashed it would take another down too), or on any where it was stopped
    from outside (no input's doing: a lone item waited 4 s for its restart beside an
    idle worker, and a drain restarted the worker to run it)."""
    return None if worker.stopped else worker.index


def server_kill(worker: WorkerHandle, exitcode: int | None, was_loading: bool) -> str | None:
    """How a worker's process ended, in words, where the server killed it itself (no OOM
    hint: its SIGKILL was the server's); None where it did not."""
    if exitcode != -signal.SIGKILL:
        return None
    if worker.stopped:
        return "was killed, stopped from outside"
    if worker.hung or worker.hung_loading:
        return "was killed for hanging" + (" while loading" if was_loading else "")
    return None


def exit_words(exitcode: int | None) -> str:
    """How a process ended, in words: the code it exited with, or the signal that
    killed it (SIGKILL is most often the kernel's OOM killer: said, as a hint)."""
    if exitcode == -signal.SIGKILL:
        return "was killed by SIGKILL (out of memory, or a kill -9)"
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def times_said(times: int) -> str:
    """`times` in words: "1 time", "2 times"."""
    return f"{times} time" if times == 1 else f"{times} times"


def job_requests(job: Job | None) -> str:
    """The requests of a batch a dead worker held, for its log line (and what their
    inputs did)."""
    return requests_named(job.request_ids) if job else ""


def request_named(job: Job | None) -> dict[str, str] | None:
    """A JSON line's `request_id` field, where the batch is one request's."""
    return request_field(job.request_ids if job else ())


def request_field(request_ids: Iterable[str]) -> dict[str, str] | None:
    """A JSON line's `request_id` field, where `request_ids` name one request."""
    ids = {request for request in request_ids if request}
    return {"request_id": ids.pop()} if len(ids) == 1 else None


def not_run(job: Job) -> None:
    """Answer a batch nobody waits for without running it (a batch it is part of may
    still be waited for: its other parts are answered as they come)."""
    job.answer(BatchResult(job.batch_id, (NOT_RUN,) * len(job.inputs), 0.0))


def remembered(average: float, seconds: float) -> float:
    """A worker's recent time for something (RUN_MEMORY of the past per batch; 0: none)."""
    return RUN_MEMORY * average + (1 - RUN_MEMORY) * seconds if average else seconds

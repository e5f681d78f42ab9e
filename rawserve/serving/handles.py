"""One worker process as the pool holds it (`WorkerHandle`), and the batches on their way
through it (`Job`; a continuous worker's many at once: `RunningBatches`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from rawserve.serving.refusals import Reason, Refused
from rawserve.serving.status import WorkerState, WorkerStatus
from rawserve.serving.supervision import WorkerRecord
from rawserve.shared.messages import BatchResult, Control, WorkerConfig, WorkerReady

# Told of a part of a scheduler's batch answered before the rest: its places in the batch,
# and their outputs (in that order) in the result.
PartAnswered = Callable[[Sequence[int], BatchResult], None]


class SharedInt(Protocol):
    """An integer in shared memory (multiprocessing's Value)."""

    value: int


@dataclass(eq=False)
class Job:
    """A batch on its way through a worker, and the scheduler's batch it answers: the
    whole of it, or a part (a retry of one of its items after a crash, or its inputs not
    refused as poison) that fills its places in it (`Assembly`). Answered once, by
    `answer`."""

    inputs: tuple[Any, ...]
    params: Mapping[str, Any]
    control: Control
    future: asyncio.Future[BatchResult]  # the scheduler's batch
    batch_id: int
    poison_key: str | None = None  # set on a one-item retry after a crash
    watchdog: asyncio.TimerHandle | None = None
    streamed: bool = False  # tokens of it reached a client: it cannot run again unseen
    waited: float = 0.0  # seconds it waited in the worker behind the batch before it
    cancelled: bool = False  # the worker was told nobody waits for it any more
    abandoned: bool = False  # nobody waits for it, though its worker runs it to the end
    # once the scheduler's batch is answered in parts: the parts' assembly, and this
    # job's inputs' places in that batch
    assembly: Assembly | None = None
    places: tuple[int, ...] = ()
    gone: frozenset[int] = frozenset()  # the indices of its inputs nobody waits for
    request_ids: tuple[str, ...] = ()  # each input's request's, for the worker's log
    admitted: tuple[float, ...] = ()  # when each input was admitted (time.monotonic)
    rerun: bool = False  # it runs again after its worker died (`BatchResult.rerun`)
    # the worker that died running it, where it runs again (None: on any): on another,
    # an input that crashes a worker would take that one down as well
    home: int | None = None
    # a continuous worker's sequence run again beside the others it was lost with (its
    # worker died once): a second such death runs each alone
    together: bool = False
    # run again after its worker died: the items that worker ran as it died (0: none
    # died running it, or it was stopped from outside, no input's doing)
    died_with: int = 0
    # told of each part answered before the whole batch is (`Assembly`)
    on_part: PartAnswered | None = None
    # one input a worker died running before, run alone so that a crash tells of it
    # (`WorkerPool._run_alone`): answered, it is forgotten
    isolated: bool = False
    answered: bool = False

    def place(self, index: int) -> int:
        """The place of its input at `index` in the scheduler's batch."""
        return self.places[index] if self.assembly is not None else index

    def holds(self, place: int) -> bool:
        """Whether it holds the input at `place` of the scheduler's batch."""
        return place in self.places if self.assembly is not None else place < len(self.inputs)

    def answer(
        self, result: BatchResult | None = None, *, error: BaseException | None = None
    ) -> None:
        """Answer it once, with its result or with an error (`settle`); a part fills its
        places in the scheduler's batch."""
        if self.answered:
            return
        self.answered = True
        if result is not None and self.rerun:
            result = replace(result, rerun=True)
        if self.assembly is None:
            settle(self.future, result=result, error=error)
        elif result is not None:
            self.assembly.fill([self.place(i) for i in range(len(self.inputs))], result)
        else:
            self.assembly.fail(error)

    def answer_unrun(self, indices: Sequence[int], output: Any) -> None:
        """Answer its inputs at `indices` with `output` without running them (refused as
        poison, not run for nobody); its parts answer the others."""
        places = [self.place(index) for index in indices]
        self._assembly().fill(places, BatchResult(self.batch_id, (output,) * len(places), 0.0))

    def forget(
        self, future: asyncio.Future[BatchResult], items: Collection[int] | None = None
    ) -> bool:
        """Nobody waits for the scheduler's batch `future` any more, or (`items`) for its
        items at those places: note which of its own inputs that is; whether nobody waits
        for any of them now."""
        if self.future is not future:
            return False
        indices = range(len(self.inputs))
        self.gone |= {i for i in indices if items is None or self.place(i) in items}
        self.abandoned = len(self.gone) == len(self.inputs)
        return self.abandoned

    def part(
        self,
        indices: Sequence[int],
        batch_id: int,
        poison_key: str | None = None,
        *,
        rerun: bool = False,
    ) -> Job:
        """A job of its inputs at `indices`: a part of the same scheduler's batch, sent
        to a worker as batch `batch_id`, an id of its own (a worker told that nobody
        waits for one part any more must not stop the next)."""
        return Job(
            tuple(self.inputs[index] for index in indices),
            self.params,
            self.control,
            self.future,
            batch_id,
            poison_key,
            assembly=self._assembly(),
            places=tuple(self.place(index) for index in indices),
            request_ids=tuple(self.request_ids[index] for index in indices if self.request_ids),
            admitted=tuple(self.admitted[index] for index in indices if self.admitted),
            rerun=rerun,
        )

    def _assembly(self) -> Assembly:
        """The assembly of its batch's parts (made as the batch is first split: from then
        on its parts answer it, not this job)."""
        if self.assembly is None:
            size = len(self.inputs)
            self.assembly = Assembly(self.future, self.batch_id, size, self.on_part)
            self.places = tuple(range(size))
        return self.assembly


class Assembly:
    """The scheduler's batch answered in parts: each part fills its places as it is
    answered, and the batch is answered as its last place is filled, in the same call (a
    verdict given as a worker dies, a quarantine say, reaches the scheduler's batch before
    the scheduler is told that no worker serves and answers 503 every request still
    waiting). The first error answers the batch. `on_part` is told of each part filled
    (the last one after the batch is answered): the requests of its items need not wait
    for the others' (an input run again alone after a crash: its batch-mate that crashed
    the worker may take two more restarts to be named), and are timed by their own call."""

    def __init__(
        self,
        target: asyncio.Future[BatchResult],
        batch_id: int,
        size: int,
        on_part: PartAnswered | None = None,
    ):
        self.target = target
        self.batch_id = batch_id
        self.on_part = on_part
        self._outputs: list[Any] = [None] * size
        self._unfilled = set(range(size))
        self._seconds = 0.0
        self._rerun = False

    def fill(self, places: Sequence[int], result: BatchResult) -> None:
        for place, output in zip(places, result.outputs, strict=True):
            self._outputs[place] = output
            self._unfilled.discard(place)
        self._seconds += result.compute_seconds
        self._rerun |= result.rerun
        if not self._unfilled:
            outputs = tuple(self._outputs)
            answer = BatchResult(self.batch_id, outputs, self._seconds, rerun=self._rerun)
            settle(self.target, result=answer)
        if self.on_part is not None:  # (the last part too: its own call's size and time)
            self.on_part(places, result)

    def fail(self, error: BaseException | None) -> None:
        settle(self.target, error=error)


class RunningBatches:
    """The batches a continuous worker runs side by side (rawserve.worker.generating): it
    takes them whenever it has free rows and answers each as soon as its own items are
    done, in any order, so they are held by batch id (and by stream, for its tokens)."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._streams: dict[int, Job] = {}
        self.rows = 0  # items in the batches held

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job: Job) -> bool:
        return self._jobs.get(job.batch_id) is job

    @property
    def holds_retry(self) -> bool:
        """It runs an input alone, so that a crash names it: again after a crash, or one
        remembered for crashes before (`Job.isolated`)."""
        return any(job.poison_key is not None or job.isolated for job in self._jobs.values())

    def add(self, job: Job) -> None:
        self._jobs[job.batch_id] = job
        self.rows += len(job.inputs)
        if job.control.stream_id is not None:
            self._streams[job.control.stream_id] = job

    def pop(self, batch_id: int) -> Job | None:
        """Take out the batch answered (None: a batch it no longer holds)."""
        job = self._jobs.pop(batch_id, None)
        if job is not None:
            self.rows -= len(job.inputs)
            if job.control.stream_id is not None:
                self._streams.pop(job.control.stream_id, None)
        return job

    def streaming(self, stream_id: int) -> Job | None:
        return self._streams.get(stream_id)

    def forget(
        self, future: asyncio.Future[BatchResult], items: Collection[int] | None = None
    ) -> list[Job]:
        """The batches nobody waits for any more, told that nobody waits for the
        scheduler's batch `future`, or for its `items` (`Job.forget`)."""
        return [job for job in self._jobs.values() if job.forget(future, items)]

    def take_all(self) -> list[Job]:
        """Every batch held, in the order sent; none held afterwards."""
        jobs = list(self._jobs.values())
        self._jobs.clear()
        self._streams.clear()
        self.rows = 0
        return jobs


class WorkerHandle:
    """One worker process, its pipe, the batch it is computing and the one behind it."""

    def __init__(self, index: int, config: WorkerConfig, record: WorkerRecord):
        self.index = index
        self.config = config
        self.state = WorkerState.WAITING  # until the pool starts its process
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None  # batches go out on it
        # the id of a stream whose client left, shared with the process: it stops generating
        self.cancelled_stream: SharedInt | None = None
        self.job: Job | None = None  # the batch it is computing
        # its pipe has closed: it will answer nothing more, and takes no batch while its
        # exit is awaited (a process may take a while to let go of its memory)
        self.gone = False
        # killed as hung at its work (`--batch-timeout`): its death is one at work
        self.hung = False
        self.hung_loading = False  # ... or killed as hung while it loaded (not at work)
        # killed where its batch ran over `batch_timeout` with its process stopped from
        # outside (SIGSTOP, a debugger): not hung at its work; its exit decides its batch
        self.stopped = False
        # the batch sent behind it, waiting in the worker (two in flight: `overlap`)
        self.queued: Job | None = None
        self.queued_at = 0.0  # when `queued` was sent
        self.overlap = False  # it may hold a second batch (decided once it is ready)
        # the second batch is formed near the end of the running one, not as it starts:
        # what arrives meanwhile joins it (`WorkerPool._hold_second`)
        self.second_open = True
        self.run_seconds = 0.0  # its recent batches' own time (an average; 0: none yet)
        self.prepare_seconds = 0.0  # ... and their preparation's, done ahead (an average)
        self.ready: WorkerReady | None = None
        self.load_failure: str | None = None  # why its process could not load, as it said
        self.started_at = 0.0
        # when its last message came (a continuous worker's sign of life), or when it was
        # given rows while it ran none
        self.heard_at = 0.0
        # reads what its process has sent and the loop has not yet seen (set as it starts)
        self.read_sent: Callable[[], None] | None = None
        self.record = record  # its restarts and crashes, counted by the supervisor
        self.batch_cap: int | None = None  # lowered by the worker after out-of-memory errors
        # a continuous worker: the sequences it runs at once (0: one batch at a time) and
        # the batches it holds (then `job` and `queued` stay empty)
        self.sequences = 0
        self.running = RunningBatches()

    def room(self) -> int:
        """How many batches it takes now: one when idle, one behind a running batch when it
        overlaps (once that batch is near its end); a continuous worker one per free row
        (each batch of one item: `batch_cap`), none while it runs a retry that must run
        alone (a crash must name its input)."""
        if self.gone:
            return 0
        if self.sequences:
            serving = self.state in (WorkerState.IDLE, WorkerState.BUSY)
            if not serving or self.running.holds_retry:
                return 0
            return max(0, self.sequences - self.running.rows)
        if self.state is WorkerState.IDLE:
            return 1
        return int(
            self.state is WorkerState.BUSY
            and self.overlap
            and self.queued is None
            and self.second_open
        )

    def holds(self, job: Job) -> bool:
        """Whether `job` is still this worker's to answer."""
        return job is self.job or job is self.queued or job in self.running

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def device(self) -> str:
        """The device as --device named it, and, for `auto`, what its worker made of it.
        Not what the worker reports otherwise: `cuda:1`'s worker sees that GPU alone, as
        its cuda:0 (rawserve.shared.devices.isolate)."""
        if self.ready and self.config.device == "auto":
            return self.ready.device
        return self.config.device

    @property
    def label(self) -> str:
        """How log lines name it: its index, after its model's name when there are several."""
        return f"{self.config.name}/{self.index}" if self.config.name else str(self.index)

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            index=self.index,
            device=self.device,
            dtype=self.ready.dtype if self.ready else self.config.dtype,
            state=self.state,
            pid=self.pid,
            restarts=self.record.restarts,
            batch_cap=self.batch_cap,
            warmup_seconds=self.ready.warmup_seconds if self.ready else None,
            engine=self.ready.engine.value if self.ready else None,
            engine_reason=self.ready.engine_reason if self.ready else None,
            dtype_reason=self.ready.dtype_reason if self.ready else None,
            bfloat16_trial=(self.ready.bfloat16_trial or None) if self.ready else None,
            attention=(self.ready.attention or None) if self.ready else None,
            cuda_graphs=(self.ready.cuda_graphs or None) if self.ready else None,
            generation=(self.ready.generation or None) if self.ready else None,
            untrained=(self.ready.untrained or None) if self.ready else None,
            sequences=self.sequences,
            running=self.running.rows,
        )


def settle(
    future: asyncio.Future[BatchResult],
    *,
    result: BatchResult | None = None,
    error: BaseException | None = None,
) -> None:
    """Answer a batch's future once: with its result, or with an error (a missing result
    is "no worker"); a future already answered is left as it is."""
    if future.done():
        return
    if result is not None:
        future.set_result(result)
    else:
        future.set_exception(error or Refused.because(Reason.NO_WORKER, "no result"))

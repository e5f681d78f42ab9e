"""The parent side of the model worker processes: spawn, pipes, supervision.

Its face is ProcessPoolExecutor-like: `submit(inputs, params)` returns an asyncio future
of the batch's `BatchResult`, `shutdown()` stops the workers. Each worker is a `spawn`ed
process running `rawserve.worker.process.worker_main`: batches go to it on a multiprocessing
pipe, and the event loop reads its replies from a one-way pipe of its own without
blocking (`rawserve.shared.pipes`; a whole message is handed on as soon as it has arrived).

Supervision lives here, so the scheduler never sees a fault, only results:
- a worker that dies is noticed at once (pipe EOF), restarted with capped exponential
  backoff, and the items of the batch it held are retried one by one. A crash proves
  nothing about an input (an operator's `kill -9` and the OOM killer look alike), so
  crashes are counted, not guessed at: an input that took a worker down while running
  alone `QUARANTINE_STRIKES` times is answered with a failure and quarantined (by
  content hash, for `QUARANTINE_SECONDS`): refused without being run;
- a batch running longer than `batch_timeout` gets its worker killed and its items
  answered with a failure;
- the worker's effective batch cap (lowered after out-of-memory errors) is learned
  from its results and offered to the scheduler through `batch_cap()`.

This module knows nothing of HTTP framing and never imports torch: it names the worker's
entry function, whose module imports torch only inside the worker process.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from rawserve.http.errors import ServiceUnavailable
from rawserve.shared.messages import (
    Batch,
    BatchResult,
    Engine,
    FailureKind,
    ItemFailure,
    ModelLimits,
    Shutdown,
    TokenChunk,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
    WorkerWarming,
)
from rawserve.shared.pipes import MessageReader
from rawserve.tasks import STREAM_ID_PARAM
from rawserve.worker.process import worker_main

log = logging.getLogger("rawserve.executor")

RESTART_BACKOFF_FIRST = 0.5  # seconds before the first restart of a dead worker
RESTART_BACKOFF_MAX = 30.0
STOP_TIMEOUT = 10.0  # seconds a worker whose pipe closed gets to exit before it is killed
EXIT_TIMEOUT = 2.0  # seconds an idle worker gets to exit at shutdown before it is killed
BATCH_TIMEOUT = 120.0  # seconds a batch may run before its worker is killed
MAX_FAILED_RESTARTS = 5  # restarts in a row that die while loading: the process is unhealthy
MAX_CRASHES = 10  # deaths in a row without one answered batch (poison alone is rarely so many)
POISON_MEMORY = 4096  # content hashes of inputs that crashed a worker, least recent dropped
QUARANTINE_STRIKES = 2  # crashes while running alone before an input is refused
QUARANTINE_SECONDS = 3600.0  # how long a crash is remembered (and a quarantine lasts)

CRASHED_ALONE = ItemFailure(FailureKind.INTERNAL, "this input crashed the model worker")
REFUSED_POISON = ItemFailure(
    FailureKind.INPUT, "this input crashed the model worker before and is refused"
)
CRASHED_MID_STREAM = ItemFailure(
    FailureKind.INTERNAL, "the model worker crashed while streaming this answer"
)
TIMED_OUT = ItemFailure(
    FailureKind.INTERNAL, "the model did not finish this batch within the batch timeout"
)


class WorkerState(enum.Enum):
    LOADING = "loading"
    WARMING = "warming"  # loaded, running its warm-up batch
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"
    STOPPED = "stopped"

    @property
    def serving(self) -> bool:
        """The model is loaded and warm: the worker computes, or can."""
        return self in (WorkerState.IDLE, WorkerState.BUSY)

    @property
    def starting(self) -> bool:
        """A new process on its way to serving: loading, then warming up."""
        return self in (WorkerState.LOADING, WorkerState.WARMING)


class LoadState(enum.Enum):
    """Why no worker is ready, for /ready's body."""

    LOADING = "loading"
    WARMING = "warming"  # loaded, warming up: ready in a moment
    RESTARTING = "restarting"


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as /info and /metrics show it."""

    index: int
    device: str
    dtype: str
    state: WorkerState
    pid: int | None
    restarts: int
    batch_cap: int | None  # lowered after out-of-memory errors; None: the configured size
    warmup_seconds: float | None = None  # its warm-up batch; None: none ran (yet)
    engine: str | None = None  # what runs its forward pass, once loaded
    engine_reason: str | None = None

    @property
    def serving(self) -> bool:
        return self.state.serving


class SharedInt(Protocol):
    """An integer in shared memory (multiprocessing's Value)."""

    value: int


class DropCounter(Protocol):
    """What the executor counts (rawserve.ops.metrics.Metrics): inputs refused as poison."""

    def drop(self, reason: str, count: int = 1) -> None: ...


@dataclass(eq=False)
class Job:
    """A batch on its way through a worker, and the future that waits for it."""

    inputs: tuple[Any, ...]
    params: Mapping[str, Any]
    future: asyncio.Future[BatchResult]
    batch_id: int
    poison_key: str | None = None  # set on a one-item retry after a crash
    watchdog: asyncio.TimerHandle | None = None
    streamed: bool = False  # tokens of it reached a client: it cannot run again unseen


class WorkerHandle:
    """One worker process, its pipe, and the batch it is computing."""

    def __init__(self, index: int, config: WorkerConfig):
        self.index = index
        self.config = config
        self.state = WorkerState.DEAD
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None  # batches go out on it
        # the id of a stream whose client left, shared with the process: it stops generating
        self.cancelled_stream: SharedInt | None = None
        self.job: Job | None = None
        self.ready: WorkerReady | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.failed_restarts = 0  # in a row, died before it was ready
        self.crashes = 0  # in a row, died after it was ready without answering a batch
        self.backoff = RESTART_BACKOFF_FIRST
        self.batch_cap: int | None = None  # lowered by the worker after out-of-memory errors

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def label(self) -> str:
        """How log lines name it: its index, after its model's name when there are several."""
        return f"{self.config.name}/{self.index}" if self.config.name else str(self.index)

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            index=self.index,
            device=self.ready.device if self.ready else self.config.device,
            dtype=self.ready.dtype if self.ready else self.config.dtype,
            state=self.state,
            pid=self.pid,
            restarts=self.restarts,
            batch_cap=self.batch_cap,
            warmup_seconds=self.ready.warmup_seconds if self.ready else None,
            engine=self.ready.engine.value if self.ready else None,
            engine_reason=self.ready.engine_reason if self.ready else None,
        )


@dataclass
class _Crashes:
    count: int  # crashes while running alone
    expires: float  # when they are forgotten


class PoisonMemory:
    """Inputs (with their parameters, by content hash) that crashed a worker while
    running alone: one crash is remembered, `strikes` of them within `seconds` put the
    input in quarantine until the memory of its last crash expires. Bounded: past `size`
    entries the least recently seen is dropped."""

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
        params = {k: v for k, v in params.items() if k != STREAM_ID_PARAM}  # new each request
        text = json.dumps([value, params], sort_keys=True, default=repr)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def crashed(self, key: str) -> bool:
        """Count a crash of this input running alone; True when it is now quarantined."""
        entry = self._entry(key)
        count = entry.count + 1 if entry is not None else 1
        self._entries[key] = _Crashes(count, self.clock() + self.seconds)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return count >= self.strikes

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


class CoreShare:
    """The CPU workers of every model the server runs: together they split the machine's
    cores (each model's executor registers its CPU workers here)."""

    def __init__(self, cores: int | None = None):
        self.cores = cores or os.cpu_count() or 1  # read once: each call reads a file in /sys
        self.workers: list[WorkerHandle] = []


class Executor:
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
        loop: asyncio.AbstractEventLoop | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`on_idle` is called whenever a worker may have become free (the scheduler's
        wake-up); `metrics` counts the inputs refused as poison; `core_share` is shared by
        the executors of every served model (each its own when not given)."""
        self._loop = loop
        self.clock = clock
        self.batch_timeout = batch_timeout
        self.share_cores = share_cores  # CPU workers split the cores by how many are busy
        self.core_share = core_share or CoreShare()
        self._all_cores: WorkerHandle | None = None  # running a lone item on every core
        self.max_failed_restarts = max_failed_restarts
        self._context = multiprocessing.get_context("spawn")
        self.workers = [
            WorkerHandle(index, replace(config, device=device))
            for index, device in enumerate(devices)
        ]
        self.core_share.workers += [w for w in self.workers if w.config.device == "cpu"]
        self.poison = PoisonMemory()
        self._retries: deque[Job] = deque()  # one-item retries after a crash, served first
        self._batch_ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._first_load: asyncio.Future[WorkerReady] | None = None
        self.on_idle = on_idle
        self.metrics = metrics
        # streamed generations: stream id → the callback that takes its TokenChunks
        self._token_listeners: dict[int, Callable[[TokenChunk], None]] = {}
        self._stream_ids = itertools.count(1)

    # --- the face the scheduler and the app use ---------------------------------------

    def start(self) -> None:
        self._loop = self._loop or asyncio.get_running_loop()
        self._first_load = self._loop.create_future()
        for worker in self.workers:
            self._spawn(worker)

    async def wait_ready(self) -> WorkerReady:
        """Wait for the first worker to load; raises RuntimeError if loading failed."""
        assert self._first_load is not None, "start() first"
        return await asyncio.shield(self._first_load)

    @property
    def ready(self) -> bool:
        return any(w.state.serving for w in self.workers)

    def load_state(self) -> tuple[LoadState, float | None]:
        """While no worker is ready: loading or restarting, and for how many seconds the
        longest load has run (None when no worker is loading right now)."""
        starting = [w for w in self.workers if w.state.starting]
        if any(w.restarts for w in self.workers):
            state = LoadState.RESTARTING
        elif starting and all(w.state is WorkerState.WARMING for w in starting):
            state = LoadState.WARMING
        else:
            state = LoadState.LOADING
        if not starting:
            return state, None
        return state, self.clock() - min(w.started_at for w in starting)

    def status(self) -> list[WorkerStatus]:
        """Each worker's state, for /info and /metrics."""
        return [worker.status() for worker in self.workers]

    @property
    def healthy(self) -> bool:
        """False once every worker keeps dying: it failed to load too many times in a row,
        or died too many times in a row without answering a batch (a broken device)."""
        return any(
            w.failed_restarts < self.max_failed_restarts and w.crashes < MAX_CRASHES
            for w in self.workers
        )

    @property
    def loaded(self) -> WorkerReady | None:
        """What a loaded worker said of its model (task, dtype, details, tokenizer); None
        until one has loaded."""
        return next((w.ready for w in self.workers if w.ready), None)

    @property
    def task(self) -> str | None:
        loaded = self.loaded
        return loaded.task if loaded else None

    @property
    def limits(self) -> ModelLimits:
        """What the model can take (every worker loads the same one); unknown until ready."""
        loaded = next((w.ready for w in self.workers if w.ready), None)
        return loaded.limits if loaded else ModelLimits()

    def max_input_tokens(self) -> int | None:
        return self.limits.max_input_tokens

    @property
    def engine(self) -> tuple[Engine, str] | None:
        """What runs the loaded workers' forward pass, and why; None before one loaded."""
        loaded = next((w.ready for w in self.workers if w.ready), None)
        return (loaded.engine, loaded.engine_reason) if loaded else None

    def idle_workers(self) -> int:
        if self._holding_cores():
            return 0
        idle = sum(w.state is WorkerState.IDLE for w in self.workers)
        return max(0, idle - len(self._retries))

    def batch_cap(self) -> int | None:
        """The most items a `submit` should carry now (None: no limit of the workers')."""
        caps = [w.batch_cap for w in self.workers if w.state is WorkerState.IDLE and w.batch_cap]
        return min(caps, default=None)

    def submit(
        self, inputs: Sequence[Any], params: Mapping[str, Any]
    ) -> asyncio.Future[BatchResult]:
        # the scheduler may send a second batch in the same breath as a lone item that
        # took every core: it runs on a free worker anyway (briefly one thread too many)
        worker = self._next_idle(despite_hold=True)
        if worker is None or self._retries:
            raise ServiceUnavailable("no model worker is free")
        future = self._running_loop.create_future()
        batch_id = next(self._batch_ids)
        refused = [self._is_poison(value, params) for value in inputs]
        if not any(refused):
            self._send(worker, Job(tuple(inputs), params, future, batch_id))
            return future
        log.warning("refused %d input(s) that crashed a worker before", sum(refused))
        if self.metrics is not None:
            self.metrics.drop("poison", sum(refused))
        if all(refused):
            future.set_result(BatchResult(batch_id, (REFUSED_POISON,) * len(inputs), 0.0))
            return future
        kept = tuple(value for value, bad in zip(inputs, refused, strict=True) if not bad)
        inner = self._running_loop.create_future()
        self._send(worker, Job(kept, params, inner, batch_id))
        slots = [REFUSED_POISON if bad else None for bad in refused]
        self._watch(self._assemble(future, batch_id, slots, [inner]))
        return future

    def _is_poison(self, value: Any, params: Mapping[str, Any]) -> bool:
        # hashing every input costs more than the rest of a submit: skip it while no
        # input has crashed a worker yet
        return bool(self.poison) and PoisonMemory.key(value, params) in self.poison

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int:
        """A new stream id; put it in a batch's params to get its tokens as they come."""
        stream_id = next(self._stream_ids)
        self._token_listeners[stream_id] = on_token
        return stream_id

    def close_stream(self, stream_id: int) -> None:
        """Forget a stream; a worker still generating for it stops at its next token."""
        if self._token_listeners.pop(stream_id, None) is None:
            return
        for worker in self.workers:  # only the worker running that stream id reacts
            if worker.cancelled_stream is not None:
                worker.cancelled_stream.value = stream_id

    async def shutdown(self, wait: bool = True) -> None:
        """Answer what is still held (503), and stop every worker.

        A busy worker cannot read a request to exit until its batch ends, and a loading
        one may take minutes: both are killed at once (the caller's grace period is
        over). An idle one is asked to exit and given `EXIT_TIMEOUT` seconds (none
        without `wait`), then killed: the shutdown ends within that bound.
        """
        self._closing = True
        stopping = ServiceUnavailable("server shutting down")
        while self._retries:
            _settle(self._retries.popleft().future, error=stopping)
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
            self._take_job(worker, error=stopping)
        timeout = EXIT_TIMEOUT if wait else 0.0
        await asyncio.gather(
            *(
                asyncio.to_thread(_join_or_kill, w.process, timeout)
                for w in self.workers
                if w.process
            )
        )
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

    def _next_idle(self, *, despite_hold: bool = False) -> WorkerHandle | None:
        if self._holding_cores() and not despite_hold:
            return None
        return next((w for w in self.workers if w.state is WorkerState.IDLE), None)

    def _holding_cores(self) -> bool:
        """A lone item runs on every core: the other CPU workers wait until it is done."""
        holder = self._all_cores
        return holder is not None and holder.state is WorkerState.BUSY

    def _send(self, worker: WorkerHandle, job: Job) -> None:
        worker.state = WorkerState.BUSY
        worker.job = job
        if self.batch_timeout:
            job.watchdog = self._running_loop.call_later(
                self.batch_timeout, self._on_batch_timeout, worker, job
            )
        try:
            threads = self._threads_for(worker, len(job.inputs))
            batch = Batch(job.batch_id, job.inputs, dict(job.params), threads)
            assert worker.conn is not None, "spawned workers have a pipe"
            worker.conn.send(batch)
        except (OSError, ValueError) as exc:  # the pipe broke: the reader will see the exit
            log.warning("worker %s: could not send a batch: %s", worker.label, exc)

    def _threads_for(self, worker: WorkerHandle, size: int) -> int | None:
        """With `share_cores`, CPU workers (of every served model) split the cores evenly,
        except that a batch of one item with no other CPU worker busy gets every core
        (low-load latency) and holds them: no other CPU worker of this model starts until
        it is done, since OpenMP threads that outnumber the cores stall each other. Another
        model's workers are not held back (one model never waits for another's work)."""
        if not self.share_cores or worker.config.device != "cpu":
            return None
        if self._all_cores is worker:
            self._all_cores = None
        cpu_workers = self.core_share.workers
        cores = self.core_share.cores
        others_busy = any(w.state is WorkerState.BUSY for w in cpu_workers if w is not worker)
        if size == 1 and not others_busy:
            self._all_cores = worker
            return cores
        return max(1, cores // len(cpu_workers))

    def _pump(self) -> None:
        """Give free workers the retries first, then tell the scheduler who is free."""
        while self._retries and (worker := self._next_idle()) is not None:
            self._send(worker, self._retries.popleft())
        if self.idle_workers():
            self._notify_idle()

    def _take_job(self, worker: WorkerHandle, *, error: Exception | None = None) -> Job | None:
        """Detach the worker's job (stopping its watchdog); fail it with `error` if given."""
        job, worker.job = worker.job, None
        if job is not None:
            if job.watchdog is not None:
                job.watchdog.cancel()
            if error is not None:
                _settle(job.future, error=error)
        return job

    def _retry_alone(self, job: Job) -> None:
        """After a crash, run each item of the lost batch alone, ahead of the queue."""
        futures = []
        for value in job.inputs:
            future = self._running_loop.create_future()
            key = PoisonMemory.key(value, job.params)
            self._retries.append(Job((value,), job.params, future, job.batch_id, key))
            futures.append(future)
        self._watch(self._assemble(job.future, job.batch_id, [None] * len(futures), futures))

    async def _assemble(
        self,
        target: asyncio.Future[BatchResult],
        batch_id: int,
        slots: list[Any],
        parts: list[asyncio.Future[BatchResult]],
    ) -> None:
        """Fill the empty `slots` in order from the outputs of `parts`; answer `target`."""
        try:
            results = await asyncio.gather(*parts)
        except Exception as exc:  # noqa: BLE001 - handed on to whoever waits for the batch
            _settle(target, error=exc)
            return
        outputs = iter(output for result in results for output in result.outputs)
        filled = tuple(next(outputs) if slot is None else slot for slot in slots)
        seconds = sum(result.compute_seconds for result in results)
        _settle(target, result=BatchResult(batch_id, filled, seconds))

    def _watch(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = self._running_loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_batch_timeout(self, worker: WorkerHandle, job: Job) -> None:
        if worker.job is not job:
            return
        log.error(
            "worker %s: a batch of %d ran over %.0f s; killing process %s",
            worker.label,
            len(job.inputs),
            self.batch_timeout,
            worker.pid,
        )
        self._take_job(worker)
        _settle(job.future, result=BatchResult(job.batch_id, (TIMED_OUT,) * len(job.inputs), 0.0))
        worker.state = WorkerState.DEAD  # until the reader sees it exit and restarts it
        if worker.process is not None:
            worker.process.kill()

    # --- process lifecycle ------------------------------------------------------------

    def _spawn(self, worker: WorkerHandle) -> None:
        batches_in, batches_out = self._context.Pipe(duplex=False)
        replies_in, replies_out = self._context.Pipe(duplex=False)
        worker.cancelled_stream = self._context.Value("q", 0, lock=False)  # a stream to stop
        process = self._context.Process(
            target=worker_main,
            args=(batches_in, replies_out, worker.config, worker.label, worker.cancelled_stream),
            name=f"rawserve-worker-{worker.index}",
            daemon=True,
        )
        process.start()
        batches_in.close()
        replies_out.close()  # the worker holds the only write end: its exit is our EOF
        worker.process, worker.conn = process, batches_out
        worker.state = WorkerState.LOADING
        worker.ready = None
        worker.batch_cap = None
        worker.started_at = self.clock()
        log.info(
            "worker %s: started (pid %d, device %s)",
            worker.label,
            process.pid,
            worker.config.device,
        )
        fd = replies_in.fileno()
        os.set_blocking(fd, False)
        reader = MessageReader()
        self._running_loop.add_reader(fd, self._on_readable, worker, replies_in, reader, process)

    def _on_readable(
        self,
        worker: WorkerHandle,
        replies: Connection,
        reader: MessageReader,
        process: BaseProcess,
    ) -> None:
        """The worker's pipe has bytes (or its end): hand each whole message on."""
        fd = replies.fileno()
        try:
            messages = reader.read(fd)
        except Exception:  # noqa: BLE001 - a pipe we cannot read is a dead worker
            log.exception("worker %s: unreadable message; stopping it", worker.label)
            messages = []
            reader.closed = True
            process.kill()
        for message in messages:
            self._on_message(worker, message)
        if reader.closed:  # end of file: the worker has exited (or is about to)
            self._running_loop.remove_reader(fd)
            replies.close()
            self._watch(self._reap(worker, process))

    async def _reap(self, worker: WorkerHandle, process: BaseProcess) -> None:
        """Wait for a worker whose pipe has closed to exit (killing it if it lingers)."""
        await asyncio.to_thread(_join_or_kill, process, STOP_TIMEOUT)
        self._on_exit(worker, process)

    def _on_message(self, worker: WorkerHandle, message: Any) -> None:
        if isinstance(message, TokenChunk):
            listener = self._token_listeners.get(message.stream_id)
            if worker.job is not None:
                worker.job.streamed = True
            if listener is not None:  # None: the stream's client has gone
                listener(message)
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
            worker.ready = message
            worker.state = WorkerState.IDLE
            worker.failed_restarts = 0
            warmed = message.warmup_seconds
            log.info(
                "worker %s: %s model ready on %s (engine %s) in %.1f s%s",
                worker.label,
                message.task,
                message.device,
                message.engine.value,
                message.load_seconds + (warmed or 0.0),
                f" (warm-up {warmed:.2f} s)" if warmed is not None else "",
            )
            if self._first_load and not self._first_load.done():
                self._first_load.set_result(message)
            self._pump()
        elif isinstance(message, WorkerLoadFailed):
            log.error("worker %s: could not load the model: %s", worker.label, message.message)
            if self._first_load and not self._first_load.done():
                self._first_load.set_exception(RuntimeError(message.message))
                self._closing = True  # a model that never loaded will not load on retry

    def _on_result(self, worker: WorkerHandle, result: BatchResult) -> None:
        job = worker.job
        if job is None or result.batch_id != job.batch_id:
            log.warning("worker %s: dropped a stale result", worker.label)
            return
        self._take_job(worker)
        if worker.state is WorkerState.BUSY:
            worker.state = WorkerState.IDLE
        worker.backoff = RESTART_BACKOFF_FIRST  # it works: forget earlier crashes
        worker.crashes = 0
        if result.effective_batch_cap != worker.batch_cap:
            log.warning(
                "worker %s: effective batch cap now %s (out of memory earlier)",
                worker.label,
                result.effective_batch_cap or "the configured maximum",
            )
            worker.batch_cap = result.effective_batch_cap
        _settle(job.future, result=result)
        if not self._closing:
            self._pump()

    def _on_exit(self, worker: WorkerHandle, process: BaseProcess) -> None:
        if process is not worker.process:
            return
        was_loading = worker.state.starting
        worker.state = WorkerState.DEAD
        if self._closing:
            self._take_job(worker, error=ServiceUnavailable("server shutting down"))
            return
        job = self._take_job(worker)
        if job is not None and job.streamed:  # a rerun would repeat the tokens already sent
            outputs = (CRASHED_MID_STREAM,) * len(job.inputs)
            _settle(job.future, result=BatchResult(job.batch_id, outputs, 0.0))
        elif job is not None and job.poison_key is not None:
            self._on_lone_crash(worker, job, job.poison_key)
        elif job is not None:
            self._retry_alone(job)
        if was_loading:
            worker.failed_restarts += 1
        else:
            worker.crashes += 1
        log.error(
            "worker %s: process %d exited with code %s%s%s; restarting in %.1f s",
            worker.label,
            process.pid,
            process.exitcode,
            " while loading" if was_loading else "",
            f" holding a batch of {len(job.inputs)}" if job else "",
            worker.backoff,
        )
        worker.restarts += 1
        self._running_loop.call_later(worker.backoff, self._respawn, worker)
        worker.backoff = min(worker.backoff * 2, RESTART_BACKOFF_MAX)
        self._pump()  # another worker may be free for the retries

    def _on_lone_crash(self, worker: WorkerHandle, job: Job, key: str) -> None:
        """An input running alone took its worker down: quarantine it after the last
        strike, else run it alone once more."""
        if not self.poison.crashed(key):
            log.warning(
                "worker %s: an input running alone crashed the worker; running it alone "
                "once more (quarantined after %d such crashes)",
                worker.label,
                self.poison.strikes,
            )
            self._retries.append(replace(job, watchdog=None))
            return
        log.error(
            "worker %s: one input crashed the worker %d times on its own; it is refused "
            "for the next %.0f s",
            worker.label,
            self.poison.strikes,
            self.poison.seconds,
        )
        if self.metrics is not None:
            self.metrics.drop("poison")
        _settle(job.future, result=BatchResult(job.batch_id, (CRASHED_ALONE,), 0.0))

    def _respawn(self, worker: WorkerHandle) -> None:
        if not self._closing and worker.state is WorkerState.DEAD:
            self._spawn(worker)

    def _notify_idle(self) -> None:
        if self.on_idle is not None:
            self.on_idle()


def _join_or_kill(process: BaseProcess, timeout: float) -> None:
    process.join(timeout=timeout)
    if process.exitcode is None:
        process.kill()
        process.join()


def _settle(
    future: asyncio.Future[BatchResult],
    *,
    result: BatchResult | None = None,
    error: BaseException | None = None,
) -> None:
    if future.done():
        return
    if result is not None:
        future.set_result(result)
    else:
        future.set_exception(error or ServiceUnavailable("no result"))

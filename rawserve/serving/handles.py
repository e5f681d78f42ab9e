"""One worker process as the pool holds it (`WorkerHandle`), and the batches on their way
through it (`Job`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from rawserve.serving.refusals import Reason, Refused
from rawserve.serving.status import WorkerState, WorkerStatus
from rawserve.serving.supervision import WorkerRecord
from rawserve.shared.messages import BatchResult, Control, WorkerConfig, WorkerReady


class SharedInt(Protocol):
    """An integer in shared memory (multiprocessing's Value)."""

    value: int


@dataclass(eq=False)
class Job:
    """A batch on its way through a worker, and the future that waits for it."""

    inputs: tuple[Any, ...]
    params: Mapping[str, Any]
    control: Control
    future: asyncio.Future[BatchResult]
    batch_id: int
    poison_key: str | None = None  # set on a one-item retry after a crash
    watchdog: asyncio.TimerHandle | None = None
    streamed: bool = False  # tokens of it reached a client: it cannot run again unseen
    waited: float = 0.0  # seconds it waited in the worker behind the batch before it


class WorkerHandle:
    """One worker process, its pipe, the batch it is computing and the one behind it."""

    def __init__(self, index: int, config: WorkerConfig, record: WorkerRecord):
        self.index = index
        self.config = config
        self.state = WorkerState.DEAD
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None  # batches go out on it
        # the id of a stream whose client left, shared with the process: it stops generating
        self.cancelled_stream: SharedInt | None = None
        self.job: Job | None = None  # the batch it is computing
        # the batch sent behind it, waiting in the worker (two in flight: `overlap`)
        self.queued: Job | None = None
        self.queued_at = 0.0  # when `queued` was sent
        self.overlap = False  # it may hold a second batch (decided once it is ready)
        self.ready: WorkerReady | None = None
        self.started_at = 0.0
        self.record = record  # its restarts and crashes, counted by the supervisor
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
            restarts=self.record.restarts,
            batch_cap=self.batch_cap,
            warmup_seconds=self.ready.warmup_seconds if self.ready else None,
            engine=self.ready.engine.value if self.ready else None,
            engine_reason=self.ready.engine_reason if self.ready else None,
            dtype_reason=self.ready.dtype_reason if self.ready else None,
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


async def assemble(
    target: asyncio.Future[BatchResult],
    batch_id: int,
    slots: list[Any],
    parts: list[asyncio.Future[BatchResult]],
) -> None:
    """Fill the empty `slots` in order from the outputs of `parts`; answer `target`."""
    try:
        results = await asyncio.gather(*parts)
    except Exception as exc:  # noqa: BLE001 - handed on to whoever waits for the batch
        settle(target, error=exc)
        return
    outputs = iter(output for result in results for output in result.outputs)
    filled = tuple(next(outputs) if slot is None else slot for slot in slots)
    seconds = sum(result.compute_seconds for result in results)
    settle(target, result=BatchResult(batch_id, filled, seconds))

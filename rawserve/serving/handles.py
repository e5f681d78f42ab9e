"""One worker process as the pool holds it (`WorkerHandle`), and the batch on its way
through it (`Job`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

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


class WorkerHandle:
    """One worker process, its pipe, and the batch it is computing."""

    def __init__(self, index: int, config: WorkerConfig, record: WorkerRecord):
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
        )

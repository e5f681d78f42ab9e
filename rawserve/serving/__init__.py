"""The serving side: everything between an admitted request and a model worker.

It owns the queue and its decisions (`core`, `batching`: pure functions of a clock), the
scheduler's async driver (`driver`), the worker pool that spawns, feeds and reaps the
worker processes (`pool`, with `handles`, `cores` and the token-stream registry
`streams`), the pure supervision core that decides restarts, retries and quarantine
(`supervision`), and the domain refusals and status types (`refusals`, `status`).

Its face is `Serving` (`face`): one typed Protocol of plain-data messages, implemented
by `ModelService` (`service`). The API side imports nothing else from here. It never
imports `rawserve.http`, the api, the protocol, h11 or torch.
"""

from rawserve.serving.core import SchedulerCore
from rawserve.serving.cores import CoreShare
from rawserve.serving.driver import Scheduler
from rawserve.serving.face import (
    ItemResult,
    Reason,
    Refusal,
    Refused,
    Serving,
    ServingStatus,
)
from rawserve.serving.pool import WorkerPool
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState, WorkerState, WorkerStatus

__all__ = [
    "CoreShare",
    "ItemResult",
    "LoadState",
    "ModelService",
    "Reason",
    "Refusal",
    "Refused",
    "Scheduler",
    "SchedulerCore",
    "Serving",
    "ServingStatus",
    "WorkerPool",
    "WorkerState",
    "WorkerStatus",
]

"""What the serving side says of its workers: their states and plain-data snapshots, as
`/info`, `/ready` and `/metrics` show them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerState(enum.Enum):
    # its process not started yet: a first start times the CPU layout before its workers
    # start (it said "dead" meanwhile, and an alert on dead workers fired at every such
    # start)
    WAITING = "waiting"
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
    """Why a model takes no work now, for /ready's body."""

    LOADING = "loading"
    WARMING = "warming"  # loaded, warming up: ready in a moment
    RESTARTING = "restarting"
    UNHEALTHY = "unhealthy"  # every worker keeps dying (as /health says)
    # the serving process has published nothing lately (stopped, stuck): an HTTP
    # process's /ready says so, as a single process would not answer it
    STALLED = "stalled"


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
    dtype_reason: str | None = None  # why that precision, once loaded
    bfloat16_trial: str | None = None  # what --dtype bfloat16 would give (None: not tried)
    attention: str | None = None  # the attention kernels chosen on a GPU (None: torch's)
    cuda_graphs: str | None = None  # whether its forward pass is replayed (None: none tried)
    generation: str | None = None  # continuous or static, and why (None: not generating)
    untrained: str | None = None  # the weights made at random, in words (None: none)
    sequences: int = 0  # a continuous generation worker: sequences it runs at once
    running: int = 0  # ... and how many it runs now

    @property
    def serving(self) -> bool:
        return self.state.serving

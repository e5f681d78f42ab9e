"""What the worker pool reports: each worker's state, the pool's health and load state,
and the facts its loaded workers gave of their model (task, limits, engine). Read-only:
`rawserve.serving.pool.WorkerPool` is built on it and does the I/O."""

from __future__ import annotations

import math
from collections.abc import Callable

from rawserve.serving.handles import WorkerHandle
from rawserve.serving.status import LoadState, WorkerState, WorkerStatus
from rawserve.serving.supervision import PoisonMemory, Supervisor, load_state
from rawserve.shared.messages import Engine, ModelLimits, WorkerReady


class PoolReports:
    """The pool's reports, read from its worker handles and its supervisor."""

    workers: list[WorkerHandle]
    supervisor: Supervisor
    clock: Callable[[], float]
    last_ready: WorkerReady | None  # what a worker last said of the model when it loaded
    # when the first load began, where that was before any worker started (a first start's
    # layout trial loads the model to time it): /ready counts the load from then
    preparing_since: float | None

    @property
    def ready(self) -> bool:
        return any(w.state.serving for w in self.workers)

    def load_state(self) -> tuple[LoadState, float | None]:
        """While no worker is ready: loading, restarting or unhealthy, and for how many
        seconds the longest load has run (None when no worker is loading right now)."""
        starting = [(w.state, w.started_at) for w in self.workers if w.state.starting]
        since = self.preparing_since
        if since is not None and self.last_ready is None:  # the first load, trial included
            starting = [(s, min(at, since)) for s, at in starting] or [(WorkerState.LOADING, since)]
        supervisor = self.supervisor
        return load_state(starting, supervisor.restarted, self.clock(), supervisor.healthy)

    def serving_again_at(self) -> float | None:
        """While no worker serves: when one should again (`Supervisor.serving_again_at`)."""
        return self.supervisor.serving_again_at([(w.state, w.started_at) for w in self.workers])

    def back_in(self) -> float | None:
        """While no worker serves: the seconds until one should again; None where that is
        not known (a first load, no worker on its way, every worker dying)."""
        at = self.serving_again_at()
        if at is None or at == math.inf:
            return None
        return max(at - self.clock(), 0.0)

    def status(self) -> list[WorkerStatus]:
        """Each worker's state, for /info and /metrics."""
        return [worker.status() for worker in self.workers]

    @property
    def healthy(self) -> bool:
        """False once every worker keeps dying (`Supervisor.healthy`)."""
        return self.supervisor.healthy

    @property
    def poison(self) -> PoisonMemory:
        """The inputs that crashed a worker while running alone."""
        return self.supervisor.poison

    @property
    def loaded(self) -> WorkerReady | None:
        """What a loaded worker said of its model (task, dtype, details, tokenizer); None
        until one has loaded. While every worker restarts, the last one's: a restart loads
        the same model, and the routes still pick a model by its task (of several, a route
        that names none goes to the first that fits, never to one restarting that does not)."""
        return next((w.ready for w in self.workers if w.ready), self.last_ready)

    @property
    def task(self) -> str | None:
        loaded = self.loaded
        return loaded.task if loaded else None

    @property
    def limits(self) -> ModelLimits:
        """What the model can take (every worker loads the same one); unknown until ready."""
        loaded = self.loaded
        return loaded.limits if loaded else ModelLimits()

    @property
    def engine(self) -> tuple[Engine, str] | None:
        """What runs the loaded workers' forward pass, and why; None before one loaded."""
        loaded = self.loaded
        return (loaded.engine, loaded.engine_reason) if loaded else None

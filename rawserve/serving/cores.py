"""How CPU workers split the cores this process may run on (without `--threads`).

The CPU workers of every served model split the cores evenly, except that a batch of one
item with no other CPU worker busy gets every core (low-load latency); a continuous
generation worker always keeps its even share (rawserve.serving.pool says why). Each
model's pool registers its CPU workers in the one `CoreShare` of the server.
"""

from __future__ import annotations

from typing import Protocol

from rawserve.serving.status import WorkerState
from rawserve.shared.devices import cpu_cores


class CpuWorker(Protocol):
    @property
    def state(self) -> WorkerState: ...


class CoreShare:
    """The CPU workers of every model the server runs: together they split the machine's
    cores (each model's pool registers its CPU workers here)."""

    def __init__(self, cores: int | None = None):
        self.cores = cores or cpu_cores()  # read once: each call asks the kernel
        self.workers: list[CpuWorker] = []

    def threads_for(self, worker: CpuWorker, size: int) -> tuple[int, bool]:
        """Threads for a batch of `size` items on `worker`, and whether it takes every
        core (a lone item while no other CPU worker is busy)."""
        others_busy = any(w.state is WorkerState.BUSY for w in self.workers if w is not worker)
        if size == 1 and not others_busy:
            return self.cores, True
        return self.even_share(), False

    def even_share(self) -> int:
        """Each CPU worker's threads when they split the cores evenly."""
        return max(1, self.cores // len(self.workers))

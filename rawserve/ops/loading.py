"""Progress lines in the log while the model loads (which can take minutes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

LOAD_PROGRESS_SECONDS = 5.0  # how often "still loading" is logged while a model loads


async def log_loading_progress(
    loaded: asyncio.Future[Any],
    log: logging.Logger,
    *,
    interval: float = LOAD_PROGRESS_SECONDS,
    clock: Callable[[], float] = time.monotonic,
    waiting_for: Callable[[], Sequence[str]] | None = None,
) -> None:
    """Log "still loading the model (N s)" every `interval` until `loaded` is done; with
    several models, `waiting_for` names those not ready yet, and the line names them (a
    slow or stuck one among several is otherwise not told apart)."""
    started = clock()
    while not loaded.done():
        try:
            await asyncio.wait_for(asyncio.shield(loaded), interval)
        except TimeoutError:
            elapsed = clock() - started
            extra: dict[str, Any] = {"elapsed_seconds": elapsed}
            if waiting_for is None:
                log.info("still loading the model (%.0f s)", elapsed, extra=extra)
                continue
            names = list(waiting_for())
            extra["models"] = names
            log.info("still loading %s (%.0f s)", ", ".join(names), elapsed, extra=extra)
        except Exception:  # noqa: BLE001 - the caller reports a failed load
            return

"""Progress lines in the log while the model loads (which can take minutes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

LOAD_PROGRESS_SECONDS = 5.0  # how often "still loading" is logged while a model loads


async def log_loading_progress(
    loaded: asyncio.Future[Any],
    log: logging.Logger,
    *,
    interval: float = LOAD_PROGRESS_SECONDS,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Log "still loading (N s)" every `interval` until `loaded` is done."""
    started = clock()
    while not loaded.done():
        try:
            await asyncio.wait_for(asyncio.shield(loaded), interval)
        except TimeoutError:
            elapsed = clock() - started
            log.info(
                "still loading the model (%.0f s)", elapsed, extra={"elapsed_seconds": elapsed}
            )
        except Exception:  # noqa: BLE001 - the caller reports a failed load
            return

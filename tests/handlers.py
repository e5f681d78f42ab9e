"""Custom `--handler` factories for tests: each returns f(inputs: list, **params) -> list."""

from __future__ import annotations

import os
import time


def echo():
    """Answers each input with the batch it was computed in (to observe batching)."""

    def handle(inputs, **params):
        return [
            {"input": item, "params": params, "batch": list(inputs), "pid": os.getpid()}
            for item in inputs
        ]

    return handle


def slow_loading():
    """Takes a while to load, then echoes."""
    time.sleep(float(os.environ.get("RAWSERVE_TEST_LOAD_SECONDS", "3")))
    return echo()


def sleepy():
    """Sleeps `sleep` seconds (a parameter) per batch, then echoes."""
    inner = echo()

    def handle(inputs, sleep=0.0, **params):
        time.sleep(sleep)
        return inner(inputs, **params)

    return handle


def failing_on_marker():
    """Raises ValueError on inputs containing "poison" (a bad input), echoes the rest."""
    inner = echo()

    def handle(inputs, **params):
        if any("poison" in str(item) for item in inputs):
            raise ValueError("this input is poison")
        return inner(inputs, **params)

    return handle

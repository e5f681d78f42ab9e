"""Which event loop runs the server (`--loop auto|asyncio|uvloop`): uvloop where it is
installed and asked for (auto), asyncio's own otherwise. The choice is logged and shown
in /info."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

LOOPS = ("auto", "asyncio", "uvloop")
T = TypeVar("T")


def chosen_loop(option: str) -> str:
    """The loop `option` means here: "uvloop" or "asyncio"."""
    if option == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return option


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if loop == "uvloop":
        import uvloop  # an optional dependency: only when chosen

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """Run `main` to its end on a new event loop of the kind `loop` names."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)

"""`--handler module:factory`: a user's callable instead of a transformers model.

Worker process only.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from rawserve.shared.messages import NO_CONTROL, Control
from rawserve.tasks import CUSTOM_TASK
from rawserve.worker.runner import Runner


class HandlerStopped(RuntimeError):
    """The handler raised an exception that is no `Exception` (SystemExit and the like)."""


class HandlerRunner(Runner):
    """`--handler module:factory`: the factory returns `f(inputs: list, **params) -> list`."""

    def __init__(self, spec: str, device: str):
        module_name, _, factory_name = spec.partition(":")
        # a module of the folder the server was started in, as `python -m rawserve` finds it
        # (its sys.path[0]); the `rawserve` command's sys.path starts at its script's folder
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        factory = getattr(importlib.import_module(module_name), factory_name or "handler")
        self.handler = factory()
        # refused at load, not served as ready with every request failing
        if not callable(self.handler):
            raise TypeError(
                f"--handler {spec}: the factory returned {type(self.handler).__name__}, "
                "not a callable f(inputs, **params)"
            )
        called = type(self.handler).__call__  # an instance's own `async def __call__`
        if inspect.iscoroutinefunction(self.handler) or inspect.iscoroutinefunction(called):
            raise TypeError(
                f"--handler {spec}: the factory returned an async function; "
                "the handler is called in the worker's thread: make it a plain def"
            )
        super().__init__(CUSTOM_TASK, device)

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        try:
            return list(self.handler(inputs, **params))
        except Exception:
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt (the worker ignores
            # SIGINT: the handler raised it), a class of its own: this input failed, and
            # the worker lives on rather than dying of it (and again on the input alone)
            raise HandlerStopped(f"the handler raised {type(exc).__name__}: {exc}") from exc

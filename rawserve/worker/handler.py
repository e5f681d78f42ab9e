"""`--handler module:factory`: a user's callable instead of a transformers model.

Worker process only.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from rawserve.shared.messages import NO_CONTROL, Control
from rawserve.tasks import CUSTOM_TASK
from rawserve.worker.runner import Runner


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
        super().__init__(CUSTOM_TASK, device)

    def run(
        self, inputs: list[Any], params: dict[str, Any], control: Control = NO_CONTROL
    ) -> list[Any]:
        return list(self.handler(inputs, **params))

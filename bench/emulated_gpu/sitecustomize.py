"""A GPU's flat pass cost, emulated on a CPU for a benchmark's servers (never imported by
rawserve itself).

With `RAWSERVE_BENCH_PASS_FLOOR_MS` set and this folder first on `PYTHONPATH`, every
process started so (a server's workers too: spawned, they run `site` afresh) gives each
GPT-2 model it builds a forward pre-hook that waits that long, the core idle, as a GPU
step costs about the same whatever its rows while the host waits: what batching many
rows or joiners into one pass wins there shows on two cores (`bench.generation_serving
--pass-floor-ms`). The hook is added when transformers' GPT-2 module is first imported,
so a process that never loads it pays nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time
from typing import Any

FLOOR_SECONDS = float(os.environ.get("RAWSERVE_BENCH_PASS_FLOOR_MS") or 0) / 1000
GPT2 = "transformers.models.gpt2.modeling_gpt2"


def floored(module: Any) -> None:
    """GPT-2 models built from `module` wait FLOOR_SECONDS before every forward pass."""
    model_class = module.GPT2LMHeadModel
    built = model_class.__init__

    @functools.wraps(built)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        self.register_forward_pre_hook(lambda model, inputs: time.sleep(FLOOR_SECONDS))

    model_class.__init__ = __init__


class FloorOnImport(importlib.abc.MetaPathFinder):
    """Finds transformers' GPT-2 module as usual, and floors its models once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != GPT2:
            return None
        sys.meta_path.remove(self)  # found the usual way from here on
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            floored(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if FLOOR_SECONDS > 0:
    sys.meta_path.insert(0, FloorOnImport())

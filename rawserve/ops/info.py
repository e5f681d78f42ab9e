"""Facts for `GET /info` that the server knows without its model: installed versions.

Versions come from the installed distributions' metadata, so the server process still
never imports torch or transformers.
"""

from __future__ import annotations

import functools
import importlib.metadata

VERSIONED = ("rawserve", "transformers", "torch", "onnxruntime", "h11", "prometheus_client")


@functools.cache
def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found

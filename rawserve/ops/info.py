"""Facts for `GET /info` that the server knows without its model: installed versions.

Versions come from the installed distributions' metadata, so the server process still
never imports torch or transformers.
"""

from __future__ import annotations

import functools

from rawserve.shared import installed

VERSIONED = ("rawserve", "transformers", "torch", "onnxruntime", "h11", "prometheus_client")


@functools.cache
def versions() -> dict[str, str | None]:
    return {name: installed.version(name) for name in VERSIONED}

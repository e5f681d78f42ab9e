"""The token-stream registry: which listener takes the tokens of each streamed generation.

A stream id is handed out when a stream opens and travels with its batch to the worker,
which sends each new token back as a `TokenChunk` while the batch is still running.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from rawserve.shared.messages import TokenChunk


class TokenStreams:
    def __init__(self) -> None:
        self._listeners: dict[int, Callable[[TokenChunk], None]] = {}
        self._ids = itertools.count(1)

    def open(self, on_token: Callable[[TokenChunk], None]) -> int:
        """A new stream id whose tokens go to `on_token`."""
        stream_id = next(self._ids)
        self._listeners[stream_id] = on_token
        return stream_id

    def close(self, stream_id: int) -> bool:
        """Forget a stream; False when it was not open (closed before, or never)."""
        return self._listeners.pop(stream_id, None) is not None

    def deliver(self, chunk: TokenChunk) -> None:
        listener = self._listeners.get(chunk.stream_id)
        if listener is not None:  # None: the stream's client has gone
            listener(chunk)

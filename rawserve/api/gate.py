"""Whether the server takes inference work now: the one owner of "draining", and the one
place that refuses work while a model is not ready."""

from __future__ import annotations

from rawserve.api.served import ServedModel
from rawserve.http.errors import ServiceUnavailable

LOADING_RETRY_AFTER = 5.0  # seconds a client should wait while a model loads


class Gate:
    def __init__(self) -> None:
        self.draining = False  # set once, on SIGTERM/SIGINT

    def start_draining(self) -> None:
        self.draining = True

    def open_for(self, model: ServedModel) -> bool:
        """Whether `model` takes work now: `check` would not raise."""
        return not self.draining and model.workers.ready

    def check(self, model: ServedModel) -> None:
        """Raise 503 unless `model` takes work now (not draining, a worker ready)."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down")
        if not model.workers.ready:
            raise ServiceUnavailable("the model is loading", retry_after=LOADING_RETRY_AFTER)

"""A served model as the routes see it: its name, its queue (the scheduler) and its workers
(the executor), each described by the `Protocol` of what the routes need from it.

Several models may be served at once; `ServedModels` finds the one a request names, the
first being the default for routes that name none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rawserve.executor import LoadState, WorkerStatus
from rawserve.http.errors import ModelNotFound
from rawserve.scheduling.core import ItemResult
from rawserve.shared.messages import ModelLimits, TokenChunk, WorkerReady


class Queue(Protocol):
    """What the routes need from a model's scheduler (rawserve.scheduler.Scheduler)."""

    @property
    def full(self) -> bool: ...

    @property
    def max_batch_size(self) -> int: ...

    def refuse_if_full(self) -> None:
        """Raise the 503 a request would get now because the queue is full."""
        ...

    async def run(
        self, inputs: Sequence[Any], params: Mapping[str, Any], deadline: float
    ) -> list[ItemResult]: ...


class Workers(Protocol):
    """What the routes need from a model's workers (rawserve.executor.Executor)."""

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def task(self) -> str | None: ...

    @property
    def limits(self) -> ModelLimits:
        """What the loaded model can take (unknown until a worker is ready)."""
        ...

    @property
    def loaded(self) -> WorkerReady | None:
        """What a loaded worker said of its model; None until one has loaded."""
        ...

    def load_state(self) -> tuple[LoadState, float | None]: ...

    def status(self) -> list[WorkerStatus]: ...

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int: ...

    def close_stream(self, stream_id: int) -> None: ...


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients call it: its alias, else the Hub id or the folder's name
    queue: Queue
    workers: Workers
    facts: Mapping[str, Any] = field(default_factory=dict)  # its options, for /info
    aliases: tuple[str, ...] = ()  # other names it answers to (the Hub id beside an alias)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class ServedModels:
    """The models of one server; the first is the default.

    A request names a model by any of its names (`POST /models/<name>`, the "model" field
    of the OpenAI routes); one that names none gets the default.
    """

    def __init__(self, models: Sequence[ServedModel]):
        if not models:
            raise ValueError("at least one model is served")
        self.all = list(models)
        self.default = self.all[0]
        self._by_name: dict[str, ServedModel] = {}
        for model in self.all:
            for name in model.names:
                if self._by_name.setdefault(name, model) is not model:
                    raise ValueError(f"two served models are both named {name!r}")

    @property
    def names(self) -> list[str]:
        """Every name a request may use, each model's own name first."""
        return list(self._by_name)

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (the default when it names none); 404 otherwise."""
        if name is None:
            return self.default
        model = self._by_name.get(name)
        if model is None:
            served = ", ".join(self._by_name)
            raise ModelNotFound(f"no model named {name[:100]!r} is served (served: {served})")
        return model

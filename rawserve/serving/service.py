"""One served model's serving side behind the face: its scheduler and its worker pool
together, as `Serving` (rawserve.serving.face) describes them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rawserve.serving.driver import RunEnd, RunningRequest
from rawserve.serving.face import ItemResult, ServingStatus
from rawserve.serving.refusals import Refusal
from rawserve.serving.status import LoadState, WorkerStatus
from rawserve.shared.messages import NO_CONTROL, Control, TokenChunk, WorkerReady


class Queue(Protocol):
    """What the service needs of a model's scheduler (rawserve.serving.driver.Scheduler)."""

    @property
    def full(self) -> bool: ...

    @property
    def headroom(self) -> float: ...

    def full_retry_after(self) -> float: ...

    @property
    def max_batch_size(self) -> int: ...

    @property
    def most_admitted(self) -> int: ...

    def admission(self, deadline: float | None = None) -> Refusal | None: ...

    def count_refusal(self) -> None: ...

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]: ...

    def begin(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control,
        on_end: RunEnd,
    ) -> RunningRequest: ...


class Workers(Protocol):
    """What the service needs of a model's workers (rawserve.serving.pool.WorkerPool)."""

    @property
    def ready(self) -> bool: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def loaded(self) -> WorkerReady | None: ...

    def load_state(self) -> tuple[LoadState, float | None]: ...

    def back_in(self) -> float | None: ...

    def status(self) -> list[WorkerStatus]: ...

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int: ...

    def close_stream(self, stream_id: int) -> None: ...


class ModelService:
    """A `Serving` made of a scheduler (`queue`) and the workers it feeds."""

    def __init__(self, queue: Queue, workers: Workers):
        self.queue = queue
        self.workers = workers

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        return await self.queue.run(inputs, params, deadline, control)

    def begin(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control,
        on_end: RunEnd,
    ) -> RunningRequest:
        """`run` that calls `on_end` instead of being awaited (rawserve.serving.driver's
        `Scheduler.begin`): how the serving process carries the HTTP processes' requests."""
        return self.queue.begin(inputs, params, deadline, control, on_end)

    def admission(self, deadline: float | None = None) -> Refusal | None:
        return self.queue.admission(deadline)

    def count_refusal(self) -> None:
        self.queue.count_refusal()

    @property
    def ready(self) -> bool:
        return self.workers.ready

    @property
    def full(self) -> bool:
        return self.queue.full

    @property
    def headroom(self) -> float:
        return self.queue.headroom

    @property
    def most_admitted(self) -> int:
        return self.queue.most_admitted

    @property
    def back_in(self) -> float | None:
        return self.workers.back_in()

    @property
    def loaded(self) -> WorkerReady | None:
        return self.workers.loaded

    def snapshot(self) -> ServingStatus:
        state, seconds = self.workers.load_state()
        return ServingStatus(
            ready=self.workers.ready,
            healthy=self.workers.healthy,
            full=(full := self.queue.full),
            full_retry_after=self.queue.full_retry_after() if full else None,
            max_batch_size=self.queue.max_batch_size,
            load_state=state,
            loading_seconds=seconds,
            workers=tuple(self.workers.status()),
            most_admitted=self.queue.most_admitted,
        )

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int:
        return self.workers.open_stream(on_token)

    def close_stream(self, stream_id: int) -> None:
        self.workers.close_stream(stream_id)

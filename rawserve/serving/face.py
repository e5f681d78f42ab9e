"""The serving side's face: what the API side needs of one served model, as one typed
`Protocol` (`Serving`) and the plain data that crosses it.

Submit items with a deadline (`run`; cancelling the call withdraws what is still
queued), receive their results (`ItemResult`, one per item, in order) and the tokens of
a streamed generation (`open_stream`, `TokenChunk`), be told when the queue is full
(`admission`), and read a status snapshot (`snapshot`, `ServingStatus`). A request that
gets no results ends in `Refused`, which carries a plain `Refusal`.

Everything that crosses it is plain data (frozen dataclasses, enums, JSON-like values),
so that a pipe can be put between the HTTP processes and the serving process without the
API side changing. The API side imports from `rawserve.serving` only what this module
names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rawserve.serving.refusals import (
    LOADING_RETRY_AFTER,
    Reason,
    Refusal,
    Refused,
    deadline_passed,
    shutting_down,
)
from rawserve.serving.status import LoadState, WorkerState, WorkerStatus
from rawserve.shared.messages import (
    EMBEDDING_ROUTE,
    NO_CONTROL,
    SPARSE_ROUTE,
    Control,
    FailureKind,
    ItemFailure,
    ModelLimits,
    TokenChunk,
    WorkerReady,
)

__all__ = [
    "EMBEDDING_ROUTE",
    "LOADING_RETRY_AFTER",
    "NO_CONTROL",
    "SPARSE_ROUTE",
    "Control",
    "FailureKind",
    "ItemFailure",
    "ItemResult",
    "LoadState",
    "ModelLimits",
    "Reason",
    "Refusal",
    "Refused",
    "Serving",
    "ServingStatus",
    "TokenChunk",
    "WorkerReady",
    "WorkerState",
    "WorkerStatus",
    "deadline_passed",
    "shutting_down",
]


@dataclass(frozen=True)
class ItemResult:
    """One item's answer: the task's output, or an `ItemFailure` (the model rejected the
    input, or failed on it), with how long it queued and the batch it ran in."""

    output: Any
    queue_seconds: float
    batch_size: int
    compute_seconds: float


@dataclass(frozen=True)
class ServingStatus:
    """One model's serving side at a moment, for `/health`, `/ready` and `/info`."""

    ready: bool  # a worker is loaded and warm
    healthy: bool  # False once every worker keeps dying
    full: bool  # the queue is at its bound
    max_batch_size: int  # items per model call (--max-batch-size)
    load_state: LoadState  # while not ready: loading, warming, restarting, unhealthy, stalled
    loading_seconds: float | None  # how long the longest load has run; None: none loading
    workers: tuple[WorkerStatus, ...]
    # the most items one request may ever be admitted with: --max-queue, and the rows of
    # workers that take one item at a time (None: not known here)
    most_admitted: int | None = None
    # while full: the seconds a refusal's Retry-After says now (None: the default wait)
    full_retry_after: float | None = None


class Serving(Protocol):
    """What the API side needs of one served model's serving side."""

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        """Queue `inputs` (sharing `params` and `control`) to be answered by `deadline`
        (a `time.monotonic()` time), and give their results in order. Raises `Refused`;
        cancelling the call withdraws the items still queued. With a `control.stream_id`
        (from `open_stream`; one input) its tokens go to that stream as they come."""
        ...

    def admission(self, deadline: float | None = None) -> Refusal | None:
        """The refusal any request would get now, whatever its body (the queue full, or,
        given the request's deadline, a `time.monotonic()` time, the wait for a
        generation's row past it), counted as rejected; None while it may be taken. Read
        before a request's body, so that a refusal under overload costs no reading,
        parsing or tokenizing."""
        ...

    def count_refusal(self) -> None:
        """A request refused before admission while the model's workers are down (a
        restart): counted as rejected, as the queue's own refusals are."""
        ...

    @property
    def ready(self) -> bool:
        """A worker is loaded and warm (read on every request: kept cheap)."""
        ...

    @property
    def full(self) -> bool: ...

    @property
    def most_admitted(self) -> int | None:
        """The most items one request may ever be admitted with (more are refused for
        good, never worth a retry): --max-queue, and the rows of workers that take one
        item at a time. None where that is not known yet."""
        ...

    @property
    def back_in(self) -> float | None:
        """While no worker serves (restarting): the seconds until one should again; None
        where that is not known (a first load, every worker dying)."""
        ...

    @property
    def loaded(self) -> WorkerReady | None:
        """What a loaded worker said of its model (task, limits, tokenizer); None until
        one has loaded."""
        ...

    def snapshot(self) -> ServingStatus: ...

    def open_stream(self, on_token: Callable[[TokenChunk], None]) -> int:
        """A new stream id: pass it to `run` to get its tokens as they come."""
        ...

    def close_stream(self, stream_id: int) -> None:
        """Forget a stream; a worker still generating for it stops at its next token."""
        ...

"""Where the serving side's refusals and failures become HTTP statuses: the one place.

The serving side speaks in domain terms (`Refusal` with its `Reason`, and an item's
`ItemFailure`); a client sees a status, a message and, where waiting helps, a
Retry-After. Every route gets its statuses from here.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from rawserve.http.errors import (
    GatewayTimeout,
    HTTPError,
    InternalError,
    PayloadTooLarge,
    ServiceUnavailable,
    UnprocessableInput,
)
from rawserve.serving.face import FailureKind, ItemFailure, ItemResult, Reason, Refusal

DEFAULT_RETRY_AFTER = 1.0  # seconds a client waits on a 503 that names no time
BUSY = (Reason.QUEUE_FULL, Reason.DEADLINE_UNREACHABLE)  # refusals many clients get at once
# A deadline a client did not choose (`--timeout`) is news to it: say how to ask for more.
LONGER_DEADLINE = "X-Request-Timeout asks for a longer deadline, in seconds"


def http_error(refusal: Refusal, longest_deadline: float | None = None) -> HTTPError:
    """The HTTP error a client gets for `refusal`; a deadline's names the header that asks
    for a longer one, and the most it may ask (`longest_deadline`: --max-timeout, where
    known), for a client that asked for more and was given that."""
    reason = refusal.reason
    longer = LONGER_DEADLINE
    if longest_deadline is not None:
        longer += f", up to {longest_deadline:g}"
    if reason is Reason.NEVER_ADMISSIBLE:  # a retry cannot help: never 503
        return PayloadTooLarge(refusal.message)
    if reason is Reason.DEADLINE_PASSED:
        return GatewayTimeout(f"{refusal.message}; {longer}")
    if reason is Reason.MODEL_FAILED:
        return InternalError(refusal.message)
    # queue full, deadline unreachable, no worker, loading, shutting down, no memory to
    # send it on: retry later
    retry_after = refusal.retry_after if refusal.retry_after is not None else DEFAULT_RETRY_AFTER
    if reason in BUSY:
        message = refusal.message
        if reason is Reason.DEADLINE_UNREACHABLE:
            message = f"{message}; {longer}"
        return ServiceUnavailable(message, retry_after=spread(retry_after), in_ms=True, busy=True)
    return ServiceUnavailable(refusal.message, retry_after=retry_after)


def spread(drain: float, draw: Callable[[], float] = random.random) -> float:
    """The wait to ask of one client refused because the queue is busy: somewhere in
    the drain time after the estimated one. Told the same wait, every client refused in
    a burst (the queue refuses at once, so a burst is many) comes back at the same
    instant, finds the queue full again and is refused again; spread, they come back at
    about the pace the queue frees room (64 openai SDK clients, default retries, on a
    queue of 4: 18-23 of them answered when told one wait, all 64 with it spread)."""
    return drain * (1.0 + draw())


def failure_error(failure: ItemFailure) -> HTTPError:
    """The HTTP error for one item the model failed on: the client's input (422), or
    the model itself (500, out of memory included)."""
    if failure.kind is FailureKind.INPUT:
        return UnprocessableInput(failure.message)
    return InternalError(failure.message)


def unwrap(result: ItemResult) -> Any:
    """An item's output, or the HTTP error its failure stands for."""
    output = result.output
    if isinstance(output, ItemFailure):
        raise failure_error(output)
    return output


def unwrap_all(results: Sequence[ItemResult], names: Sequence[str] | None = None) -> list[Any]:
    """Every item's output, or the HTTP error of the first that failed; of several, its
    message says which input it was (of a list of texts, one without a mask failed the
    request 422 "No mask_token ([MASK]) found on the input", and its client could not
    tell which): as `names` calls each, where the inputs are not the body's one list.
    Where every input failed alike, the message says so ("each of the 3 inputs: ..."):
    the request's parameters may be at fault (a handler's unknown keyword was "the input
    at index 0"), or each input (none with a mask), and either way no one input is."""
    for index, result in enumerate(results):
        failure = result.output
        if isinstance(failure, ItemFailure):
            alike = failed_alike(results)
            which = (
                f"each of the {len(results)} inputs"
                if alike
                else input_name(index, len(results), names)
            )
            if which is not None:
                failure = replace(failure, message=f"{which}: {failure.message}")
            raise failure_error(failure)
    return [result.output for result in results]


def input_name(index: int, count: int, names: Sequence[str] | None) -> str | None:
    """What a failure's message calls the input at `index` of `count` (None: the only one)."""
    if names is not None:
        return names[index]
    return f"the input at index {index}" if count > 1 else None


def failed_alike(results: Sequence[ItemResult]) -> bool:
    """Whether each of several results failed, each with the same kind and message."""
    failures = [result.output for result in results]
    first = failures[0] if failures else None
    return (
        len(failures) > 1
        and isinstance(first, ItemFailure)
        and all(
            isinstance(other, ItemFailure)
            and (other.kind, other.message) == (first.kind, first.message)
            for other in failures
        )
    )

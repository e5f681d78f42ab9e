"""Why the serving side did not answer a request with results: refusals and failures as
domain values, with nothing of HTTP in them.

A `Refusal` is plain data (a reason, the message a client may read, and how long to wait
before a retry where one can help), so it can cross a pipe as it is; `Refused` is the
exception that carries one out of `Serving.run`. The API side maps each `Reason` to an
HTTP status in one place (`rawserve.api.outcomes`). A failure of one item, rather than of
the whole request, is an `ItemFailure` in that item's result (`rawserve.shared.messages`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# seconds a client should wait while no worker serves and nothing says when one will (a
# first load, every worker dying): what a new request and a waiting one are both told
LOADING_RETRY_AFTER = 5.0


class Reason(enum.Enum):
    QUEUE_FULL = "queue_full"  # the queue bound is hit: retry later
    DEADLINE_UNREACHABLE = "deadline_unreachable"  # the work ahead outlasts the deadline
    NEVER_ADMISSIBLE = "never_admissible"  # more items than the queue can ever hold
    NO_WORKER = "no_worker"  # no model worker is free, or none has loaded yet
    LOADING = "loading"  # the model is still loading (or restarting)
    SHUTTING_DOWN = "shutting_down"
    DEADLINE_PASSED = "deadline_passed"
    MODEL_FAILED = "model_failed"  # the model worker failed while computing it
    OUT_OF_MEMORY = "out_of_memory"  # the server had no memory to send it on: retry later


@dataclass(frozen=True)
class Refusal:
    reason: Reason
    message: str  # safe to show a client: no traceback, path or repr of internals
    retry_after: float | None = None  # seconds; None: the default wait, where one applies


class Refused(Exception):
    """A request (or batch) the serving side refused or could not finish."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal

    @classmethod
    def because(cls, reason: Reason, message: str, retry_after: float | None = None) -> Refused:
        return cls(Refusal(reason, message, retry_after))


def deadline_passed() -> Refused:
    return Refused.because(
        Reason.DEADLINE_PASSED, "the request's deadline passed before it was answered"
    )


def shutting_down() -> Refused:
    return Refused.because(Reason.SHUTTING_DOWN, "server shutting down")


def not_back_in_time(retry_after: float | None) -> Refused:
    """No worker of the model serves, and none would before the request's deadline: a
    restart to wait for (`retry_after`: until it should be over), or none in sight (then
    the wait a new request is told: it was the 1 s default where the gate said 5)."""
    if retry_after is None:
        message = "the model worker keeps dying; it cannot answer this request"
        retry_after = LOADING_RETRY_AFTER
    else:
        message = (
            "the model worker is restarting; it would not be back before this request's deadline"
        )
    return Refused.because(Reason.LOADING, message, retry_after)


def crashed_not_back() -> Refused:
    """A request sent alone to a worker that died with it, and that no worker would run
    again before its deadline: failed (500), not refused (503). It is likely what took the
    worker down, and a 503 is the answer a proxy retries on another replica
    (deploy/nginx.conf), where it would take that worker down too."""
    return Refused.because(
        Reason.MODEL_FAILED,
        "the model worker stopped while running this request, and would not be back "
        "before its deadline",
    )


def out_of_memory() -> Refused:
    return Refused.because(Reason.OUT_OF_MEMORY, "the server is out of memory: try again later")


def unsendable() -> Refused:
    """A request the server could not hand its worker (its pickling failed): a fault of
    the server's, as the API sides bound what a body may hold before it gets here."""
    return Refused.because(
        Reason.MODEL_FAILED, "the server could not hand this request to its model worker"
    )


def model_failed() -> Refused:
    return Refused.because(
        Reason.MODEL_FAILED, "the model worker failed while computing this request"
    )

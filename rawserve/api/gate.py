"""Whether the server takes inference work now: the one owner of "draining", and the one
place that refuses work while a model is not ready."""

from __future__ import annotations

from rawserve.api.outcomes import http_error
from rawserve.api.served import ServedModel
from rawserve.serving.face import LOADING_RETRY_AFTER, LoadState, Reason, Refusal


class Gate:
    def __init__(self) -> None:
        self.draining = False  # set once, on SIGTERM, SIGINT or SIGHUP

    def start_draining(self) -> None:
        self.draining = True

    def check(self, model: ServedModel, worker: bool = True) -> None:
        """Raise 503 unless `model` takes work now (not draining, a worker ready, or
        without `worker`, loaded once: what the server holds of it serves)."""
        if self.draining:  # (in the words of the queue's refusal of what it still holds)
            raise http_error(Refusal(Reason.SHUTTING_DOWN, "server shutting down"))
        if not model.serving.ready and (worker or model.serving.loaded is None):
            if down(model):  # an outage of a model that served: shedding, as a full queue's
                model.serving.count_refusal()
            message = not_ready_message(model)
            raise http_error(Refusal(Reason.LOADING, message, loading_retry_after(model)))


def down(model: ServedModel) -> bool:
    """Whether `model`'s workers are down after serving (restarting, or dying again and
    again), not loading or warming up for the first time."""
    snapshot = model.serving.snapshot()
    return not snapshot.healthy or snapshot.load_state is LoadState.RESTARTING


def not_ready_message(model: ServedModel) -> str:
    """Why `model` takes no work, as /ready and /health say it: a model whose worker
    crashed is not "loading" to a client told to come back (nor one that keeps dying)."""
    snapshot = model.serving.snapshot()
    if not snapshot.healthy:
        return "the model worker keeps dying; it cannot take requests"
    if snapshot.load_state is LoadState.RESTARTING:
        return "the model worker is restarting"
    if snapshot.load_state is LoadState.WARMING:
        return "the model is warming up"
    return "the model is loading"


def loading_retry_after(model: ServedModel) -> float:
    """How long a client should wait while `model` has no worker serving: until its
    restart should be over, where that is known (never under a second), else
    LOADING_RETRY_AFTER."""
    back_in = model.serving.back_in
    return LOADING_RETRY_AFTER if back_in is None else max(back_in, 1.0)

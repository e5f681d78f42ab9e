"""Running a batch in the worker: in chunks no larger than the batch cap, each bisected
on failure so that only the items that fail get an `ItemFailure`; the cap itself, lowered
after an out-of-memory error and raised again after batches that fit; and the real token
counts sampled for the server's cost model. Shared by the static batch loop
(`rawserve.worker.process`) and continuous generation (`rawserve.worker.generating`).

Worker process only: imports no torch, since the server imports the worker's modules to
name the process's target (and a handler's worker may not load it at all).
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rawserve.shared.messages import NO_CONTROL, Batch, Control, FailureKind, ItemFailure
from rawserve.worker.library_panics import panics_as_errors

if TYPE_CHECKING:
    from rawserve.worker.runner import Runner

log = logging.getLogger("rawserve.worker")

CAP_RESTORE_AFTER = 20  # good batches at a lowered cap before it is doubled again
TOKEN_SAMPLE_EVERY = 16  # count real tokens on one batch in this many (it costs a tokenize)


class BatchCap:
    """The effective batch size after out-of-memory errors: halved on each, then
    doubled back after every CAP_RESTORE_AFTER batches that fit, up to no cap."""

    def __init__(self, restore_after: int = CAP_RESTORE_AFTER):
        self.restore_after = restore_after
        self.limit: int | None = None
        self._lowered_from = 0  # the largest batch that ran out of memory
        self._good = 0

    def lower(self, size: int) -> None:
        self.limit = max(1, min(size // 2, self.limit or size))
        self._lowered_from = max(self._lowered_from, size)
        self._good = 0

    def on_success(self) -> None:
        if self.limit is None:
            return
        self._good += 1
        if self._good >= self.restore_after:
            self._good = 0
            self.limit *= 2
            if self.limit >= self._lowered_from:
                self.limit, self._lowered_from = None, 0


def sample_token_counts(
    runner: Runner, batch: Batch, tokenizer: Any = None
) -> tuple[int, ...] | None:
    """Real token counts of the batch's inputs, on one batch in TOKEN_SAMPLE_EVERY
    (counted with `tokenizer`, the calling thread's own, when given)."""
    if batch.batch_id % TOKEN_SAMPLE_EVERY:
        return None
    try:
        counts = runner.count_tokens(list(batch.inputs), tokenizer)
    except Exception:  # noqa: BLE001 - a measurement, never a reason to fail a batch
        log.debug("could not count tokens", exc_info=True)
        return None
    return tuple(counts) if counts is not None else None


def run_batch(
    runner: Runner,
    inputs: list[Any],
    params: dict[str, Any],
    cap: BatchCap | None = None,
    control: Control = NO_CONTROL,
    prepared: Any = None,
    request_ids: Sequence[str] = (),
) -> list[Any]:
    """Run a batch in chunks no larger than the cap, each bisected on failure.
    `prepared`: what `runner.prepare` made of the whole batch (used when it runs whole);
    `request_ids`: each input's request's, named by the log line of an item that fails."""
    cap = cap or BatchCap()
    size = cap.limit or len(inputs)
    if size < len(inputs):
        prepared = None
    outputs: list[Any] = []
    for start in range(0, len(inputs), size):
        chunk, ids = inputs[start : start + size], request_ids[start : start + size]
        outputs += run_bisecting(runner, chunk, params, cap, control, prepared, ids)
    cap.on_success()
    return outputs


def run_bisecting(
    runner: Runner,
    inputs: list[Any],
    params: dict[str, Any],
    cap: BatchCap | None = None,
    control: Control = NO_CONTROL,
    prepared: Any = None,
    request_ids: Sequence[str] = (),
) -> list[Any]:
    """Run a batch; if it raises (or answers a count of outputs not its inputs'), run each
    half alone, down to the failing items."""
    try:
        with panics_as_errors():
            if prepared is None:
                outputs = runner.run(inputs, params, control)
            else:
                outputs = runner.run_prepared(inputs, params, control, prepared)
    except Exception as exc:  # noqa: BLE001 - every failure becomes data, never a pickle
        try:
            failure = runner.describe_failure(exc)
        except Exception:  # noqa: BLE001 - an error that cannot be told (its __str__ raises)
            failure = ItemFailure(FailureKind.INTERNAL, "the model failed on this input")
        if failure.kind is FailureKind.OUT_OF_MEMORY:
            release_memory()
            if cap is not None and len(inputs) > 1:
                cap.lower(len(inputs))
                log.warning(
                    "out of memory on a batch of %d: split, batch cap now %d",
                    len(inputs),
                    cap.limit,
                )
        if len(inputs) == 1:
            from rawserve.worker.runner import NotNumbers  # the worker's

            request = request_ids[0] if request_ids else "-"
            named = {"request_id": request}  # a JSON line's field, as the access log's
            if isinstance(exc, NotNumbers):  # the model's numbers, not a bug to trace
                log.warning("an item failed (request %s): %s", request, exc, extra=named)
            elif failure.kind is not FailureKind.INPUT:
                log.error("an item failed (request %s)", request, exc_info=exc, extra=named)
            return [failure]
    else:
        if len(outputs) == len(inputs):
            return outputs
        if len(inputs) == 1:  # an input a handler answered with no answer, or several
            request = request_ids[0] if request_ids else "-"
            log.error(
                "the model answered %d outputs for 1 input (request %s)", len(outputs), request
            )
            return [
                ItemFailure(FailureKind.INTERNAL, "the model answered the wrong number of outputs")
            ]
        # which input was miscounted is not known: the halves are run, as for an error
    # the halves run after the batch's error is handled: the failing item's own error is
    # then logged alone, not chained to each larger batch's ("During handling of ...")
    half = len(inputs) // 2
    first = run_bisecting(runner, inputs[:half], params, cap, control, None, request_ids[:half])
    return first + run_bisecting(
        runner, inputs[half:], params, cap, control, None, request_ids[half:]
    )


def release_memory() -> None:
    """After an out-of-memory error: drop the failed call's tensors and cached blocks."""
    gc.collect()
    torch = sys.modules.get("torch")  # cached blocks are torch's, where a handler loaded it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

"""The worker process's main loop: load the model once, then run batches from the pipe.

Runs only in the child (started with `spawn`, so this module must stay importable
without side effects). torch and transformers are imported inside `worker_main`, never
at module level, because the server process imports this module to name the target.
A batch that raises is bisected, so only the items that fail get an `ItemFailure`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rawserve.messages import (
    Batch,
    BatchResult,
    FailureKind,
    ItemFailure,
    Shutdown,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
)

log = logging.getLogger("rawserve.worker")


def worker_main(conn: Any, config: WorkerConfig, index: int) -> None:
    """Entry point of worker process `index`."""
    from rawserve.devices import isolate

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s worker-{index} %(levelname)s %(message)s"
    )
    plan = isolate(config.device)
    if plan.visible_gpus is not None:  # before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = plan.visible_gpus
    started = time.monotonic()
    try:
        from rawserve.runner import load_runner

        runner = load_runner(config, plan.torch_device)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, logged here
        log.exception("could not load the model")
        conn.send(WorkerLoadFailed(f"{type(exc).__name__}: {str(exc)[:500]}"))
        return
    conn.send(
        WorkerReady(
            pid=os.getpid(),
            task=runner.task,
            device=runner.device,
            dtype=runner.dtype,
            load_seconds=time.monotonic() - started,
            details=runner.details,
        )
    )
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if isinstance(message, Shutdown):
            return
        if isinstance(message, Batch):
            started = time.perf_counter()
            outputs = run_bisecting(runner, list(message.inputs), dict(message.params))
            conn.send(BatchResult(message.batch_id, tuple(outputs), time.perf_counter() - started))


def run_bisecting(runner: Any, inputs: list[Any], params: dict[str, Any]) -> list[Any]:
    """Run a batch; if it raises, run each half alone, down to the failing items."""
    try:
        outputs = runner.run(inputs, params)
    except Exception as exc:  # noqa: BLE001 - every failure becomes data, never a pickle
        if len(inputs) == 1:
            failure = runner.describe_failure(exc)
            if failure.kind is not FailureKind.INPUT:
                log.error("an item failed", exc_info=exc)
            return [failure]
        half = len(inputs) // 2
        return run_bisecting(runner, inputs[:half], params) + run_bisecting(
            runner, inputs[half:], params
        )
    if len(outputs) != len(inputs):
        log.error("the model answered %d outputs for %d inputs", len(outputs), len(inputs))
        failure = ItemFailure(
            FailureKind.INTERNAL, "the model answered the wrong number of outputs"
        )
        return [failure] * len(inputs)
    return outputs

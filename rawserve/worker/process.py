"""The worker process's main loop: load the model once, then run batches from the pipe.

Batches come in on a multiprocessing pipe, read by a thread of their own while the model
runs (`rawserve.worker.feeder`: the server may send the next batch early); everything
the worker says (ready, results, streamed tokens) goes out, from the model's thread, on
a one-way pipe of its own that the server's event loop reads (`rawserve.shared.pipes`).

Runs only in the child (started with `spawn`, so this module must stay importable
without side effects). torch and transformers are imported inside `worker_main`, never
at module level, because the server process imports this module to name the target.
A batch that raises is bisected, so only the items that fail get an `ItemFailure`. An
out-of-memory error also lowers the worker's effective batch cap for a while (larger
batches are run in chunks); each `BatchResult` tells the parent the current cap.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from rawserve.shared.devices import isolate
from rawserve.shared.logs import setup_worker_logging
from rawserve.shared.memory import FreeMemoryReleaser
from rawserve.shared.messages import (
    NO_CONTROL,
    Batch,
    BatchResult,
    Control,
    FailureKind,
    ItemFailure,
    Shutdown,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
    WorkerWarming,
)
from rawserve.shared.pipes import MessageWriter
from rawserve.worker.feeder import Feeder
from rawserve.worker.library_panics import panics_as_errors

if TYPE_CHECKING:
    from rawserve.worker.runner import Runner

log = logging.getLogger("rawserve.worker")

CAP_RESTORE_AFTER = 20  # good batches at a lowered cap before it is doubled again
# The worker runs at a lower CPU priority than the server process: when both want a core,
# the event loop (answers, 503s, /health) goes first and the model waits a moment.
WORKER_NICENESS = 10
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


def load_failed(exc: Exception) -> WorkerLoadFailed:
    """A model load's failure in one line for the operator: the message's first paragraph
    (transformers' own errors nest whole tracebacks after it), or where a pipeline nests
    each model class's traceback, the error its last one ends with; where it came from is
    for --log-level debug."""
    log.debug("could not load the model", exc_info=True)
    text = str(exc).strip()
    paragraph = text.split("\n\n")[0]
    line = f"{type(exc).__name__}: {paragraph}"
    if "See the original errors:" in text:  # "Could not load model ... with any of ..."
        line = text.splitlines()[-1]
    if "ignore_mismatched_sizes" in line:
        line = (
            "the weights' shapes do not match config.json (a config edited, or weights of "
            "another size): transformers' LOAD REPORT, logged before, lists each tensor"
        )
    return WorkerLoadFailed(" ".join(line.split())[:500])


def no_progress_bars() -> None:
    """No progress bars (they are noise in a server's log), and above all no tqdm lock in a
    process the server may kill: tqdm makes a multiprocessing semaphore for its bars, which
    a process killed (at the end of the grace period, a stop during the first start's
    trial, or from outside) leaves to the resource tracker, and the stop then warned of a
    "leaked semaphore"."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # Bars drawn by others (the ONNX exporter's) still take tqdm's lock: make it a thread
    # lock only. Imported here, not at the top: this module is imported by the server too.
    import tqdm.std

    tqdm.std.TqdmDefaultWriteLock.mp_lock = None


def worker_main(
    batches: Connection,
    replies: Connection,
    config: WorkerConfig,
    label: str | int,
    cancelled_stream: Any = None,
) -> None:
    """Entry point of worker process `label` (its index, after its model's name when the
    server has several): reads `batches`, writes its messages to `replies` (the write end
    of a one-way pipe). `cancelled_stream` is a shared integer: the id of a stream whose
    client has gone."""
    out = MessageWriter(replies.fileno())
    # A stop sent to the whole process group (Ctrl-C in a terminal, systemd's default
    # stop of a service, `kill -- -PGID`) reaches the workers too: the server drains and
    # then stops its workers itself (or kills them), so a worker must not die of it
    # mid-batch (it was restarted, its batch retried as if its input had crashed it).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    no_progress_bars()
    setup_worker_logging(label)  # the server's --log-level and --log-format, from the env
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # not allowed here: run at the server's priority
        pass
    plan = isolate(config.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if plan.visible_gpus is not None:  # before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = plan.visible_gpus
    started = time.monotonic()
    try:
        # torch and transformers load here, in the worker process only
        from rawserve.worker.loading import (
            library_logs_through_ours,
            load_runner,
            tokenize_in_the_calling_thread,
        )

        imported = time.monotonic()
        library_logs_through_ours()
        tokenize_in_the_calling_thread(os.environ)
        runner = load_runner(config, plan.torch_device)
        log.info(
            "imports took %.2f s, the model load %.2f s",
            imported - started,
            time.monotonic() - imported,
        )
        runner.bind_stream(out.send, cancelled_stream)  # token streaming, if it streams
        from rawserve.worker.generating import continuous_loop
        from rawserve.worker.warmup import example, warm_up
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which logs it
        out.send(load_failed(exc))
        return
    load_seconds = time.monotonic() - started
    warmup_seconds = None
    # the first client's request costs what every later one costs (a task with no example
    # input, a handler's, is not warmed: nor said to be)
    if config.warmup_batch and example(runner) is not None:
        out.send(WorkerWarming(load_seconds))
        warmup_seconds = warm_up(runner, config.warmup_batch)
    # a causal LM batches continuously: sequences join and leave between decoding steps
    generating = continuous_loop(runner, config, out.send, cancelled_stream)
    prepares = config.prepare_ahead
    if prepares is None:
        prepares = runner.on_cuda
    prepare = prepare_batch(runner) if prepares and generating is None else None
    # What is loaded by now lives as long as the worker: leave it out of the collector's
    # full passes, which otherwise stall a batch (every running sequence, when generating)
    # for ~200 ms with a small model loaded (well under 1 ms once frozen; bench/RESULTS.md).
    gc.collect()
    gc.freeze()
    out.send(
        WorkerReady(
            pid=os.getpid(),
            task=runner.task,
            device=runner.device,
            dtype=runner.dtype,
            load_seconds=load_seconds,
            details=runner.details,
            warmup_seconds=warmup_seconds,
            limits=runner.limits,
            engine=runner.engine,
            engine_reason=runner.engine_reason,
            dtype_reason=runner.dtype_reason,
            bfloat16_trial=runner.bfloat16_trial,
            attention=runner.attention,
            cuda_graphs=runner.cuda_graphs,
            tokenizer=runner.tokenizer_json(),
            sequences=generating.rows if generating is not None else 0,
        )
    )
    if generating is not None:
        generating.run(Feeder(batches).start())
        return
    out.pickler = runner.answer_pickler
    feeder = Feeder(batches, prepare, timed=True).start()  # the next arrives while one runs
    cap = BatchCap()
    releaser = FreeMemoryReleaser()  # tensors of every shape: the heap would only grow
    threads = config.threads
    free_since = time.perf_counter()  # when the model thread last finished a batch
    while True:
        message = feeder.next()
        if isinstance(message, Shutdown):
            return
        if isinstance(message, Batch):
            if message.threads and message.threads != threads:
                runner.set_threads(message.threads)
                threads = message.threads
            # A batch costs the worker from its arrival, or from the end of the batch
            # ahead of it: its preparation counts where the model waited for it.
            received = feeder.received(message.batch_id)
            started = max(received.at, free_since)
            ahead: Ahead | None = received.prepared
            inputs, params = list(message.inputs), dict(message.params)
            tensors = ahead.tensors if ahead is not None else None
            outputs = run_batch(runner, inputs, params, cap, message.control, tensors)
            result = BatchResult(
                message.batch_id,
                tuple(outputs),
                time.perf_counter() - started,
                cap.limit,
                # counted ahead, or now (a tokenizer pass on the model's thread)
                ahead.token_counts if ahead is not None else sample_token_counts(runner, message),
                prepare_seconds=received.prepare_seconds,
            )
            if not send_result(out, result):  # the server is gone
                return
            # after the reply: the server is not kept waiting (nor the next batch)
            releaser.after_batch(next_waiting=feeder.waiting())
            free_since = time.perf_counter()


def send_result(out: MessageWriter, result: BatchResult) -> bool:
    """Send a batch's result; False when the server is gone. An output that cannot be
    pickled for the server (a handler's answer holding a lock, a lambda, an open file, an
    object of its own module's class) is its item's failure: its batch-mates are answered
    and the worker lives on, where the worker would die of it, and die again running the
    input alone, as of a poison input."""
    try:
        out.send(result)
        return True
    except Exception:  # noqa: BLE001 - the server is gone, or pickle refused an output
        pass  # (nothing was written: pickling comes first)
    outputs = tuple(sendable(out, output) for output in result.outputs)
    try:
        out.send(replace(result, outputs=outputs))
    except (OSError, ValueError):  # the server is gone
        return False
    return True


def sendable(out: MessageWriter, output: Any) -> Any:
    """`output`, or its item's failure where the writer cannot write it."""
    try:
        out.encode(output)
    except Exception as exc:  # noqa: BLE001 - what pickle raises depends on the object
        log.error("an output cannot be sent to the server: %s: %s", type(exc).__name__, exc)
        return ItemFailure(FailureKind.INTERNAL, "the model's answer to this input cannot be sent")
    return output


@dataclass
class Ahead:
    """What the preparing thread did for a batch before the model thread got it."""

    tensors: Any  # what `runner.prepare` made (None: nothing)
    token_counts: tuple[int, ...] | None  # the sampled real token counts, when due


def prepare_batch(runner: Runner) -> Callable[[Batch], Ahead] | None:
    """The feeder's preparing step for this runner; None when it prepares nothing."""
    if not runner.prepares_ahead:
        return None
    try:
        tokenizer = runner.ahead_tokenizer()  # its copy made now, not on the first batch
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied: tokenize in turn
        log.warning(
            "batches are tokenized in the model's thread: the tokenizer cannot be copied",
            exc_info=True,
        )
        return None

    def prepare(batch: Batch) -> Ahead:
        tensors = runner.prepare(list(batch.inputs), dict(batch.params), batch.control)
        return Ahead(tensors, sample_token_counts(runner, batch, tokenizer))

    return prepare


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
) -> list[Any]:
    """Run a batch in chunks no larger than the cap, each bisected on failure.
    `prepared`: what `runner.prepare` made of the whole batch (used when it runs whole)."""
    cap = cap or BatchCap()
    size = cap.limit or len(inputs)
    if size < len(inputs):
        prepared = None
    outputs: list[Any] = []
    for start in range(0, len(inputs), size):
        chunk = inputs[start : start + size]
        outputs += run_bisecting(runner, chunk, params, cap, control, prepared)
    cap.on_success()
    return outputs


def run_bisecting(
    runner: Runner,
    inputs: list[Any],
    params: dict[str, Any],
    cap: BatchCap | None = None,
    control: Control = NO_CONTROL,
    prepared: Any = None,
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
            from rawserve.worker.runner import NotNumbers  # the worker's (imports torch)

            if isinstance(exc, NotNumbers):  # the model's numbers, not a bug to trace
                log.warning("an item failed: %s", exc)
            elif failure.kind is not FailureKind.INPUT:
                log.error("an item failed", exc_info=exc)
            return [failure]
    else:
        if len(outputs) == len(inputs):
            return outputs
        if len(inputs) == 1:  # an input a handler answered with no answer, or several
            log.error("the model answered %d outputs for 1 input", len(outputs))
            return [
                ItemFailure(FailureKind.INTERNAL, "the model answered the wrong number of outputs")
            ]
        # which input was miscounted is not known: the halves are run, as for an error
    # the halves run after the batch's error is handled: the failing item's own error is
    # then logged alone, not chained to each larger batch's ("During handling of ...")
    half = len(inputs) // 2
    return run_bisecting(runner, inputs[:half], params, cap, control) + run_bisecting(
        runner, inputs[half:], params, cap, control
    )


def release_memory() -> None:
    """After an out-of-memory error: drop the failed call's tensors and cached blocks."""
    gc.collect()
    import torch  # in the worker process only: the server imports this module

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

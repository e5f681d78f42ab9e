"""The worker process's main loop: load the model once, then run batches from the pipe.

Batches come in on a multiprocessing pipe, read by a thread of their own while the model
runs (`rawserve.worker.feeder`: the server may send the next batch early); everything
the worker says (ready, results, streamed tokens) goes out, from the model's thread, on
a one-way pipe of its own that the server's event loop reads (`rawserve.shared.pipes`).

Runs only in the child (started with `spawn`, so this module must stay importable
without side effects). torch and transformers are imported inside `worker_main`, never
at module level, because the server process imports this module to name the target;
and for a model only: a handler's worker loads what the handler's own code imports.
Batches run through `rawserve.worker.batch_runs` (bisected on failure, chunked by the
batch cap an out-of-memory error lowers); each `BatchResult` tells the parent the
current cap.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rawserve.shared.devices import isolate
from rawserve.shared.logs import setup_worker_logging
from rawserve.shared.memory import FreeMemoryReleaser
from rawserve.shared.messages import (
    Batch,
    BatchResult,
    FailureKind,
    ItemFailure,
    Shutdown,
    WorkerConfig,
    WorkerLoadFailed,
    WorkerReady,
    WorkerWarming,
)
from rawserve.shared.pipes import MessageWriter
from rawserve.worker.batch_runs import BatchCap, run_batch, sample_token_counts
from rawserve.worker.feeder import Feeder
from rawserve.worker.libraries import library_logs_through_ours, tokenize_in_the_calling_thread
from rawserve.worker.parent_watch import exit_with_parent

if TYPE_CHECKING:
    from rawserve.worker.generating import GenerationLoop
    from rawserve.worker.runner import Runner

log = logging.getLogger("rawserve.worker")

# The worker runs at a lower CPU priority than the server process: when both want a core,
# the event loop (answers, 503s, /health) goes first and the model waits a moment.
WORKER_NICENESS = 10
# And the kernel's first choice when memory runs out: a worker killed is restarted (its
# requests retried), the server process killed ends the server. A process may raise its
# own oom_score_adj (up to 1000) without privileges.
OOM_SCORE_ADJ_RAISE = 500
OOM_SCORE_ADJ_MAX = 1000
OOM_SCORE_ADJ_FILE = "/proc/self/oom_score_adj"


# torch.load's refusal (weights_only) of a .bin that pickles an object other than tensors
PICKLED_OBJECT = re.compile(r"Weights only load failed\..*?Unsupported global: GLOBAL (\S+)", re.S)


def load_failed(exc: Exception) -> WorkerLoadFailed:
    """A model load's failure in one line for the operator: the message's first paragraph
    (transformers' own errors nest whole tracebacks after it), or where a pipeline nests
    each model class's traceback, the error its last one ends with; where it came from is
    for --log-level debug."""
    log.debug("could not load the model", exc_info=True)
    text = str(exc).strip()
    paragraph = text.split("\n\n")[0]
    line = f"{type(exc).__name__}: {paragraph}" if paragraph else type(exc).__name__
    if isinstance(exc, MemoryError):
        line = f"{line} (the worker ran out of memory: a memory limit, or too little RAM)"
    if "See the original errors:" in text:  # "Could not load model ... with any of ..."
        line = text.splitlines()[-1]
    if pickled := PICKLED_OBJECT.search(text):  # torch's advice is a programmer's
        line = (
            f"the model's .bin weights are pickled with {pickled[1]}, which torch.load "
            "runs as code only when told to (weights_only=False): rawserve loads weights "
            "alone; serve the model's safetensors, or convert its .bin to safetensors"
        )
    if "ignore_mismatched_sizes" in line:
        line = (
            "the weights' shapes do not match config.json (a config edited, or weights of "
            "another size): transformers' LOAD REPORT, logged before, lists each tensor"
        )
    if (at := own_code_at(exc)) is not None and at not in line:
        line = f"{line} ({at})"
    return WorkerLoadFailed(" ".join(line.split())[:500])


def own_code_at(exc: BaseException) -> str | None:
    """Where the failure was raised in code of the user's own (a handler's module and
    what it imports; a model's remote code), not rawserve's, an installed library's or
    Python's: `file, line N` of the innermost such frame, or None. A handler whose
    import failed three modules down was told only "No module named ...", with no file."""
    found, called = None, False  # (only code rawserve called: not a program calling it)
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = frame.f_code.co_filename
        if path.startswith(RAWSERVE_CODE):
            called = True
        elif called and not path.startswith("<") and not path.startswith(NOT_OWN_CODE):
            found = f"{path}, line {line}"
    return found


# (folders ending in a separator: a folder, not a name's start)
RAWSERVE_CODE = os.path.join(str(Path(__file__).resolve().parents[1]), "")
# the folders of code that is not the user's own besides rawserve's: the installed
# packages' and Python's standard library
NOT_OWN_CODE = tuple(
    os.path.join(sysconfig.get_paths()[name], "")
    for name in ("stdlib", "platstdlib", "purelib", "platlib")
)


def prefer_for_oom_kill(path: str = OOM_SCORE_ADJ_FILE) -> int | None:
    """Raise this process's oom_score_adj by OOM_SCORE_ADJ_RAISE over what it inherited
    (at most OOM_SCORE_ADJ_MAX); the value set, or None where there is no such file
    (not Linux) or it cannot be written."""
    try:
        with open(path, encoding="ascii") as file:
            inherited = int(file.read())
        raised = min(inherited + OOM_SCORE_ADJ_RAISE, OOM_SCORE_ADJ_MAX)
        with open(path, "w", encoding="ascii") as file:
            file.write(str(raised))
    except (OSError, ValueError) as exc:
        log.debug("oom_score_adj left as inherited: %s", exc)
        return None
    log.debug("oom_score_adj %d, raised from %d", raised, inherited)
    return raised


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
    exit_with_parent()
    try:
        serve(batches, replies, config, label, cancelled_stream)
    except BrokenPipeError:  # the server is gone: nobody to tell (a traceback said it)
        return


def serve(
    batches: Connection,
    replies: Connection,
    config: WorkerConfig,
    label: str | int,
    cancelled_stream: Any,
) -> None:
    """`worker_main`'s work: load the model, then answer batches until told to stop."""
    out = MessageWriter(replies.fileno())
    outlive_stop_signals()
    no_progress_bars()
    setup_worker_logging(label)  # the server's --log-level and --log-format, from the env
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # not allowed here: run at the server's priority
        pass
    prefer_for_oom_kill()
    plan = isolate(config.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if plan.visible_gpus is not None:  # before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = plan.visible_gpus
    started = time.monotonic()
    tokenize_in_the_calling_thread(os.environ)
    try:
        if config.handler:  # its own code imports what it uses (and its load counts them)
            from rawserve.worker.handler import load_handler

            imported = time.monotonic()
            runner: Runner = load_handler(config, plan.torch_device)
        else:  # torch and transformers load here, in the worker process only
            from rawserve.worker.loading import load_runner

            imported = time.monotonic()
            library_logs_through_ours()
            runner = load_runner(config, plan.torch_device)
            if runner.untrained is not None:  # served all the same: a base model may be wanted
                log.warning("untrained weights: %s", runner.untrained.warning(runner.task))
        log.info(
            "imports took %.2f s, the model load %.2f s",
            imported - started,
            time.monotonic() - imported,
        )
        runner.bind_stream(out.send, cancelled_stream)  # token streaming, if it streams
        from rawserve.worker.warmup import ModelFails, example, warm_up
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which logs it
        out.send(load_failed(exc))
        return
    load_seconds = time.monotonic() - started
    warmup_seconds = None
    # the first client's request costs what every later one costs (a task with no example
    # input, a handler's, is not warmed: nor said to be)
    if config.warmup_batch and example(runner) is not None:
        out.send(WorkerWarming(load_seconds))
        try:
            warmup_seconds = warm_up(runner, config.warmup_batch)
        except ModelFails as exc:
            out.send(WorkerLoadFailed(str(exc)))
            return
    generating = generation_loop(runner, config, out.send, cancelled_stream)
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
            generation=runner.generation_mode,
            untrained=runner.untrained.warning(runner.task) if runner.untrained else "",
            tokenizer=runner.tokenizer_json(),
            sequences=generating.rows if generating is not None else 0,
        )
    )
    if generating is not None:
        generating.run(Feeder(batches).start())
        return
    out.pickler = runner.answer_pickler
    feeder = Feeder(batches, prepare, timed=True).start()  # the next arrives while one runs
    runner.bind_cancel(feeder.running_cancelled)  # a generation nobody waits for stops
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
            ids = message.request_ids
            outputs = run_batch(runner, inputs, params, cap, message.control, tensors, ids)
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


def generation_loop(
    runner: Runner, config: WorkerConfig, send: Callable[[Any], None], cancelled_stream: Any
) -> GenerationLoop | None:
    """The loop a causal LM is served with: sequences join and leave the running batch
    between decoding steps (None: one batch after another). Never a handler's: its worker
    does not import the causal LM's modules (and torch with them) to be told so."""
    if config.handler:
        return None
    from rawserve.worker.generating import continuous_loop

    return continuous_loop(runner, config, send, cancelled_stream)


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


def outlive_stop_signals() -> None:
    """A stop sent to the whole process group (Ctrl-C in a terminal, systemd's default
    stop of a service, `kill -- -PGID`) reaches the workers too: the server drains and
    then stops its workers itself (or kills them), so a worker must not die of it
    mid-batch (it was restarted, its batch retried as if its input had crashed it). A
    handler that does nothing, not SIG_IGN: a process a handler starts inherited SIG_IGN,
    ignored every SIGTERM and outlived the server. What the worker starts takes the
    signals as any process does (exec resets a handler; a fork is reset here), so it
    stops with its process group, a handler's batch running it then failing."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _outlived)
    os.register_at_fork(after_in_child=_stop_signals_as_default)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # (SIGHUP: a closed terminal)


def _outlived(signum: int, frame: Any) -> None:
    """The worker's answer to a stop signal: none (see `outlive_stop_signals`)."""


def _stop_signals_as_default() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)

"""Starting and stopping one worker process: its two one-way pipes (batches in, replies
out), the shared integer that names a stream to stop, and a join that kills what lingers.

Never imports torch: it names the worker's entry function, whose module imports torch
only inside the worker process.
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

from rawserve.serving.handles import WorkerHandle
from rawserve.shared.board import SharedMemoryError
from rawserve.worker.process import worker_main


def start_process(context: SpawnContext, worker: WorkerHandle) -> tuple[BaseProcess, Connection]:
    """Start `worker`'s process (setting its process, its batch pipe and its stream to
    stop); the read end of its replies, non-blocking, is returned. Where it cannot (out of
    file descriptors or processes), the pipes it opened are closed and the error raised."""
    let_go(worker)
    opened: list[Connection] = []
    try:
        batches_in, batches_out = context.Pipe(duplex=False)
        opened += (batches_in, batches_out)
        replies_in, replies_out = context.Pipe(duplex=False)
        opened += (replies_in, replies_out)
        try:
            worker.cancelled_stream = context.Value("q", 0, lock=False)  # a stream to stop
        except OSError as exc:
            raise SharedMemoryError(exc) from exc
        process = context.Process(
            target=worker_main,
            args=(batches_in, replies_out, worker.config, worker.label, worker.cancelled_stream),
            name=f"rawserve-worker-{worker.index}",
            daemon=True,
        )
        process.start()
    except OSError:
        for end in opened:
            end.close()
        raise
    batches_in.close()
    replies_out.close()  # the worker holds the only write end: its exit is our EOF
    worker.process, worker.conn = process, batches_out
    os.set_blocking(replies_in.fileno(), False)
    return process, replies_in


def exit_watch(process: BaseProcess) -> int | None:
    """A file descriptor that turns readable once `process` has exited (a pidfd: Linux 5.3
    and later), for the caller to close; None where there is none (the pipe's end of file
    is then all that says so)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None or process.pid is None:
        return None
    try:
        return int(pidfd_open(process.pid))
    except OSError:  # no such call in this kernel, or no descriptor left
        return None


_reaping: weakref.WeakKeyDictionary[BaseProcess, threading.Lock] = weakref.WeakKeyDictionary()
_reaping_lock = threading.Lock()


def _reap_lock(process: BaseProcess) -> threading.Lock:
    """The lock its reapers take turns by (`join_or_kill`, `take_exit_code`)."""
    with _reaping_lock:
        return _reaping.setdefault(process, threading.Lock())


def let_go(worker: WorkerHandle) -> None:
    """Close the pipe and the exit sentinel of `worker`'s last process, which has exited
    and been reaped: left to the garbage collector, two descriptors of each restart
    stayed open (a reference cycle held them) until a full collection."""
    if worker.conn is not None:
        worker.conn.close()
        worker.conn = None
    if worker.process is not None and worker.process.exitcode is not None:
        worker.process.close()
        worker.process = None  # (should the new one not start, none is named)


def take_exit_code(process: BaseProcess) -> None:
    """Reap `process`, which has exited (its pidfd said so), now: a join waits on its
    sentinel, a pipe that a child of its may hold. In turn with `join_or_kill` (a thread
    already in it is reaping it: left to it)."""
    lock = _reap_lock(process)
    if lock.acquire(blocking=False):
        try:
            process.exitcode  # noqa: B018 - polled (waitpid) for its side effect
        except ValueError:  # closed: reaped, and let go of as its restart began
            pass
        finally:
            lock.release()


def join_or_kill(process: BaseProcess, timeout: float) -> bool:
    """Wait up to `timeout` for `process` to exit, then kill it; whether it was killed.

    One caller at a time per process: a worker that exits at shutdown is waited for by
    the shutdown and by the reader that saw its pipe close, each in a thread, and of two
    waits on one child the kernel reaps it for one; the other's wait fails (ECHILD),
    which multiprocessing reads as "still running": that caller then said the worker
    "did not exit" and sent SIGKILL to its pid, which the system may have given to
    another process by then. Taking turns, the second finds the exit code."""
    with _reap_lock(process):
        process.join(timeout=timeout)
        if process.exitcode is not None:
            return False
        process.kill()
        process.join()
        return True

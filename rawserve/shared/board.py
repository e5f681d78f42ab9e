"""The serving process's published queue state, read by the HTTP processes without a
message: a small file mapped into every process's memory (`mmap`).

One record per served model, five 8-byte floats: ready (a worker is loaded and warm),
healthy (not every worker keeps dying), full (the queue is at its bound), the
Retry-After a full queue gives, and when it was written (the system's monotonic clock,
the same in every process). Only the serving process writes (every few milliseconds,
mostly the same values again); the HTTP processes read it on every request (a refusal
at the queue bound is answered at once, with no round trip), and a record not written
for seconds says the serving process is stopped or stuck.

The serving process holds a lock on the file for its life: a board whose owner's pid is
not running here is still its owner's while the lock is held (a server in another PID
namespace sharing /dev/shm, a container's `--ipc=host`, has a pid this one cannot see).

Each field is written whole, through a memoryview of doubles: one aligned 8-byte copy,
atomic, so a reader sees the old value or the new. Not `struct.pack_into`: it zeroes
the field before writing its bytes, and an HTTP process then read a "ready" written
again as 0 now and then (a request refused: "the model is loading").
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import tempfile
import time

from rawserve.shared.process_state import has_proc, state_of

FIELDS = 5  # per model
READY, HEALTHY, FULL, RETRY_AFTER, WRITTEN_AT = range(FIELDS)
FIELD_SIZE = 8  # a double
PREFIX = "rawserve-board-"  # then the serving process's pid, a dash, a random part


class SharedMemoryError(OSError):
    """Shared memory that cannot be made: a file in /dev/shm (in the temporary folder
    where there is no /dev/shm; Python's multiprocessing chooses the same way) that a
    read-only or full filesystem refuses. The workers' stop flags and the HTTP processes'
    board live there, so the server cannot start without it; `strerror` says so in one
    line, naming the folder and the way out."""

    def __init__(self, cause: OSError):
        folder = os.path.dirname(cause.filename) if cause.filename else "/dev/shm"
        super().__init__(
            cause.errno,
            f"cannot make shared memory in {folder} ({cause.strerror or cause}): "
            "mount a writable /dev/shm (without one, set TMPDIR to a writable folder)",
        )

    def __str__(self) -> str:  # the line, without OSError's "[Errno N]"
        return str(self.strerror)


class Board:
    def __init__(self, path: str, models: int, create: bool = False):
        self.path = path
        size = FIELDS * FIELD_SIZE * max(1, models)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        self._owned: int | None = None  # the serving process's descriptor, locked
        try:
            if create:
                # a new file: free, but for another server's look at it (`locked`), which
                # holds it a moment
                fcntl.flock(fd, fcntl.LOCK_EX)
                allocate(fd, size)
            self._map = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        if create:
            self._owned = fd  # kept open: the lock lasts as long as this process
        else:
            os.close(fd)
        self._fields = memoryview(self._map).cast("d")  # page-aligned: every field aligned
        if create:
            for model in range(models):
                self.publish(model, ready=False, healthy=True, full=False, retry_after=None)

    @classmethod
    def create(cls, models: int) -> Board:
        """A new board in a fresh file (in shared memory where the system has it), named
        by the serving process; the boards of serving processes that are gone are removed
        (a server killed outright, its HTTP processes with it, could not remove its own)."""
        try:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            remove_orphans(folder)
            prefix = f"{PREFIX}{os.getpid()}-"
            handle, path = tempfile.mkstemp(prefix=prefix, dir=folder)
            os.close(handle)
            os.unlink(path)  # created again, exclusively, by the constructor
            return cls(path, models, create=True)
        except OSError as exc:
            raise SharedMemoryError(exc) from exc

    def publish(
        self,
        model: int,
        *,
        ready: bool,
        healthy: bool,
        full: bool,
        retry_after: float | None,
        at: float | None = None,
    ) -> None:
        written = time.monotonic() if at is None else at
        values = (float(ready), float(healthy), float(full), retry_after, written)
        for field, value in enumerate(values):
            self._fields[model * FIELDS + field] = math.nan if value is None else value

    def read(self, model: int, field: int) -> float:
        value: float = self._fields[model * FIELDS + field]
        return value

    def flag(self, model: int, field: int) -> bool:
        return self.read(model, field) == 1.0

    def age(self, model: int) -> float:
        """Seconds since the model's record was last written."""
        return time.monotonic() - self.read(model, WRITTEN_AT)

    def retry_after(self, model: int) -> float | None:
        value = self.read(model, RETRY_AFTER)
        return None if math.isnan(value) else value

    def remove(self) -> None:
        """Delete the file (the serving process, on its way out); mappings stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def remove_if_orphaned(self, wait: float = 1.0) -> None:
        """Delete the file if the serving process that made it is gone (killed outright,
        it could not), waiting up to `wait` s for one on its way out (its sockets close
        a moment before it is gone); while that process runs, the file is its own, and
        the HTTP processes it starts still open it."""
        until = time.monotonic() + wait
        while not orphaned(self.path):
            if time.monotonic() > until:
                return
            time.sleep(0.02)
        self.remove()


def allocate(fd: int, size: int) -> None:
    """Give the file `fd` its `size` bytes as pages of its filesystem, now: a full /dev/shm
    refuses them here (ENOSPC), where a file only truncated to its size is mapped all the
    same and the first write to it kills the process with SIGBUS, without a word."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # macOS has none (nor a /dev/shm: the file is in the temporary folder)
        os.ftruncate(fd, size)


def orphaned(path: str) -> bool:
    """Whether `path` is a board whose serving process is gone (one of another user, a
    pid taken again since, or one holding its lock, in another PID namespace, is not)."""
    name = os.path.basename(path)
    pid = name.removeprefix(PREFIX).partition("-")[0]
    if not name.startswith(PREFIX) or not pid.isdigit() or is_running(int(pid)):
        return False
    return not locked(path)


def locked(path: str) -> bool:
    """Whether a process holds the board's lock (one that cannot be opened: another
    user's, held as far as we know)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as it closes
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_orphans(folder: str) -> None:
    """Remove the boards in `folder` whose serving process is gone."""
    for name in os.listdir(folder):
        if orphaned(os.path.join(folder, name)):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass  # removed meanwhile, or not ours to remove


def is_running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (one exited but not yet waited for
    by its parent, a zombie, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    state = state_of(pid)
    if state is None:  # gone meanwhile, or a system without /proc
        return not has_proc()
    return state not in ("Z", "X")

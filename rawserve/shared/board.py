"""The serving process's published queue state, read by the HTTP processes without a
message: a small file mapped into every process's memory (`mmap`).

One record per served model, four 8-byte floats, each written whole (an aligned 8-byte
store is atomic: a reader sees the old value or the new, never half of each):
ready (a worker is loaded and warm), healthy (not every worker keeps dying), full (the
queue is at its bound), and the Retry-After a full queue gives. Only the serving
process writes; the HTTP processes read it on every request (a refusal at the queue
bound is answered at once, with no round trip).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import tempfile

RECORD = struct.Struct("=4d")
READY, HEALTHY, FULL, RETRY_AFTER = range(4)
FIELD = struct.Struct("=d")


class Board:
    def __init__(self, path: str, models: int, create: bool = False):
        self.path = path
        size = RECORD.size * max(1, models)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            for model in range(models):
                self.publish(model, ready=False, healthy=True, full=False, retry_after=None)

    @classmethod
    def create(cls, models: int) -> Board:
        """A new board in a fresh file (in shared memory where the system has it)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, path = tempfile.mkstemp(prefix="rawserve-board-", dir=folder)
        os.close(handle)
        os.unlink(path)  # created again, exclusively, by the constructor
        return cls(path, models, create=True)

    def publish(
        self, model: int, *, ready: bool, healthy: bool, full: bool, retry_after: float | None
    ) -> None:
        values = (float(ready), float(healthy), float(full), retry_after)
        for field, value in enumerate(values):
            offset = model * RECORD.size + field * FIELD.size
            FIELD.pack_into(self._map, offset, math.nan if value is None else value)

    def read(self, model: int, field: int) -> float:
        return FIELD.unpack_from(self._map, model * RECORD.size + field * FIELD.size)[0]

    def flag(self, model: int, field: int) -> bool:
        return self.read(model, field) == 1.0

    def retry_after(self, model: int) -> float | None:
        value = self.read(model, RETRY_AFTER)
        return None if math.isnan(value) else value

    def remove(self) -> None:
        """Delete the file (the serving process, on its way out); mappings stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

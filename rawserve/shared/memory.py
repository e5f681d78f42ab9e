"""Keep a process's memory flat under load (glibc malloc), in the server and in the workers.

glibc raises its mmap threshold each time a large block it had mapped is freed, up to
32 MB: after a few large blocks, blocks of hundreds of kilobytes to megabytes come from
the heap instead, between smaller long-lived objects, and the heap grows in steps it
never gives back.

- The server fixes the threshold (`fix_mmap_threshold`): every block above it is mapped
  and returned to the system when freed. Measured on 200,000 requests (echo handler, 64
  clients): RSS 43.1 → 49.8 MiB with glibc's default, 42.6 → 43.3 MiB with this.
- A torch worker cannot: its tensors are mostly above any such threshold, and mapping
  each afresh (zeroed pages, a fault per page) made it a quarter slower. It gives the
  heap's free pages back now and then instead (`FreeMemoryReleaser`), and at once after
  a batch that grew it a lot (a 1 MB question-answering context: 180 MB of windows,
  otherwise kept until the next trim, or after several such batches for good). Both
  measured in bench/RESULTS.md.
- After an answer built of many small objects (`/tokenize`), the server gives the heap's
  free pages back once (`give_back_free_memory`): such objects sit below any mmap
  threshold, and the heap would keep their pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rawserve.memory")

M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc's malloc.h)
MMAP_THRESHOLD_BYTES = 256 * 1024
# A worker whose resident memory grew by this much since its last trim gives the free
# pages back after the batch at once: a trim costs milliseconds, such a batch far more.
GREW_A_LOT_BYTES = 64 * 2**20
STATM = "/proc/self/statm"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _glibc_function(name: str) -> Any | None:
    """A function of glibc's, or None where there is none (not Linux, musl, ...)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(_libc(), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, looked up once: `find_library` runs `ldconfig -p` (about 1 ms), and
    /tokenize trims after each large answer."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Blocks of `threshold` bytes and up are mapped and unmapped on their own; True if
    set (Linux with glibc), False where there is no such allocator."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused")
        return False
    return True


def give_back_free_memory() -> bool:
    """Return the heap's free pages to the system now (glibc's `malloc_trim`); False where
    there is no such allocator."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _malloc_trim() -> Any | None:
    """glibc's `malloc_trim`, typed; None where there is none."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
    return trim


def resident_bytes() -> int | None:
    """This process's resident memory, in bytes; None where /proc does not say."""
    try:
        with open(STATM, "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


class FreeMemoryReleaser:
    """Gives the heap's free pages back to the system (glibc's `malloc_trim`) once every
    `every` calls of `after_batch`: a trim walks the whole heap, a few milliseconds at
    most (1.6-2.7 ms with a BERT-base-sized model loaded), so it is not done after every
    batch. Nor while the next batch is already waiting (a GPU worker holds two: the
    device would idle through the trim): it waits for a batch with none behind it, up to
    `postpone` times `every` batches. After a batch that left the process `grown` bytes
    larger than after the last trim, it trims at once: a dense question-answering
    request's windows (4.4 GB) stayed with the worker through later small batches."""

    def __init__(
        self,
        every: int = 4,
        postpone: int = 8,
        grown: int = GREW_A_LOT_BYTES,
        resident: Callable[[], int | None] = resident_bytes,
    ):
        self.every = every
        self.postpone = postpone
        self.grown = grown
        self._resident = resident
        self._count = 0  # batches since the last trim
        self._trim = _malloc_trim()
        self._trimmed_at = resident()  # the resident bytes after the last trim

    @property
    def available(self) -> bool:
        return self._trim is not None

    def after_batch(self, next_waiting: bool = False) -> bool:
        """Count a batch; trim once `every` have run, unless `next_waiting` (then at a
        later one with nothing waiting, or after `postpone` times `every` regardless);
        trim at once when the process has `grown`. True when it trimmed."""
        self._count += 1
        if self._trim is None:
            return False
        if not self._grew_a_lot():
            if self._count < self.every:
                return False
            if next_waiting and self._count < self.every * self.postpone:
                return False
        self._trim(0)
        self._count = 0
        self._trimmed_at = self._resident()
        return True

    def _grew_a_lot(self) -> bool:
        now = self._resident()
        if now is None or self._trimmed_at is None:
            return False
        return now - self._trimmed_at > self.grown

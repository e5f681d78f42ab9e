"""The malloc settings that keep the server's and the workers' memory flat (glibc on Linux)."""

from __future__ import annotations

import platform
import sys

import pytest

from rawserve.shared.memory import FreeMemoryReleaser, fix_mmap_threshold, resident_bytes
from tests.server import RunningServer

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt and malloc_trim are glibc's",
)


@glibc_only
def test_the_mmap_threshold_is_fixed_on_glibc():
    assert fix_mmap_threshold() is True


def test_elsewhere_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert fix_mmap_threshold() is False
    releaser = FreeMemoryReleaser(every=1)
    assert not releaser.available and releaser.after_batch() is False


@glibc_only
def test_free_memory_is_given_back_every_nth_batch_only():
    releaser = FreeMemoryReleaser(every=4)
    assert releaser.available
    assert [releaser.after_batch() for _ in range(8)] == [False, False, False, True] * 2


def test_the_trim_waits_while_the_next_batch_waits_but_not_for_ever(monkeypatch):
    calls = []
    releaser = FreeMemoryReleaser(every=2, postpone=3)
    monkeypatch.setattr(releaser, "_trim", calls.append)
    # a GPU worker's second batch is here when the first is answered: no trim then
    assert [releaser.after_batch(next_waiting=True) for _ in range(3)] == [False] * 3
    assert releaser.after_batch(next_waiting=False) is True  # the first gap
    assert [releaser.after_batch(next_waiting=True) for _ in range(6)] == [False] * 5 + [True]
    assert calls == [0, 0]  # 2 x 3 batches at most between trims


def test_the_trim_is_glibcs_own_call(monkeypatch):
    calls = []
    releaser = FreeMemoryReleaser(every=2)
    monkeypatch.setattr(releaser, "_trim", calls.append)
    releaser.after_batch()
    releaser.after_batch()
    assert calls == [0]  # malloc_trim(0): keep no padding at the heap's top


def test_a_batch_that_grew_the_worker_a_lot_is_trimmed_at_once(monkeypatch):
    """A dense question-answering request's windows (4.4 GB) stayed with the worker, the
    heap's free pages kept, through later small batches: a batch that leaves the process
    much larger than after the last trim is trimmed after, whatever its count and
    whether another waits; one that grew it little waits its turn."""
    calls = []
    resident = iter([100, 110, 100 + 2**30, 120, 130, 140, 150]).__next__
    releaser = FreeMemoryReleaser(every=4, grown=2**20, resident=resident)
    monkeypatch.setattr(releaser, "_trim", calls.append)
    assert releaser.after_batch() is False  # 10 bytes more: no trim
    assert releaser.after_batch(next_waiting=True) is True  # a GiB more: now
    # counted afresh from what was left after the trim (120)
    assert [releaser.after_batch() for _ in range(3)] == [False, False, False]
    assert calls == [0]


def test_without_a_resident_size_the_trim_waits_its_turn(monkeypatch):
    releaser = FreeMemoryReleaser(every=2, resident=lambda: None)
    monkeypatch.setattr(releaser, "_trim", lambda _: None)
    assert [releaser.after_batch() for _ in range(4)] == [False, True] * 2


@glibc_only
def test_the_resident_size_is_read_from_proc():
    size = resident_bytes()
    assert size is not None and 2**20 < size < 2**40


def test_a_worker_leaves_what_it_loaded_out_of_the_collectors_full_passes():
    """Frozen once loaded: a full collection then skips the model's and the libraries'
    objects (a pass over them stalled every running batch for ~200 ms)."""
    with RunningServer(["--handler", "tests.handlers:collector", "--no-warmup"]) as server:
        status, [state] = server.post_json({"inputs": ["x"]})
    assert status == 200
    assert state["frozen"] > 10_000  # the imports and the handler, at least
    assert state["tracked"] < state["frozen"]  # only what came after is collected


def test_glibc_is_looked_up_once(monkeypatch):
    """`find_library` runs `ldconfig -p` (about 1 ms): /tokenize paid it at each trim."""
    import ctypes.util

    from rawserve.shared import memory

    looked_up = []
    find_library = ctypes.util.find_library
    monkeypatch.setattr(
        ctypes.util, "find_library", lambda name: looked_up.append(name) or find_library(name)
    )
    memory._libc.cache_clear()
    try:
        for _ in range(3):
            memory.give_back_free_memory()
    finally:
        memory._libc.cache_clear()
    assert len(looked_up) <= 1  # (none off Linux)

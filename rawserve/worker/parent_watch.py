"""A worker whose server died without stopping it (SIGKILL, the kernel's OOM killer)
exits on its own, within `CHECK_SECONDS`.

Its pipe tells it only when the model's thread reads or writes again: a worker loading a
model, or in a long batch (or hung in one: the batch timeout's kill died with the
server), lived on as an orphan for as long, its memory (a GPU's too) held, and a server
restarted at once by a supervisor (a shell loop, supervisord) ran short of it. A thread
that polls the parent's id, not the kernel's parent-death signal: that one fires when the
thread that started the worker ends, and the server starts workers from threads too.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

CHECK_SECONDS = 0.5


def exit_with_parent() -> None:
    """Exit this process (code 1) once the process that started it is gone."""
    started_by = multiprocessing.parent_process()  # (None: not started by multiprocessing)
    parent = started_by.pid if started_by is not None else os.getppid()
    thread = threading.Thread(target=_watch, args=(parent,), name="rawserve-parent-watch")
    thread.daemon = True
    thread.start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:  # an orphan is adopted: its parent's id changes
        time.sleep(CHECK_SECONDS)
    os._exit(1)  # nobody to answer, nor to hear how it ended

"""A process's state as Linux's /proc says it: running, sleeping, stopped, a zombie."""

from __future__ import annotations

import os

# stopped by a signal (SIGSTOP, SIGTSTP: `kill -STOP`, a container paused by its cgroup
# freezer shows "D" or "S" instead), or at a debugger's tracing stop
STOPPED = ("T", "t")


def state_of(pid: int) -> str | None:
    """The one-letter state of process `pid` (`R`, `S`, `D`, `T`, `t`, `Z`, ...); None
    where it is gone or the system has no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # (its name, in parentheses before the state, may hold spaces and parentheses)
            return stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped, by a signal or a debugger: not running at all."""
    return state_of(pid) in STOPPED


def has_proc() -> bool:
    return os.path.isdir("/proc")

"""The process's open files limit (`ulimit -n`), raised at start-up to what the
connection cap needs.

A connection takes a file descriptor before anything can be said on it: past the limit
the event loop cannot accept it, and resets it, so the cap's 503 and the probes' reserve
past the cap (rawserve.http.limits) would never be reached. Many machines start a shell
with a soft limit of 1024, under the default cap of 1000 plus the probes' seats, the
refused connections that wait for their clients' close, and the server's own
descriptors; the hard limit is usually far higher, and a process may raise
its soft limit up to it (as Go's runtime does for every program). Only as far as needed:
raised to the hard limit, libraries that still use `select()` would fail on the
descriptors above 1024. The HTTP processes inherit the limit.

And the standard descriptors (0, 1, 2) are open: a process started with one closed
(`>&-`, `2>&-`, a service manager's) takes it for the next file it opens, the event
loop's own, and uvloop aborts the process as it closes such a descriptor at the end of a
clean stop (exit code 134); the worker and HTTP processes start without it too, and take
it for one of their pipes (a handler's print would write into it). Each closed one is
opened on /dev/null first, as OpenSSH's daemon does.
"""

from __future__ import annotations

import logging
import os
import resource

from rawserve.http.limits import OWN_FILES

log = logging.getLogger("rawserve")

STANDARD_DESCRIPTORS = (0, 1, 2)
# what "no cap" raises the open files limit to where the hard limit is unlimited (Linux's
# default most a process may have, fs.nr_open)
NO_CAP_FILES = 1_048_576


def open_standard_descriptors() -> None:
    """Open /dev/null on each standard descriptor that is closed, inherited by the
    processes the server starts (Python opens a file for this process alone)."""
    for fd in STANDARD_DESCRIPTORS:
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            os.set_inheritable(fd, True)


def raise_open_files_limit(connections: int) -> None:
    """Make room for `connections` open connections in each process (0: no cap: as many
    as the hard limit allows); warn where the hard limit does not allow it."""
    if not connections:
        raise_for_no_cap()
        return
    needed = connections + OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit to %d: %s", target, exc)
            target = soft
        else:
            log.info("open files limit raised from %d to %d", soft, target)
    if target < needed:
        log.warning(
            "the open files limit (%d, ulimit -n) holds fewer than the %d connections a "
            "process may keep (--max-connections, the probes' seats, and the refused "
            "connections waiting for their clients' close): past it refusals are reset "
            "at once, and then new connections too, not answered",
            target,
            connections,
        )


def raise_for_no_cap() -> None:
    """With no connection cap the open files limit is the only bound: the soft limit
    raised to the hard one (left at a shell's 1024, "no cap" took fewer connections than
    the default cap's 1000 did, and reset the rest without a word), and the log says it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NO_CAP_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit to %d: %s", target, exc)
        else:
            soft = target
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,}"
    log.info(
        "--max-connections 0: each process takes connections up to its open files limit "
        "(%s, ulimit -n, less its own files); past it new connections are reset, not "
        "answered",
        shown,
    )

"""The signals that drain the server, in its own process and in each HTTP process:
SIGTERM, SIGINT, and SIGHUP (a closed terminal sends it to the whole process group; there
is no configuration to reload, and dying of it lost every answer in flight), unless SIGHUP
is ignored: under `nohup` the server outlives its terminal."""

from __future__ import annotations

import signal


def interrupt_on_stop_signals() -> None:
    """Until the server puts its own handlers in place, its stop signals stop the start
    as Ctrl-C does (KeyboardInterrupt): as a container's PID 1 (no init) the kernel
    ignores a signal left at its default action, and a stop as the server's modules were
    imported or its model downloaded was lost, the server then serving until the SIGKILL
    after it; SIGHUP's default ended the process without a word. (SIGINT is Python's
    own, and left ignored where it was: a server started in the background.)"""
    for signum in stop_signals():
        if signum is not signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)


def stop_signals() -> tuple[signal.Signals, ...]:
    """What to drain on (read before the process puts its own handlers in place: a child
    started by then no longer inherits an ignored SIGHUP)."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return (signal.SIGTERM, signal.SIGINT)
    return (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

"""The signals that drain the server, in its own process and in each HTTP process:
SIGTERM, SIGINT, and SIGHUP (a closed terminal sends it to the whole process group; there
is no configuration to reload, and dying of it lost every answer in flight), unless SIGHUP
is ignored: under `nohup` the server outlives its terminal."""

from __future__ import annotations

import signal


def stop_signals() -> tuple[signal.Signals, ...]:
    """What to drain on (read before the process puts its own handlers in place: a child
    started by then no longer inherits an ignored SIGHUP)."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return (signal.SIGTERM, signal.SIGINT)
    return (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

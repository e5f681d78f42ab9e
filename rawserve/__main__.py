"""`python -m rawserve` and the `rawserve` command: the command line lives in rawserve.main.

SIGTERM stops the start as Ctrl-C does from this first line on: as a container's PID 1
(the Dockerfile's entry point, no init) the kernel ignores a signal left at its default
action, and one sent while the server's modules are still being imported (a pod deleted
as it starts) was lost, the server then serving until the SIGKILL after it. The script
pip writes for the `rawserve` command imports `command` from here for the same reason.
SIGHUP too, unless ignored (`nohup`): it ended the process by its default action, without
a word.
"""

import signal

signal.signal(signal.SIGTERM, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # (under nohup it stays ignored)
    signal.signal(signal.SIGHUP, signal.default_int_handler)  # a terminal closed: the same

try:
    from rawserve.main import command, main
except KeyboardInterrupt:  # stopped while importing, as main() stops on one while starting
    raise SystemExit(1) from None

__all__ = ["command", "main"]

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m rawserve` and the `rawserve` command: the command line lives in rawserve.main.

The stop signals stop the start as Ctrl-C does from this first line on (a pod deleted as
its server's modules are still being imported: `interrupt_on_stop_signals`). The script
pip writes for the `rawserve` command imports `command` from here for the same reason.
"""

from rawserve.ops.stop_signals import interrupt_on_stop_signals

interrupt_on_stop_signals()

try:
    from rawserve.main import command, main
except KeyboardInterrupt:  # stopped while importing, as main() stops on one while starting
    raise SystemExit(1) from None

__all__ = ["command", "main"]

if __name__ == "__main__":
    raise SystemExit(main())

"""What the compatibility scripts (tests/compat_*_client.py) print of each client call.

Imported by those scripts from their own folder, inside the clients' virtual environments:
standard library only, nothing of rawserve or of the tests package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def outcome_of(shape: Callable[[Any], Any] = lambda result: result) -> Callable[[Any], Any]:
    """`outcome(call)`: what `call()` answered, made JSON by `shape`, or the client's
    exception (its class and message: the test reads which error the client raised)."""

    def outcome(call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the error is what is being checked
            return {"raised": type(exc).__name__, "message": str(exc)}
        return shape(result)

    return outcome

"""The access log: one INFO line per response on the `rawserve.access` logger.

`--no-access-log` raises that logger's level (rawserve.shared.logs), so the line is then
never formatted. With `--log-format json` the fields go out as JSON keys.
"""

from __future__ import annotations

import logging

access_log = logging.getLogger("rawserve.access")


def log_access(
    peer: str, method: str, target: str, status: int, size: int, seconds: float, request_id: str
) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    access_log.info(
        '%s "%s %s" %d %d %.1fms %s',
        *(peer, method, target, status, size, 1000 * seconds, request_id),
        extra={
            "peer": peer,
            "method": method,
            "target": target,
            "status": status,
            "bytes": size,
            "duration_ms": round(1000 * seconds, 3),
            "request_id": request_id,
        },
    )

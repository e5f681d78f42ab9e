"""The access log: one line per response on the `rawserve.access` logger.

`--no-access-log` raises that logger's level (rawserve.shared.logs), so the line is then
never formatted. With `--log-format json` the fields go out as JSON keys. Probes
(`GET /health`, `/ready`, `/ready/<model>`) are logged at DEBUG: an orchestrator asks every
few seconds, and those lines would drown the requests.

What a client chose (method, target, request id) is escaped in the text line: a quote, a
backslash or a control character becomes `\\xHH`, so a path cannot close the quoted field
and write fields of its own, nor start a line. The JSON keys carry the values as sent
(JSON escapes them itself).
"""

from __future__ import annotations

import logging
import re

access_log = logging.getLogger("rawserve.access")

PROBE_PATHS = ("/health", "/ready")
_PROBE_PREFIX = "/ready/"
# quotes and backslashes (which end or escape a field), control characters and DEL
_UNSAFE = re.compile(r'["\\\x00-\x1f\x7f-\x9f]')


def escape(value: str) -> str:
    """`value` fit for a quoted field of the text line (`"` becomes `\\x22`)."""
    return _UNSAFE.sub(lambda match: f"\\x{ord(match.group()):02x}", value)


def is_probe(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and (path in PROBE_PATHS or path.startswith(_PROBE_PREFIX))


def log_access(
    peer: str, method: str, target: str, status: int, size: int, seconds: float, request_id: str
) -> None:
    level = logging.DEBUG if is_probe(method, target.partition("?")[0]) else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    access_log.log(
        level,
        '%s "%s %s" %d %d %.1fms %s',
        *(peer, escape(method), escape(target), status, size, 1000 * seconds, escape(request_id)),
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

"""The access log: one line per response on the `rawserve.access` logger.

`--no-access-log` raises that logger's level (rawserve.shared.logs), so the line is then
never formatted. With `--log-format json` the fields go out as JSON keys. Where the
server's own logging set-up is the only place the line goes, it is written there
directly (`DirectLines`: the same line, for a sixth of the cost); else it goes through
logging as a record. Probes (`GET` or `HEAD` of /health, /ready, /ready/<model> and
SageMaker's /ping) are logged at DEBUG: an orchestrator asks every few seconds, and those
lines would drown the requests.

What a client chose (method, target, request id) is escaped in the text line: a quote, a
backslash or a character that is not printable becomes `\\xHH` (or `\\uHHHH`), so a path
cannot close the quoted field and write fields of its own, nor start a line. The JSON
keys carry the values as sent (JSON escapes them itself). A target longer than a head may
be (a head refused as too large) is cut, with "..." at its end.

A client's retry of a request it sent before is marked in the JSON keys (`retry`: the
how-manieth), where the client says so: OpenAI's SDK (and every SDK Stainless makes)
sends `x-stainless-retry-count` with each try, and its retries (after a 408, a 429, a 5xx
or a lost connection) are otherwise lines like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rawserve.shared.logs import direct_lines, escaped

access_log = logging.getLogger("rawserve.access")

LINE = '%s "%s %s" %d %d %.1fms %s'  # peer "method target" status bytes duration request id
PROBE_PATHS = ("/health", "/ready", "/ping")  # (/ping: SageMaker's readiness)
_PROBE_PREFIX = "/ready/"
_FIELD_ENDS = ('"', "\\")  # a quote ends a quoted field; a backslash escapes
# A target is cut past this many characters: a head within its 16 KiB has a shorter one,
# but a larger head that came in one read is parsed before its 414
MAX_TARGET_CHARS = 16 * 1024
RETRY_HEADER = b"x-stainless-retry-count"
MAX_RETRY_DIGITS = 3  # a retry count is small: a longer value is not one


def escape(value: str) -> str:
    """`value` fit for a quoted field of the text line: `"`, `\\` and every character
    that is not printable (control characters, line separators) as `\\xHH`/`\\uHHHH`."""
    if value.isprintable() and '"' not in value and "\\" not in value:
        return value  # what nearly every request sends: no copy
    return "".join(
        char if char.isprintable() and char not in _FIELD_ENDS else escaped(char) for char in value
    )


def retry_count(value: str | None) -> int:
    """The retry a request is by its `RETRY_HEADER` (0: the first try, or no count)."""
    if value is None or len(value) > MAX_RETRY_DIGITS:
        return 0
    return int(value) if value.isascii() and value.isdigit() else 0  # ("²" is a digit)


PROBE_ANSWERS = frozenset({200, 503})  # a probe's up and down


def is_probe(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and (path in PROBE_PATHS or path.startswith(_PROBE_PREFIX))


def log_access(
    peer: str | Callable[[], str],
    method: str,
    target: str,
    status: int,
    size: int,
    seconds: float,
    request_id: str,
    retry: int = 0,
    path: str | None = None,
) -> None:
    """Log one response (`peer`: the client's address, or a function that says it, called
    only when the line is written: nothing is formatted for a log that is off; `retry`:
    the client's retry it answers, a JSON key only; `path`: the target's path as the
    routes saw it, where it differs: an absolute form's, a %-encoded one's)."""
    # a probe's answers (up, down) at DEBUG; anything else a probe path answers, as a 401 to
    # someone trying keys there or a 404, at INFO: an operator sees those
    path = target.partition("?")[0] if path is None else path
    probe = is_probe(method, path) and status in PROBE_ANSWERS
    level = logging.DEBUG if probe else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    if callable(peer):
        peer = peer()
    if len(target) > MAX_TARGET_CHARS:
        target = target[:MAX_TARGET_CHARS] + "..."
    args = (peer, escape(method), escape(target), status, size, 1000 * seconds, escape(request_id))
    fields = {
        "peer": peer,
        "method": method,
        "target": target,
        "status": status,
        "bytes": size,
        "duration_ms": round(1000 * seconds, 3),
        "request_id": request_id,
    }
    if retry:
        fields["retry"] = retry
    direct = direct_lines(access_log, level)
    if direct is None or not direct.write(direct.line(level, access_log.name, LINE % args, fields)):
        access_log.log(level, LINE, *args, extra=fields)  # another handler, or a failed write

"""Logging set-up: one line per event, as text or as JSON, and the access log switch.

Stdlib `logging` only. `setup_logging` configures the root logger of a process (the
server, and each worker through `setup_worker_logging`, which reads the same options
from the RAWSERVE_* environment the worker inherits). The access log is the
`rawserve.access` logger (one INFO line per response, written by the protocol);
`--no-access-log` raises its level so those lines are never formatted. Never imports
h11 or torch.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
ACCESS_LOGGER = "rawserve.access"
# huggingface_hub's HTTP client logs every request of a download at INFO
CHATTY_LOGGERS = ("httpx2", "httpx", "httpcore")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRIBUTES = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class TextFormatter(logging.Formatter):
    """The classic text line; a multi-line message or traceback is kept on one line."""

    def __init__(self, fmt: str = TEXT_FORMAT):
        super().__init__(fmt)
        self._stamp = (-1, "")  # (second, its date and time): one strftime a second

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\\n")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        cached_second, stamp = self._stamp
        if second != cached_second:  # the access log writes a line per request
            stamp = time.strftime(self.default_time_format, self.converter(record.created))
            self._stamp = (second, stamp)
        return f"{stamp},{int(record.msecs):03d}"  # logging's default_msec_format


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and key not in document:
                document[key] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, default=str, ensure_ascii=False)


def make_formatter(log_format: str, text_format: str = TEXT_FORMAT) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter(text_format)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")


def setup_logging(
    level: str = "info",
    log_format: str = "text",
    access_log: bool = True,
    *,
    stream: TextIO | None = None,
    text_format: str = TEXT_FORMAT,
) -> None:
    """Send every logger's records to `stream` (stderr) as one line each."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(log_format, text_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The access log is INFO; off means it is never even formatted.
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET if access_log else logging.WARNING)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(root.level, logging.WARNING))


def setup_worker_logging(label: str | int, environ: Mapping[str, str] | None = None) -> None:
    """Logging in worker process `label` (e.g. 0, or cls/0), with the server's level and
    format."""
    env = os.environ if environ is None else environ
    log_format = env.get("RAWSERVE_LOG_FORMAT", "text")
    setup_logging(
        env.get("RAWSERVE_LOG_LEVEL", "info"),
        log_format if log_format in LOG_FORMATS else "text",
        text_format=f"%(asctime)s worker-{label} %(levelname)s %(message)s",
    )

"""Logging set-up: one line per event, as text or as JSON, and the access log switch.

Stdlib `logging` only. `setup_logging` configures the root logger of a process (the
server, and each worker through `setup_worker_logging`, which reads the same options
from the RAWSERVE_* environment the worker inherits). The access log is the
`rawserve.access` logger (one INFO line per response, written by the protocol);
`--no-access-log` raises its level so those lines are never formatted. Never imports
h11 or torch.
"""

from __future__ import annotations

import codecs
import datetime
import io
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import Any, TextIO

from rawserve.shared.log_writer import background

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # --log-level, any case
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
ACCESS_LOGGER = "rawserve.access"
# huggingface_hub's HTTP client logs every request of a download at INFO, and the ONNX
# exporter's graph passes each node they fold or drop (some 200 lines a first start)
CHATTY_LOGGERS = ("httpx2", "httpx", "httpcore", "onnxscript", "onnx_ir")

# The request a task serves (its X-Request-Id), set by the protocol in the task that answers
# it: the serving side tags the items it queues with it, so that a model worker's log line
# about an item names the request the access log names (tasks the answer starts inherit it)
REQUEST_ID: ContextVar[str] = ContextVar("rawserve_request_id", default="")

# A message is cut past this many characters: a library's warning may quote a client's
# whole input (transformers' fill-mask wrote a 900,000-character target into one line),
# and a request may not write its body into the log. Our own messages quote clients'
# values cut far shorter. A traceback (or a stack) is cut to as much again
# (`bounded_traceback`): a handler's error quoting a 3 MB input wrote a 3 MB line.
MAX_MESSAGE_CHARS = 16 * 1024
MAX_TRACEBACK_LINE_CHARS = 2 * 1024  # of each of its lines: a frame's line is short

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRIBUTES = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


# The scheme of an address (`https://`), from the first letter of a run of the characters
# a scheme may hold (`_x1https://`: `https://`), the run's other letters never starting one:
# a run that ends in no :// is read once, not again from each of its letters
# (`(?<!...)(?:...)*+` is the run's start and its characters before that letter)
SCHEME_PREFIX = r"(?<![\w+.\-])(?:[^\WA-Za-z]|[+.\-])*+"
SCHEME = r"[A-Za-z][\w+.\-]*+://"
# An @ after which a host follows: its next /, ?, #, space, quote or the end comes before
# any other @
_HOST_AFTER = r"(?=[^\s'\"/?#@]*+(?:[/?#\s'\"]|$))"
# The user part (to the first /, ?, #, @, space, quote or bracket) holds a colon that is no
# host's port (`host:8080/`): checked once, at its start
_USER_COLON = r"(?=[^\s'\"/?#@\[\]:]*+:(?!\d*+(?:[/?#\s'\"]|$)))"
# An address's credentials: its userinfo, before its host (`https://token@host`,
# `redis://:secret@cache`), a user:password to the first @ after which a host follows
# (`https://user:pa/ss@host`, `postgres://user:p@ss@db`, written unescaped), not a host's
# port (`http://host:8080/a@b`), an IPv6 host's colons, nor an @ in a path or a query
# (`https://user:pw@host/x@2x.png`, `?email=a@b.c`). Left out of every line (a mirror's
# HF_ENDPOINT of https://user:password@host was written in huggingface_hub's retry lines
# and rawserve's own, a client's absolute-form target in its access line) and of what
# clients are told of a failure.
# Linear in the text's length: a scheme starts only at its run's first letter, a
# user part's colon is checked once, and a stretch with no host's @ is read once.
URL_CREDENTIALS = re.compile(
    rf"(?P<scheme>{SCHEME_PREFIX}{SCHEME})(?:(?P<userinfo>"
    # user:password, to the first @ before a host (the password may hold / and @)
    rf"{_USER_COLON}[^\s'\"?#]*?@{_HOST_AFTER}"
    # a user (a token) alone
    rf"|[^\s'\"/?#@\[\]]*+@{_HOST_AFTER})"
    # a user:password with no such @ before the next space, quote, ? or #: nor has an
    # address that starts in that stretch; taken whole (and given back as it is), so
    # that each one's search does not read the same stretch again
    rf"|{_USER_COLON}[^\s'\"?#]*+)"
)


def without_credentials(text: str) -> str:
    """`text` with each address's credentials written `<credentials>`."""
    if "@" not in text:
        return text  # nearly every line: no search
    return URL_CREDENTIALS.sub(_credentials_left_out, text)


def _credentials_left_out(found: re.Match[str]) -> str:
    if found["userinfo"] is None:
        return found[0]
    return f"{found['scheme']}<credentials>@"


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message`, cut past `limit` characters with a note of how much was left out."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit:,} more characters)"


def bounded_traceback(text: str) -> str:
    """A traceback (or a stack) cut to about `MAX_MESSAGE_CHARS`: each line to
    `MAX_TRACEBACK_LINE_CHARS`, then its last lines kept, those before left out with a
    note. The last lines are where the error is (its type and message, the frame that
    raised it, the latest of a chain of exceptions); the first are rawserve's own frames
    that called the handler or the library, the same in every traceback."""
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    lines = [bounded(line, MAX_TRACEBACK_LINE_CHARS) for line in text.splitlines()]
    # its first lines too (a quarter): an exception's message of many lines left only its
    # last lines, the client's text, neither the error's type nor its first line
    first = _lines_within(lines, MAX_MESSAGE_CHARS // 4)
    last = _lines_within(lines[len(first) :][::-1], MAX_MESSAGE_CHARS - MAX_MESSAGE_CHARS // 4)
    left_out = len(lines) - len(first) - len(last)
    note = [f"... ({left_out:,} lines left out)"] if left_out else []
    return "\n".join(first + note + last[::-1])


def _lines_within(lines: list[str], size: int) -> list[str]:
    """The first of `lines` that hold `size` characters together (one at least)."""
    kept: list[str] = []
    for line in lines:
        size -= len(line) + 1
        if size < 0 and kept:
            break
        kept.append(line)
    return kept


def printable(line: str) -> str:
    """`line` as one line a terminal shows as it is: a newline as `\\n`, every other
    character that is not printable (a carriage return, the ESC of a terminal's escape,
    U+2028, a C1 control) as `escaped`: a client's text quoted in a message cannot start
    a line of its own nor drive the terminal."""
    if line.isprintable():
        return line  # nearly every line: no copy
    return "".join(
        char if char.isprintable() else "\\n" if char == "\n" else escaped(char) for char in line
    )


def escaped(char: str) -> str:
    """A character as `\\xHH`, `\\uHHHH` or `\\UHHHHHHHH`."""
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


NAMED_REQUESTS = 4  # request ids a line names at most


def requests_named(request_ids: Iterable[str]) -> str:
    """Requests a log line is about, as " (request a, b and 3 more)" ("" for none): an
    operator looks for the request a client names (its X-Request-Id)."""
    ids = [request for request in dict.fromkeys(request_ids) if request]
    if not ids:
        return ""
    more = f" and {len(ids) - NAMED_REQUESTS} more" if len(ids) > NAMED_REQUESTS else ""
    return f" (request {', '.join(ids[:NAMED_REQUESTS])}{more})"


def json_line(document: Mapping[str, object]) -> str:
    """`document` as one line of JSON. `json.dumps` escapes the C0 controls; the other
    characters that are not printable (DEL, the C1 controls, U+2028, U+2029) are escaped
    too: a reader splitting lines as Python's `str.splitlines` does, or a terminal, would
    take some for a line break or a control. They only occur inside strings, where
    `\\uHHHH` is the same character."""
    line = json.dumps(document, default=str, ensure_ascii=False)
    if line.isprintable():
        return line
    return "".join(char if char.isprintable() else json.dumps(char)[1:-1] for char in line)


class TextFormatter(logging.Formatter):
    """The classic text line; a multi-line message or traceback is kept on one line,
    and what is not printable is escaped (`printable`)."""

    def __init__(self, fmt: str = TEXT_FORMAT):
        super().__init__(fmt)
        self.fmt = fmt
        self._stamp = (-1, "")  # (second, its date and time): one strftime a second

    def format(self, record: logging.LogRecord) -> str:
        return printable(without_credentials(super().format(record)))

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802
        record.message = bounded(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802
        return bounded_traceback(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return bounded_traceback(super().formatStack(stack_info))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self.stamp(record.created)

    def stamp(self, created: float) -> str:
        """`asctime` of a record made at `created`."""
        second = int(created)
        cached_second, stamp = self._stamp
        if second != cached_second:  # the access log writes a line per request
            stamp = time.strftime(self.default_time_format, self.converter(created))
            self._stamp = (second, stamp)
        milliseconds = int((created - second) * 1000)  # as LogRecord.msecs
        return f"{stamp},{milliseconds:03d}"  # logging's default_msec_format


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the process's own `fields`
    (a worker's `"worker": "cls/0"`), then the record's `extra` fields."""

    def __init__(self, fields: Mapping[str, object] | None = None):
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        message = bounded(record.getMessage())
        document = json_document(record.created, record.levelname, record.name, message)
        document.update(self.fields)
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and key not in document:
                document[key] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return without_credentials(json_line(document))

    def formatException(self, ei: Any) -> str:  # noqa: N802
        return bounded_traceback(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return bounded_traceback(super().formatStack(stack_info))


def first_line(exc: BaseException) -> str:
    """An exception's message in one line, its first (its type's name if it has none): a
    library's message may nest whole tracebacks after it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def json_document(created: float, level_name: str, logger: str, message: str) -> dict[str, Any]:
    """The keys every JSON line starts with."""
    return {
        "time": datetime.datetime.fromtimestamp(created, datetime.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "level": level_name.lower(),
        "logger": logger,
        "message": message,
    }


def make_formatter(
    log_format: str, text_format: str = TEXT_FORMAT, fields: Mapping[str, object] | None = None
) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(fields)
    if log_format == "text":
        return TextFormatter(text_format)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")


def log_thread_failure(args: threading.ExceptHookArgs) -> None:
    """A thread's uncaught error (a thread a handler started, a library's) as one line of
    the log, where Python writes a bare traceback of many lines to stderr."""
    if args.exc_type is SystemExit:
        return  # a thread that exits, as Python's own hook takes it
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("rawserve").error(
        "thread %s failed",
        name,
        exc_info=args.exc_value,
    )


def setup_logging(
    level: str = "info",
    log_format: str = "text",
    access_log: bool = True,
    *,
    stream: TextIO | None = None,
    text_format: str = TEXT_FORMAT,
    fields: Mapping[str, object] | None = None,
) -> None:
    """Send every logger's records to `stream` (stderr) as one line each; `fields` go
    into every JSON line (what `text_format` says of the process in a text line).
    stderr is written by a thread of its own (`log_writer`): a reader that stalls never
    stops the process; a `stream` given is written in the caller's thread."""
    global _direct_lines
    handler = logging.StreamHandler(stream or background(sys.stderr))
    formatter = make_formatter(log_format, text_format, fields)
    handler.setFormatter(formatter)
    _direct_lines = DirectLines.for_handler(handler, formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Python's warnings (torch's, the libraries') are log lines too: in the same format,
    # not bare text between JSON objects; and so is a thread's uncaught error
    logging.captureWarnings(True)
    threading.excepthook = log_thread_failure
    # The access log is INFO; off means it is never even formatted.
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET if access_log else logging.WARNING)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(root.level, logging.WARNING))


def setup_worker_logging(label: str | int, environ: Mapping[str, str] | None = None) -> None:
    """Logging in worker process `label` (e.g. 0, or cls/0), with the server's level and
    format; each line names the worker (of several models, their workers log alike)."""
    env = os.environ if environ is None else environ
    log_format = env.get("RAWSERVE_LOG_FORMAT", "text")
    for name in ("stdout", "stderr"):  # set up again: the log goes to the stream itself
        stream = getattr(sys, name)
        if isinstance(stream, LinesToLog):
            setattr(sys, name, stream.stream)
    # (a model's name is its folder's, which may hold a "%": a format's own character)
    named = str(label).replace("%", "%%")
    setup_logging(
        env.get("RAWSERVE_LOG_LEVEL", "info"),
        log_format if log_format in LOG_FORMATS else "text",
        text_format=f"%(asctime)s worker-{named} %(levelname)s %(message)s",
        fields={"worker": str(label)},
    )
    # A handler's print(), a library's writes: lines of the log in either format (JSON
    # lines, or text lines with the worker's prefix, escaped as `printable`), never raw
    # text, where a client's input a handler prints would start a forged line of its own
    # or drive the terminal; cut as a message is
    sys.stdout = LinesToLog(logging.getLogger("stdout"), logging.INFO, sys.stdout)
    sys.stderr = LinesToLog(logging.getLogger("stderr"), logging.WARNING, sys.stderr)


_LINE_ENDS = re.compile(r"\r\n|[\r\n]")


class LinesToLog(io.TextIOBase):
    """A text stream whose every line is a record of `logger`: a worker's `print()` (a
    handler's), and what libraries write to `sys.stdout` or `sys.stderr`, came out as
    plain text: between the JSON objects of --log-format json, which a log shipper that
    reads JSON chokes on, and in text as a line of its own a client's input could forge.
    What is written to the file descriptor itself (a C library's) still goes to `stream`
    as it is."""

    def __init__(self, logger: logging.Logger, level: int, stream: TextIO):
        super().__init__()
        self.logger = logger
        self.level = level
        self.stream = stream
        self.pending = ""  # a line's start, until its end is written
        # the threads writing a line to the log: what the log writes here meanwhile from
        # the same thread (logging's report of its own failure, to sys.stderr) goes to the
        # stream as it is, else that report would fail again, and again, to a
        # RecursionError that took the worker down (another thread's lines are lines of
        # the log, as ever)
        self.logging: set[int] = set()
        self.buffer = BytesToLines(self)

    def write(self, text: str) -> int:
        # (a progress bar's writes end in "\r": each a line; a line's start held no longer
        # than a message may be: split anew at each write, it took quadratic time)
        if "\n" not in text and "\r" not in text:
            self.pending += text
            if len(self.pending) > MAX_MESSAGE_CHARS:
                self._log(self.pending)
                self.pending = ""
            return len(text)
        *lines, self.pending = _LINE_ENDS.split(self.pending + text)
        for line in lines:
            self._log(line)
        return len(text)

    def _log(self, line: str) -> None:
        if not line.strip():
            return
        thread = threading.get_ident()
        if thread in self.logging:
            self.stream.write(printable(line.rstrip()) + "\n")
            return
        self.logging.add(thread)
        try:
            self.logger.log(self.level, "%s", line.rstrip())
        finally:
            self.logging.discard(thread)

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.stream, "encoding", None) or "utf-8")

    def __getattr__(self, name: str) -> Any:
        # what a stream has beside text lines (`reconfigure`, `errors`): the stream's own
        return getattr(self.stream, name)

    def fileno(self) -> int:
        return self.stream.fileno()

    def writable(self) -> bool:
        return True


class BytesToLines(io.RawIOBase):
    """A `LinesToLog`'s `buffer`: bytes written to it (`sys.stdout.buffer.write`, the
    usual way to write UTF-8 whatever the locale) are decoded and become its lines as
    its text does; they went to the log's stream raw, where a client's text a handler
    wrote started a line of its own (a forged record) and broke a JSON log."""

    def __init__(self, lines: LinesToLog):
        super().__init__()
        self.lines = lines
        self.decoder = codecs.getincrementaldecoder(lines.encoding)("replace")

    def write(self, data: Any) -> int:
        written = bytes(memoryview(data))  # (bytes(5) is five NULs: a TypeError, as ever)
        self.lines.write(self.decoder.decode(written))
        return len(written)

    def fileno(self) -> int:
        return self.lines.fileno()

    def writable(self) -> bool:
        return True


# --- lines written straight to the stream -------------------------------------------

_PLAIN_FIELDS = {"asctime", "name", "levelname", "message"}  # what a direct line can fill in


class DirectLines:
    """Lines written to the stream of the handler `setup_logging` installed, exactly as
    that handler would write them, without a record, a logger's walk or a formatter.

    For the access log, one line per response: logging's path cost ~20 µs of a busy
    event loop a line, this one ~3 (bench/RESULTS.md). Used only while a line of the
    logger would reach that handler and nothing else (`direct_lines`): a handler or a
    filter added later (a program's own logging, a test's capture) gets the record the
    usual way."""

    def __init__(
        self,
        handler: logging.StreamHandler,
        text: TextFormatter | None,
        fields: Mapping[str, object] | None = None,
    ):
        self.handler = handler
        self.text = text  # None: the handler writes JSON
        self.fields = dict(fields or {})  # a JSON line's own, after its message

    @classmethod
    def for_handler(
        cls, handler: logging.StreamHandler, formatter: logging.Formatter
    ) -> DirectLines | None:
        """None where the format asks for more than a direct line knows (a file, a line)."""
        if isinstance(formatter, JsonFormatter):
            return cls(handler, None, formatter.fields)
        if not isinstance(formatter, TextFormatter):
            return None
        asked = set(re.findall(r"%\((\w+)\)", formatter.fmt))
        return cls(handler, formatter) if asked <= _PLAIN_FIELDS else None

    def line(self, level: int, logger: str, message: str, fields: Mapping[str, object]) -> str:
        """The line the handler's formatter makes of a record made now."""
        now = time.time()
        level_name = logging.getLevelName(level)
        if self.text is None:
            document = json_document(now, level_name, logger, message)
            document.update(self.fields)
            document.update((k, v) for k, v in fields.items() if k not in document)
            return without_credentials(json_line(document))
        values = {
            "asctime": self.text.stamp(now),
            "name": logger,
            "levelname": level_name,
            "message": message,
        }
        return printable(without_credentials(self.text.fmt % values))

    def write(self, line: str) -> bool:
        """Write one line as `StreamHandler.emit` does; False where that failed (the
        caller then hands a record to logging, which reports the failure its way)."""
        handler = self.handler
        handler.acquire()
        try:
            handler.stream.write(line + handler.terminator)
            handler.stream.flush()
        except Exception:  # noqa: BLE001 - logging's handleError reports it (writing again)
            return False
        finally:
            handler.release()
        return True


_direct_lines: DirectLines | None = None


def direct_lines(logger: logging.Logger, level: int) -> DirectLines | None:
    """The direct writer when a record of `logger` at `level` would go to setup_logging's
    handler and nowhere else, through no filter; None otherwise."""
    direct = _direct_lines
    if direct is None or level < direct.handler.level or direct.handler.filters:
        return None
    node: logging.Logger | None = logger
    while node is not None and node is not logging.root:
        if node.handlers or node.filters or not node.propagate:
            return None
        node = node.parent
    root = logging.root
    if root.filters or len(root.handlers) != 1 or root.handlers[0] is not direct.handler:
        return None
    return direct

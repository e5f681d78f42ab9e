"""Logging: one line per event as text or JSON, the access log switch, options and env."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import re
import sys
import threading
import time
import warnings

import pytest

from rawserve.http.access_log import log_access
from rawserve.ops.loading import log_loading_progress
from rawserve.options import parse_config
from rawserve.shared import log_writer
from rawserve.shared.logs import (
    MAX_MESSAGE_CHARS,
    TEXT_FORMAT,
    JsonFormatter,
    TextFormatter,
    setup_logging,
    setup_worker_logging,
    without_credentials,
)
from tests.server import RunningServer, module_server, started_as_used

STOPPED = re.compile(r"INFO stopped$|\"message\": \"stopped\"")  # the last line


@pytest.fixture
def restore_logging():
    root, access = logging.getLogger(), logging.getLogger("rawserve.access")
    saved = (list(root.handlers), root.level, access.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    access.setLevel(saved[2])


def record(message: str, **extra) -> logging.LogRecord:
    made = logging.makeLogRecord(
        {"name": "rawserve.test", "levelno": logging.WARNING, "levelname": "WARNING"}
    )
    made.msg = message
    made.__dict__.update(extra)
    return made


def test_json_lines_carry_time_level_logger_message_and_extra_fields():
    line = JsonFormatter().format(record("queue at %d", status=503, request_id="abc"))
    document = json.loads(line)
    assert document["level"] == "warning"
    assert document["logger"] == "rawserve.test"
    assert document["message"] == "queue at %d"
    assert document["status"] == 503 and document["request_id"] == "abc"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", document["time"])


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_an_addresss_credentials_are_left_out_of_every_line(formatter):
    """A mirror's HF_ENDPOINT of https://user:password@host was written in clear in
    huggingface_hub's retry lines and in rawserve's own."""
    said = "HTTP Error 503 thrown while requesting HEAD %s/org/emb/resolve/main/config.json"
    line = formatter.format(record(said % "http://user:SECRETpw@127.0.0.1:19690"))
    assert "SECRETpw" not in line and "user" not in line
    assert "http://<credentials>@127.0.0.1:19690/org/emb/resolve/main/config.json" in line
    mail = formatter.format(record("write to bob@example.com"))  # no address: as said
    assert "bob@example.com" in mail


@pytest.fixture
def json_lines(restore_logging):
    """The worker's log set up as --log-format json: the lines written, read as objects;
    transformers' own logging is left as the library sets itself up."""
    import transformers

    stream = io.StringIO()
    setup_logging("info", "json", stream=stream)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logging.captureWarnings(False)
    transformers.utils.logging.disable_propagation()
    transformers.utils.logging.enable_default_handler()


def test_library_warnings_and_transformers_lines_are_json_lines_too(json_lines):
    """With --log-format json a worker's every line is one object: Python warnings
    (torch's, the libraries') and transformers' loggers, which have a handler of their
    own, included."""
    import transformers

    from rawserve.worker.libraries import library_logs_through_ours

    library_logs_through_ours()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library warning", UserWarning, stacklevel=1)
    transformers.utils.logging.get_logger("transformers.models.x").warning("a model note")
    documents = json_lines()
    assert [(d["logger"], d["level"]) for d in documents] == [
        ("py.warnings", "warning"),
        ("transformers.models.x", "warning"),
    ]
    assert "a library warning" in documents[0]["message"]
    assert documents[1]["message"] == "a model note"


def test_transformers_false_alarm_about_padding_is_left_out(json_lines):
    """`generate` drops an attention mask of all ones, and the model then warned that
    the ids "may be padded" at every generation worker's warm-up; its other lines stay."""
    import transformers

    from rawserve.worker.libraries import library_logs_through_ours

    library_logs_through_ours()
    library_logs_through_ours()  # (a handler's worker calls it again: one filter)
    models = transformers.utils.logging.get_logger("transformers.modeling_utils")
    models.warning(
        "We strongly recommend passing in an `attention_mask` since your input_ids may be "
        "padded. See https://huggingface.co/docs/transformers/troubleshooting"
    )
    models.warning("a weight was not initialized")
    assert [d["message"] for d in json_lines()] == ["a weight was not initialized"]
    assert len(logging.getLogger("transformers.modeling_utils").filters) == 1


def test_a_workers_prints_are_json_lines_too(json_lines):
    """A handler's print() (and a library's writes to sys.stdout or sys.stderr) came out
    as plain text between the JSON objects; now each line is an object of its own."""
    from rawserve.shared.logs import LinesToLog

    out = LinesToLog(logging.getLogger("stdout"), logging.INFO, io.StringIO())
    err = LinesToLog(logging.getLogger("stderr"), logging.WARNING, io.StringIO())
    print("one", file=out)
    out.write("two\nthr")
    out.write("ee\n\n")
    print("a warning", file=err)
    assert [(d["logger"], d["level"], d["message"]) for d in json_lines()] == [
        ("stdout", "info", "one"),
        ("stdout", "info", "two"),
        ("stdout", "info", "three"),
        ("stderr", "warning", "a warning"),
    ]


def test_bytes_a_worker_writes_to_its_streams_buffer_are_its_lines_too(json_lines):
    """`sys.stdout.buffer.write()`, the usual way to write UTF-8 whatever the locale, went
    to the log's stream raw: a client's text a handler wrote that way started a forged
    record of its own and broke a JSON log (two testers)."""
    from rawserve.shared.logs import LinesToLog

    raw = io.StringIO()
    out = LinesToLog(logging.getLogger("stdout"), logging.INFO, raw)
    forged = '{"level":"ERROR","logger":"rawserve","message":"FORGED"}'
    out.buffer.write(f"A\n{forged}\n".encode())
    out.buffer.write("h\u00e9".encode()[:2])  # a character cut between two writes
    out.buffer.write("h\u00e9".encode()[2:] + b" \xff\n")
    out.buffer.flush()
    with pytest.raises(TypeError):  # as a BufferedWriter's (bytes(5) made five NULs)
        out.buffer.write(5)
    assert raw.getvalue() == ""  # nothing reaches the stream but through the log
    assert [(d["logger"], d["message"]) for d in json_lines()] == [
        ("stdout", "A"),
        ("stdout", forged),
        ("stdout", "h\u00e9 \ufffd"),
    ]


@pytest.mark.parametrize(("log_format", "swapped"), [("json", True), ("text", True)])
def test_a_worker_s_standard_streams_log_their_lines_in_either_format(
    restore_logging, monkeypatch, log_format, swapped
):
    """In text, a handler's print() was written raw: a client's input it printed started a
    forged line of its own, or drove the terminal (now a line with the worker's prefix,
    escaped as every line is)."""
    from rawserve.shared.logs import LinesToLog, setup_worker_logging

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # (put back after)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    stderr = sys.stderr
    setup_worker_logging(0, {"RAWSERVE_LOG_FORMAT": log_format})
    assert isinstance(sys.stdout, LinesToLog) is swapped
    assert isinstance(sys.stderr, LinesToLog) is swapped
    assert sys.stderr.fileno() == stderr.fileno()  # a C library's writes: the same fd


def test_a_worker_s_prints_in_text_are_lines_of_the_log(restore_logging, monkeypatch):
    """A handler printing a client's text wrote it raw: a line of its own that read as the
    server's (`... rawserve ERROR forged`), and a terminal's escape."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    setup_worker_logging(0, {"RAWSERVE_LOG_FORMAT": "text"})
    print("got: hi\r2026-01-01 00:00:00,000 rawserve ERROR forged\x1b[31m")
    print("\n2026-01-01 00:00:00,000 rawserve ERROR forged too")
    logging.captureWarnings(False)
    log_writer.wait_written(5)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # (a carriage return ends a line, as a progress bar's do)
    assert all(re.match(r"\S+ \S+ worker-0 INFO ", line) for line in lines), lines
    assert lines[0].endswith(" INFO got: hi")
    assert lines[1].endswith(" INFO 2026-01-01 00:00:00,000 rawserve ERROR forged\\x1b[31m")


def test_a_worker_s_streams_are_streams_and_take_a_progress_bar_in_linear_time():
    """Wrapped in text too, a handler's `sys.stdout.buffer.write` and `reconfigure` were
    500s and `encoding` None; writes with no newline (a progress bar's "\\r...") were
    joined and split again at every write: 80,000 of them ran past a 30 s deadline."""
    from rawserve.shared.logs import MAX_MESSAGE_CHARS, LinesToLog

    said: list[str] = []

    class Logger:
        def log(self, level, form, line):
            said.append(line)

    raw = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    stream = LinesToLog(Logger(), logging.INFO, raw)  # type: ignore[arg-type]
    assert stream.encoding == "utf-8" and stream.buffer.writable()  # (its lines: below)
    stream.reconfigure(line_buffering=True)
    for step in range(80_000):
        stream.write(f"\r{step}")
        assert len(stream.pending) <= MAX_MESSAGE_CHARS + 16
    assert said[:2] == ["0", "1"] and len(said) == 79_999
    stream.write("x" * (MAX_MESSAGE_CHARS + 1))  # a line's start is held no longer than a line
    assert stream.pending == ""


def raised(message: str) -> tuple:
    try:
        raise RuntimeError(message)
    except RuntimeError:
        return sys.exc_info()


@pytest.mark.parametrize(
    "message", ["y" * 3_000_000, "\n".join(f"line {n}" for n in range(300_000))]
)
def test_a_traceback_is_cut_as_a_message_is_keeping_its_end(message):
    """A handler's error quoting a 3 MB input wrote a 3 MB line (the message was cut, its
    traceback not): now its last lines, where the error is, each cut, about 16 KiB."""
    made = record("the model failed")
    made.exc_info = raised(message)
    document = json.loads(JsonFormatter().format(made))
    made.exc_text = None  # (the text formatter makes its own)
    text = TextFormatter().format(made)
    for written in (document["exception"], text):
        assert len(written) < 2 * MAX_MESSAGE_CHARS
        assert ("RuntimeError: yyy" in written) or written.endswith("line 299999")
        assert "more characters)" in written or "lines left out)" in written
    # its first lines too: the error's type and its message's first line (a message of
    # many lines left only its last, the client's text)
    if message.startswith("line"):
        assert "RuntimeError: line 0" in document["exception"]
        assert "RuntimeError: line 0" in text


def test_a_handler_s_transformers_lines_are_json_lines_from_its_factory_on(
    json_lines, monkeypatch, tmp_path
):
    """A handler's worker imports no transformers itself: where the handler's module does,
    its loggers are set up before the factory runs (which loads the handler's model, and
    logs as it does)."""
    import transformers

    from rawserve.shared.messages import WorkerConfig
    from rawserve.worker.handler import load_handler

    (tmp_path / "noting_handler.py").write_text(
        "import transformers\n"
        "def make():\n"
        "    transformers.utils.logging.get_logger('transformers.models.x').warning('loading')\n"
        "    return lambda inputs, **params: list(inputs)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noting_handler", raising=False)
    transformers.utils.logging.disable_propagation()  # as the library sets itself up
    transformers.utils.logging.enable_default_handler()
    load_handler(WorkerConfig(model="", handler="noting_handler:make"), "cpu")
    documents = json_lines()
    assert [(d["logger"], d["message"]) for d in documents] == [
        ("transformers.models.x", "loading")
    ]


def test_torchs_warnings_are_lines_of_ours_not_of_its_own_handler(restore_logging):
    """torch gives its loggers a stderr handler of its own that stops their records: the
    ONNX exporter's "torchvision is not installed" warnings came out in torch's format,
    between the JSON objects of --log-format json."""
    pytest.importorskip("torch")
    from rawserve.worker.libraries import library_logs_through_ours

    torch_loggers = [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and name.split(".")[0] == "torch"
    ]
    saved = [(logger, list(logger.handlers), logger.propagate) for logger in torch_loggers]
    stream = io.StringIO()
    setup_logging("info", "json", stream=stream)
    try:
        library_logs_through_ours()
        logging.getLogger("torch.onnx._internal.exporter._registration").warning(
            "torchvision is not installed"
        )
    finally:
        logging.captureWarnings(False)
        for logger, handlers, propagate in saved:
            logger.handlers[:], logger.propagate = handlers, propagate
    [document] = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert document["logger"] == "torch.onnx._internal.exporter._registration"
    assert document["level"] == "warning"
    assert document["message"] == "torchvision is not installed"


def test_the_onnx_exporters_per_node_lines_are_left_out_but_its_warnings_kept(restore_logging):
    """A first start on ONNX Runtime exports the graph: its passes log each node they
    fold or drop at INFO, some 200 lines in the server's log."""
    setup_logging("info", "text", stream=io.StringIO())
    for name in ("onnxscript.optimizer._constant_folding", "onnx_ir.passes.common"):
        exporter = logging.getLogger(name)
        assert not exporter.isEnabledFor(logging.INFO)
        assert exporter.isEnabledFor(logging.WARNING)
    assert logging.getLogger("rawserve.worker").isEnabledFor(logging.INFO)


@pytest.mark.parametrize(
    ("label", "named"),
    [(0, "0"), ("cls/0", "cls/0"), ("emb%v2/0", "emb%v2/0"), ("a%sb/1", "a%sb/1")],
)
def test_a_workers_json_lines_name_the_worker_as_its_text_lines_do(
    restore_logging, monkeypatch, label, named
):
    """Of several models, every worker logs "imports took ...", "engine: ..." alike: a
    JSON line that did not name its worker could be any model's."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    for log_format in ("text", "json"):
        setup_worker_logging(label, {"RAWSERVE_LOG_FORMAT": log_format})
        logging.getLogger("rawserve.worker").info("engine: torch")
        logging.getLogger("rawserve.worker").info("a field", extra={"worker": "not this"})
    logging.captureWarnings(False)
    log_writer.wait_written(5)  # stderr is written by a thread of its own
    text, _, *documents = stream.getvalue().splitlines()
    assert f" worker-{named} INFO engine: torch" in text
    assert [(json.loads(line)["worker"], json.loads(line)["message"]) for line in documents] == [
        (named, "engine: torch"),
        (named, "a field"),
    ]


def test_a_log_that_fails_in_a_workers_stream_reports_it_on_the_stream_once(monkeypatch):
    """logging reports a handler's failure on sys.stderr, which in a worker is a
    LinesToLog writing to the same log: the report failed again, and again, and the
    worker died of a RecursionError (a model folder named with a "%" did that at load).
    The report goes to the stream itself."""
    from rawserve.shared.logs import LinesToLog

    class Failing(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                raise ValueError("this handler cannot write")
            except ValueError:
                self.handleError(record)

    logger = logging.getLogger("rawserve.tests.failing")
    logger.propagate = False
    logger.addHandler(Failing())
    raw = io.StringIO()
    stream = LinesToLog(logger, logging.WARNING, raw)
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(logging, "raiseExceptions", True)
    try:
        stream.write("a line\n")
    finally:
        logger.handlers.clear()
    report = raw.getvalue()
    assert "--- Logging error ---" in report and "this handler cannot write" in report
    assert report.count("--- Logging error ---") == 1 and "\x1b" not in report


def test_lines_printed_from_several_threads_at_once_are_all_lines_of_the_log():
    """The guard against a log failure recursing is the writing thread's own: kept for
    the stream, another thread's line written while one was being logged went to the
    stream raw (a handler's threads printing at once: up to 900 of 1,200 lines came out
    as bare text in a JSON log)."""
    import threading
    import time

    from rawserve.shared.logs import LinesToLog

    logged: list[str] = []

    class Slow(logging.Handler):  # (a write that takes a while: threads overlap in it)
        def emit(self, record: logging.LogRecord) -> None:
            time.sleep(0.001)
            logged.append(record.getMessage())

    logger = logging.getLogger("rawserve.tests.threads")
    logger.propagate = False
    logger.addHandler(Slow())
    raw = io.StringIO()
    stream = LinesToLog(logger, logging.WARNING, raw)

    def prints(thread: int) -> None:
        for line in range(25):
            stream.write(f"thread {thread} line {line}\n")

    threads = [threading.Thread(target=prints, args=(n,)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        logger.handlers.clear()
    assert raw.getvalue() == "" and len(logged) == 100


def test_a_threads_uncaught_error_is_one_log_line(restore_logging, monkeypatch):
    """A thread a handler starts that raises wrote Python's bare traceback to stderr, many
    lines amid the log (with --log-format json, lines that are not JSON)."""
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    stream = io.StringIO()
    setup_logging("info", "json", stream=stream)

    def fail():
        raise ZeroDivisionError("in a thread")

    thread = threading.Thread(target=fail, name="model-helper")
    thread.start()
    thread.join()
    [line] = stream.getvalue().splitlines()
    document = json.loads(line)
    assert (document["level"], document["message"]) == ("error", "thread model-helper failed")
    assert "ZeroDivisionError: in a thread" in document["exception"]


def test_a_traceback_stays_on_one_line_in_both_formats():
    failed = record("it failed")
    try:
        raise ValueError("first line\nsecond line")
    except ValueError:
        failed.exc_info = sys.exc_info()
    for formatter in (JsonFormatter(), TextFormatter()):
        line = formatter.format(failed)
        assert "\n" not in line
        assert "second line" in line
    assert "ValueError" in json.loads(JsonFormatter().format(failed))["exception"]


def test_a_message_past_its_bound_is_cut_in_both_formats():
    """A library's warning quoted a client's whole fill-mask target: one line of 900,000
    characters a request. The message is cut, saying how much; so is a traceback, its
    line of 32 KiB to 2 KiB (`test_a_traceback_is_cut_as_a_message_is_keeping_its_end`)."""
    from rawserve.shared.logs import MAX_MESSAGE_CHARS

    target = "q" * 900_000
    warned = record("The specified target token `%s` does not exist")
    warned.args = (target,)
    try:
        raise ValueError("x" * (2 * MAX_MESSAGE_CHARS))
    except ValueError:
        warned.exc_info = sys.exc_info()
    for line in (TextFormatter().format(warned), JsonFormatter().format(warned)):
        assert len(line) < 4 * MAX_MESSAGE_CHARS
        assert f"... ({900_000 + 44 - MAX_MESSAGE_CHARS:,} more characters)" in line
    exception = json.loads(JsonFormatter().format(warned))["exception"]
    assert exception.endswith(f"ValueError: {'x' * 2036}... (30,732 more characters)")
    short = record("fine")
    assert json.loads(JsonFormatter().format(short))["message"] == "fine"
    assert TextFormatter().format(short).endswith(" fine")


# What a client's text may carry into a message (a handler's error quoting its input):
# a carriage return and a line of the server's own, a terminal's escape, line separators
FORGED_TEXT = "bad\r2026-01-01 00:00:00,000 rawserve ERROR forged\x1b[2J\u2028\u2029\x85\x9b\x7f"


def test_a_clients_text_in_a_message_cannot_start_a_line_or_drive_a_terminal():
    failed = record("an item failed: %s", forged=FORGED_TEXT)
    failed.args = (FORGED_TEXT,)
    try:
        raise RuntimeError(FORGED_TEXT)
    except RuntimeError:
        failed.exc_info = sys.exc_info()
    text = TextFormatter().format(failed)
    assert text.isprintable() and "\\x0d2026-01-01" in text  # one line, and visible
    line = JsonFormatter().format(failed)
    assert line.isprintable() and len(line.splitlines()) == 1  # splitlines: U+2028 too
    document = json.loads(line)
    assert document["message"] == f"an item failed: {FORGED_TEXT}"  # the text as it was
    assert document["forged"] == FORGED_TEXT and FORGED_TEXT in document["exception"]


@pytest.mark.parametrize("access_log", [True, False])
def test_the_access_log_switch(restore_logging, access_log):
    stream = io.StringIO()
    setup_logging("info", "json", access_log=access_log, stream=stream)
    logging.getLogger("rawserve.access").info("GET / 200", extra={"status": 200})
    logging.getLogger("rawserve").info("an event")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["logger"] for line in lines] == [
        *(["rawserve.access"] if access_log else []),
        "rawserve",
    ]


@pytest.mark.parametrize(
    ("argv", "env", "no_access_log", "log_format"),
    [
        ([], {}, False, "text"),
        (["--no-access-log", "--log-format", "json"], {}, True, "json"),
        ([], {"RAWSERVE_NO_ACCESS_LOG": "1", "RAWSERVE_LOG_FORMAT": "json"}, True, "json"),
        ([], {"RAWSERVE_NO_ACCESS_LOG": "True"}, True, "text"),
        ([], {"RAWSERVE_NO_ACCESS_LOG": "0"}, False, "text"),
        ([], {"RAWSERVE_NO_ACCESS_LOG": "off"}, False, "text"),
    ],
)
def test_options_and_their_environment_variables(monkeypatch, argv, env, no_access_log, log_format):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = parse_config(argv)
    assert (not config.access_log, config.log_format) == (no_access_log, log_format)


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--log-format", "xml"], {}), ([], {"RAWSERVE_NO_ACCESS_LOG": "maybe"})],
)
def test_bad_logging_options_are_refused(monkeypatch, capsys, argv, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert "rawserve: error:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def servers(request):
    """A server of its own for each slow test (each stops it), those the selected tests
    use started together (their workers load side by side)."""
    echo = ["--handler", "tests.handlers:echo"]
    with started_as_used(
        request,
        {
            "json_server": lambda: RunningServer([*echo, "--log-format", "json"]),
            "quiet_server": lambda: RunningServer(echo, env={"RAWSERVE_NO_ACCESS_LOG": "1"}),
            "unread_server": lambda: RunningServer(echo),
            "lingering_server": lambda: RunningServer(
                ["--handler", "tests.handlers:lingering_thread", "--device", "cpu"]
            ),
        },
    ) as get:
        yield get


json_server = module_server("json_server")
quiet_server = module_server("quiet_server")
unread_server = module_server("unread_server")
lingering_server = module_server("lingering_server")


@pytest.mark.slow
def test_json_logs_from_the_server_and_its_worker_with_an_access_line_per_request(json_server):
    server = json_server
    with server:
        status, headers, _ = server.request("POST", "/?x=1", "hello", {"X-Request-Id": "req-42"})
        assert status == 200
        server.stop()
        server.wait_for_log(STOPPED)
    documents = [json.loads(line) for line in server.lines]  # every line is one object
    assert all({"time", "level", "logger", "message"} <= set(d) for d in documents)
    assert any(d["message"].startswith("worker 0: started") for d in documents)
    [access] = [d for d in documents if d["logger"] == "rawserve.access"]
    assert access["method"] == "POST" and access["target"] == "/?x=1"
    assert access["status"] == 200 and access["request_id"] == "req-42"
    assert access["duration_ms"] >= 0 and access["bytes"] > 0


@pytest.mark.slow
def test_no_access_log_from_the_environment(quiet_server):
    server = quiet_server
    with server:
        assert server.request("POST", "/", "hello")[0] == 200
        assert server.request("GET", "/nope")[0] == 404
        server.stop()
        server.wait_for_log(STOPPED)
    assert not [line for line in server.lines if "rawserve.access" in line]
    assert any("ready in" in line for line in server.lines)  # the rest is still logged


@pytest.mark.slow
def test_a_log_nobody_reads_never_stops_the_server(unread_server):
    """A log shipper that stalls (or a terminal paused) stops reading stderr: once its
    pipe was full (some 400 access lines), every log write blocked the event loop, and
    the server answered nothing, not even /health, until someone read again."""
    with unread_server as server:
        server.pause_log()
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for _ in range(1500):  # some 200 KB of access lines: three pipes' worth
            connection.request("POST", "/", body="hello")
            response = connection.getresponse()
            assert (response.status, response.read()[:10]) == (200, b'{"input":"')
        connection.close()
        assert server.request("GET", "/health", timeout=10)[0] == 200
        server.resume_log()
        server.request("GET", "/the-last-request")
        server.wait_for_log(re.compile("/the-last-request"))
    assert len([line for line in server.lines if '"POST /" 200' in line]) == 1500


def test_text_times_match_the_standard_formatter_across_seconds():
    ours, standard = TextFormatter(), logging.Formatter()
    for created in (1_700_000_000.001, 1_700_000_000.999, 1_700_000_001.5, 1_700_000_000.25):
        record = logging.makeLogRecord(
            {"msg": "x", "created": created, "msecs": created % 1 * 1000}
        )
        assert ours.formatTime(record) == standard.formatTime(record)


# --- the access line: a client cannot write fields of its own, probes only at debug ----

TEXT_ACCESS = re.compile(r'^\S+ "(?P<method>\S+) (?P<target>[^"]*)" (?P<status>\d+) \d+ \S+ \S+$')


def access_lines(
    level: str, log_format: str, *requests: tuple[str, str, str], status: int = 404
) -> list[str]:
    stream = io.StringIO()
    setup_logging(level, log_format, stream=stream, text_format="%(message)s")
    for method, target, request_id in requests:
        log_access("10.0.0.1:5000", method, target, status, 15, 0.0002, request_id)
    return stream.getvalue().splitlines()


FORGED = [
    ("GET", '/x"_200_15_0.2ms_forged', "id-1"),
    ("GET", "/a\\b", 'id"2'),
    ("GET", '/x\r\n10.0.0.9:1 "GET /admin" 200', "id-3"),
    ('GE"T', "/\x1b[31mred\x00", "id\\4"),
]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_targets_credentials_are_left_out_of_its_access_line(restore_logging, log_format):
    """An absolute-form target's user:password was written in clear by the access line,
    which does not go through the formatters."""
    target = "http://bob:hunter2@127.0.0.1/health?u=http://carol:s3cret@x.example/"
    [line] = access_lines("info", log_format, ("GET", target, "id-1"), status=400)
    assert "hunter2" not in line and "s3cret" not in line
    assert "http://<credentials>@127.0.0.1/health" in line


@pytest.mark.parametrize(
    ("said", "written"),
    [
        ("http://user:pw@host/p?email=a@b.c", "http://<credentials>@host/p?email=a@b.c"),
        ("postgres://user:p@ss@db", "postgres://<credentials>@db"),
        ("https://user:pa/ss@host/x", "https://<credentials>@host/x"),
        ("redis://:s3cret@cache:6379/0", "redis://<credentials>@cache:6379/0"),
        ("https://user:pw@host/x@2x.png", "https://<credentials>@host/x@2x.png"),
        ("https://u:p@h:8080/@types/node", "https://<credentials>@h:8080/@types/node"),
        ("postgres://user:p@ss@db/x@y", "postgres://<credentials>@db/x@y"),
        ("a=https://u:p@h,b=https://h3/@x", "a=https://<credentials>@h,b=https://h3/@x"),
        ("http://[::1]:8080/a@b", None),
        ("http://[2001:db8::1]:443/users/@me", None),
        # an @ past the host is no userinfo: as said
        ("https://hub.example/api/models?author=me@x.org", None),
        ("https://github.com/a/b/blob/main/x@2x.png", None),
        ("http://localhost:8080/a@b", None),
    ],
)
def test_only_an_addresss_userinfo_is_written_credentials(said, written):
    """The pattern reached the last @ anywhere in an address, its path and query too:
    an author=me@x.org query lost its host and path, in every line."""
    assert without_credentials(said) == (written or said)


def test_a_client_cannot_forge_text_access_log_fields(restore_logging):
    lines = access_lines("info", "text", *FORGED)
    assert len(lines) == len(FORGED)  # no line a client started
    for line in lines:
        match = TEXT_ACCESS.match(line)
        assert match and match["status"] == "404", line  # the real status, where a parser reads it
        assert not any(c in line for c in "\x00\x1b\r")
    assert lines[0].split('"')[1] == "GET /x\\x22_200_15_0.2ms_forged"
    assert lines[1].endswith("id\\x222") and "/a\\x5cb" in lines[1]


def test_json_access_lines_keep_the_values_as_sent_and_an_escaped_message(restore_logging):
    lines = access_lines("info", "json", *FORGED)
    assert len(lines) == len(FORGED)
    for line, (method, target, request_id) in zip(lines, FORGED, strict=True):
        document = json.loads(line)
        assert (document["method"], document["target"]) == (method, target)
        assert document["request_id"] == request_id and document["status"] == 404
        assert TEXT_ACCESS.match(document["message"])["status"] == "404"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_target_of_a_head_refused_as_too_large_is_cut_in_its_access_line(
    restore_logging, log_format
):
    """A head over 16 KiB that came in one read is parsed, then refused with 431: its
    100 KB path made a 100 KB line, a line per request as large as the client likes."""
    [line] = access_lines("info", log_format, ("GET", "/" + "a" * 100_000, "id"))
    assert len(line) < 40_000  # the JSON line holds the target twice: key and message
    target = json.loads(line)["target"] if log_format == "json" else line.split('"')[1]
    assert target.endswith("a...") and len(target) < 17_000


@pytest.mark.parametrize("path", ["/health", "/ready", "/ready/some-model", "/health?x=1", "/ping"])
def test_probes_are_logged_at_debug_only(restore_logging, path):
    for status in (200, 503):  # up, down
        lines = access_lines(
            "info", "text", ("GET", path, "id"), ("POST", path, "id"), status=status
        )
        assert lines == [f'10.0.0.1:5000 "POST {path}" {status} 15 0.2ms id']  # a POST
        both = access_lines(
            "debug", "text", ("GET", path, "id"), ("HEAD", path, "id"), status=status
        )
        assert len(both) == 2
    # anything else a probe path answers is no probe's answer: keys tried there (401) and
    # names not served (404) went unseen at the default level
    for status in (401, 404):
        [line] = access_lines("info", "text", ("GET", path, "id"), status=status)
        assert line == f'10.0.0.1:5000 "GET {path}" {status} 15 0.2ms id'


def test_a_head_probe_is_logged_at_debug_only_as_a_get_probe_is(restore_logging):
    """A load balancer probing with HEAD wrote a line at the default level every few
    seconds, the lines GET's probes were kept out of."""
    for path in ("/health", "/ready/some-model"):
        assert access_lines("info", "text", ("HEAD", path, "id"), status=200) == []


def test_a_json_access_records_duration_is_in_milliseconds(restore_logging):
    """`duration_ms` said seconds (0.0 for a 0.2 ms answer): a dashboard read every
    request as instant, where the text line said 0.2ms."""
    [line] = access_lines("info", "json", ("GET", "/a", "id"))
    assert json.loads(line)["duration_ms"] == 0.2


def test_an_access_record_is_the_one_logging_makes_with_its_own_time(restore_logging):
    """Where a handler of its own takes the line, it gets a record with every field a
    record made by `Logger.log` has (so any handler's format works: a file name, a line,
    a thread), and the time it was made at."""
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    setup_logging("info", "text", stream=io.StringIO())
    logging.getLogger().addHandler(Keep())
    log_access("10.0.0.1:5000", "GET", "/a", 200, 15, 0.0002, "id-1")
    made = logging.getLogger("rawserve.access").makeRecord(
        "rawserve.access", logging.INFO, "f.py", 1, "m", (), None, extra={"peer": "x"}
    )
    log_access("10.0.0.1:5000", "GET", "/b", 200, 15, 0.0002, "id-2")
    first, second = seen
    standard = set(vars(made)) - {"peer"}
    assert standard <= set(vars(first)) and first.funcName == "log_access"
    assert (first.filename, first.process) == ("access_log.py", made.process)
    assert first.created <= made.created <= second.created
    assert second.relativeCreated - first.relativeCreated == pytest.approx(
        1000 * (second.created - first.created)
    )
    line = "%(levelname)s %(name)s:%(filename)s:%(lineno)d %(threadName)s %(message)s"
    assert logging.Formatter(line).format(second).endswith('"GET /b" 200 15 0.2ms id-2')


# --- the access line written straight to the stream --------------------------------


def lines_both_ways(
    log_format: str, text_format: str, monkeypatch, fields: dict[str, object] | None = None
) -> tuple[str, str]:
    """One access line written directly, and the same through logging's record path (a
    filter on the root, which a direct line could not apply, sends it there)."""
    monkeypatch.setattr(time, "time", lambda: 1764230400.0429)
    stream = io.StringIO()
    setup_logging("info", log_format, stream=stream, text_format=text_format, fields=fields)
    monkeypatch.setattr(
        logging.getLogger("rawserve.access"), "handle", lambda record: pytest.fail("a record")
    )
    log_access("10.0.0.1:5000", "GET", "/a\nb", 200, 15, 0.0002, "id-1")
    monkeypatch.undo()
    monkeypatch.setattr(time, "time", lambda: 1764230400.0429)
    logging.getLogger().addFilter(lambda record: True)
    try:
        log_access("10.0.0.1:5000", "GET", "/a\nb", 200, 15, 0.0002, "id-1")
    finally:
        logging.getLogger().filters.clear()
    direct, through_logging = stream.getvalue().splitlines()
    return direct, through_logging


@pytest.mark.parametrize(
    ("log_format", "text_format"),
    [("text", TEXT_FORMAT), ("text", "%(levelname)s %(message)s"), ("json", TEXT_FORMAT)],
)
def test_a_direct_access_line_is_the_line_logging_writes(
    restore_logging, monkeypatch, log_format, text_format
):
    direct, through_logging = lines_both_ways(log_format, text_format, monkeypatch)
    assert direct == through_logging
    fields = {"worker": "cls/0"}
    direct, through_logging = lines_both_ways(log_format, text_format, monkeypatch, fields)
    assert direct == through_logging
    message = json.loads(direct)["message"] if log_format == "json" else direct
    assert message.endswith('"GET /a\\x0ab" 200 15 0.2ms id-1')


def test_a_format_asking_for_more_than_a_direct_line_knows_goes_through_logging(restore_logging):
    stream = io.StringIO()
    setup_logging("info", "text", stream=stream, text_format="%(filename)s %(message)s")
    log_access("10.0.0.1:5000", "GET", "/a", 200, 15, 0.0002, "id-1")
    assert stream.getvalue() == 'access_log.py 10.0.0.1:5000 "GET /a" 200 15 0.2ms id-1\n'


def test_an_access_line_that_cannot_be_written_is_reported_as_logging_reports_it(
    restore_logging, capsys
):
    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError("the disk is full")

    setup_logging("info", "text", stream=Broken())
    log_access("10.0.0.1:5000", "GET", "/a", 200, 15, 0.0002, "id-1")  # raises nothing
    assert "Logging error" in capsys.readouterr().err


@pytest.mark.slow
def test_a_worker_held_at_exit_by_a_thread_of_its_own_is_killed_with_a_line_saying_so(
    lingering_server,
):
    server = lingering_server
    with server:
        assert server.post_json({"inputs": "hello"})[0] == 200
        server.stop()
        server.wait_for_log(STOPPED)
    assert any(
        re.search(r"WARNING worker 0: did not exit within 2 s; killed$", line)
        for line in server.lines
    ), server.lines[-10:]


async def test_the_loading_progress_line_names_the_models_not_ready_yet(caplog):
    """With several models, which one is slow to load (or stuck) is what an operator
    reading the log needs: each line names those still loading."""
    loaded = asyncio.get_running_loop().create_future()
    waiting = ["gen", "cls"]
    log = logging.getLogger("rawserve")
    with caplog.at_level(logging.INFO, logger="rawserve"):
        progress = asyncio.ensure_future(
            log_loading_progress(loaded, log, interval=0.01, waiting_for=lambda: waiting)
        )
        while not caplog.records:
            await asyncio.sleep(0.01)
        waiting = ["gen"]
        caplog.clear()
        while not caplog.records:
            await asyncio.sleep(0.01)
        loaded.set_result(None)
        await progress
    line = caplog.records[0]
    assert re.fullmatch(r"still loading gen \(\d+ s\)", line.getMessage())
    assert line.models == ["gen"]  # a JSON line's field too


async def test_one_models_loading_progress_line_stays_as_it_was(caplog):
    loaded = asyncio.get_running_loop().create_future()
    with caplog.at_level(logging.INFO, logger="rawserve"):
        progress = asyncio.ensure_future(
            log_loading_progress(loaded, logging.getLogger("rawserve"), interval=0.01)
        )
        while not caplog.records:
            await asyncio.sleep(0.01)
        loaded.set_result(None)
        await progress
    assert re.fullmatch(r"still loading the model \(\d+ s\)", caplog.records[0].getMessage())

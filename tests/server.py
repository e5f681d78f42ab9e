"""Start the real `python -m rawserve` on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENING = re.compile(r"listening on https?://(?:[\d.]+|\[[\da-f:]+\]):(\d+)")
READY = re.compile(r"ready in [\d.]+ s")


class RunningServer:
    """A rawserve process; its log lines are kept in `lines` and matched as they come."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        own_group: bool = False,
        closed: Sequence[int] = (),
    ):
        self.args = ["--host", "127.0.0.1", "--port", "0", *args]
        self.own_group = own_group  # a process group of its own: it can be signalled whole
        self.closed = tuple(closed)  # standard descriptors it starts without (0: stdin, 1)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO_ROOT, **(env or {})}
        self.lines: list[str] = []
        self._new_lines: queue.Queue[str | None] = queue.Queue()
        self.process: subprocess.Popen[str] | None = None
        self.port: int | None = None
        self._reading = threading.Event()  # cleared: its stderr is not read (pause_log)
        self._reading.set()

    def start(self, wait_ready: bool = True, timeout: float = 120) -> RunningServer:
        self.launch()
        try:
            self.port = int(self.wait_for_log(LISTENING, timeout).group(1))
            if wait_ready:
                self.wait_for_log(READY, timeout)
        except BaseException:
            self.stop()  # a server that did not come up must not outlive the test
            raise
        return self

    def launch(self) -> None:
        """The process, started; `start` then waits for its port (and readiness)."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rawserve", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            start_new_session=self.own_group,
            preexec_fn=self._prepare_child if self.own_group or self.closed else None,
        )
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _prepare_child(self) -> None:
        if self.own_group:  # as a terminal's session starts it, even where the tests run
            sighup_at_default()
        for fd in self.closed:
            os.close(fd)

    def _read_log(self) -> None:
        assert self.process and self.process.stderr
        for line in self.process.stderr:
            self._reading.wait()
            self._new_lines.put(line.rstrip("\n"))
        self._new_lines.put(None)

    def pause_log(self) -> None:
        """Stop reading the server's stderr (as a stalled log shipper would): its pipe
        fills, and a process writing to it blocks."""
        self._reading.clear()

    def resume_log(self) -> None:
        self._reading.set()

    def wait_for_log(self, pattern: re.Pattern[str], timeout: float = 60) -> re.Match[str]:
        """Block until a log line matches (checking lines already seen first)."""
        for line in self.lines:
            if match := pattern.search(line):
                return match
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._new_lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError("server exited:\n" + "\n".join(self.lines[-30:]))
            self.lines.append(line)
            if match := pattern.search(line):
                return match
        raise AssertionError(
            f"no log line matched {pattern.pattern!r}:\n" + "\n".join(self.lines[-30:])
        )

    def wait_for_lines(
        self, pattern: re.Pattern[str], count: int, timeout: float = 30
    ) -> list[re.Match[str]]:
        """The matches of the log's lines, once `count` lines match or `timeout` has
        passed (an access line is written a moment after its answer is sent: read at
        once, a busy machine's log held 30 of 40)."""
        end = time.monotonic() + timeout
        while True:
            found = [match for line in self.read_log() if (match := pattern.search(line))]
            if len(found) >= count or time.monotonic() > end:
                return found
            time.sleep(0.05)

    def read_log(self) -> list[str]:
        """Every log line so far (those not yet matched by `wait_for_log` too)."""
        while True:
            try:
                line = self._new_lines.get_nowait()
            except queue.Empty:
                return self.lines
            if line is not None:
                self.lines.append(line)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return (
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            connection.close()

    def post_json(self, document: Any, path: str = "/", **kwargs) -> tuple[int, Any]:
        status, _, body = self.request(
            "POST", path, json.dumps(document), {"Content-Type": "application/json"}, **kwargs
        )
        return status, json.loads(body)

    def signal_group(self, signum: int = signal.SIGTERM) -> None:
        """`signum` to the server and every process it started (`own_group` only)."""
        assert self.process and self.own_group
        os.killpg(self.process.pid, signum)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process
        self.process.send_signal(signum)

    def stop(self, timeout: float = 30) -> int:
        assert self.process
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=10)
        if self.process.stderr and not self._reader.is_alive():
            self.process.stderr.close()
        return self.process.returncode

    def __enter__(self) -> RunningServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sighup_at_default() -> None:
    """SIGHUP at its default action, as a terminal starts a command: where the tests run
    under nohup (SIGHUP ignored), a child would inherit it ignored (a `preexec_fn`)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def ipv6_loopback() -> bool:
    """Whether this machine has IPv6 (a test of `::` or `::1` is skipped where not)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@contextmanager
def running_together(
    servers: Mapping[str, RunningServer], clients: dict[Any, Any] | None = None
) -> Iterator[Mapping[str, RunningServer]]:
    """Start every server at once (their models load side by side), wait until each is
    ready, and stop them all on the way out, whatever happened: they drain side by side
    too. `clients` (a test module's open HTTP clients, by key) are closed and forgotten
    before the servers stop."""
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.port = int(server.wait_for_log(LISTENING, timeout=150).group(1))
        for server in servers.values():
            server.wait_for_log(READY, timeout=150)
        yield servers
    finally:
        for client in (clients or {}).values():
            client.close()
        if clients is not None:
            clients.clear()
        launched = [server.process for server in servers.values() if server.process is not None]
        for process in launched:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in launched:
            with suppress(subprocess.TimeoutExpired):  # then stop() signals again, and kills
                process.wait(timeout=30)
        for server in servers.values():
            if server.process is not None:
                server.stop()


def module_tests(request: Any) -> list[Any]:
    """The tests this run selected in `request`'s module."""
    return [
        item for item in request.session.items if getattr(item, "module", None) is request.module
    ]


@contextmanager
def started_as_used(
    request: Any, servers: Mapping[str, Callable[[], RunningServer]]
) -> Iterator[Callable[[str], RunningServer]]:
    """`get(name)`: the module's server `name` (the name of the fixture that hands it out).
    The servers that the tests selected in `request`'s module use (as a fixture, or as a
    parameter's value passed to `request.getfixturevalue`) start together, on entry
    (`running_together`): their models load side by side, not one after the other, and a
    run of some of the module's tests starts only the servers those use. Any other starts
    alone when asked for. All stop on the way out."""
    used: set[str] = set()
    for item in module_tests(request):
        used.update(item.fixturenames)
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            used.update(value for value in callspec.params.values() if isinstance(value, str))
    started = {name: make() for name, make in servers.items() if name in used}
    alone: dict[str, RunningServer] = {}
    with running_together(started), ExitStack() as later:

        def get(name: str) -> RunningServer:
            if name in started:
                return started[name]
            if name not in alone:
                alone[name] = later.enter_context(servers[name]())
            return alone[name]

        yield get


def module_server(name: str) -> Any:
    """The module-scoped fixture `name`: the module's server `name`, from its `servers`
    fixture (`started_as_used`). In a test module: `faulty = module_server("faulty")`."""

    @pytest.fixture(scope="module", name=name)
    def fixture(servers: Callable[[str], RunningServer]) -> RunningServer:
        return servers(name)

    return fixture

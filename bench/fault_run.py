"""Fault run: kill -9 the model worker again and again under load; count what is lost.

Starts `python -m rawserve` (the default model unless --model/--handler say otherwise)
on a free loopback port, keeps a closed loop of concurrent clients busy, and kills the
worker process `--kills` times, each time once the restarted worker has answered again.
For each kill it reads the server's log to split the time from the kill to ready again:
noticing the exit, the restart backoff, and the new worker's start (imports + model
load, as the worker reports it). At the end: requests sent, answers by status, and
requests left unanswered (the target is 0).

    .venv/bin/python -m bench.fault_run --kills 20 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import described, servers
from bench.load import build_request, connect

REPO_ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on https?://[\d.]+:(\d+)")
READY = re.compile(r"worker 0: .* ready on .* in ([\d.]+) s")
LOAD_SPLIT = re.compile(r"worker-0 .*imports took ([\d.]+) s, the model load ([\d.]+) s")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A server that survives its workers is a server you can sleep next to.",
    "Batching requests keeps the model busy and the latency low.",
    "Every admitted request gets exactly one answer.",
]


class ServerLog:
    """The server's stderr, line by line, with the time each line arrived."""

    def __init__(self, process: subprocess.Popen[str]):
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._done = False
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr
        for line in process.stderr:
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def wait_for(
        self, pattern: re.Pattern[str], after: int = 0, timeout: float = 120
    ) -> tuple[int, float, re.Match[str]]:
        """The first line from index `after` on that matches: (index, arrival time, match)."""
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                for index in range(after, len(self.lines)):
                    if match := pattern.search(self.lines[index][1]):
                        return index, self.lines[index][0], match
                after = len(self.lines)
                left = end - time.monotonic()
                if self._done or left <= 0:
                    tail = "\n".join(line for _, line in self.lines[-20:])
                    raise RuntimeError(f"no log line matched {pattern.pattern!r}:\n{tail}")
                self._changed.wait(left)


@dataclass
class KillTiming:
    detect: float  # kill → the server logs the exit
    backoff: float  # exit → the new process starts
    start: float  # new process starts → ready (interpreter, imports, model load)
    imports: float  # torch and transformers imports, as the worker reports them
    load: float  # the model load alone, as the worker reports it
    total: float  # kill → ready again


async def post(port: int, body: bytes) -> int:
    """One request on a connection of its own; the answer's status."""
    connection = await connect(port)
    try:
        status, _ = await connection.request(build_request(body))
        return status
    finally:
        connection.close()


async def run(args: argparse.Namespace) -> dict:
    server_args = [sys.executable, "-m", "rawserve", "--host", "127.0.0.1", "--port", "0"]
    if args.model:
        server_args += ["--model", args.model]
    if args.handler:
        server_args += ["--handler", args.handler]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        server_args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    log = ServerLog(process)
    try:
        _, _, listening = await asyncio.to_thread(log.wait_for, LISTENING, 0, 120)
        port = int(listening.group(1))
        seen, _, _ = await asyncio.to_thread(log.wait_for, READY, 0, 300)
        return await fault_run(args, port, log, seen + 1)
    finally:
        servers.terminate(process, 60)


async def fault_run(args: argparse.Namespace, port: int, log: ServerLog, seen: int) -> dict:
    statuses: Counter[str] = Counter()
    sent = 0
    stop = asyncio.Event()
    answered = asyncio.Event()  # set on every 200

    async def client(number: int) -> None:
        nonlocal sent
        count = 0
        while not stop.is_set():
            text = f"{TEXTS[(number + count) % len(TEXTS)]} ({number}-{count})"
            count += 1
            sent += 1
            try:
                status = await asyncio.wait_for(post(port, text.encode()), 90)
            except (OSError, ConnectionError, TimeoutError) as exc:
                statuses[f"unanswered: {type(exc).__name__}"] += 1
                continue
            statuses[str(status)] += 1
            if status == 200:
                answered.set()

    clients = [asyncio.create_task(client(n)) for n in range(args.concurrency)]
    timings: list[KillTiming] = []
    started = time.monotonic()
    try:
        for _ in range(args.kills):
            answered.clear()
            await answered.wait()  # the (restarted) worker answers again
            await asyncio.sleep(args.between)  # and serves the load for a while
            pid = current_worker_pid(log)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            exit_line, exit_at, _ = await asyncio.to_thread(
                log.wait_for, servers.worker_ended(pid), seen, 60
            )
            start_line, start_at, _ = await asyncio.to_thread(
                log.wait_for, re.compile(r"worker 0: started \(pid"), exit_line, 60
            )
            seen, ready_at, _ = await asyncio.to_thread(log.wait_for, READY, start_line, 300)
            _, _, split = await asyncio.to_thread(log.wait_for, LOAD_SPLIT, start_line, 10)
            seen += 1
            timings.append(
                KillTiming(
                    detect=exit_at - killed_at,
                    backoff=start_at - exit_at,
                    start=ready_at - start_at,
                    imports=float(split.group(1)),
                    load=float(split.group(2)),
                    total=ready_at - killed_at,
                )
            )
            print(
                f"kill {len(timings):2d}: pid {pid}, ready again in {timings[-1].total:.2f} s "
                f"(worker start {timings[-1].start:.2f} s: imports {timings[-1].imports:.2f} s, "
                f"model load {timings[-1].load:.2f} s)",
                flush=True,
            )
        await asyncio.sleep(args.between)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    elapsed = time.monotonic() - started
    unanswered = sum(n for status, n in statuses.items() if status.startswith("unanswered"))
    return {
        "kills": len(timings),
        "seconds": round(elapsed, 1),
        "concurrency": args.concurrency,
        "sent": sent,
        "answers": dict(statuses),
        "unanswered": unanswered,
        "kill_to_ready_seconds": summary([t.total for t in timings]),
        "detect_seconds": summary([t.detect for t in timings]),
        "backoff_seconds": summary([t.backoff for t in timings]),
        "worker_start_seconds": summary([t.start for t in timings]),
        "imports_seconds": summary([t.imports for t in timings]),
        "model_load_seconds": summary([t.load for t in timings]),
    }


def current_worker_pid(log: ServerLog) -> int:
    """The pid of the current worker 0, from its latest 'started' log line."""
    for _, line in reversed(log.lines):
        if match := re.search(r"worker 0: started \(pid (\d+)", line):
            return int(match.group(1))
    raise RuntimeError("no worker has started")


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fault_run", description=described(__doc__)
    )
    parser.add_argument("--model", help="model folder (default: the packaged MiniLM)")
    parser.add_argument("--handler", help="MODULE:FACTORY instead of a model")
    parser.add_argument("--kills", type=int, default=20, help="times the worker is killed")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--between", type=float, default=1.0, help="seconds of load per life")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

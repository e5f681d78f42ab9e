"""The server's own ceiling at 1, 2, 4 … HTTP processes, and asyncio against uvloop.

rawserve with the echo handler (`tests.handlers:echo`: no model at all), so what is
measured is the HTTP path and the hop to the serving process: closed-loop clients on
keep-alive connections, `POST /` with a short text. Each configuration is started afresh
for each round and the rounds are interleaved (A B A B …): on a shared machine the
noise moves between runs, so the medians and the ranges are reported, never one run.

Per run: requests per second, p99 latency, and the server's CPU per request (every
process of the server except the model workers: the serving process and the HTTP
processes), read from /proc. Loopback only; every run is bounded in time.

    python -m bench.http_processes                      # 1 and 2 processes, both loops
    python -m bench.http_processes --processes 1 2 4 --rounds 5 --duration 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import described, spread
from bench.load import build_request, wait_until_serving, warm_up
from bench.servers import cpu_seconds, descendants, rawserve

ECHO = "tests.handlers:echo"
REQUEST = build_request(b'{"inputs": "hello"}', content_type="application/json")
START_SECONDS = 120.0


def configurations(processes: Sequence[int], loops: Sequence[str]) -> list[tuple[str, list[str]]]:
    return [
        (f"{count} HTTP process{'es' if count > 1 else ''}, {loop}", [
            "--http-processes", str(count), "--loop", loop]
         )
        for count in processes
        for loop in loops
    ]  # fmt: skip


def worker_pids(port: int) -> set[int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=10) as answer:
        return set(json.load(answer)["worker_pids"])


async def one_run(
    args: Sequence[str], clients: int, duration: float, log: Path, client_processes: int
) -> dict[str, Any]:
    server = rawserve(
        None,
        log,
        ["--no-access-log", "--max-queue", "4096", "--max-batch-size", "64", *args],
        handler=ECHO,
    ).start()
    try:
        await wait_until_serving(server.port, REQUEST, START_SECONDS, server.alive)
        workers = worker_pids(server.port)
        await warm_up(server.port, [REQUEST], 1.0, clients)
        own = [pid for pid in descendants(server.pid) if pid not in workers]
        before = {pid: cpu_seconds(pid) for pid in own}
        result = await spread.closed_loop(
            server.port, [REQUEST], clients, duration, processes=client_processes
        )
        used = sum(cpu_seconds(pid) - before[pid] for pid in own)
        serving_used = cpu_seconds(server.pid) - before[server.pid]
    finally:
        server.stop()
    summary = result.summary()
    answered = summary["statuses"].get("200", 0)
    return {
        "req_per_s": summary["throughput"],
        "p99_ms": summary.get("p99_ms"),
        "server_cpu_us_per_request": round(1e6 * used / max(1, answered), 1),
        # the serving process alone: one process for all the HTTP processes, its cost
        # a request bounds the server's rate however many HTTP processes there are
        "serving_cpu_us_per_request": round(1e6 * serving_used / max(1, answered), 1),
        "client_cpu_share": summary["client_cpu_share"],
        "not_200": {k: v for k, v in summary["statuses"].items() if k != "200"},
    }


def median_range(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


async def run(
    processes: Sequence[int],
    loops: Sequence[str],
    rounds: int,
    clients: int,
    duration: float,
    client_processes: int,
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(rounds):  # A B A B: each round runs every configuration once
            for label, args in configurations(processes, loops):
                log = Path(folder) / "server.log"
                figures = await one_run(args, clients, duration, log, client_processes)
                runs.setdefault(label, []).append(figures)
                print(f"round {round_ + 1}: {label}: {figures}", flush=True)
    return {
        "cores": os.cpu_count(),
        "clients": clients,
        "client_processes": client_processes,
        "duration_s": duration,
        "rounds": rounds,
        "results": {
            label: {
                key: median_range([run[key] for run in figures if run[key] is not None])
                for key in (
                    "req_per_s",
                    "p99_ms",
                    "server_cpu_us_per_request",
                    "serving_cpu_us_per_request",
                )
            }
            for label, figures in runs.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.http_processes", description=described(__doc__)
    )
    parser.add_argument("--processes", type=int, nargs="+", default=None)
    parser.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes sending the load (default: 1 up to 4 cores, else a quarter of them)",
    )
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    processes = args.processes or [count for count in (1, 2, 4, 8, 16) if count <= cores]
    senders = args.client_processes or (1 if cores <= 4 else cores // 4)
    report = asyncio.run(
        run(processes, args.loops, args.rounds, args.clients, args.duration, senders)
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

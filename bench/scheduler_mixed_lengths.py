"""The scheduler's measurements on a real server (`python -m rawserve`, the packaged
all-MiniLM-L6-v2 sentence embedder, which pads each batch to its longest input).

- `compare`: a closed loop on the `mixed` texts (a few to ~200 tokens), count-only
  batching (`--batching count`) against cost-aware batching (`--batching cost` with a
  token budget), in interleaved rounds (A B B A ...) so that a drifting machine hits
  both alike. Prints throughput and p99 latency of each run, and the ratios.
- `overload`: cost-aware batching; its capacity (closed loop), then Poisson arrivals at
  3x that rate with a per-request deadline: the share of 200s that met the deadline,
  and the goodput (200s in time per second) as a fraction of the capacity.
- `delay`: `--max-batch-delay-ms` candidates at low load (one client: the latency a
  delay adds) and at a moderate load (8 clients: what it buys in throughput).

Loopback only; every load run stops by itself after `--duration` seconds (at most 60).

    python -m bench.scheduler_mixed_lengths compare --rounds 2 --duration 15
    python -m bench.scheduler_mixed_lengths overload --deadline 1 --duration 20
    python -m bench.scheduler_mixed_lengths delay --delays 0,1,2,5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.load import (
    LoadResult,
    build_requests,
    closed_loop,
    open_loop,
    wait_until_serving,
    warm_up,
)
from bench.workloads import RAW_TEXT, texts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_DURATION = 60.0
WARMUP_SECONDS = 3.0
COUNT_ONLY = ("--batching", "count")
COST_AWARE = ("--batching", "cost", "--max-batch-tokens", "4096")
SERVER_ARGS: list[str] = []  # --server-args, given to every server
CODE = [REPO_ROOT]  # --code: where the served rawserve package is imported from


@contextmanager
def serve(*args: str) -> Iterator[int]:
    """Run `python -m rawserve` on a free loopback port; yields the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": CODE[0]}
    command = [sys.executable, "-m", "rawserve", "--host", "127.0.0.1", "--port", str(port)]
    with open(os.path.join(tempfile.gettempdir(), f"rawserve-bench-{port}.log"), "wb") as log:
        process = subprocess.Popen(
            [*command, "--log-level", "warning", *args, *SERVER_ARGS],  # restarts, failures
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=env,
            cwd=CODE[0],  # `python -m` puts the working folder first on the path
        )
        try:
            yield port
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def ready(port: int, requests: Sequence[bytes]) -> None:
    await wait_until_serving(port, requests[0], 180)
    await warm_up(port, requests, WARMUP_SECONDS)


def run_closed(config: Sequence[str], requests, clients: int, duration: float) -> LoadResult:
    with serve(*config) as port:

        async def go() -> LoadResult:
            await ready(port, requests)
            return await closed_loop(port, requests, clients, duration)

        return asyncio.run(go())


def brief(result: LoadResult) -> dict[str, Any]:
    summary = result.summary()
    keep = ("throughput", "p50_ms", "p99_ms", "statuses", "client_cpu_share", "goodput")
    return {key: summary[key] for key in keep if key in summary}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    requests = build_requests(texts("mixed"), RAW_TEXT)
    configs = {"count": COUNT_ONLY, "cost": COST_AWARE}
    order = []
    for round_index in range(args.rounds):
        pair = ["count", "cost"] if round_index % 2 == 0 else ["cost", "count"]
        order += pair
    runs: dict[str, list[dict[str, Any]]] = {"count": [], "cost": []}
    for name in order:
        result = brief(run_closed(configs[name], requests, args.clients, args.duration))
        runs[name].append(result)
        print(name, json.dumps(result), file=sys.stderr, flush=True)
    ratios = [
        cost["throughput"] / count["throughput"]
        for count, cost in zip(runs["count"], runs["cost"], strict=True)
    ]
    return {
        "configs": {name: " ".join(config) for name, config in configs.items()},
        "clients": args.clients,
        "runs": runs,
        "throughput_ratio_per_round": [round(r, 3) for r in ratios],
        "throughput_ratio_median": round(statistics.median(ratios), 3),
        "p99_ms_median": {
            name: statistics.median(run["p99_ms"] for run in results)
            for name, results in runs.items()
        },
    }


def overload(args: argparse.Namespace) -> dict[str, Any]:
    plain = build_requests(texts("mixed"), RAW_TEXT)
    timed = build_requests(texts("mixed"), RAW_TEXT, timeout_header=args.deadline)
    with serve(*COST_AWARE) as port:

        async def go() -> tuple[LoadResult, LoadResult]:
            await ready(port, plain)
            capacity = await closed_loop(port, plain, args.clients, args.duration)
            rate = args.overload * capacity.summary()["throughput"]
            flood = await open_loop(
                port, timed, rate, args.duration, deadline=args.deadline, seed=1
            )
            return capacity, flood

        capacity, flood = asyncio.run(go())
    cap = capacity.summary()["throughput"]
    summary = flood.summary()
    ok = summary["statuses"].get("200", 0)
    in_time = ok - summary["late_200"]
    return {
        "config": " ".join(COST_AWARE),
        "capacity_per_s": cap,
        "capacity_p99_ms": capacity.summary()["p99_ms"],
        "offered_per_s": round(flood.rate or 0.0, 1),
        "deadline_s": args.deadline,
        "statuses": summary["statuses"],
        "share_of_200_in_time": round(in_time / ok, 4) if ok else None,
        "goodput_per_s": summary["goodput"],
        "goodput_over_capacity": round(summary["goodput"] / cap, 3),
        "p99_ms_of_200": summary["p99_ms"],
        "p99_ms_of_503": summary.get("503", {}).get("p99_ms"),
        "client_cpu_share": summary["client_cpu_share"],
    }


def delay(args: argparse.Namespace) -> dict[str, Any]:
    requests = build_requests(texts("short"), RAW_TEXT)
    results = {}
    for milliseconds in args.delays.split(","):
        config = ("--max-batch-delay-ms", milliseconds)
        with serve(*config) as port:

            async def go(port: int) -> tuple[LoadResult, LoadResult]:
                await ready(port, requests)
                alone = await closed_loop(port, requests, 1, args.duration)
                busy = await closed_loop(port, requests, 8, args.duration)
                return alone, busy

            alone, busy = asyncio.run(go(port))
        results[milliseconds] = {
            "1_client": brief(alone),
            "8_clients": brief(busy),
        }
        print(milliseconds, json.dumps(results[milliseconds]), file=sys.stderr, flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler_mixed_lengths")
    parser.add_argument("mode", choices=("compare", "overload", "delay"))
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per load run")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="compare: A/B pairs")
    parser.add_argument("--overload", type=float, default=3.0, help="times the capacity")
    parser.add_argument("--deadline", type=float, default=1.0, help="X-Request-Timeout (s)")
    parser.add_argument("--delays", default="0,1,2,5", help="delay: candidates in ms")
    parser.add_argument("--server-args", default="", help="more rawserve options, for all runs")
    parser.add_argument(
        "--code", default=REPO_ROOT, help="folder holding the rawserve package to serve"
    )
    args = parser.parse_args(argv)
    args.duration = min(args.duration, MAX_DURATION)
    SERVER_ARGS.extend(args.server_args.split())
    CODE[0] = os.path.abspath(args.code)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = {"mode": args.mode, "machine": machine(), "server_args": args.server_args}
    report.update({"compare": compare, "overload": overload, "delay": delay}[args.mode](args))
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())

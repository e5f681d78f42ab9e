"""The scheduler's measurements on a real server (`python -m rawserve`, the packaged
all-MiniLM-L6-v2 sentence embedder, which pads each batch to its longest input).

- `compare`: the `mixed` texts (a few to ~200 tokens) sent by closed-loop clients to a
  count-only server (`--batching count`) and a cost-aware one (`--batching cost` with a
  token budget) running side by side, each worker on one thread, so that both see the
  same background load. Prints throughput (estimated tokens and requests per second)
  and p99 latency of each, per round, and the ratios.
- `overload`: cost-aware batching; its capacity (the fixed work above), then Poisson
  arrivals at 3x that rate with a per-request deadline: the share of 200s that met the
  deadline, and the goodput (200s in time, per second, in requests and in tokens) as a
  fraction of the capacity.
- `lists`: bursts of lists of `--list-size` texts (`--lists` of them, `--gap` ms apart),
  each due `--deadline` after it is sent, on a server with no options, once its cost
  model has measured lists alone: per burst, how many were answered 200 (all in time?),
  503 at once, or 504 (admitted, then late). A 504 is an admitted request the scheduler
  failed; a 503 is one it refused in time to go elsewhere.
- `delay`: `--max-batch-delay-ms` candidates in interleaved rounds, at low load (one
  client: the latency over the model's own, from each answer's Server-Timing) and at a
  moderate load (8 clients: what a delay buys in throughput and batch size).

Loopback only; every load run stops by itself within 60 s.

    python -m bench.scheduler_mixed_lengths compare --rounds 3 --duration 30 --clients 32
    python -m bench.scheduler_mixed_lengths overload --deadline 5 --duration 20
    python -m bench.scheduler_mixed_lengths delay --delays 0,1,2,5
    python -m bench.scheduler_mixed_lengths lists --deadline 0.15 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import described, servers
from bench.load import (
    Connection,
    build_request,
    build_requests,
    connect,
    percentile,
    wait_until_serving,
    warm_up,
)
from bench.workloads import RAW_TEXT, texts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_DURATION = 60.0
WARMUP_SECONDS = 3.0
MAX_OPEN_REQUESTS = 2048  # open loop: arrivals beyond this many unanswered are not sent
LONG_TOKENS = 100  # from here an input counts as long
HOST = "127.0.0.1"
SERVER_TIMING = re.compile(r"model;dur=([\d.]+).*batch;desc=\"?(\d+)")
COUNT_ONLY = ("--batching", "count", "--threads", "1")
COST_AWARE = ("--batching", "cost", "--max-batch-tokens", "4096", "--threads", "1")
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
    log_path = Path(tempfile.gettempdir()) / f"rawserve-bench-{port}.log"
    try:
        with open(log_path, "wb") as log:
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
            except Exception:  # its last words, before its log goes
                said = log_path.read_text(errors="replace").splitlines()[-20:]
                print("\n".join(said), file=sys.stderr)
                raise
            finally:
                servers.terminate(process, 30)
    finally:
        log_path.unlink(missing_ok=True)  # one a server: they piled up in /tmp


async def ready(port: int, requests: Sequence[bytes]) -> None:
    await wait_until_serving(port, requests[0], 180)
    await warm_up(port, requests, WARMUP_SECONDS)


@dataclass(frozen=True)
class Answer:
    index: int  # which request
    sent: float  # seconds since the run started
    latency: float
    status: int


def tokens(text: str) -> int:
    """The server's own cheap estimate (rawserve.tasks.estimate_tokens)."""
    return 2 + len(text) // 4


async def fixed_work(port: int, requests: Sequence[bytes], clients: int) -> tuple[list, float]:
    """Every request once, by `clients` closed-loop clients; (answers, seconds for all).

    The same work for every configuration: a closed loop that runs for a fixed time
    would favour whichever scheduler answers short inputs first (its clients come back
    sooner), and count more, shorter requests.
    """
    loop = asyncio.get_running_loop()
    indices = iter(range(len(requests)))
    answers: list[Answer] = []
    start = loop.time()
    stop_at = start + MAX_DURATION

    async def client() -> None:
        connection = await connect(port)
        try:
            for index in indices:
                if loop.time() > stop_at:
                    return
                if connection.closed or not connection.keep_alive:
                    connection.close()
                    connection = await connect(port)
                sent = loop.time()
                try:
                    status, _ = await connection.request(requests[index])
                except ConnectionError:
                    status = -1
                    connection.close()
                answers.append(Answer(index, sent - start, loop.time() - sent, status))
        finally:
            connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return answers, loop.time() - start


async def poisson(
    port: int, requests: Sequence[bytes], rate: float, duration: float, seed: int = 1
) -> list[Answer]:
    """Poisson arrivals at `rate` per second for `duration` s, whatever the answers."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    answers: list[Answer] = []
    idle: list[Connection] = []
    tasks: set[asyncio.Task] = set()
    start = loop.time()

    async def one(index: int, sent: float) -> None:
        connection = idle.pop() if idle else None
        try:
            if connection is None:
                connection = await connect(port)
            status, _ = await connection.request(requests[index])
        except (ConnectionError, OSError):
            status = -1
        answers.append(Answer(index, sent - start, loop.time() - sent, status))
        if connection is not None and connection.keep_alive and not connection.closed:
            idle.append(connection)
        elif connection is not None:
            connection.close()

    arrival = start
    for index in itertools.cycle(range(len(requests))):
        arrival += rng.expovariate(rate)
        if arrival >= start + duration or len(tasks) >= MAX_OPEN_REQUESTS:
            break
        await asyncio.sleep(max(0.0, arrival - loop.time()))
        task = loop.create_task(one(index, arrival))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=MAX_DURATION)
    for connection in idle:
        connection.close()
    return answers


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def describe(answers: Sequence[Answer], seconds: float, corpus: Sequence[str]) -> dict:
    ok = [a for a in answers if a.status == 200]
    long_ok = [a.latency for a in ok if tokens(corpus[a.index]) >= LONG_TOKENS]
    short_ok = [a.latency for a in ok if tokens(corpus[a.index]) < LONG_TOKENS]
    return {
        "seconds": round(seconds, 2),
        "statuses": dict(sorted(Counter(str(a.status) for a in answers).items())),
        "requests_per_s": round(len(ok) / seconds, 2),
        "tokens_per_s": round(sum(tokens(corpus[a.index]) for a in ok) / seconds, 1),
        "p50_ms": ms(percentile([a.latency for a in ok], 50)),
        "p99_ms": ms(percentile([a.latency for a in ok], 99)),
        "p99_ms_short": ms(percentile(short_ok, 99)),
        "p99_ms_long": ms(percentile(long_ok, 99)),
    }


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Count-only and cost-aware servers side by side, loaded at the same time.

    On a shared machine whose load swings from one minute to the next, two runs one
    after the other measure the neighbours as much as the server; run together, both
    see the same background. Each is loaded by its own closed loop for the same time;
    throughput counts the estimated tokens of the answered inputs (which does not
    favour a scheduler that answers short inputs first) as well as requests.
    """
    corpus = texts("mixed")
    requests = build_requests(corpus, RAW_TEXT)
    configs = {"count": COUNT_ONLY, "cost": COST_AWARE}
    runs: dict[str, list[dict[str, Any]]] = {"count": [], "cost": []}
    for _ in range(args.rounds):
        with serve(*configs["count"]) as count_port, serve(*configs["cost"]) as cost_port:
            ports = {"count": count_port, "cost": cost_port}

            async def go(ports: dict[str, int]) -> dict[str, dict[str, Any]]:
                await asyncio.gather(*(ready(port, requests) for port in ports.values()))
                indices: dict[str, list[int]] = {name: [] for name in ports}
                seen = await asyncio.gather(
                    *(
                        timed_requests(port, requests, args.clients, args.duration, indices[name])
                        for name, port in ports.items()
                    )
                )
                return {
                    name: side_by_side(answers, indices[name], corpus, args.duration)
                    for name, answers in zip(ports, seen, strict=True)
                }

            round_result = asyncio.run(go(ports))
        for name, result in round_result.items():
            runs[name].append(result)
        print(json.dumps(round_result), file=sys.stderr, flush=True)
    ratios = {
        unit: [
            round(cost[unit] / count[unit], 3)
            for count, cost in zip(runs["count"], runs["cost"], strict=True)
        ]
        for unit in ("tokens_per_s", "requests_per_s")
    }
    return {
        "configs": {name: " ".join(config) for name, config in configs.items()},
        "clients_each": args.clients,
        "seconds_each": args.duration,
        "runs": runs,
        "ratio_per_round": ratios,
        "ratio_median": {unit: statistics.median(r) for unit, r in ratios.items()},
        "p99_ms_median": {
            name: statistics.median(run["p99_ms"] for run in results)
            for name, results in runs.items()
        },
    }


def side_by_side(answers, indices: list[int], corpus: Sequence[str], duration: float) -> dict:
    latencies = [latency for latency, _, _ in answers]
    long = [
        lat
        for (lat, _, _), i in zip(answers, indices, strict=True)
        if tokens(corpus[i]) >= LONG_TOKENS
    ]
    return {
        "requests_per_s": round(len(answers) / duration, 2),
        "tokens_per_s": round(sum(tokens(corpus[i]) for i in indices) / duration, 1),
        "p50_ms": ms(percentile(latencies, 50)),
        "p99_ms": ms(percentile(latencies, 99)),
        "p99_ms_long": ms(percentile(long, 99)),
        "mean_batch": round(statistics.mean(b for _, _, b in answers), 2) if answers else None,
    }


def overload(args: argparse.Namespace) -> dict[str, Any]:
    corpus = texts("mixed")[: args.requests]
    plain = build_requests(corpus, RAW_TEXT)
    timed = build_requests(corpus, RAW_TEXT, timeout_header=args.deadline)
    with serve(*COST_AWARE) as port:

        async def go() -> tuple[dict, list, dict]:
            await ready(port, plain)
            before = describe(*await fixed_work(port, plain, args.clients), corpus)
            rate = args.overload * before["requests_per_s"]
            flood = await poisson(port, timed, rate, args.duration)
            after = describe(*await fixed_work(port, plain, args.clients), corpus)
            return before, flood, after

        before, flood, after = asyncio.run(go())
    # the machine's speed drifts: the capacity is the mean of a run before and after
    capacity = {
        unit: round((before[unit] + after[unit]) / 2, 2)
        for unit in ("requests_per_s", "tokens_per_s")
    }
    ok = [a for a in flood if a.status == 200]
    in_time = [a for a in ok if a.latency <= args.deadline]
    in_time_tokens = sum(tokens(corpus[a.index]) for a in in_time)
    offered_tokens = sum(tokens(corpus[a.index]) for a in flood)
    return {
        "config": " ".join(COST_AWARE),
        "capacity": capacity,
        "capacity_before": before,
        "capacity_after": after,
        "offered_per_s": round(len(flood) / args.duration, 1),
        "offered_tokens_per_s": round(offered_tokens / args.duration, 1),
        "deadline_s": args.deadline,
        "flood": describe(flood, args.duration, corpus),
        "share_of_200_in_time": round(len(in_time) / len(ok), 4) if ok else None,
        "goodput_requests_over_capacity": round(
            len(in_time) / args.duration / capacity["requests_per_s"], 3
        ),
        "goodput_tokens_over_capacity": round(
            in_time_tokens / args.duration / capacity["tokens_per_s"], 3
        ),
        "p99_ms_of_503": ms(percentile([a.latency for a in flood if a.status == 503], 99)),
    }


async def timed_requests(
    port: int, requests: Sequence[bytes], clients: int, duration: float, indices=None
) -> list[tuple[float, float, int]]:
    """Closed loop; per answer (latency s, the model's own ms, batch size) from the
    answer's Server-Timing header, so a delay's cost is seen apart from the model's.
    Given a list `indices`, the index of each answered request is appended to it."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + duration
    order = itertools.cycle(range(len(requests)))
    seen: list[tuple[float, float, int]] = []

    async def client() -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            while loop.time() < stop_at:
                sent = loop.time()
                index = next(order)
                writer.write(requests[index])
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(
                    line.split(": ", 1) for line in head.decode().lower().split("\r\n")[1:-2]
                )
                await reader.readexactly(int(fields["content-length"]))
                timing = SERVER_TIMING.search(fields.get("server-timing", ""))
                if head.startswith(b"HTTP/1.1 200") and timing:
                    model_ms, batch = float(timing.group(1)), int(timing.group(2))
                    seen.append((loop.time() - sent, model_ms, batch))
                    if indices is not None:
                        indices.append(index)
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return seen


def delay_summary(seen: Sequence[tuple[float, float, int]], duration: float) -> dict:
    overhead = [1000 * latency - model_ms for latency, model_ms, _ in seen]
    return {
        "requests_per_s": round(len(seen) / duration, 1),
        "p50_ms": ms(percentile([latency for latency, _, _ in seen], 50)),
        "model_p50_ms": round(statistics.median(m for _, m, _ in seen), 2) if seen else None,
        "over_model_p50_ms": round(statistics.median(overhead), 2) if seen else None,
        "over_model_p99_ms": round(percentile(overhead, 99) or 0.0, 2),
        "mean_batch": round(statistics.mean(b for _, _, b in seen), 2) if seen else None,
    }


def delay(args: argparse.Namespace) -> dict[str, Any]:
    """Rounds over the candidates (0 1 2 5, 5 2 1 0, ...): one client, then eight."""
    requests = build_requests(texts("short"), RAW_TEXT)
    candidates = args.delays.split(",")
    results: dict[str, list[dict[str, Any]]] = {ms_: [] for ms_ in candidates}
    for round_index in range(args.rounds):
        for milliseconds in candidates if round_index % 2 == 0 else candidates[::-1]:
            with serve("--max-batch-delay-ms", milliseconds) as port:

                async def go(port: int) -> dict[str, Any]:
                    await ready(port, requests)
                    alone = await timed_requests(port, requests, 1, args.duration)
                    busy = await timed_requests(port, requests, 8, args.duration)
                    return {
                        "1_client": delay_summary(alone, args.duration),
                        "8_clients": delay_summary(busy, args.duration),
                    }

                result = asyncio.run(go(port))
            results[milliseconds].append(result)
            print(milliseconds, json.dumps(result), file=sys.stderr, flush=True)
    return {"runs": results}


async def burst(port: int, requests: Sequence[bytes], gap: float) -> list[tuple[int, float]]:
    """Each of `requests` sent on a connection of its own, `gap` seconds apart: its
    (status, latency), in the order sent."""
    loop = asyncio.get_running_loop()

    async def one(request: bytes) -> tuple[int, float]:
        connection = await connect(port)
        start = loop.time()
        try:
            status, _ = await connection.request(request)
        except ConnectionError:
            status = 0
        finally:
            connection.close()
        return status, loop.time() - start

    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


def lists(args: argparse.Namespace) -> dict[str, Any]:
    corpus = texts("mixed")
    bodies = [
        json.dumps({"inputs": corpus[start : start + args.list_size]}).encode()
        for start in range(0, args.lists * args.list_size, args.list_size)
    ]
    plain = [build_request(body, content_type="application/json") for body in bodies]
    header = [("X-Request-Timeout", f"{args.deadline:g}")]
    timed = [
        build_request(body, content_type="application/json", extra_headers=header)
        for body in bodies
    ]
    rounds, alone = [], []
    with serve() as port:

        async def go() -> None:
            await wait_until_serving(port, plain[0], 180)
            for request in plain[:20]:  # one at a time: the cost model learns a list's time
                alone.append((await burst(port, [request], 0))[0][1])
            for _ in range(args.rounds):
                answers = await burst(port, timed, args.gap / 1000)
                rounds.append(Counter(status for status, _ in answers))
                late = sum(1 for status, took in answers if status == 200 and took > args.deadline)
                rounds[-1]["late_200"] = late
                await asyncio.sleep(1.0)  # the queue drains between bursts

        asyncio.run(go())
    answered = sum(r[200] + r[504] for r in rounds)
    return {
        "deadline_s": args.deadline,
        "list_size": args.list_size,
        "lists_per_burst": args.lists,
        "gap_ms": args.gap,
        "list_alone_ms": ms(statistics.median(alone[5:])),
        "bursts": [dict(sorted(r.items(), key=str)) for r in rounds],
        "share_of_admitted_in_time": round(sum(r[200] for r in rounds) / answered, 3)
        if answered
        else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scheduler_mixed_lengths", description=described(__doc__)
    )
    parser.add_argument(
        "mode",
        choices=("compare", "overload", "delay", "lists"),
        help="compare: count-only against cost-aware batching, side by side, on mixed "
        "lengths; overload: cost-aware batching at --overload times its capacity, each "
        "request due --deadline after it is sent; delay: the --delays candidates at 1 and 8 "
        "clients; lists: bursts of --lists lists of --list-size texts, --gap ms apart, each "
        "due --deadline after it is sent",
    )
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per load run")
    parser.add_argument(
        "--clients", type=int, default=64, help="closed-loop clients (compare; overload's capacity)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="compare: A/B pairs")
    parser.add_argument("--requests", type=int, default=640, help="mixed texts used")
    parser.add_argument("--overload", type=float, default=3.0, help="times the capacity")
    parser.add_argument("--deadline", type=float, default=1.0, help="X-Request-Timeout (s)")
    parser.add_argument("--delays", default="0,1,2,5", help="delay: candidates in ms")
    parser.add_argument("--lists", type=int, default=30, help="lists: lists in a burst")
    parser.add_argument("--list-size", type=int, default=32, help="lists: texts in a list")
    parser.add_argument("--gap", type=float, default=5.0, help="lists: ms between lists")
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
    modes = {"compare": compare, "overload": overload, "delay": delay, "lists": lists}
    report.update(modes[args.mode](args))
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())

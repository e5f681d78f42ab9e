"""The load generator of bench.load, run from several processes at once.

One Python process sends about 10,000 requests a second at most: enough for a 2-core
machine, not for a server with a GPU and 16 cores, whose figures would then be the
client's. Here the clients (or the open loop's arrival rate) are split between processes
that start together, and their samples are merged into one result, as if one process had
sent them all. The first process alone runs the /health prober, when one is asked for.

    await spread.closed_loop(port, requests, clients=256, duration=5, processes=4)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench import load

START_MARGIN = 1.0  # seconds for the processes to start before the run begins


def _part(kind: str, start_at: float, port: int, requests: list[bytes], split: dict[str, Any]):
    """One process's share of the run (in a process of the pool), from `start_at`."""
    time.sleep(max(0.0, start_at - time.time()))
    run = load.closed_loop if kind == "closed" else load.open_loop
    return asyncio.run(run(port, requests, **split))


def merge(parts: Sequence[load.LoadResult]) -> load.LoadResult:
    """The parts' samples as one run's (their clocks start together, within a few ms)."""
    samples = load.Samples()
    for part in parts:
        for sent, latency, status, size in zip(
            part.samples.sent,
            part.samples.latency,
            part.samples.status,
            part.samples.size,
            strict=True,
        ):
            samples.add(sent, latency, status, size)
    first = parts[0]
    return load.LoadResult(
        first.mode,
        max(part.duration for part in parts),
        samples,
        sum(part.client_cpu for part in parts),
        clients=None if first.clients is None else sum(part.clients or 0 for part in parts),
        rate=None if first.rate is None else sum(part.rate or 0.0 for part in parts),
        deadline=first.deadline,
        dropped=sum(part.dropped for part in parts),
        health=first.health,
    )


def shares(total: int, processes: int) -> list[int]:
    """`total` split as evenly as it goes, no share empty."""
    count = max(1, min(processes, total))
    return [total // count + (1 if index < total % count else 0) for index in range(count)]


async def _in_processes(
    kind: str, port: int, requests: Sequence[bytes], splits: list[dict[str, Any]]
) -> load.LoadResult:
    loop = asyncio.get_running_loop()
    start_at = time.time() + START_MARGIN
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(splits), mp_context=context) as pool:
        futures = [
            loop.run_in_executor(pool, _part, kind, start_at, port, list(requests), split)
            for split in splits
        ]
        return merge(await asyncio.gather(*futures))


async def closed_loop(
    port: int,
    requests: Sequence[bytes],
    clients: int,
    duration: float,
    *,
    processes: int = 1,
    health_interval: float | None = None,
    deadline: float | None = None,
) -> load.LoadResult:
    """bench.load.closed_loop with its clients split between `processes` processes."""
    if processes <= 1:
        return await load.closed_loop(
            port, requests, clients, duration, health_interval=health_interval, deadline=deadline
        )
    splits = [
        dict(
            clients=share,
            duration=duration,
            health_interval=health_interval if index == 0 else None,
            deadline=deadline,
        )
        for index, share in enumerate(shares(clients, processes))
    ]
    return await _in_processes("closed", port, requests, splits)


async def open_loop(
    port: int,
    requests: Sequence[bytes],
    rate: float,
    duration: float,
    *,
    processes: int = 1,
    deadline: float | None = None,
    health_interval: float | None = None,
) -> load.LoadResult:
    """bench.load.open_loop with its arrival rate split between `processes` processes
    (each its own Poisson stream: their sum is one at the whole rate)."""
    if processes <= 1:
        return await load.open_loop(
            port, requests, rate, duration, deadline=deadline, health_interval=health_interval
        )
    splits = [
        dict(
            rate=rate / processes,
            duration=duration,
            deadline=deadline,
            health_interval=health_interval if index == 0 else None,
            seed=index,
        )
        for index in range(processes)
    ]
    return await _in_processes("open", port, requests, splits)

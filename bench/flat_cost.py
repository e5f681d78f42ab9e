"""The scheduler and the worker pool against a batch cost shaped like a GPU's, on any machine.

A GPU's batch costs about the same whatever its items (an H100 ran a BERT-base-sized
batch of 21 short texts in 8.3 ms and one of 64 in 7.7 ms), so how many items a batch
takes decides the throughput. Here the worker is the `tests.handlers:flat_cost` handler,
which sleeps `--batch-ms` per batch (plus 0.01 ms an item) and leaves the cores free;
the scheduler and the pool are rawserve's own, in this process, fed by closed-loop
clients that take a random 0.5-`2 x --turnaround-ms` between an answer and their next
request (the hop through HTTP). One batch in flight per worker against two (a GPU
worker's), alternately: items/s, the batch an item ran in (mean), latency p50 and p99.

    python -m bench.flat_cost                       # 64 clients, 8 ms batches, 3 ms turnaround
    python -m bench.flat_cost --clients 1 64 256 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

HANDLER = "tests.handlers:flat_cost"


async def closed_loop(scheduler: Any, clients: int, seconds: float, turnaround: float) -> dict:
    batches: list[int] = []
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop:
            sent = time.monotonic()
            [result] = await scheduler.run(["hello"], {}, sent + 10.0)
            latencies.append(time.monotonic() - sent)
            batches.append(result.batch_size)
            await asyncio.sleep(random.uniform(0.0005, 2 * turnaround))

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "items_per_s": round(len(latencies) / elapsed),
        "mean_batch": round(statistics.mean(batches), 1),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from rawserve.serving.core import SchedulerCore
    from rawserve.serving.driver import Scheduler
    from rawserve.serving.pool import WorkerPool
    from rawserve.shared.messages import WorkerConfig

    os.environ["RAWSERVE_TEST_BATCH_MS"] = str(args.batch_ms)
    pool = WorkerPool(WorkerConfig(model="", handler=HANDLER, threads=1), ["cpu"])
    pool.start()
    await pool.wait_ready()
    core = SchedulerCore(max_queue=4096, max_batch_size=args.max_batch_size, workers=1)
    scheduler = Scheduler(core, pool)
    pool.on_idle = scheduler.wake
    scheduler.start()
    turnaround = args.turnaround_ms / 1000
    await closed_loop(scheduler, 4, 1.0, turnaround)  # warm: the batch time is learned
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for clients in args.clients:
            for in_flight in (1, 2):
                for worker in pool.workers:
                    worker.overlap = in_flight == 2
                found = await closed_loop(scheduler, clients, args.seconds, turnaround)
                name = f"{clients} clients, {in_flight} in flight"
                runs.setdefault(name, []).append(found)
                print(name, json.dumps(found), file=sys.stderr, flush=True)
    await scheduler.stop()
    await pool.shutdown()
    return {
        "batch_ms": args.batch_ms,
        "turnaround_ms": args.turnaround_ms,
        "results": {
            name: {key: statistics.median(run[key] for run in found) for key in found[0]}
            for name, found in runs.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flat_cost", description=__doc__)
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[64], help="closed-loop clients, a run each"
    )
    parser.add_argument(
        "--batch-ms", type=float, default=8.0, help="what a batch costs, whatever its items"
    )
    parser.add_argument(
        "--turnaround-ms",
        type=float,
        default=3.0,
        help="a client's pause between an answer and its next request: random, 0.5 to 2x this",
    )
    parser.add_argument("--max-batch-size", type=int, default=256, help="the scheduler's")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of every run; medians are printed"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds a run")
    report = asyncio.run(measure(parser.parse_args(argv)))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

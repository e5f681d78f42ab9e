"""Two batches in flight per worker against one, on the same warm workers, A B A B.

The worker pool (rawserve.serving.pool) runs the packaged all-MiniLM-L6-v2's embeddings
on `--device` (default: one single-threaded CPU worker per core, the default CPU layout)
and is fed closed-loop: a batch of `--batch` short texts is submitted whenever a worker
has room. Rounds alternate between one batch in flight per worker and two (the worker
keeps its process between rounds: only the pool's choice changes), and the median and
range of each are printed.

    python -m bench.overlap --rounds 4 --seconds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def closed_loop(pool, texts: list[str], batch: int, seconds: float) -> float:
    """Items per second while every free slot of the pool is kept filled."""
    done = 0
    pending: set[asyncio.Future] = set()
    start = time.perf_counter()
    cursor = 0
    while time.perf_counter() - start < seconds:
        while pool.idle_workers():
            inputs = [texts[(cursor + i) % len(texts)] for i in range(batch)]
            cursor += batch
            pending.add(pool.submit(inputs, {}))
        finished, pending = await asyncio.wait(
            pending, return_when=asyncio.FIRST_COMPLETED, timeout=1.0
        )
        done += sum(len(future.result().outputs) for future in finished)
    finished, _ = await asyncio.wait(pending) if pending else (set(), set())
    done += sum(len(future.result().outputs) for future in finished)
    return done / (time.perf_counter() - start)


async def main_async(args: argparse.Namespace) -> dict:
    from bench.models import minilm_path
    from bench.workloads import texts
    from rawserve.serving.pool import WorkerPool
    from rawserve.shared.messages import WorkerConfig

    devices = args.device.split(",") if args.device else ["cpu"] * (os.cpu_count() or 1)
    config = WorkerConfig(
        model=minilm_path(), task="feature-extraction", pooling="mean", threads=args.threads
    )
    pool = WorkerPool(config, devices)
    pool.start()
    await pool.wait_ready()
    while not all(worker.ready for worker in pool.workers):
        await asyncio.sleep(0.2)
    corpus = texts("short")
    await closed_loop(pool, corpus, args.batch, 2.0)  # warm
    rates: dict[str, list[float]] = {"one": [], "two": []}
    for _ in range(args.rounds):
        for name in ("one", "two"):
            for worker in pool.workers:
                worker.overlap = name == "two"
            rate = await closed_loop(pool, corpus, args.batch, args.seconds)
            rates[name].append(round(rate, 1))
            print(f"{name} in flight: {rate:.1f} items/s", file=sys.stderr, flush=True)
    await pool.shutdown()
    return {
        "devices": devices,
        "threads": args.threads,
        "batch": args.batch,
        "load_average": os.getloadavg()[0],
        **{
            name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
            for name, values in rates.items()
        },
        "rounds": rates,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__)
    parser.add_argument("--device", default=None, help="e.g. cpu,cpu or cuda (default: per core)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    result = asyncio.run(main_async(parser.parse_args(argv)))
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

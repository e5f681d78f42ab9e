"""The first request after /ready, with and without the warm-up batch.

For each mode, a fresh rawserve on the packaged all-MiniLM-L6-v2 (CPU, one worker) is
started `--rounds` times (the two modes taking turns, so other work on the machine
weighs on both alike); once /ready says 200, one request is sent and timed (the first
one a client would send), then `--steady` more one after another on the same connection,
whose median is that round's steady-state p50. With warm-up the first request should
cost what the later ones cost (within 1.5x of the p50); without it, it pays the model's
lazy set-up.

    python -m bench.first_request [--rounds 5] [--steady 200] [--max-batch-size 32]

Loopback only; run it under the exclusive CPU lock when its figures matter.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.load import build_request, connect, percentile, wait_until_serving
from bench.servers import rawserve

TEXT = "A first request, as a client would send it once the server says it is ready."
READY = build_request(b"", method="GET", path="/ready")
START_TIMEOUT = 300.0


async def first_and_steady(port: int, steady: int) -> tuple[float, list[float]]:
    """The first request's latency, then `steady` more, each after the previous."""
    request = build_request(TEXT.encode())
    connection = await connect(port)
    try:
        started = time.perf_counter()
        status, _ = await connection.request(request)
        first = time.perf_counter() - started
        assert status == 200, status
        later = []
        for _ in range(steady):
            started = time.perf_counter()
            status, _ = await connection.request(request)
            later.append(time.perf_counter() - started)
            assert status == 200, status
    finally:
        connection.close()
    return first, later


def one_round(warmup: bool, steady: int, max_batch_size: int, logs: Path) -> tuple[float, float]:
    """(first request, steady p50) on a fresh server, in seconds."""
    args = ["--max-batch-size", str(max_batch_size)] + ([] if warmup else ["--no-warmup"])
    name = "warm" if warmup else "cold"
    server = rawserve(None, logs / f"rawserve-{name}-{time.monotonic_ns()}.log", args)
    server.start()
    try:
        asyncio.run(wait_until_serving(server.port, READY, START_TIMEOUT, alive=server.alive))
        first, later = asyncio.run(first_and_steady(server.port, steady))
    finally:
        server.stop()
    p50 = percentile(later, 50)
    assert p50 is not None
    return first, p50


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_request", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="fresh servers per mode")
    parser.add_argument("--steady", type=int, default=200, help="requests after the first")
    parser.add_argument("--max-batch-size", type=int, default=32)
    options = parser.parse_args(argv)
    # (first, steady p50) per round and mode; the modes alternate round by round so that
    # whatever else runs on the machine weighs on both alike
    rounds: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rawserve-first-") as logs:
        for _ in range(options.rounds):
            for warmup in (True, False):
                measured = one_round(warmup, options.steady, options.max_batch_size, Path(logs))
                rounds[warmup].append(measured)
    load = max(load, os.getloadavg()[0])
    print(
        f"{options.rounds} rounds per mode, {options.steady} steady requests each, "
        f"--max-batch-size {options.max_batch_size}, {os.cpu_count()} cores, "
        f"1-minute load average up to {load:.1f}"
    )
    print(
        "| warm-up | first request: median (min-max) | steady p50: median "
        "| first / p50: median of rounds (min-max) |"
    )
    print("|---|---|---|---|")
    for warmup, measured in rounds.items():
        firsts = [first for first, _ in measured]
        p50s = [p50 for _, p50 in measured]
        ratios = [first / p50 for first, p50 in measured]
        print(
            f"| {'on' if warmup else 'off (--no-warmup)'} "
            f"| {ms(statistics.median(firsts))} ({ms(min(firsts))}-{ms(max(firsts))}) "
            f"| {ms(statistics.median(p50s))} "
            f"| {statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f}x) |"
        )
    return 0


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


if __name__ == "__main__":
    raise SystemExit(main())

"""The first request after /ready, with and without the warm-up batch.

For each mode, a fresh rawserve on the packaged all-MiniLM-L6-v2 (CPU, one worker) is
started `--rounds` times; once /ready says 200, one request is sent and timed (the first
one a client would send), then `--steady` more one after another on the same connection,
whose median is the steady-state p50. With warm-up the first request should cost what
the later ones cost (within 1.5x of the p50); without it, it pays the model's lazy set-up.

    python -m bench.first_request [--rounds 5] [--steady 200] [--max-batch-size 32]

Loopback only; run it under the exclusive CPU lock when its figures matter.
"""

from __future__ import annotations

import argparse
import asyncio
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
    with tempfile.TemporaryDirectory(prefix="rawserve-first-") as logs:
        rows = []
        for warmup in (True, False):
            firsts, p50s = [], []
            for _ in range(options.rounds):
                first, p50 = one_round(warmup, options.steady, options.max_batch_size, Path(logs))
                firsts.append(first)
                p50s.append(p50)
            rows.append((warmup, firsts, p50s))
    print("| warm-up | first request (median, min-max) | steady p50 (median) | first / p50 |")
    print("|---|---|---|---|")
    for warmup, firsts, p50s in rows:
        first, p50 = statistics.median(firsts), statistics.median(p50s)
        print(
            f"| {'on' if warmup else 'off (--no-warmup)'} "
            f"| {first * 1000:.1f} ms ({min(firsts) * 1000:.1f}-{max(firsts) * 1000:.1f}) "
            f"| {p50 * 1000:.2f} ms | {first / p50:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a lone request's time goes: one client, one request at a time, split by the
server's own Server-Timing.

Starts rawserve on one of the comparison's models once per `--config` (its options,
after the scenario's; none: the defaults, a GPU's where there is one), sends `--requests`
single short texts one after another on one keep-alive connection, and prints the medians
and 90th percentiles of:

- `client`: the round trip the client saw;
- `queue`: from admission to the batch leaving for the worker (the scheduler's wait);
- `model`: the worker, from reading the batch to sending its result (tokenizing,
  the forward pass, the outputs brought to the host and shaped);
- `rest`: client − queue − model: the client, the sockets, h11, the HTTP process and
  the serving process, and the pipes between them (`--http-processes 1` leaves out the
  hop between the HTTP and serving processes).

    python -m bench.lone_request --scenario bert-base-classification \\
        --config= --config="--http-processes 1"
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench import described, load, servers
from bench.models import BUILDERS, scenarios
from bench.workloads import texts

TIMING = re.compile(r"(\w+);dur=([0-9.]+)")
PARTS = ("client", "queue", "model", "rest")


def timings(header: str) -> dict[str, float]:
    """Server-Timing's durations by name, in ms."""
    return {name: float(ms) for name, ms in TIMING.findall(header)}


def one_by_one(port: int, bodies: Sequence[bytes], count: int) -> dict[str, list[float]]:
    """`count` requests, one at a time; each part's durations in ms."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    found: dict[str, list[float]] = {part: [] for part in PARTS}
    try:
        for i in range(count):
            started = time.perf_counter()
            connection.request("POST", "/", body=bodies[i % len(bodies)])
            answer = connection.getresponse()
            answer.read()
            client = 1000 * (time.perf_counter() - started)
            if answer.status != 200:
                raise RuntimeError(f"answered {answer.status}")
            parts = timings(", ".join(answer.headers.get_all("Server-Timing") or ()))
            found["client"].append(client)
            found["queue"].append(parts["queue"])
            found["model"].append(parts["model"])
            found["rest"].append(client - parts["queue"] - parts["model"])
    finally:
        connection.close()
    return found


def report(config: str, found: dict[str, list[float]]) -> str:
    def spread(values: list[float]) -> str:
        ninetieth = statistics.quantiles(values, n=10)[-1]
        return f"{statistics.median(values):6.2f} / {ninetieth:6.2f}"

    cells = "  ".join(f"{part} {spread(found[part])}" for part in PARTS)
    return f"[{config or 'defaults'}] ms p50 / p90:  {cells}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lone_request", description=described(__doc__)
    )
    parser.add_argument(
        "--scenario", choices=BUILDERS, default="classification", help="the comparison's model"
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--config", action="append", help="rawserve's options for one run (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rawserve-lone")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = scenarios(args.out, [args.scenario])[0]
    bodies = [text.encode() for text in texts("short")]
    for i, config in enumerate(args.config or [""]):
        options = [*scenario.rawserve_args, *config.split()]
        server = servers.rawserve(scenario.model, args.out / f"server-{i}.log", options).start()
        try:
            first = load.build_request(bodies[0])
            asyncio.run(load.wait_until_serving(server.port, first, 180, server.alive))
            one_by_one(server.port, bodies, 50)  # warm: shapes, caches, the cost model
            print(report(config, one_by_one(server.port, bodies, args.requests)), flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

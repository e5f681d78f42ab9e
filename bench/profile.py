"""Where the time goes: rawserve under a closed-loop load, sampled with py-spy.

Starts rawserve on one of the comparison's models, drives it with N clients, and samples
the server process and its model worker with `py-spy record` (install it in the venv:
`pip install py-spy`); prints, for each process, the CPU it used per answered item and
the functions where its samples fall (inclusive and self), and keeps the raw stacks.

    python -m bench.profile --scenario classification --texts short --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import load, servers
from bench.compare import body_format
from bench.models import BUILDERS, scenarios
from bench.workloads import TEXT_SETS, texts

OPEN_LOOP_DEADLINE = 2.0  # X-Request-Timeout in open loop, as in the comparison's overload


def summarise(raw: Path, top: int = 25) -> str:
    """Inclusive and self shares of the frames in a py-spy raw (collapsed) file."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        total += samples
        frames = [_frame(frame) for frame in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += samples
        own[frames[-1]] += samples
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples; inclusive:"]
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top // 2)]
    return "\n".join(lines)


def _frame(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


async def drive(
    port: int,
    requests: list[bytes],
    clients: int,
    rate: float | None,
    seconds: float,
    warmup: float,
):
    await load.warm_up(port, requests, warmup)
    if rate:
        return await load.open_loop(port, requests, rate, seconds, deadline=OPEN_LOOP_DEADLINE)
    return await load.closed_loop(port, requests, clients, seconds)


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside this Python (a venv not activated); None if neither."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument(
        "--scenario", choices=BUILDERS, default="classification", help="the comparison's model"
    )
    parser.add_argument("--texts", choices=TEXT_SETS, default="short")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--open-rate",
        type=float,
        help="open loop at this many arrivals/s instead of closed loop (overload profiles)",
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--rawserve-args", default="")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rawserve-prof")
    args = parser.parse_args(argv)
    py_spy = find_py_spy()
    if py_spy is None:  # said now, not after the server's start and warm-up (a minute)
        said = "needs py-spy, not installed here: pip install -e .[bench] (or pip install py-spy)"
        parser.exit(2, f"{parser.prog}: {said}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = scenarios(args.out, [args.scenario])[0]
    server = servers.rawserve(
        scenario.model,
        args.out / "server.log",
        [*scenario.rawserve_args, *args.rawserve_args.split()],
    ).start()
    fmt = body_format("rawserve", scenario)
    deadline = OPEN_LOOP_DEADLINE if args.open_rate else None
    requests = load.build_requests(texts(args.texts), fmt, timeout_header=deadline)
    try:
        asyncio.run(load.wait_until_serving(server.port, requests[0], 180, server.alive))
        pids = servers.descendants(server.pid)
        worker = max(pids[1:], key=servers.rss_bytes)  # the model worker is the big one
        samplers = {
            name: subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(args.seconds)),
                    "-r",
                    str(args.rate),
                    "-f",
                    "raw",
                    "-o",
                    str(args.out / f"{name}.txt"),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, pid in (("server", server.pid), ("worker", worker))
        }
        before = servers.cpu_snapshot(server.pid)
        run = asyncio.run(
            drive(server.port, requests, args.clients, args.open_rate, args.seconds + 1, 2.0)
        )
        after = servers.cpu_snapshot(server.pid)
        for sampler in samplers.values():
            sampler.wait(timeout=60)
    finally:
        server.stop()
    summary = run.summary()
    answered = max(1, sum(summary["statuses"].values()))
    server_cpu = after[server.pid] - before[server.pid]
    load_shape = f"{args.open_rate:.0f}/s open" if args.open_rate else f"{args.clients} clients"
    print(
        f"{args.scenario}, {args.texts} texts, {load_shape}: "
        f"{summary['throughput']:.1f} items/s, "
        f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms, {summary['statuses']}"
    )
    print(
        f"CPU per answer: server {1e6 * server_cpu / answered:.0f} µs, "
        f"worker {1e6 * (after.get(worker, 0) - before.get(worker, 0)) / answered:.0f} µs, "
        f"load generator {1e6 * run.client_cpu / answered:.0f} µs"
    )
    for name in samplers:
        print(f"{name} (py-spy, active samples only):")
        print(summarise(args.out / f"{name}.txt"))
    print(f"raw stacks and logs in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a continuous worker's refusals say (`Retry-After`) against the wait they name, on
rows simulated by the scheduler's own core, so that the figures are the same on any
machine.

    python -m bench.row_wait                               # 3 seeds, the CPU's rows
    python -m bench.row_wait --early 0.5                   # half the answers end early
    python -m bench.row_wait --slow 1.25 --slow-after 10   # the rows slow once measured

A worker of `--rows` rows decodes a step at a time, `--fixed` + `--per-row` x the rows
running seconds a step (a 2-core CPU's tiny GPT-2 by default), each sequence its asked
new tokens (8-128) and 4 steps more (its prefill, its wait to join); requests come as
Poisson arrivals at `--factor` times the rows' capacity for `--duration` seconds, each due
`--deadline` after it comes. `SchedulerCore` admits, refuses and sends them, and learns
their pace from the sequences that ran, as on a server (no event loop, no HTTP: the
scheduler's own judgement alone).

For each refusal past the first third of the run: the wait it said, and the wait it
names, until every sequence queued when it was refused had left the queue (a request
sent again then finds the rows taking new ones). Reported per seed: their medians and the
ratio's 10th, 50th and 90th percentiles (1 is a wait said right; the spread a server
puts on it, one to two times, is not applied here), and what admission did: answers, the
ones past their deadlines, those expired queued (504s), refusals.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import described
from rawserve.serving.core import (
    DeadlineUnreachable,
    OwnTimeUnreachable,
    QueueFull,
    SchedulerCore,
    WorkItem,
)

PREFILL_STEPS = 4  # a sequence's steps beside its new tokens


@dataclass
class Row:
    """A running sequence: its one-item batch, the tokens it makes, and its steps."""

    batch: list[WorkItem]
    makes: int
    steps: int = -PREFILL_STEPS
    made: int = 0


@dataclass
class Run:
    answered: int = 0
    late: int = 0
    expired: int = 0
    refused: int = 0
    waiting: dict[int, WorkItem] = field(default_factory=dict)  # admitted, not left
    left_at: dict[int, float] = field(default_factory=dict)
    said: list[tuple[float, float, list[int]]] = field(default_factory=list)


def simulate(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    core = SchedulerCore(max_queue=4096, max_batch_size=1, workers=args.rows, default_new_tokens=16)
    mean_steps = sum(args.asks) / 2 + PREFILL_STEPS
    capacity = args.rows / (mean_steps * (args.fixed + args.per_row * args.rows))
    rate = args.factor * capacity
    run = Run()
    running: list[Row] = []
    now, arrival = 0.0, 0.0
    while now < args.duration or running or run.waiting:
        while arrival <= now < args.duration:
            asks = {"max_new_tokens": rng.randint(*args.asks)}
            item = core.new_item("w " * 12, asks, arrival + args.deadline, arrival)
            try:
                core.admit([item], now)
                run.waiting[item.seq] = item
            except (DeadlineUnreachable, OwnTimeUnreachable, QueueFull) as refusal:
                run.refused += 1
                run.said.append((now, refusal.retry_after, list(run.waiting)))
            arrival += rng.expovariate(rate)
        decision = core.decide(now, args.rows - len(running))
        for item in decision.expired:
            run.expired += 1
            run.left_at[item.seq] = now
            del run.waiting[item.seq]
        for batch in decision.batches:
            for item in batch:
                run.left_at[item.seq] = now
                del run.waiting[item.seq]
            asked = batch[0].new_tokens
            early = rng.random() < args.early
            running.append(Row(batch, rng.randint(1, asked) if early else asked))
        slow = args.slow if now > args.slow_after else 1.0
        now += slow * (args.fixed + args.per_row * max(len(running), 1))
        running = [row for row in running if not step(core, row, now, run)]
    return summary(run, args.duration, capacity, rate)


def step(core: SchedulerCore, row: Row, now: float, run: Run) -> bool:
    """One decoding step of `row`'s sequence; whether it left the rows (ended, or
    stopped at its deadline as a server stops it)."""
    row.steps += 1
    if row.steps > 0:  # (past its prefill)
        row.made += 1
    deadline = row.batch[0].deadline
    if row.made >= row.makes:
        core.finish_batch(row.batch, now, [row.made])
        run.answered += 1
        run.late += now > deadline
        return True
    if now >= deadline:
        core.stopped_batch(row.batch, now, [row.made])
        run.late += 1
        return True
    return False


def summary(run: Run, duration: float, capacity: float, rate: float) -> dict[str, Any]:
    said, named = [], []
    for at, wait, queued in run.said:
        if at > duration / 3 and queued:
            left = max(run.left_at[seq] for seq in queued) - at
            if left > 0.05:
                said.append(wait)
                named.append(left)
    ratios = sorted(s / n for s, n in zip(said, named, strict=True))

    def pick(q: float) -> float | None:
        return round(ratios[int(q * (len(ratios) - 1))], 2) if ratios else None

    return {
        "capacity_per_s": round(capacity, 1),
        "rate": round(rate, 1),
        "answered": run.answered,
        "late": run.late,
        "expired_queued": run.expired,
        "refused": run.refused,
        "said_p50_s": round(statistics.median(said), 2) if said else None,
        "named_p50_s": round(statistics.median(named), 2) if named else None,
        "ratio_p10": pick(0.1),
        "ratio_p50": pick(0.5),
        "ratio_p90": pick(0.9),
        "refusals_read": len(ratios),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.row_wait", description=described(__doc__)
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--fixed", type=float, default=0.0025, help="a step's seconds alone")
    parser.add_argument("--per-row", type=float, default=0.00027, help="and per row beside")
    parser.add_argument("--factor", type=float, default=3.0, help="times the capacity")
    parser.add_argument("--deadline", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--asks", type=int, nargs=2, default=(8, 128), help="new tokens")
    parser.add_argument("--early", type=float, default=0.0, help="share ending early")
    parser.add_argument("--slow", type=float, default=1.0, help="the steps' slowing")
    parser.add_argument("--slow-after", type=float, default=float("inf"), help="seconds")
    args = parser.parse_args(argv)
    for seed in range(args.seeds):
        print(json.dumps({"seed": seed, **simulate(args, seed)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

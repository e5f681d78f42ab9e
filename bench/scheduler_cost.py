"""What the scheduler costs a request in Python: admission, batching, settling, measured
in process with nothing else in the way.

The real `Scheduler` and `SchedulerCore`, driven as the serving process drives them
behind HTTP processes (`Scheduler.begin`, a batch's answers in one pass); the worker pool
is a stand-in that answers each batch `--batch-ms` after it is sent. `--clients`
one-text requests in a closed loop: each one answered is followed by a new one on the
event loop's next pass. Prints the process's CPU microseconds a request (best of
`--rounds`) and the mean batch size; the serving process's whole cost a request, with
its channels and pipes, is `bench.http_processes`'s to measure.

    python -m bench.scheduler_cost --clients 256 --seconds 3 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from bench import described
from rawserve.ops.loops import run as run_on_loop
from rawserve.serving.core import SchedulerCore
from rawserve.serving.driver import Scheduler
from rawserve.shared.messages import NO_CONTROL, BatchResult, Control, ModelLimits

WARM_SECONDS = 1.0  # the cost model measures its first batches before a round starts


class InstantWorkers:
    """The pool's face to the scheduler: `workers` workers, each batch answered after
    `seconds` (a timer, no process, no pipe)."""

    def __init__(self, workers: int, seconds: float):
        self.workers = workers
        self.seconds = seconds
        self.busy = 0
        self.batches = 0
        self.items = 0

    def idle_workers(self) -> int:
        return self.workers - self.busy

    def empty_workers(self) -> int:
        return 0  # (batches, not a continuous worker's rows)

    def batch_cap(self) -> int | None:
        return None

    limits = ModelLimits()  # an echo: nothing is cut, nothing generated

    def concurrency(self) -> int:
        return self.workers

    def rows_when_ready(self) -> int:
        return self.workers

    def abandon(
        self, future: asyncio.Future[BatchResult], items: Collection[int] | None = None
    ) -> None:
        pass

    def submit(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        control: Control,
        request_ids: Sequence[str] = (),
        admitted: Sequence[float] = (),
        on_part: Any = None,
    ) -> asyncio.Future[BatchResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[BatchResult] = loop.create_future()
        self.busy += 1
        self.batches += 1
        self.items += len(inputs)
        outputs = tuple({"label": "POSITIVE", "score": 0.9} for _ in inputs)
        result = BatchResult(self.batches, outputs, self.seconds)
        loop.call_later(self.seconds, self._answer, future, result)
        return future

    def _answer(self, future: asyncio.Future[BatchResult], result: BatchResult) -> None:
        self.busy -= 1
        future.set_result(result)


async def one_round(
    clients: int, seconds: float, batch_seconds: float, max_batch_size: int
) -> dict[str, float]:
    workers = InstantWorkers(2, batch_seconds)
    core = SchedulerCore(max_queue=4 * clients, max_batch_size=max_batch_size, workers=2)
    scheduler = Scheduler(core, workers, slice_answers=False)
    scheduler.start()
    loop = asyncio.get_running_loop()
    answered = 0
    running = True

    def ask() -> None:
        if running:
            deadline = time.monotonic() + 30.0
            scheduler.begin(["The movie was good."], {}, deadline, NO_CONTROL, on_end)

    def on_end(results: Any, error: BaseException | None) -> None:
        nonlocal answered
        answered += 1
        loop.call_soon(ask)

    for _ in range(clients):
        ask()
    await asyncio.sleep(WARM_SECONDS)
    start_answered, start_cpu = answered, time.process_time()
    start_batches, start_items = workers.batches, workers.items
    await asyncio.sleep(seconds)
    requests, cpu = answered - start_answered, time.process_time() - start_cpu
    batches, items = workers.batches - start_batches, workers.items - start_items
    running = False
    await scheduler.stop()
    return {
        "cpu_us_per_request": round(1e6 * cpu / max(1, requests), 2),
        "requests_per_s": round(requests / seconds),
        "mean_batch": round(items / max(1, batches), 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scheduler_cost", description=described(__doc__)
    )
    parser.add_argument("--clients", type=int, default=256, help="closed-loop one-text clients")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the cheapest is printed")
    parser.add_argument(
        "--batch-ms", type=float, default=0.5, help="the stand-in pool answers a batch after this"
    )
    parser.add_argument("--max-batch-size", type=int, default=64, help="the scheduler's")
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="uvloop", help="the event loop"
    )
    args = parser.parse_args(argv)
    rounds = [
        run_on_loop(
            one_round(args.clients, args.seconds, args.batch_ms / 1000, args.max_batch_size),
            args.loop,
        )
        for _ in range(args.rounds)
    ]
    best = min(rounds, key=lambda figures: figures["cpu_us_per_request"])
    print(json.dumps({"clients": args.clients, "loop": args.loop, "best": best, "rounds": rounds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

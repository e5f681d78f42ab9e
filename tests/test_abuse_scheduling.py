"""Admission and batching under abuse, end to end: no false refusal on an idle server,
fair shares between a client's large lists and other clients' single requests, and
items that accumulated while the worker was busy leave together.

Real `python -m rawserve` processes; bounded in time and count, loopback only.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import pytest

from tests.load import Client
from tests.server import RunningServer

pytestmark = pytest.mark.slow

LONG_TEXT = "word " * 209_700  # just under 1 MiB; the model reads its first 512 tokens


# --- 4. no false "deadline unreachable" on an idle server ----------------------------


def test_a_long_text_on_an_idle_server_is_answered_not_refused():
    sentence = "the quick brown fox jumps over the lazy dog and keeps running far away " * 4
    with RunningServer(["--no-access-log"]) as server:  # the packaged MiniLM
        for _ in range(4):  # a few large lists teach the cost model the speed
            status, answer = server.post_json({"inputs": [sentence] * 32})
            assert status == 200, answer
        for _ in range(3):  # the default 30 s deadline; the model reads 512 tokens of it
            status, headers, body = server.request(
                "POST", "/", LONG_TEXT, {"Content-Type": "text/plain"}
            )
            assert status == 200, body[:300]


# --- 9. one client's large lists do not make everyone wait ---------------------------


async def singles_p50(port: int, clients: int, seconds: float) -> float:
    latencies: list[float] = []
    end = time.monotonic() + seconds

    async def one_client(index: int) -> None:
        client = Client(port)
        n = 0
        while time.monotonic() < end:
            started = time.perf_counter()
            status, _ = await client.post_json({"inputs": f"single {index} {n}"})
            assert status == 200
            latencies.append(time.perf_counter() - started)
            n += 1

    await asyncio.gather(*(one_client(i) for i in range(clients)))
    return statistics.median(latencies)


async def flood_lists(port: int, stop: asyncio.Event, answered: list[int]) -> None:
    client = Client(port)
    while not stop.is_set():
        status, answer = await client.post_json({"inputs": [f"list item {i}" for i in range(256)]})
        assert status == 200, answer
        answered.append(len(answer))


def test_large_lists_do_not_starve_single_requests():
    args = ["--handler", "tests.abuse_handlers:paced", "--max-queue", "1024"]
    args += ["--max-client-batch-size", "256", "--no-access-log"]
    with RunningServer(args) as server:

        async def scenario() -> tuple[float, float, int]:
            await singles_p50(server.port, 1, 1.0)  # warm up: the cost model measures
            idle = await singles_p50(server.port, 3, 3.0)
            stop, answered = asyncio.Event(), []
            lists = [asyncio.create_task(flood_lists(server.port, stop, answered)) for _ in "ab"]
            await asyncio.sleep(0.5)  # the lists are queued
            loaded = await singles_p50(server.port, 3, 6.0)
            stop.set()
            await asyncio.gather(*lists)
            return idle, loaded, sum(answered)

        idle, loaded, list_items = asyncio.run(scenario())
    assert list_items > 0, "the lists were never answered"
    assert loaded <= 3 * idle, f"singles' p50 {1000 * loaded:.0f} ms vs {1000 * idle:.0f} ms idle"


# --- 11. items that queued while the worker was busy go out together -----------------


def test_items_queued_behind_a_slow_batch_go_out_as_one_batch():
    lengths = [1, 5, 20, 40, 60, 80, 120, 160, 200]
    with RunningServer(["--handler", "tests.handlers:faulty", "--no-access-log"]) as server:
        answers: list = []

        def post(document: dict) -> None:
            answers.append(server.post_json(document))

        slow = threading.Thread(
            target=post, args=({"inputs": "slow", "parameters": {"sleep": 1.0}},)
        )
        slow.start()
        server.wait_for_log(__import__("re").compile("faulty handler: sleeping"), timeout=30)
        threads = [
            threading.Thread(target=post, args=({"inputs": "a" * n},), daemon=True) for n in lengths
        ]
        for thread in threads:
            thread.start()
        for thread in [slow, *threads]:
            thread.join(timeout=30)
    batches = sorted(len(answer["batch"]) for status, answer in answers if status == 200)
    assert len(batches) == 10
    assert batches == [1] + [len(lengths)] * len(lengths), json.dumps(batches)

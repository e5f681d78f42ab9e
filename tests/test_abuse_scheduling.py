"""Admission and batching under abuse, end to end: no false refusal on an idle server,
fair shares between a client's large lists and other clients' single requests, and
items that accumulated while the worker was busy leave together.

Real `python -m rawserve` processes; bounded in time and count, loopback only.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from tests.load import Client
from tests.server import RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

LONG_TEXT = "word " * 209_700  # just under 1 MiB; the model reads its first 512 tokens


@pytest.fixture(scope="module")
def servers(request):
    """A server of its own for each test, those the selected tests use started together
    (their workers load side by side)."""
    paced = ["--handler", "tests.abuse_handlers:paced", "--max-queue", "1024"]
    paced += ["--max-client-batch-size", "256", "--max-batch-size", "16", "--no-access-log"]
    with started_as_used(
        request,
        {
            "minilm_server": lambda: RunningServer(["--no-access-log"]),  # the packaged MiniLM
            "paced_server": lambda: RunningServer(paced),
            "faulty_server": lambda: RunningServer(
                ["--handler", "tests.handlers:faulty", "--no-access-log"]
            ),
        },
    ) as get:
        yield get


minilm_server = module_server("minilm_server")
paced_server = module_server("paced_server")
faulty_server = module_server("faulty_server")


# --- 4. no false "deadline unreachable" on an idle server ----------------------------


def test_a_long_text_on_an_idle_server_is_answered_not_refused(minilm_server):
    sentence = "the quick brown fox jumps over the lazy dog and keeps running far away " * 4
    with minilm_server as server:
        for _ in range(4):  # a few large lists teach the cost model the speed
            status, answer = server.post_json({"inputs": [sentence] * 32})
            assert status == 200, answer
        for _ in range(3):  # the default 30 s deadline; the model reads 512 tokens of it
            status, headers, body = server.request(
                "POST", "/", LONG_TEXT, {"Content-Type": "text/plain"}
            )
            assert status == 200, body[:300]


# --- 9. one client's large lists do not make everyone wait ---------------------------


async def queued_items(port: int) -> float:
    """The queue depth the server reports on /metrics (its one model)."""
    status, body = await Client(port).request("GET", "/metrics", b"", [])
    assert status == 200
    match = re.search(rb"^rawserve_queue_depth\{[^}]*\} (\S+)$", body, re.MULTILINE)
    assert match, body[:500]
    return float(match.group(1))


def test_large_lists_do_not_starve_single_requests(paced_server):
    """Fairness as order, which holds on any machine: single requests sent one after
    another while two lists of 256 items are queued are each answered while the lists are
    still being computed. A queue served in arrival order would answer the first single
    only after all 512 items (32 batches of 16)."""
    with paced_server as server:

        async def scenario() -> tuple[list[bool], list[int]]:
            client = Client(server.port)
            lists = [
                asyncio.create_task(
                    client.post_json({"inputs": [f"list {name} {i}" for i in range(256)]})
                )
                for name in "ab"
            ]
            while await queued_items(server.port) < 300:  # both lists are in the queue
                assert not any(task.done() for task in lists)
                await asyncio.sleep(0.005)
            lists_pending = []
            for n in range(3):
                status, answer = await client.post_json({"inputs": f"single {n}"})
                assert status == 200, answer
                lists_pending.append(not all(task.done() for task in lists))
            answers = await asyncio.gather(*lists)
            return lists_pending, [len(answer) for status, answer in answers if status == 200]

        lists_pending, list_sizes = asyncio.run(scenario())
    assert list_sizes == [256, 256], "the lists were not answered"
    assert lists_pending == [True, True, True], "a single waited behind the lists"


# --- 11. items that queued while the worker was busy go out together -----------------


def test_items_queued_behind_a_slow_batch_go_out_as_one_batch(faulty_server):
    lengths = [1, 5, 20, 40, 60, 80, 120, 160, 200]
    with faulty_server as server:
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

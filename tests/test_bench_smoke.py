"""The benchmark harness runs end to end: its load generator against rawserve's echo handler.

Only a smoke test (about two seconds of load): the benchmarks themselves are not tests.
"""

from __future__ import annotations

import asyncio

import pytest

from bench import load, refusal_cost, report, spread
from bench.workloads import RAW_TEXT, BodyFormat, texts
from tests.server import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def echo_server():
    with RunningServer(["--handler", "tests.handlers:echo"]) as server:
        yield server


def test_closed_and_open_loop_runs_answer_200_and_summarise(echo_server):
    requests = load.build_requests(texts("short")[:16], RAW_TEXT)
    json_requests = load.build_requests(texts("mixed")[:16], BodyFormat({}), timeout_header=5)

    async def run():
        closed = await load.closed_loop(echo_server.port, requests, 8, 0.8, health_interval=0.05)
        counted = await load.closed_loop(echo_server.port, json_requests, 4, 10.0, max_requests=40)
        opened = await load.open_loop(echo_server.port, json_requests, 200, 0.8, deadline=5.0)
        return closed.summary(), counted.summary(), opened.summary()

    closed, counted, opened = asyncio.run(run())
    assert closed["requests"] > 0 and closed["statuses"] == {"200": closed["requests"]}
    assert closed["p50_ms"] is not None and closed["health"]["ok"] == closed["health"]["requests"]
    assert counted["requests"] == 40 and counted["statuses"] == {"200": 40}
    assert opened["statuses"].get("200", 0) > 50 and opened["late_200"] == 0


def test_load_from_several_processes_is_one_run(echo_server):
    """bench.spread: the clients (or the arrival rate) split between processes, their
    samples merged as if one process had sent them all."""
    requests = load.build_requests(texts("short")[:16], RAW_TEXT)

    async def run():
        closed = await spread.closed_loop(
            echo_server.port, requests, 5, 0.8, processes=2, health_interval=0.05
        )
        opened = await spread.open_loop(echo_server.port, requests, 200, 0.8, processes=2)
        return closed, opened

    closed, opened = asyncio.run(run())
    assert closed.clients == 5 and closed.health is not None and closed.health.status
    summary = closed.summary()
    assert summary["requests"] > 0 and summary["statuses"] == {"200": summary["requests"]}
    assert opened.rate == 200 and opened.summary()["statuses"].get("200", 0) > 50
    assert spread.shares(10, 4) == [3, 3, 2, 2] and spread.shares(2, 4) == [1, 1]


def test_report_checks_targets_from_figures():
    point = {"clients": 64, "throughput": 300.0, "p50_ms": 100.0, "p99_ms": 150.0}
    results = {
        "scenarios": [
            {
                "model": "classification",
                "ceiling": {"short": {"forward/arrival": {"best": 320.0, "curve": {}}}},
                "servers": {"rawserve": {"text_sets": {"short": {"points": [point]}}}},
            }
        ]
    }
    table = report.ratio_table(results)
    assert "0.94" in table and "| yes |" in table


def test_refusal_cost_harness_times_real_refusals():
    """The harness asserts that every request it times was answered 503 from the head, on
    a connection that stays open: an error page or a closed connection would be timed as
    a (very cheap) refusal otherwise."""
    loop = asyncio.new_event_loop()
    try:
        seconds = refusal_cost.per_refusal(200, loop, queue=8)
    finally:
        loop.close()
    assert 0 < seconds < 0.05

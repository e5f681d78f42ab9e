"""GET /metrics: real traffic against the real server (slow), and the registry's series,
their merge across processes and their rendering in-process (fast), parsed with
prometheus_client's parser."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rawserve.ops.metrics import Metrics
from tests.load import Client, exchange, run_load
from tests.server import RunningServer, module_server, started_as_used

MAX_QUEUE = 3
BUSY_SECONDS = 1.5  # how long one request keeps the only worker busy


@pytest.fixture(scope="module")
def servers(request):
    """The module's servers its selected tests use, started together."""
    sleepy = ["--handler", "tests.handlers:sleepy", "--max-batch-size", "4"]
    with started_as_used(
        request,
        {
            "server": lambda: RunningServer([*sleepy, "--max-queue", str(MAX_QUEUE)]),
            # its own: its test crashes the worker
            "faulty_server": lambda: RunningServer(["--handler", "tests.handlers:faulty"]),
        },
    ) as get:
        yield get


server = module_server("server")
faulty_server = module_server("faulty_server")


def scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(sample name, sorted labels): value}."""
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` that carry these labels (and maybe others, such
    as the model's name)."""
    wanted = set(labels.items())
    return sum(
        sample_value
        for (sample_name, sample_labels), sample_value in samples.items()
        if sample_name == name and wanted <= set(sample_labels)
    )


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    """Poll the server (it has no event to offer a client) until `condition` holds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition did not hold in time"
        time.sleep(0.02)


async def leave_while(server: RunningServer, body: bytes, gauge: str) -> None:
    """POST `body`, leave once `gauge` (queue depth, items in flight) shows it, and
    wait until the gauge is back to 0."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    headers = [("Content-Type", "application/json")]
    leaving = asyncio.create_task(exchange(reader, writer, "POST", "/", body, headers))
    await asyncio.to_thread(wait_until, lambda: value(scrape(server), gauge) == 1)
    leaving.cancel()
    writer.close()
    await asyncio.to_thread(wait_until, lambda: value(scrape(server), gauge) == 0)


@pytest.mark.slow
def test_metrics_count_requests_batches_and_every_kind_of_drop(server):
    before = scrape(server)
    bodies = [json.dumps({"inputs": f"item {i}"}).encode() for i in range(24)]
    headers = [("Content-Type", "application/json")]
    answers = asyncio.run(run_load(server.port, bodies, MAX_QUEUE, 60, headers))
    assert [status for status, _ in answers] == [200] * 24
    assert server.request("GET", "/no-such-route")[0] == 404
    # a list longer than the queue bound is refused whole: 413 (no retry can help), not
    # counted as "rejected": no load was shed (an alert on shedding fired for a client's bug)
    status, _ = server.post_json({"inputs": ["a"] * (MAX_QUEUE + 1)})
    assert status == 413
    # refused from its head, in the absolute form a proxy sends: counted under its route
    # (it was "other", where the same request with a small body counts under "/")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
        raw.sendall(b"POST http://x/ HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000000\r\n\r\n")
        assert raw.recv(65536).startswith(b"HTTP/1.1 413")

    async def drops() -> None:
        client = Client(server.port)
        busy = asyncio.create_task(
            client.post_json({"inputs": "busy", "parameters": {"sleep": BUSY_SECONDS}})
        )
        await asyncio.to_thread(
            wait_until, lambda: value(scrape(server), "rawserve_items_in_flight") == 1
        )
        # queued behind the busy worker with a short deadline: 504, "expired"
        status, _ = await client.request("POST", "/", b"late", [("X-Request-Timeout", "0.2")])
        assert status == 504
        # queued behind the busy worker, then the client leaves: "disconnected"
        await leave_while(server, json.dumps({"inputs": "gone"}).encode(), "rawserve_queue_depth")
        assert (await busy)[0] == 200

    asyncio.run(drops())
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("rawserve_requests_total", route="/", method="POST", status="200") == 25
    assert grew("rawserve_requests_total", route="other", method="GET", status="404") == 1
    assert grew("rawserve_requests_total", route="/", method="POST", status="413") == 2
    assert grew("rawserve_requests_total", route="/", method="POST", status="504") == 1
    # the client that left before its answer: nginx's 499
    assert grew("rawserve_requests_total", route="/", method="POST", status="499") == 1
    assert grew("rawserve_request_duration_seconds_count", route="/") == 29
    assert grew("rawserve_items_dropped_total", reason="rejected") == 0
    assert grew("rawserve_items_dropped_total", reason="expired") == 1
    assert grew("rawserve_items_dropped_total", reason="disconnected") == 1
    model = (("model", "tests.handlers:sleepy"),)
    assert ("rawserve_items_dropped_total", (*model, ("reason", "poison"))) in after
    # 25 items were computed, in at most 25 batches of at most 4
    assert grew("rawserve_batch_size_sum") == 25
    assert 25 / 4 <= grew("rawserve_batch_size_count") <= 25
    assert grew("rawserve_batch_compute_seconds_count") == grew("rawserve_batch_size_count")
    assert grew("rawserve_batch_compute_seconds_sum") >= BUSY_SECONDS * 0.9
    # each computed item's wait in the queue, once (the expired and the gone never left it)
    assert grew("rawserve_queue_seconds_count") == 25
    assert grew("rawserve_queue_seconds_bucket", le="+Inf") == 25
    assert 0 <= grew("rawserve_queue_seconds_sum") < 25 * BUSY_SECONDS
    # state read at scrape time
    assert value(after, "rawserve_queue_depth") == 0
    assert value(after, "rawserve_queued_tokens") == 0
    assert value(after, "rawserve_queue_limit") == MAX_QUEUE
    assert value(after, "rawserve_worker_ready", worker="0", device="cpu") == 1
    assert value(after, "rawserve_worker_state", worker="0", state="idle") == 1
    assert value(after, "rawserve_worker_restarts_total", worker="0") == 0
    assert value(after, "rawserve_event_loop_lag_seconds_count") >= 1


@pytest.mark.slow
def test_queue_depth_and_queued_tokens_while_items_wait(server):
    async def scenario() -> None:
        client = Client(server.port)
        busy = asyncio.create_task(
            client.post_json({"inputs": "busy", "parameters": {"sleep": 0.5}})
        )
        await asyncio.to_thread(
            wait_until, lambda: value(scrape(server), "rawserve_items_in_flight") == 1
        )
        waiting = asyncio.create_task(client.post_json({"inputs": ["one two three", "four"]}))
        await asyncio.to_thread(
            wait_until, lambda: value(scrape(server), "rawserve_queue_depth") == 2
        )
        assert value(scrape(server), "rawserve_queued_tokens") > 0
        assert (await busy)[0] == 200
        assert (await waiting)[0] == 200

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_batch_computed_for_a_client_that_left_is_still_counted(server):
    """The worker spent that time on it: a model call, in `batch_size` and
    `batch_compute_seconds` (not a drop: it was not answered without a model call)."""
    before = scrape(server)

    body = json.dumps({"inputs": "leaving", "parameters": {"sleep": 0.5}}).encode()
    asyncio.run(leave_while(server, body, "rawserve_items_in_flight"))
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("rawserve_requests_total", route="/", method="POST", status="499") == 1
    assert grew("rawserve_batch_size_sum") == 1
    assert grew("rawserve_batch_compute_seconds_sum") >= 0.4
    assert grew("rawserve_items_dropped_total") == 0


def test_unknown_paths_share_one_route_label():
    metrics = Metrics(routes={"/", "/metrics"})
    for path in ("/a", "/b", "/c"):
        metrics.observe_request(path, "GET", 404, 0.001)
    metrics.observe_request("/metrics", "GET", 200, 0.001)
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    routes = {
        sample.labels["route"]
        for family in text_string_to_metric_families(body.decode())
        if family.name == "rawserve_requests"
        for sample in family.samples
        if sample.name == "rawserve_requests_total"
    }
    assert routes == {"other", "/metrics"}


def test_a_long_request_and_batch_are_measured_not_read_as_the_last_bound():
    """A 111 s generation read as a p99 of 30 s, its compute as 5 s, and a batch of 1,000
    as 256: histogram_quantile reads what passed the last bound as that bound. The bounds
    reach what the server allows (--max-timeout 300 s, --batch-timeout 120 s)."""
    metrics = Metrics(routes=["/"])
    metrics.observe_request("/", "POST", 200, 111.0)
    metrics.for_model("m").observe_batch(1000, 111.0)
    samples = [
        sample
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        for sample in family.samples
        if sample.name.endswith("_bucket")
    ]

    def first_bound_holding(name: str) -> str:
        held = [s for s in samples if s.name == name and s.value == 1 and s.labels["le"]]
        return min(held, key=lambda s: float(s.labels["le"])).labels["le"]

    assert first_bound_holding("rawserve_request_duration_seconds_bucket") == "120.0"
    assert first_bound_holding("rawserve_batch_compute_seconds_bucket") == "120.0"
    assert first_bound_holding("rawserve_batch_size_bucket") == "1024.0"


def test_one_route_answered_with_two_statuses_counts_each_status_apart():
    """An alert on the share of 5xx answers reads the `status` label: a route's 503s are
    their own series, never added to its 200s."""
    metrics = Metrics(routes=["/"])
    for status in (200, 503, 200):
        metrics.observe_request("/", "POST", status, 0.001)
    samples = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        for sample in family.samples
        if sample.name == "rawserve_requests_total"
    }
    assert samples == {"200": 2, "503": 1}


def test_streams_that_end_with_an_error_event_are_counted_by_model_and_status():
    metrics = Metrics()
    counts = metrics.for_model("gen")
    for status in (500, 504, 504):
        counts.stream_error(status)
    body = metrics.render()[0]
    assert b'rawserve_stream_errors_total{model="gen",status="500"} 1.0' in body
    assert b'rawserve_stream_errors_total{model="gen",status="504"} 2.0' in body


def test_the_http_processes_listening_are_read_at_each_scrape():
    """With --http-processes N > 1 one that could not start again (its TLS files
    unreadable) left the server on fewer, seen in the log and /info alone."""
    metrics, listening = Metrics(), [2]
    metrics.count_http_processes(lambda: listening[0])
    assert b"rawserve_http_processes_listening 2.0" in metrics.render()[0]
    listening[0] = 1
    assert b"rawserve_http_processes_listening 1.0" in metrics.render()[0]
    assert b"rawserve_http_processes_listening" not in Metrics().render()[0]  # one process


def test_each_server_has_its_own_registry():
    first, second = Metrics(), Metrics()
    first.for_model("m").drop("expired", 3)
    second.for_model("m")
    assert b'rawserve_items_dropped_total{model="m",reason="expired"} 3.0' in first.render()[0]
    assert b'rawserve_items_dropped_total{model="m",reason="expired"} 0.0' in second.render()[0]


async def test_the_loop_lag_probe_sees_a_blocked_loop():
    metrics = Metrics()
    loop = asyncio.get_running_loop()
    probe = loop.create_task(metrics.probe_loop_lag(loop, interval=0.01))
    await asyncio.sleep(0)  # the probe arms its timer
    time.sleep(0.1)  # then the loop is blocked past it
    assert await probe >= 0.05
    assert metrics.registry.get_sample_value("rawserve_event_loop_lag_seconds_count") == 1
    assert metrics.registry.get_sample_value("rawserve_event_loop_lag_last_seconds") >= 0.05


@pytest.mark.slow
def test_poison_inputs_and_worker_restarts_are_counted(faulty_server):
    with faulty_server as faulty:
        # it crashes its worker, then twice more alone (an input is quarantined only
        # after two crashes on its own): a poison input (500), three restarts
        status, _ = faulty.post_json({"inputs": "crash here"}, timeout=60)
        assert status == 500
        # a restart loads torch and the model again: allow a loaded machine its time
        wait_until(
            lambda: value(scrape(faulty), "rawserve_worker_ready", worker="0", device="cpu"),
            timeout=90,
        )
        # remembered: refused without a model call (422)
        status, _ = faulty.post_json({"inputs": "crash here"})
        assert status == 422
        samples = scrape(faulty)
    assert value(samples, "rawserve_items_dropped_total", reason="poison") == 2
    # no batch ran to its end: the histograms that size batches hold none (a crashed
    # batch was recorded as a model call of 0 s); the refusal is no model call either
    assert value(samples, "rawserve_batch_size_count") == 0
    assert value(samples, "rawserve_batch_compute_seconds_count") == 0
    assert value(samples, "rawserve_worker_restarts_total", worker="0") == 3
    assert value(samples, "rawserve_requests_total", route="/", method="POST", status="500") == 1


def test_request_series_stay_bounded_whatever_the_paths_and_methods():
    metrics = Metrics(routes=["/"])
    for n in range(50):
        metrics.observe_request(f"/probe-{n}", f"METHOD{n}", 404, 0.001)
    metrics.observe_request("/", "POST", 200, 0.01)
    metrics.observe_request("/", "POST", 200, 0.02)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        for sample in family.samples
        if sample.name == "rawserve_requests_total"
    }
    assert samples == {
        (
            "rawserve_requests_total",
            (("method", "other"), ("route", "other"), ("status", "404")),
        ): 50,
        ("rawserve_requests_total", (("method", "POST"), ("route", "/"), ("status", "200"))): 2,
    }


def test_a_generation_workers_passes_are_counted_by_kind():
    """A continuous generation worker's `GenerationPasses` reach the model's metrics: how
    many prefills and decoding steps ran, and their tokens (a decoding step's tokens are
    its rows: their ratio is the batch the loop runs)."""
    from rawserve.serving.pool import WorkerPool
    from rawserve.shared.messages import GenerationPasses, WorkerConfig

    metrics = Metrics()
    pool = WorkerPool(
        WorkerConfig(model="unused", task="text-generation"),
        ["cpu"],
        metrics=metrics.for_model("gpt"),
    )
    [worker] = pool.workers
    pool._on_message(worker, GenerationPasses(prefills=2, prompt_tokens=30, steps=9, rows=40))
    pool._on_message(worker, GenerationPasses(steps=1, rows=5))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        for sample in family.samples
    }
    assert value(samples, "rawserve_generation_passes_total", model="gpt", kind="prefill") == 2
    assert value(samples, "rawserve_generation_passes_total", model="gpt", kind="decode") == 10
    assert value(samples, "rawserve_generation_pass_tokens_total", kind="prefill") == 30
    assert value(samples, "rawserve_generation_pass_tokens_total", kind="decode") == 45


def test_a_generation_workers_latencies_are_histograms_merged_across_processes():
    """The loop's latencies come counted into buckets (`Counts`): each model's series adds
    them up, rendered as Prometheus histograms, and summed with the other processes'."""
    from rawserve.ops.metrics import merge_families, render_families
    from rawserve.shared.messages import GenerationPasses
    from rawserve.shared.tallies import INTER_TOKEN_BUCKETS, WAIT_BUCKETS, Counts

    def counts(bounds, at: dict[int, int], total: float) -> Counts:
        buckets = [0] * (len(bounds) + 1)
        for index, count in at.items():
            buckets[index] = count
        return Counts(tuple(buckets), total)

    metrics = Metrics()
    gpt = metrics.for_model("gpt")
    # 3 in the bucket up to 1 ms, 1 in the one up to 15 ms
    first = counts(WAIT_BUCKETS, {WAIT_BUCKETS.index(0.001): 3, WAIT_BUCKETS.index(0.015): 1}, 0.02)
    gpt.count_passes(GenerationPasses(steps=1, rows=4, first_token=first))
    gpt.count_passes(
        GenerationPasses(
            steps=1,
            rows=4,
            first_token=counts(WAIT_BUCKETS, {len(WAIT_BUCKETS): 1}, 40.0),  # past 30 s
            inter_token=counts(INTER_TOKEN_BUCKETS, {INTER_TOKEN_BUCKETS.index(0.0015): 8}, 0.012),
        )
    )
    metrics.for_model("bert")  # a model that generates nothing has no series
    other = Metrics()  # another process's, with nothing of the kind
    rendered = render_families(merge_families([metrics.families(), other.families()]))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(rendered.decode())
        for sample in family.samples
    }
    ttft = "rawserve_generation_time_to_first_token_seconds"
    assert value(samples, f"{ttft}_bucket", model="gpt", le="0.001") == 3
    assert value(samples, f"{ttft}_bucket", model="gpt", le="0.01") == 3
    assert value(samples, f"{ttft}_bucket", model="gpt", le="0.015") == 4
    assert value(samples, f"{ttft}_bucket", model="gpt", le="30.0") == 4
    assert value(samples, f"{ttft}_bucket", model="gpt", le="+Inf") == 5
    assert value(samples, f"{ttft}_count", model="gpt") == 5
    assert value(samples, f"{ttft}_sum", model="gpt") == pytest.approx(40.02)
    between = "rawserve_generation_inter_token_seconds"
    assert value(samples, f"{between}_bucket", model="gpt", le="0.001") == 0
    assert value(samples, f"{between}_bucket", model="gpt", le="0.0015") == 8
    assert value(samples, f"{between}_count", model="gpt") == 8
    assert not [
        key for key in samples if dict(key[1]).get("model") == "bert" and "generation" in key[0]
    ]
    assert not [key for key in samples if key[0].startswith("rawserve_generation_queue_seconds")]


def test_a_continuous_workers_learned_step_and_answer_length_are_gauges():
    """What the scheduler has learned of a continuous worker's sequences is exported once
    it is a reason to refuse: the step's seconds beside one row and beside the most rows
    measured, those rows, and the tokens nine in ten answers stay within (+Inf while more
    than a tenth run to their cap). Before that, none of them is."""
    from types import SimpleNamespace

    from rawserve.serving.core import SchedulerCore
    from rawserve.serving.pool import WorkerPool
    from rawserve.serving.sequences import SEEN_ENOUGH
    from rawserve.shared.messages import WorkerConfig

    metrics = Metrics()
    pool = WorkerPool(WorkerConfig(model="unused", task="text-generation"), ["cpu"])
    core = SchedulerCore(max_batch_size=1)
    metrics.watch("gpt", SimpleNamespace(core=core, in_flight=0), pool)

    def samples():
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics.render()[0].decode())
            for sample in family.samples
        }

    learned = ("step_seconds", "rows_measured", "likely_new_tokens")
    assert not [
        name for name, _ in samples() if name.removeprefix("rawserve_generation_") in learned
    ]

    for made in (8, 128):  # a step of 2 ms beside one row, 1 ms more a row beside it
        for rows in (1, 11):
            core.pace.observe(made, rows, (made + 4) * (0.002 + 0.001 * (rows - 1)))
    for _ in range(SEEN_ENOUGH):  # capped answers: each is as long as it asks
        core.answer_lengths.ended(100, 100)
    found = samples()
    assert value(found, "rawserve_generation_step_seconds", model="gpt", rows="one") == (
        pytest.approx(0.002)
    )
    assert value(found, "rawserve_generation_step_seconds", rows="most") == pytest.approx(0.012)
    assert value(found, "rawserve_generation_rows_measured", model="gpt") == 11
    assert value(found, "rawserve_generation_likely_new_tokens", model="gpt") == float("inf")

    for _ in range(10 * SEEN_ENOUGH):  # now more than nine in ten end at 30 of their 100
        core.answer_lengths.ended(100, 30)
    assert value(samples(), "rawserve_generation_likely_new_tokens") == 30


def test_a_merged_counter_was_created_when_its_earliest_process_created_it():
    """Several processes' counters merged are one series: summed, and created when the
    first of them was (`_created` tells Prometheus when the count started from 0; a later
    process's time would date the whole sum from when that process started)."""
    from rawserve.ops.metrics import merge_families, render_families

    def process(created: float, dropped: float):
        labels = {"model": "m", "reason": "expired"}
        samples = [
            ("rawserve_items_dropped_total", labels, dropped),
            ("rawserve_items_dropped_created", labels, created),
        ]
        return [("rawserve_items_dropped", "counter", "Items dropped", "", samples)]

    merged = merge_families([process(2000.0, 1), process(1000.0, 2), process(1500.0, 4)])
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(render_families(merged).decode())
        for sample in family.samples
    }
    assert value(samples, "rawserve_items_dropped_total", reason="expired") == 7
    assert value(samples, "rawserve_items_dropped_created", reason="expired") == 1000.0

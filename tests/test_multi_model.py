"""Several models behind one server: each its own queue, scheduler and workers.

The real server with real tiny models and the clients users have: the openai client picks
a model by its `model` field, huggingface_hub's InferenceClient reaches one at
/models/<name>. Isolation: one model saturated leaves the other's p99 within 2x of its
figure alone; one model's worker killed, the other answers every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import h11
import numpy as np
import pytest

from tests.load import Client, exchange
from tests.server import REPO_ROOT, RunningServer

pytestmark = pytest.mark.slow

JSON = [("Content-Type", "application/json")]
ATTEMPTS = 3  # of the saturation measurement (see its test)
SATURATE_AT_MOST = 120.0  # seconds: the saturating load stops by itself after it


@pytest.fixture(scope="module")
def pair(tiny_model):
    """emb (the default: first) and cls, named by alias, cls with its task given."""
    args = [
        "--model",
        f"emb={tiny_model('sentence-embedding')}",
        "--model",
        f"cls={tiny_model('text-classification')}:text-classification",
        "--max-batch-size",
        "8",
    ]
    with RunningServer(args) as server:
        yield server


@pytest.fixture(autouse=True, scope="module")
def clients_may_reach_loopback():
    """HF_HUB_OFFLINE=1 (set for the whole suite) makes huggingface_hub refuse every
    request, its InferenceClient's to our loopback server included."""
    from huggingface_hub import constants

    saved, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    yield
    constants.HF_HUB_OFFLINE = saved


def get_json(server: RunningServer, path: str) -> tuple[int, dict]:
    status, _, body = server.request("GET", path)
    return status, json.loads(body)


def test_post_root_is_the_first_model_and_models_name_picks_one(pair):
    status, default = pair.post_json({"inputs": "i like it"})
    assert status == 200 and len(default) == 32  # a sentence vector: emb
    status, named = pair.post_json({"inputs": "i like it"}, path="/models/emb")
    assert status == 200 and named == default
    status, labels = pair.post_json({"inputs": "i like it"}, path="/models/cls")
    assert status == 200 and labels[0][0]["label"] in ("NEGATIVE", "POSITIVE")
    status, answer = pair.post_json({"inputs": "x"}, path="/models/nope")
    assert status == 404 and "served: emb, sentence-embedding, cls" in answer["error"]


def test_the_openai_client_selects_each_model_by_its_model_field(pair):
    import openai

    api = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.port}/v1", api_key="unused")
    try:
        assert [model.id for model in api.models.list().data] == ["emb", "cls"]
        vector = api.embeddings.create(model="emb", input="i like it").data[0].embedding
        np.testing.assert_allclose(vector, pair.post_json({"inputs": "i like it"})[1], atol=1e-6)
        with pytest.raises(openai.NotFoundError) as wrong_task:
            api.embeddings.create(model="cls", input="i like it")
        # the SDK shows rawserve's message (OpenAI's error object on /v1)
        assert "needs a feature-extraction model" in wrong_task.value.message
        with pytest.raises(openai.NotFoundError) as unknown:
            api.embeddings.create(model="text-embedding-3-small", input="i like it")
        assert "served: emb" in unknown.value.message
        assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    finally:
        api.close()


def test_inference_client_reaches_each_model_at_its_own_path(pair):
    from huggingface_hub import InferenceClient

    base = f"http://127.0.0.1:{pair.port}/models"
    classifier = InferenceClient(model=f"{base}/cls")
    embedder = InferenceClient(model=f"{base}/emb")
    [top, *_] = classifier.text_classification("i like it")
    assert top.label in ("NEGATIVE", "POSITIVE")
    vector = embedder.feature_extraction("i like it")
    np.testing.assert_allclose(vector.reshape(-1), pair.post_json({"inputs": "i like it"})[1])


def test_ready_info_and_metrics_describe_every_model(pair):
    assert get_json(pair, "/ready") == (
        200,
        {"status": "ready", "models": {"emb": "ready", "cls": "ready"}},
    )
    assert get_json(pair, "/ready/cls") == (200, {"status": "ready", "task": "text-classification"})
    status, missing = get_json(pair, "/ready/nope")
    assert status == 404 and "served: emb" in missing["error"]
    status, info = get_json(pair, "/info")
    assert status == 200 and info["name"] == "emb"  # the default model, at the top
    described = {model["name"]: model for model in info["models"]}
    assert described["emb"]["task"] == "feature-extraction"
    assert described["emb"]["pooling"] == "mean"
    assert described["cls"]["task"] == "text-classification"
    assert described["cls"]["requested_task"] == "text-classification"
    assert described["emb"]["worker_pids"] != described["cls"]["worker_pids"]
    pair.post_json({"inputs": "x"}, path="/models/cls")
    metrics = pair.request("GET", "/metrics")[2].decode()
    for model in ("emb", "cls"):
        assert f'rawserve_queue_depth{{model="{model}"}}' in metrics
        assert f'rawserve_worker_ready{{device="cpu",model="{model}",worker="0"}} 1.0' in metrics
    assert 'rawserve_batch_size_count{model="cls"}' in metrics


def test_log_lines_name_the_model_of_each_worker(pair):
    for name in ("emb", "cls"):
        assert any(f"worker {name}/0: started" in line for line in pair.lines)
        assert any(f" worker-{name}/0 INFO " in line for line in pair.lines)  # its own lines
    assert not any("worker 0:" in line for line in pair.lines)


# --- isolation -----------------------------------------------------------------------


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


async def timed_requests(port: int, path: str, count: int) -> list[float]:
    """`count` requests one after another on one keep-alive connection; each latency."""
    body = json.dumps({"inputs": "i like this movie"}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    latencies = []
    try:
        for _ in range(count):
            conn = h11.Connection(h11.CLIENT)
            started = time.perf_counter()
            status, answer = await exchange(reader, writer, "POST", path, body, JSON, conn)
            latencies.append(time.perf_counter() - started)
            assert status == 200, answer
    finally:
        writer.close()
    return latencies


async def saturate(port: int, path: str, clients: int, stop: asyncio.Event) -> dict[int, int]:
    """`clients` closed loops posting long generations until `stop`: more than the model
    computes, so its worker never rests and its queue stays at its bound; a refused
    client waits the Retry-After it is given, as a client should. Prints "saturated" at
    the first 503; returns the statuses counted."""
    body = json.dumps({"inputs": "the movie", "parameters": {"max_new_tokens": 48}}).encode()
    counts: dict[int, int] = {}
    until = time.monotonic() + SATURATE_AT_MOST

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not stop.is_set() and time.monotonic() < until:
                conn = h11.Connection(h11.CLIENT)
                status, answer = await exchange(reader, writer, "POST", path, body, JSON, conn)
                counts[status] = counts.get(status, 0) + 1
                if status == 503:
                    if counts[status] == 1:
                        print("saturated", flush=True)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return counts


def saturate_main(port: int, path: str, clients: int) -> None:
    """The saturating load in a process of its own, so the measuring client's event loop
    is not the one driving it; it stops when its stdin closes and prints the statuses."""

    async def until_stdin_closes() -> dict[int, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wait_for_eof() -> None:
            sys.stdin.read()
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_for_eof, daemon=True).start()
        return await saturate(port, path, clients, stop)

    print(json.dumps(asyncio.run(until_stdin_closes())), flush=True)


@contextlib.contextmanager
def saturating(port: int, path: str, clients: int) -> Iterator[dict[str, int]]:
    """The model at `path` saturated (its queue full: some clients refused) while the
    block runs; yields the statuses the load got, filled in when the block ends."""
    code = "from tests.test_multi_model import saturate_main; "
    code += f"saturate_main({port}, {path!r}, {clients})"
    load = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    counts: dict[str, int] = {}
    try:
        assert load.stdout is not None and load.stdout.readline() == "saturated\n"
        yield counts
    finally:
        output, _ = load.communicate(timeout=60)  # closes its stdin: it stops
    counts.update(json.loads(output))


def test_a_saturated_model_leaves_the_other_within_twice_its_p99(tiny_model):
    """Measured up to ATTEMPTS times, alone then beside the saturated model: a passing
    attempt shows the isolation. What it guards against (a queue, scheduler or worker
    shared with the saturated model) would put the generation's batches of 48 tokens in
    front of every classification in every attempt; a passing attempt after a failing
    one only means something else on the machine disturbed the first measurement. On 2
    cores with nothing else running: p99 8.6 ms alone, 14.2 ms beside the saturated model
    (whose worker then holds one of the two cores); the whole test takes about 20 s."""
    args = [
        "--model",
        f"cls={tiny_model('text-classification')}",
        "--model",
        f"gen={tiny_model('text-generation')}",
        "--max-queue",
        "8",
        "--max-batch-size",
        "4",
    ]
    figures = []
    with RunningServer(args) as server:
        asyncio.run(timed_requests(server.port, "/models/cls", 30))  # connections, caches
        for _ in range(ATTEMPTS):
            alone = p99(asyncio.run(timed_requests(server.port, "/models/cls", 300)))
            with saturating(server.port, "/models/gen", clients=16) as counts:
                busy = p99(asyncio.run(timed_requests(server.port, "/models/cls", 300)))
                depth = queue_depth(server, "gen")
            assert counts.get("503", 0) > 0 and counts.get("200", 0) > 0  # saturated, served
            assert depth > 0
            figures.append((round(alone * 1000, 2), round(busy * 1000, 2)))
            if busy <= 2 * alone:
                break
    assert busy <= 2 * alone, f"p99 alone, saturated beside it (ms): {figures}"


def queue_depth(server: RunningServer, model: str) -> float:
    metrics = server.request("GET", "/metrics")[2].decode()
    match = re.search(rf'^rawserve_queue_depth{{model="{model}"}} (\S+)$', metrics, re.MULTILINE)
    assert match, metrics
    return float(match.group(1))


def test_a_crashed_model_worker_never_fails_the_other_model(pair):
    status, info = get_json(pair, "/info")
    [cls_pid] = {model["name"]: model for model in info["models"]}["cls"]["worker_pids"]

    async def requests_while_killing() -> list[int]:
        client = Client(pair.port)
        body = json.dumps({"inputs": "i like it"}).encode()
        statuses = []
        for index in range(120):
            if index == 20:
                os.kill(cls_pid, signal.SIGKILL)
            status, _ = await client.request("POST", "/models/emb", body, JSON)
            statuses.append(status)
        return statuses

    assert asyncio.run(requests_while_killing()) == [200] * 120
    # and the killed model comes back on its own
    end = time.monotonic() + 120
    while get_json(pair, "/ready/cls")[0] != 200:
        assert time.monotonic() < end, "cls did not come back"
        time.sleep(0.1)
    assert pair.post_json({"inputs": "i like it"}, path="/models/cls")[0] == 200

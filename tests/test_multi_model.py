"""Several models behind one server: each its own queue, scheduler and workers.

The real server with real tiny models and the clients users have: the openai client picks
a model by its `model` field, huggingface_hub's InferenceClient reaches one at
/models/<name>. Isolation: one model saturated leaves the other's p99 within 2x of its
figure alone; one model's worker killed, the other answers every request.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import h11
import numpy as np
import pytest

from tests.load import Client, exchange
from tests.server import REPO_ROOT, RunningServer

pytestmark = pytest.mark.slow

JSON = [("Content-Type", "application/json")]


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
        assert "feature-extraction models only" in wrong_task.value.response.json()["error"]
        with pytest.raises(openai.NotFoundError) as unknown:
            api.embeddings.create(model="text-embedding-3-small", input="i like it")
        assert "served: emb" in unknown.value.response.json()["error"]
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
    """`count` requests one after another on one connection; each one's latency."""
    client = Client(port)
    body = json.dumps({"inputs": "i like this movie"}).encode()
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        status, answer = await client.request("POST", path, body, JSON)
        latencies.append(time.perf_counter() - started)
        assert status == 200, answer
    return latencies


async def saturate(port: int, path: str, clients: int, seconds: float) -> dict[int, int]:
    """`clients` closed loops posting long generations for `seconds`: more than the model
    computes, so its worker never rests and its queue stays at its bound; a refused
    client waits the Retry-After it is given, as a client should. Statuses counted."""
    body = json.dumps({"inputs": "the movie", "parameters": {"max_new_tokens": 48}}).encode()
    counts: dict[int, int] = {}
    until = time.monotonic() + seconds

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.monotonic() < until:
                conn = h11.Connection(h11.CLIENT)
                status, answer = await exchange(reader, writer, "POST", path, body, JSON, conn)
                counts[status] = counts.get(status, 0) + 1
                if status == 503:
                    await asyncio.sleep(min(1.0, until - time.monotonic()))
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return counts


def saturate_main(port: int, path: str, clients: int, seconds: float) -> None:
    """The saturating load in a process of its own, so the measuring client's event loop
    is not the one driving it; prints the statuses it got."""
    print(json.dumps(asyncio.run(saturate(port, path, clients, seconds))))


def saturating(port: int, path: str, clients: int, seconds: float) -> subprocess.Popen[str]:
    code = (
        "from tests.test_multi_model import saturate_main; "
        f"saturate_main({port}, {path!r}, {clients}, {seconds})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        stdin=subprocess.DEVNULL,
    )


def test_a_saturated_model_leaves_the_other_within_twice_its_p99(tiny_model):
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
    with RunningServer(args) as server:
        asyncio.run(timed_requests(server.port, "/models/cls", 30))  # connections, caches
        alone = asyncio.run(timed_requests(server.port, "/models/cls", 200))
        load = saturating(server.port, "/models/gen", clients=16, seconds=15)
        try:
            # the generation model's queue at its bound: 503s for the clients beyond it
            server_full = server.wait_for_log(re.compile(r'"POST /models/gen" 503'), 30)
            assert server_full
            busy = asyncio.run(timed_requests(server.port, "/models/cls", 200))
            assert load.poll() is None  # still saturating when the measurement ended
            depth = queue_depth(server, "gen")
        finally:
            output, _ = load.communicate(timeout=60)
    counts = json.loads(output)
    assert counts.get("503", 0) > 0 and counts.get("200", 0) > 0  # saturated, and served
    assert depth > 0
    assert p99(busy) <= 2 * p99(alone), (p99(alone), p99(busy))


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

"""Several models behind one server: each its own queue, scheduler and workers.

The real server with real tiny models and the clients users have: the openai client picks
a model by its `model` field, huggingface_hub's InferenceClient reaches one at
/models/<name>. Isolation: one model saturated never refuses or fails the other's
requests; one model's worker killed, the other answers every request.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import numpy as np
import pytest

from bench.isolation import saturating, timed_requests
from tests.load import Client
from tests.server import RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

JSON = [("Content-Type", "application/json")]


@pytest.fixture(scope="module")
def servers(request, tiny_model):
    """The module's servers its selected tests use, started together."""
    pair = [
        "--model",
        f"emb={tiny_model('sentence-embedding')}",
        "--model",
        f"cls={tiny_model('text-classification')}:text-classification",
        "--max-batch-size",
        "8",
    ]
    saturated = [
        "--model",
        f"cls={tiny_model('text-classification')}",
        "--model",
        f"gen={tiny_model('text-generation')}",
        "--max-queue",
        "8",
        "--max-batch-size",
        "4",
        "--max-sequences",  # one sequence a worker: 16 clients fill the queue
        "1",
    ]
    with started_as_used(
        request,
        {"pair": lambda: RunningServer(pair), "saturated": lambda: RunningServer(saturated)},
    ) as get:
        yield get


# emb (the default: first) and cls, named by alias, cls with its task given.
pair = module_server("pair")
# cls and gen, gen with one sequence a worker and a queue of 8.
saturated = module_server("saturated")


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
    # each with the most tokens it reads of an input, not the default model's alone
    assert described["emb"]["max_input_length"] == info["max_input_length"] > 0
    assert described["cls"]["max_input_length"] > 0
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


def test_a_saturated_model_never_refuses_or_fails_the_other(saturated):
    """While the generation model is saturated (its queue at its bound, its clients
    refused with 503), every classification is answered 200, from cls's own worker, and
    cls's queue stays empty between requests: nothing is shared with the saturated model.
    What holds on any machine is asserted here; the latency beside the saturated model
    (p99 within 2x of alone) is measured by `python -m bench.isolation`."""
    with saturated as server:
        info = json.loads(server.request("GET", "/info")[2])
        pids = {model["name"]: set(model["worker_pids"]) for model in info["models"]}
        assert not pids["cls"] & pids["gen"]
        with saturating(server.port, "/models/gen", clients=16) as counts:
            latencies = asyncio.run(timed_requests(server.port, "/models/cls", 100))
            assert queue_depth(server, "gen") > 0
            assert queue_depth(server, "cls") == 0
        assert counts.get("503", 0) > 0 and counts.get("200", 0) > 0  # saturated, served
    assert len(latencies) == 100  # timed_requests asserts each answer was a 200


def queue_depth(server: RunningServer, model: str) -> float:
    metrics = server.request("GET", "/metrics")[2].decode()
    match = re.search(rf'^rawserve_queue_depth{{model="{model}"}} (\S+)$', metrics, re.MULTILINE)
    assert match, metrics
    return float(match.group(1))


def test_a_crashed_model_worker_never_fails_the_other_model(pair):
    """emb, the first model, is killed: until it is back, cls answers every request, at
    its own path and on TEI's /predict, which names no model and so goes to the first
    model that fits it (cls: emb, restarting, still embeds)."""
    status, info = get_json(pair, "/info")
    [emb_pid] = {model["name"]: model for model in info["models"]}["emb"]["worker_pids"]

    async def requests_until_emb_is_back() -> tuple[list[int], int]:
        client = Client(pair.port)
        body = json.dumps({"inputs": "i like it"}).encode()
        statuses, while_down = [], 0
        os.kill(emb_pid, signal.SIGKILL)
        end = time.monotonic() + 120
        while True:
            ready, _ = await client.request("GET", "/ready/emb")
            if ready == 200 and while_down:
                return statuses, while_down
            while_down += ready != 200
            assert time.monotonic() < end, "emb did not come back"
            for path in ("/models/cls", "/predict"):
                status, _ = await client.request("POST", path, body, JSON)
                statuses.append(status)

    statuses, while_down = asyncio.run(requests_until_emb_is_back())
    assert while_down > 0 and statuses == [200] * len(statuses)
    assert pair.post_json({"inputs": "i like it"}, path="/models/emb")[0] == 200

"""GET /info, and what an operator sees while the model loads (/ready's body, log lines)."""

from __future__ import annotations

import importlib.metadata
import json
import re

import pytest

from tests.server import RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

STILL_LOADING = re.compile(r"still loading the model \((\d+) s\)")


@pytest.fixture(scope="module")
def servers(request):
    """The module's servers its selected tests use, started together."""
    args = ["--handler", "tests.handlers:echo", "--max-batch-size", "8", "--max-queue", "16"]
    args += ["--timeout", "12", "--max-batch-delay-ms", "2"]
    no_device = {"RAWSERVE_DEVICE": ""}  # the layout a user gets with no --device
    with started_as_used(
        request,
        {
            "server": lambda: RunningServer(args, env=no_device),
            "guarded_server": lambda: RunningServer(
                ["--handler", "tests.handlers:echo", "--api-key", "s3cret"]
            ),
        },
    ) as get:
        yield get


server = module_server("server")
guarded_server = module_server("guarded_server")


def test_info_tells_the_model_settings_versions_and_worker_pids(server):
    status, headers, body = server.request("GET", "/info")
    assert status == 200 and headers["content-type"] == "application/json"
    for index in range(len(json.loads(body)["workers"])):  # the first one ready was enough
        server.wait_for_log(re.compile(rf"worker {index}: \S+ model ready"))
    info = json.loads(server.request("GET", "/info")[2])
    assert info["task"] == "custom"
    # a handler is not warmed (its inputs are its own) nor said to be, nor given an engine
    assert not any("warming up" in line for line in server.lines)
    assert server.wait_for_log(re.compile(r"ready in .* s: serving a custom handler$"))
    assert info["handler"] == "tests.handlers:echo"
    # no --device on a machine without a GPU: one single-threaded worker per core
    assert info["devices"] == ["cpu"] * len(info["workers"]) and info["threads_per_worker"] == 1
    assert "worker(s) x 1 thread" in info["layout"]
    # nor a precision or an engine of ours: they are its own code's (it said float32, torch
    # and warm-up true, which a handler author read as what ran)
    assert info["dtype"] is None and info["warmup"] is False and info["engine"] == "handler"
    assert info["ready"] is True
    assert info["batching"] == {
        "mode": "cost",  # (--batching: it was in neither /info nor the log)
        "max_batch_size": 8,
        "max_batch_delay_ms": 2.0,
        "max_batch_tokens": None,
        "limits": "on the CPU: up to 8 items (as given), no token budget",
        "max_queue": 16,
        "timeout_seconds": 12.0,
        "effective_max_batch_size": 8,
    }
    for worker in info["workers"]:
        assert worker["device"] == "cpu" and worker["state"] == "idle"
        assert worker["restarts"] == 0 and worker["engine"] == "handler"
        assert worker["dtype"] is None and worker["engine_reason"] == "the handler's own code"
        assert worker["max_sequences"] == 0  # a handler runs batches whole
    # the pids /info gives are the processes that compute (the echo handler tells its pid)
    status, answer = server.post_json({"inputs": "who computes this?"})
    assert status == 200
    assert info["worker_pids"] == [worker["pid"] for worker in info["workers"]]
    assert answer["pid"] in info["worker_pids"]
    assert info["server_pid"] == server.process.pid
    for name in ("rawserve", "transformers", "torch"):
        assert info["versions"][name] == importlib.metadata.version(name)


def test_the_server_process_never_loads_torch(server):
    server.request("GET", "/info")  # versions were looked up: still no torch
    with open(f"/proc/{server.process.pid}/maps") as maps:
        mapped = maps.read()
    assert "libtorch" not in mapped
    assert "/transformers/" not in mapped


def test_while_loading_ready_tells_the_phase_and_the_log_tells_the_progress(tmp_path):
    loaded = tmp_path / "loaded"  # the load lasts until it exists
    env = {"RAWSERVE_TEST_LOAD_SECONDS": "60", "RAWSERVE_TEST_LOADED": str(loaded)}
    loading = RunningServer(["--handler", "tests.handlers:slow_loading"], env=env)
    with loading.start(wait_ready=False):
        status, headers, body = loading.request("GET", "/ready")
        assert status == 503 and headers["retry-after"] == "5"
        document = json.loads(body)
        assert document["status"] == "loading"
        assert 0 <= document["elapsed_seconds"] < 6
        status, _, body = loading.request("GET", "/info")
        assert status == 200 and json.loads(body)["workers"][0]["state"] == "loading"
        seconds = int(loading.wait_for_log(STILL_LOADING, timeout=60).group(1))
        assert seconds >= 4
        loaded.touch()
        loading.wait_for_log(re.compile(r"ready in [\d.]+ s"), timeout=60)
        status, _, body = loading.request("GET", "/ready")
        assert status == 200 and json.loads(body)["status"] == "ready"


def test_with_an_api_key_metrics_stay_open_and_info_needs_the_key(guarded_server):
    with guarded_server as guarded:
        assert guarded.request("GET", "/metrics")[0] == 200
        assert guarded.request("GET", "/info")[0] == 401
        status, _, body = guarded.request(
            "GET", "/info", headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and json.loads(body)["task"] == "custom"

"""What the app answers in the pass that read a request: probes, and refusals."""

from __future__ import annotations

import json

import pytest

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.errors import ServiceUnavailable, Unauthorized
from rawserve.http.exchange import HttpRequest
from rawserve.scheduler import Scheduler
from rawserve.scheduling.core import SchedulerCore
from tests.test_scheduler import FakeBackend


class Workers(FakeBackend):
    """The executor's face the app reads, on the scheduler's fake backend."""

    ready = True
    healthy = True
    task = "text-classification"


def request(method: str, path: str, body: bytes = b"", headers=()) -> HttpRequest:
    return HttpRequest(method, path, "", list(headers), body, request_id="test")


@pytest.fixture
def app():
    workers = Workers()
    scheduler = Scheduler(SchedulerCore(max_queue=2), workers)
    model = ServedModel("test-model", scheduler, workers)
    return App(ServedModels([model]), AppSettings(api_key="secret"))


def test_probes_are_answered_at_once(app):
    assert json.loads(app.answer_now(request("GET", "/health")).body) == {"status": "ok"}
    ready = app.answer_now(request("GET", "/ready"))
    assert ready.status == 200 and json.loads(ready.body)["task"] == "text-classification"
    app.start_draining()
    assert app.answer_now(request("HEAD", "/ready")).status == 503


async def test_inference_goes_the_long_way_until_the_queue_is_full(app):
    authorized = [("authorization", "Bearer secret")]
    post = request("POST", "/", b"hello", authorized)
    assert app.answer_now(post) is None  # room in the queue: handled by `handle`
    for value in ("a", "b"):
        core = app.models.default.queue.core
        core.admit([core.new_item(value, {}, 1e9, 0.0)])
    with pytest.raises(ServiceUnavailable) as refused:
        app.answer_now(post)
    assert "queue full" in str(refused.value)
    with pytest.raises(Unauthorized):  # the key is checked first, full queue or not
        app.answer_now(request("POST", "/", b"hello"))


def test_only_probes_and_inference_are_answered_at_once(app):
    assert app.answer_now(request("GET", "/info")) is None
    assert app.answer_now(request("GET", "/metrics")) is None
    assert app.answer_now(request("DELETE", "/health")) is None  # handle answers 405

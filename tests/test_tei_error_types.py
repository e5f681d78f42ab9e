"""TEI's routes type their errors as TEI does (`Empty`, `Validation`, `Overloaded`,
`Unhealthy`, `Backend`), keeping rawserve's statuses; the other routes keep rawserve's
types. In-process, on fake models (tests/test_model_selection.py); TEI's routes against
real models are in tests/test_tei.py."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.http.errors import BadRequest
from rawserve.http.exchange import HttpRequest
from rawserve.serving.face import NO_CONTROL, Control, ItemResult
from rawserve.shared.messages import FailureKind, ItemFailure
from tests.test_model_selection import AnsweringQueue, served

JSON = [("content-type", "application/json")]


def post(path: str, document: Any) -> HttpRequest:
    return HttpRequest("POST", path, "", JSON, json.dumps(document).encode(), request_id="t")


def cross_encoder() -> ServedModel:
    """A text-classification model with one label, which TEI's /rerank serves."""
    model = served("rank", "text-classification")
    workers = model.serving.workers  # type: ignore[attr-defined]
    workers.loaded = replace(workers.loaded, details={"id2label": {"0": "LABEL_0"}})
    return model


def models() -> ServedModels:
    return ServedModels(
        [served("emb", "feature-extraction"), served("cls", "text-classification"), cross_encoder()]
    )


async def answer(app: App, request: HttpRequest) -> tuple[int, dict[str, Any], dict[str, str]]:
    response = await app.handle(request)
    return response.status, json.loads(response.body), dict(response.headers)


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/embed", {"inputs": []}),
        ("/embed_all", {"inputs": []}),
        ("/predict", {"inputs": []}),
        ("/rerank", {"query": "q", "texts": []}),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}),
    ],
)
async def test_an_empty_list_of_inputs_is_400_empty(path, document):
    status, body, _ = await answer(App(models()), post(path, document))
    assert (status, body["error_type"]) == (400, "Empty"), body
    assert "empty" in body["error"]


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/embed", {"inputs": 7}),
        ("/embed", {"inputs": "hello", "normalize": "yes"}),
        ("/embed", {"inputs": "hello", "dimensions": 0}),
        ("/predict", {"inputs": ["a", "b", "c"]}),
        ("/rerank", {"query": "q"}),
        ("/rerank", {"query": "q", "texts": [1]}),
    ],
)
async def test_what_teis_validation_refuses_is_validation_with_rawserves_status(path, document):
    status, body, _ = await answer(App(models()), post(path, document))
    assert status in (400, 422) and body["error_type"] == "Validation", (status, body)


async def test_a_body_that_is_not_json_keeps_rawserves_type():
    request = HttpRequest("POST", "/embed", "", JSON, b"{no", request_id="t")
    status, body, _ = await answer(App(models()), request)
    assert (status, body["error_type"]) == (400, "bad_request")


async def test_a_full_queue_is_overloaded_and_a_stopping_server_unhealthy():
    served_models = models()
    app = App(served_models)
    queue = served_models.get("emb").serving.queue
    assert isinstance(queue, AnsweringQueue)
    queue.full = True  # (of several models, refused once the body says which)
    status, body, headers = await answer(app, post("/embed", {"inputs": "hello"}))
    assert (status, body["error_type"]) == (503, "Overloaded") and "Retry-After" in headers
    alone = App(ServedModels([served_models.get("emb")]))
    refusal = alone.answer_now(post("/embed", {"inputs": "hello"}))  # as the head is read
    assert refusal is not None and refusal.status == 503
    assert json.loads(refusal.body)["error_type"] == "Overloaded"
    assert "Retry-After" in dict(refusal.headers)
    queue.full = False
    app.start_draining()
    status, body, headers = await answer(app, post("/embed", {"inputs": "hello"}))
    assert (status, body["error_type"]) == (503, "Unhealthy") and "Retry-After" in headers


class FailingQueue(AnsweringQueue):
    """A model that fails on every input, as `kind` says."""

    kind = FailureKind.INTERNAL

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        failure = ItemFailure(self.kind, "the model failed on this input")
        return [ItemResult(failure, 0.0, len(inputs), 0.001) for _ in inputs]


@pytest.mark.parametrize(
    ("kind", "status", "error_type"),
    [(FailureKind.INTERNAL, 500, "Backend"), (FailureKind.INPUT, 422, "Validation")],
)
async def test_a_models_failure_is_backend_and_an_input_it_rejects_validation(
    kind, status, error_type
):
    served_models = models()
    queue = FailingQueue("emb", "feature-extraction")
    queue.kind = kind
    served_models.get("emb").serving.queue = queue  # type: ignore[attr-defined]
    answered = await answer(App(served_models), post("/embed", {"inputs": "hello"}))
    assert answered[:2] == (
        status,
        {"error": "the model failed on this input", "error_type": error_type},
    )


async def test_the_other_routes_keep_rawserves_types():
    app = App(models())
    with pytest.raises(BadRequest) as refused:  # the protocol renders it, in rawserve's types
        await app.handle(post("/", {"inputs": []}))
    assert refused.value.error_type == "bad_request"
    status, body, _ = await answer(app, post("/v1/embeddings", {"input": [], "model": "emb"}))
    assert status == 400 and body["error"]["code"] == "bad_request"

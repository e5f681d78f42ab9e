"""Selecting one of several served models from a request: `POST /models/<name>` and the
"model" field of the OpenAI routes; `POST /` and requests that name none get the first.

The app runs on fake models whose queues answer at once and say which model computed;
the real server with two real models is in tests/test_multi_model.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.errors import (
    HTTPError,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
)
from rawserve.http.exchange import HttpRequest
from rawserve.serving.face import NO_CONTROL, Control, ItemResult, Reason, Refusal
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState, WorkerStatus
from rawserve.shared.messages import ModelLimits, WorkerReady

KEY = [("authorization", "Bearer secret")]


class AnsweringQueue:
    """A model's queue that computes at once: each output names the model."""

    def __init__(self, name: str, task: str):
        self.name = name
        self.task = task
        self.full = False
        self.max_batch_size = 8
        self.most_admitted: int | None = None  # no bound of its own
        self.calls: list[list[Any]] = []

    def admission(self, deadline: float | None = None) -> Refusal | None:
        return Refusal(Reason.QUEUE_FULL, "the queue is full", 1.0) if self.full else None

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        self.calls.append(list(inputs))
        if self.task == "feature-extraction" and control.embedding_route:
            outputs: list[Any] = [
                {"embedding": np.full(3, len(self.calls), "f4"), "tokens": 2} for _ in inputs
            ]
        elif self.task == "text-generation":
            details = {"finish_reason": "length", "generated_tokens": 1, "prompt_tokens": 1}
            outputs = [[{"generated_text": self.name, "details": details}] for _ in inputs]
        else:
            outputs = [{"label": self.name, "score": 1.0} for _ in inputs]
        return [ItemResult(output, 0.0, len(inputs), 0.001) for output in outputs]


class ReadyWorkers:
    def __init__(self, task: str):
        self.task = task
        self.ready = True
        self.healthy = True
        self.limits = ModelLimits()
        self.loaded = WorkerReady(pid=1, task=task, device="cpu", dtype="float32", load_seconds=0)

    def load_state(self) -> tuple[LoadState, float | None]:
        return LoadState.LOADING, None

    def back_in(self) -> float | None:
        return None

    def status(self) -> list[WorkerStatus]:
        return []

    def open_stream(self, on_token: Any) -> int:
        return 1

    def close_stream(self, stream_id: int) -> None:
        pass


def served(name: str, task: str, aliases: tuple[str, ...] = ()) -> ServedModel:
    service = ModelService(AnsweringQueue(name, task), ReadyWorkers(task))
    return ServedModel(name, service, aliases=aliases)


@pytest.fixture
def app() -> App:
    models = ServedModels(
        [
            served("cls", "text-classification", aliases=("org/sst2",)),
            served("emb", "feature-extraction", aliases=("BAAI/bge-small-en-v1.5",)),
        ]
    )
    return App(models, AppSettings(api_key="secret"))


def post(path: str, document: Any = None, body: bytes = b"", headers=KEY) -> HttpRequest:
    if document is not None:
        body = json.dumps(document).encode()
        headers = [*headers, ("content-type", "application/json")]
    return HttpRequest("POST", path, "", list(headers), body, request_id="test")


def computed_by(app: App, name: str) -> int:
    queue = app.models.get(name).serving.queue
    assert isinstance(queue, AnsweringQueue)
    return len(queue.calls)


async def test_fillings_past_the_answer_limit_are_413_and_never_computed():
    """A fill-mask answer's size is known from the request: each mask's candidates (top_k,
    or the targets) repeat the whole text. Past the limit, 413 before the model runs."""
    model = served("fm", "fill-mask")
    model.serving.loaded.details["mask_token"] = "<mask>"
    app = App(ServedModels([model]), AppSettings(max_answer_bytes=1_000_000))
    text = " ".join(["<mask>"] * 10)  # 69 bytes: 10 x 100 x (69 + 80) bytes at top_k 100
    too_many = {"inputs": [text] * 7, "parameters": {"top_k": 100}}
    with pytest.raises(PayloadTooLarge, match="larger than 1,000,000 bytes"):
        await app.handle(post("/", too_many))
    named = [f"t{i}" for i in range(100)]
    targets = {"inputs": [text] * 7, "parameters": {"targets": named, "top_k": 100}}
    with pytest.raises(PayloadTooLarge):
        await app.handle(post("/", targets))
    assert computed_by(app, "fm") == 0
    # each target is scored once, and top_k of them kept: a target named 100 times, or 100
    # targets at the default top_k, answer few candidates (they were refused as 100)
    for fits in (
        {"inputs": [text] * 6, "parameters": {"top_k": 100}},
        {"inputs": [text] * 7},
        {"inputs": [text] * 7, "parameters": {"targets": ["a"] * 100, "top_k": 100}},
        {"inputs": [text] * 7, "parameters": {"targets": named}},
    ):
        assert (await app.handle(post("/", fits))).status == 200
    assert computed_by(app, "fm") == 4


def test_a_model_answers_to_its_name_and_its_aliases():
    models = ServedModels([served("cls", "x", ("org/sst2",)), served("emb", "y")])
    assert models.get(None) is models.default is models.all[0]
    assert models.get("org/sst2") is models.get("cls")
    assert models.get("emb") is models.all[1]
    assert models.names == ["cls", "org/sst2", "emb"]


@pytest.mark.parametrize("name", ["", "nope", "CLS", "cls ", "org/sst2/", "../cls", "x" * 5000])
def test_an_unknown_name_is_404_listing_the_served_names(name):
    models = ServedModels([served("cls", "x", ("org/sst2",)), served("emb", "y")])
    with pytest.raises(NotFound) as caught:
        models.get(name)
    message = str(caught.value)
    assert "served: cls, org/sst2, emb" in message
    assert len(message) < 300  # a hostile name is not echoed whole


def test_a_folder_served_under_two_aliases_is_named_by_its_alias_and_its_404_says_so():
    """`--model a=./cls --model b=./cls`: both are served; the folder's name, which
    both would answer to, is neither's, and a request naming it is told why."""
    folder = {"model": "/models/cls/"}
    models = ServedModels(
        [
            ServedModel("a", served("a", "x").serving, folder),
            ServedModel("b", served("b", "y").serving, folder),
        ]
    )
    assert models.get("b") is models.all[1]
    with pytest.raises(NotFound) as caught:
        models.get("cls")
    message = str(caught.value)
    assert "'cls' names several served models (a, b)" in message and "alias" in message


def test_a_hub_id_served_under_two_aliases_is_shared_by_its_id_not_its_last_part():
    """A Hub id's last component names no model (org/tinycls answers to org/tinycls):
    a request naming `tinycls` was told it named the models sharing the id."""
    hub = {"model": "org/tinycls", "revision": "0" * 40}
    models = ServedModels(
        [
            ServedModel("x", served("x", "x").serving, hub),
            ServedModel("y", served("y", "y").serving, hub),
        ]
    )
    with pytest.raises(NotFound, match="'org/tinycls' names several served models"):
        models.get("org/tinycls")
    with pytest.raises(NotFound, match="no model named 'tinycls' is served"):
        models.get("tinycls")


def test_two_models_may_not_share_a_name():
    with pytest.raises(ValueError, match="both named 'emb'"):
        ServedModels([served("emb", "x"), served("cls", "y", ("emb",))])


async def test_post_root_serves_the_default_model(app):
    response = await app.handle(post("/", body=b"hello"))  # raw text: pipe("hello")'s shape
    assert json.loads(response.body) == [{"label": "cls", "score": 1.0}]
    assert (computed_by(app, "cls"), computed_by(app, "emb")) == (1, 0)


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/models/cls", "cls"),
        ("/models/org/sst2", "cls"),
        ("/models/emb", "emb"),
        ("/models/BAAI/bge-small-en-v1.5", "emb"),
    ],
)
async def test_post_models_name_serves_that_model(app, path, model):
    response = await app.handle(post(path, {"inputs": "hello"}))
    assert response.status == 200
    assert computed_by(app, model) == 1
    other = "emb" if model == "cls" else "cls"
    assert computed_by(app, other) == 0


@pytest.mark.parametrize("path", ["/models/nope", "/models/", "/models/cls/extra", "/models/%ff"])
async def test_post_models_unknown_is_404_listing_the_served_names(app, path):
    with pytest.raises(NotFound) as caught:
        await app.handle(post(path, {"inputs": "hello"}))
    assert "served: cls, org/sst2, emb, BAAI/bge-small-en-v1.5" in str(caught.value)


async def test_the_served_names_are_not_shown_without_the_key(app):
    with pytest.raises(Unauthorized):
        await app.handle(post("/models/nope", {"inputs": "x"}, headers=[]))
    with pytest.raises(Unauthorized):
        await app.handle(post("/models/emb", {"inputs": "x"}, headers=[]))


async def test_a_model_path_takes_only_post(app):
    request = HttpRequest("GET", "/models/emb", "", KEY, b"", request_id="test")
    with pytest.raises(Exception) as caught:
        await app.handle(request)
    assert getattr(caught.value, "status", None) == 405


def test_a_full_model_is_refused_at_once_and_the_other_is_not(app):
    queue = app.models.get("emb").serving.queue
    assert isinstance(queue, AnsweringQueue)
    queue.full = True
    with pytest.raises(ServiceUnavailable):
        app.answer_now(post("/models/emb", {"inputs": "x"}))
    assert app.answer_now(post("/models/cls", {"inputs": "x"})) is None
    assert app.answer_now(post("/", {"inputs": "x"})) is None


@pytest.mark.parametrize(("name", "model"), [("emb", "emb"), ("BAAI/bge-small-en-v1.5", "emb")])
async def test_the_openai_model_field_selects_the_model(app, name, model):
    response = await app.handle(post("/v1/embeddings", {"input": "hi", "model": name}))
    document = json.loads(response.body)
    assert response.status == 200 and document["model"] == "emb"
    assert computed_by(app, "emb") == 1


async def test_a_route_without_a_model_field_uses_the_first_model_that_fits_it(app):
    # the first model classifies: the embeddings go to the second, the one that embeds
    response = await app.handle(post("/v1/embeddings", {"input": "hi"}))
    assert response.status == 200 and json.loads(response.body)["model"] == "emb"
    embedded = await app.handle(post("/embed", {"inputs": "hi"}))
    assert embedded.status == 200
    assert computed_by(app, "emb") == 2 and computed_by(app, "cls") == 0


async def test_a_restarting_model_keeps_its_task_and_never_takes_another_models_route(app):
    """cls, the first model, restarts: not ready, but what it serves is known. A route it
    does not fit that names no model goes to emb, and a body naming cls there is 404
    saying what cls serves (a retry would not change it), not a 503 to come back."""
    workers = app.models.get("cls").serving.workers
    assert isinstance(workers, ReadyWorkers)
    workers.ready = False
    response = await app.handle(post("/v1/embeddings", {"input": "hi"}))
    assert response.status == 200 and json.loads(response.body)["model"] == "emb"
    named = await app.handle(post("/v1/embeddings", {"input": "hi", "model": "cls"}))
    assert named.status == 404
    assert json.loads(named.body)["error"]["message"] == (
        "this route needs a feature-extraction model of dense vectors; 'cls' serves "
        "text-classification"
    )
    with pytest.raises(ServiceUnavailable):  # its own requests wait for it
        await app.handle(post("/models/cls", {"inputs": "x"}))


async def test_a_model_still_loading_never_takes_the_route_of_one_that_is_ready():
    """gen, listed first, loads for minutes while emb is ready: before a worker has loaded
    gen, the task its folder says (its facts') tells the routes it cannot embed, so an
    /embed that names no model is emb's, not a 503 "loading" for gen."""
    workers = ReadyWorkers("text-generation")
    workers.ready, workers.loaded = False, None  # type: ignore[assignment]
    loading = ModelService(AnsweringQueue("gen", "text-generation"), workers)
    gen = ServedModel("gen", loading, {"task": "text-generation"})
    app = App(ServedModels([gen, served("emb", "feature-extraction")]))
    assert app.answer_now(post("/embed", {"inputs": "hi"}, headers=[])) is None
    embedded = await app.handle(post("/embed", {"inputs": "hi"}, headers=[]))
    assert embedded.status == 200 and computed_by(app, "emb") == 1
    named = await app.handle(post("/embed", {"inputs": "hi", "model": "gen"}, headers=[]))
    assert named.status == 404
    assert json.loads(named.body)["error"] == (
        "this route needs a feature-extraction model; 'gen' serves text-generation"
    )
    generated = await app.handle(post("/generate", {"inputs": "hi"}, headers=[]))
    assert generated.status == 503  # its own requests wait for it


async def test_a_named_model_that_does_not_fit_the_route_is_404_naming_the_model_field(app):
    answer = await app.handle(post("/v1/embeddings", {"model": "cls", "input": "hi"}))
    error = json.loads(answer.body)["error"]
    assert answer.status == 404 and error["param"] == "model", error
    assert error["message"] == (
        "this route needs a feature-extraction model of dense vectors; 'cls' serves "
        "text-classification"
    )


async def test_a_chat_that_names_no_model_goes_to_one_with_a_chat_template():
    """A base model listed first has no chat template: a chat or a Response naming no
    model is the chat model's; the base model takes what names it, and completions."""
    base, chat = served("base", "text-generation"), served("chat", "text-generation")
    workers = chat.serving.workers
    assert isinstance(workers, ReadyWorkers)
    workers.loaded = replace(workers.loaded, details={"chat_template": True})
    app = App(ServedModels([base, chat]))
    messages = {"messages": [{"role": "user", "content": "hi"}]}
    for path, document in [("/v1/chat/completions", messages), ("/v1/responses", {"input": "hi"})]:
        answer = await app.handle(post(path, document, headers=[]))
        assert answer.status == 200, answer.body
        assert computed_by(app, "chat") == 1 and computed_by(app, "base") == 0
        app.models.get("chat").serving.queue.calls.clear()  # type: ignore[attr-defined]
    named = await app.handle(
        post("/v1/chat/completions", {**messages, "model": "base"}, headers=[])
    )
    assert named.status == 400 and "no chat template" in named.body.decode()
    completed = await app.handle(post("/v1/completions", {"prompt": "hi"}, headers=[]))
    assert completed.status == 200 and computed_by(app, "base") == 1


async def test_a_chat_that_names_no_model_waits_for_a_model_that_may_have_a_template():
    """While the second model loads, whether it has a chat template is not known: a chat
    naming no model waits for it (503), not a 400 from the ready one that has none."""
    base = served("base", "text-generation")
    workers = ReadyWorkers("text-generation")
    workers.ready, workers.loaded = False, None  # type: ignore[assignment]
    loading = ServedModel("chat", ModelService(AnsweringQueue("chat", "text-generation"), workers))
    app = App(ServedModels([base, loading]))
    messages = {"messages": [{"role": "user", "content": "hi"}]}
    answer = await app.handle(post("/v1/chat/completions", messages, headers=[]))
    assert answer.status == 503, answer.body
    completed = await app.handle(post("/v1/completions", {"prompt": "hi"}, headers=[]))
    assert completed.status == 200 and computed_by(app, "base") == 1


async def test_a_route_that_no_model_fits_is_404_naming_what_it_needs_and_what_each_serves(app):
    answer = await app.handle(post("/v1/chat/completions", {"messages": []}))
    assert answer.status == 404
    assert json.loads(answer.body)["error"]["message"] == (
        "this route needs a text-generation model; no served model fits "
        "('cls' serves text-classification, 'emb' serves feature-extraction)"
    )


@pytest.mark.parametrize(
    ("path", "document", "needs"),
    [
        ("/v1/chat/completions", {"messages": []}, "a text-generation model"),
        ("/generate", {"inputs": "hi"}, "a text-generation model"),
        ("/predict", {"inputs": "hi"}, "a text-classification model"),
    ],
)
async def test_two_models_of_one_task_that_a_route_does_not_fit_are_both_named(
    path, document, needs
):
    models = ServedModels(
        [served("emb", "feature-extraction"), served("emb2", "feature-extraction")]
    )
    try:  # the OpenAI and TGI routes answer in their own error shapes; TEI's raise
        answer = await App(models).handle(post(path, document, headers=[]))
        assert answer.status == 404
        message = answer.body.decode()
    except NotFound as caught:
        message = str(caught)
    assert f"this route needs {needs}; no served model fits (" in message
    assert "'emb' serves feature-extraction, 'emb2' serves feature-extraction" in message


async def test_a_route_no_model_fits_names_every_served_model_however_many():
    """Eight models' list was cut at 300 characters, in a model's name (the cut kept
    for messages that may quote a client's input): it is the server's own words."""
    names = [f"classifier-{n}" for n in range(8)]
    app = App(ServedModels([served(name, "text-classification") for name in names]))
    answer = await app.handle(post("/v1/chat/completions", {"messages": []}, headers=[]))
    message = json.loads(answer.body)["error"]["message"]
    assert answer.status == 404 and len(message) > 300, message
    assert message.endswith("'classifier-7' serves text-classification)"), message


@pytest.mark.parametrize(("model", "status"), [("nope", 404), (7, 400), (["emb"], 400)])
async def test_a_bad_openai_model_field_is_refused(app, model, status):
    answer = await app.handle(post("/v1/embeddings", {"input": "hi", "model": model}))
    assert answer.status == status
    assert computed_by(app, "emb") == 0


async def test_an_unknown_model_is_openais_model_not_found_listing_the_served(app):
    answer = await app.handle(post("/v1/embeddings", {"input": "hi", "model": "gpt-4o"}))
    assert answer.status == 404
    assert json.loads(answer.body) == {
        "error": {
            "message": "no model named 'gpt-4o' is served (served: cls, org/sst2, emb, "
            "BAAI/bge-small-en-v1.5)",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        },
        "error_type": "not_found",
    }


@pytest.mark.parametrize("name", ["tgi", "gpt-4o", "emb", None])
async def test_one_served_model_answers_to_any_name(name):
    app = App(ServedModels([served("emb", "feature-extraction")]))
    document = {"input": "hi"} if name is None else {"input": "hi", "model": name}
    response = await app.handle(post("/v1/embeddings", document))
    assert response.status == 200
    assert json.loads(response.body)["model"] == "emb"  # the answer names the served model
    embedded = await app.handle(post("/embed", {"inputs": "hi", "model": name or "x"}))
    assert embedded.status == 200


@pytest.mark.parametrize(("name", "model"), [("gen", "gen"), ("gen2", "gen2"), (None, "gen")])
async def test_tgis_generate_takes_the_model_field_as_the_other_routes_do(name, model):
    """Of several generation models, TGI's routes serve the one the body names (the first
    without a name), and the documented body says so."""
    models = ServedModels([served("gen", "text-generation"), served("gen2", "text-generation")])
    app = App(models)
    document = {"inputs": "hi", **({"model": name} if name else {})}
    answer = await app.handle(post("/generate", document, headers=[]))
    assert answer.status == 200 and json.loads(answer.body)["generated_text"] == model
    assert [computed_by(app, each) for each in ("gen", "gen2")] == [
        int(model == "gen"),
        int(model == "gen2"),
    ]
    not_served = await app.handle(post("/generate", {"inputs": "hi", "model": "nope"}, headers=[]))
    assert not_served.status == 404 and "served: gen, gen2" in not_served.body.decode()
    paths = json.loads((await app.handle(get("/openapi.json", headers=[]))).body)["paths"]
    body = paths["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "string" in body["properties"]["model"]["type"]


async def test_one_served_model_still_refuses_a_model_field_that_is_not_a_name():
    app = App(ServedModels([served("emb", "feature-extraction")]))
    answer = await app.handle(post("/v1/embeddings", {"input": "hi", "model": 7}))
    assert answer.status == 400


async def test_v1_models_lists_every_served_model(app):
    request = HttpRequest("GET", "/v1/models", "", KEY, b"", request_id="test")
    listed = json.loads((await app.handle(request)).body)["data"]
    assert [entry["id"] for entry in listed] == ["cls", "emb"]


def get(path: str, headers=KEY) -> HttpRequest:
    return HttpRequest("GET", path, "", headers, b"", request_id="test")


# (the openai SDK sends a Hub id's "/" as %2F: the protocol decodes it, test_protocol.py)
@pytest.mark.parametrize("name", ["emb", "BAAI/bge-small-en-v1.5"])
async def test_v1_models_gives_a_served_model_by_any_of_its_names_as_listed(app, name):
    listed = json.loads((await app.handle(get("/v1/models"))).body)["data"]
    answer = await app.handle(get("/v1/models/" + name))
    assert answer.status == 200
    assert json.loads(answer.body) == listed[1]


@pytest.mark.parametrize("name", ["gpt-4o", "org/other", "BAAI", ""])
async def test_v1_models_of_a_name_not_served_is_openais_model_not_found(app, name):
    answer = await app.handle(get("/v1/models/" + name))
    assert answer.status == 404
    error = json.loads(answer.body)["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model"), error
    assert "served: cls, org/sst2, emb" in error["message"]
    assert (await app.handle(get("/v1/models/emb", headers=[]))).status == 401


async def test_openapi_lists_the_routes_each_served_model_fits_described_for_it(app):
    """The first model classifies, the second embeds: the embedding routes, which a body
    that names no model takes to the second, are served and so documented, for it."""
    paths = json.loads((await app.handle(get("/openapi.json"))).body)["paths"]
    for path in ("/v1/embeddings", "/embed", "/embed_all", "/similarity", "/predict"):
        assert "post" in paths[path], path
    assert {"/v1/chat/completions", "/v1/completions", "/generate", "/rerank"}.isdisjoint(paths)
    for path in (path for path in paths if "post" in paths[path]):  # each one is served
        try:
            status = (await app.handle(post(path, {}))).status
        except HTTPError as refused:  # the body {} is refused, by the route
            status = refused.status
        assert status not in (404, 405), path
    embedded = paths["/embed"]["post"]["responses"]["200"]["content"]["application/json"]
    assert embedded["schema"]["type"] == "array"


@pytest.mark.parametrize("name", ["gen", "gen2"])
@pytest.mark.parametrize(
    ("route", "document"),
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_a_models_own_path_serves_its_openai_generation_routes(name, route, document):
    """InferenceClient appends the OpenAI route to a model's URL (`/models/<name>`, the
    Inference API's), with that URL as the body's "model": the path names the model."""
    models = ServedModels([served("gen", "text-generation"), served("gen2", "text-generation")])
    for model in models.all:
        model.serving.loaded.details["chat_template"] = "{{ messages[0].content }}"
    app = App(models)
    document = {**document, "model": f"http://127.0.0.1:8000/models/{name}"}
    answer = await app.handle(post(f"/models/{name}{route}", document, headers=[]))
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["model"] == name
    assert [computed_by(app, each) for each in ("gen", "gen2")] == [
        int(name == "gen"),
        int(name == "gen2"),
    ]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/models/nope/v1/chat/completions", "no model named 'nope' is served"),
        ("/models/emb/v1/completions", "this route needs a text-generation model"),
    ],
)
async def test_a_models_own_openai_route_refuses_in_openais_shape(path, message):
    models = ServedModels([served("gen", "text-generation"), served("emb", "feature-extraction")])
    answer = await App(models).handle(post(path, {"prompt": "hi"}, headers=[]))
    assert answer.status == 404
    assert json.loads(answer.body)["error"]["message"].startswith(message)


@pytest.mark.parametrize("route", ["/v1/models", "/v1/embeddings", "/v1/nothing", "/v1"])
async def test_a_models_own_base_url_answers_another_route_in_openais_shape(route):
    """An SDK given `/models/gen/v1` as its base URL and asked for a route that base URL
    does not serve (`models.list()`) is told so in OpenAI's object, which is all it reads:
    it was TGI's shape, naming a model `gen/v1/models` that nobody asked for."""
    models = ServedModels([served("gen", "text-generation"), served("emb", "feature-extraction")])
    app = App(models)
    for method in ("GET", "POST"):
        request = HttpRequest(method, f"/models/gen{route}", "", [], b"{}", request_id="t")
        refused = app.answer_now(request)
        assert refused is not None and refused.status == 404
        error = json.loads(refused.body)["error"]
        assert error["type"] == "not_found_error"
        assert error["message"].startswith(f"no route for /models/gen{route}"), error
        assert "serves chat/completions, completions, responses" in error["message"]
    # a model not served keeps its own 404, naming the served ones (rawserve's shape)
    with pytest.raises(ModelNotFound, match="no model named 'nope/v1/models'"):
        app.answer_now(HttpRequest("GET", "/models/nope/v1/models", "", [], b"", request_id="t"))


async def test_a_models_own_openai_route_is_refused_from_the_head_when_it_cannot_generate():
    """/models/emb/v1/chat/completions is 404 before its body is asked for (an `Expect:
    100-continue` gets no 100), and whatever the body, as /v1/chat/completions is where no
    model generates: a body that is not JSON was a 400 of the path's, not the route's 404."""
    models = ServedModels([served("gen", "text-generation"), served("emb", "feature-extraction")])
    app = App(models)
    refused = app.answer_now(post("/models/emb/v1/chat/completions", headers=[]))
    assert refused is not None and refused.status == 404
    message = json.loads(refused.body)["error"]["message"]
    assert message.startswith("this route needs a text-generation model"), message
    assert app.answer_now(post("/models/gen/v1/chat/completions", headers=[])) is None
    answer = await app.handle(post("/models/emb/v1/completions", body=b"hi", headers=[]))
    assert answer.status == 404, answer.body


async def test_health_of_several_models_says_which_one_keeps_failing(app):
    """/health turns 503 for the whole process when one model's restarts keep failing
    (an orchestrator replaces it); the body names the model, as /ready's does."""
    answer = await app.handle(get("/health", headers=[]))
    assert answer.status == 200
    assert json.loads(answer.body)["models"] == {"cls": "ok", "emb": "ok"}
    app.models.get("emb").serving.workers.healthy = False
    answer = await app.handle(get("/health", headers=[]))
    assert answer.status == 503
    assert json.loads(answer.body) == {
        "status": "unhealthy",
        "models": {"cls": "ok", "emb": "unhealthy"},
    }


@pytest.mark.parametrize(("labels", "reranks"), [(1, True), (2, False), (0, False)])
async def test_rerank_is_served_by_a_classifier_of_one_label_only(labels, reranks):
    """A cross-encoder scores a pair with its one label; a classifier of two labels (a
    sentiment model) is no reranker, and TEI's /rerank is not served by it."""
    model = served("c", "text-classification")
    model.serving.loaded.details["id2label"] = {str(i): f"L{i}" for i in range(labels)}
    app = App(ServedModels([model]), AppSettings(api_key="secret"))
    paths = json.loads((await app.handle(get("/openapi.json"))).body)["paths"]
    assert ("/rerank" in paths) is reranks


async def test_a_route_no_model_fits_names_the_model_field_only_where_the_body_does():
    """OpenAI's `param` says which field was at fault: "model" only where the body named
    one; a body without it, sent to a route the one served model cannot serve, has none."""
    app = App(ServedModels([served("cls", "text-classification")]))
    unnamed = await app.handle(post("/v1/embeddings", {"input": "hi"}, headers=[]))
    error = json.loads(unnamed.body)["error"]
    assert unnamed.status == 404 and error["param"] is None, error
    named = await app.handle(post("/v1/embeddings", {"input": "hi", "model": "cls"}, headers=[]))
    assert named.status == 404 and json.loads(named.body)["error"]["param"] == "model"


async def test_a_body_naming_a_full_model_is_refused_503_before_it_is_read_or_run():
    """A route whose body names the model refuses a full model's request before the body
    is checked or tokenized: a bad body 503 as a good one, and nothing computed."""
    models = [served("cls", "text-classification"), served("emb", "feature-extraction")]
    app = App(ServedModels(models))
    queue = app.models.get("emb").serving.queue
    assert isinstance(queue, AnsweringQueue)
    queue.full = True
    for body in ({"input": "hi", "model": "emb"}, {"input": 7, "model": "emb"}):
        answer = await app.handle(post("/v1/embeddings", body, headers=[]))
        assert answer.status == 503, answer.body
    assert queue.calls == []


def test_a_folder_served_once_under_an_alias_is_not_said_to_name_several():
    """A 404 says a name "names several served models" only where two share it."""
    one = served("a", "text-classification")
    one = ServedModel(one.name, one.serving, {"model": "/srv/x"})
    models = ServedModels([one, served("b", "feature-extraction")])
    with pytest.raises(ModelNotFound, match="no model named 'x' is served"):
        models.get("x")

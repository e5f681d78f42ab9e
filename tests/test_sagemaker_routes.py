"""SageMaker's routes (`rawserve.api.sagemaker`): the route `/invocations` stands for, by
the model its body names and what the body holds, and the other names TEI serves. The
answers themselves are checked on real servers in test_tei.py and
test_openai_generation.py."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from unittest.mock import ANY

import pytest

from rawserve.api.sagemaker import answered, invocation_path, target
from rawserve.api.served import ServedModels
from rawserve.http.errors import BadRequest, ModelNotFound
from rawserve.http.exchange import HttpRequest, HttpResponse
from tests.test_model_selection import served


def request(path: str, body: bytes = b"", method: str = "POST") -> HttpRequest:
    return HttpRequest(method, path, "", [("content-type", "application/json")], body, "t")


def with_labels(model, labels: dict[int, str]):
    """`model` once loaded with `labels` (a classifier's id2label)."""
    loaded = model.serving.workers.loaded
    model.serving.workers.loaded = replace(loaded, details={**loaded.details, "id2label": labels})
    return model


GENERATION = ServedModels([served("gen", "text-generation")])


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"inputs": "hi"}, "/generate"),
        ({"inputs": "hi", "stream": True}, "/generate_stream"),
        ({"inputs": "hi", "stream": "yes"}, "/generate"),  # (which refuses it)
        ({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"),
        ({"messages": [], "stream": True}, "/v1/chat/completions"),
        ({"prompt": "hi"}, "/v1/completions"),
        ({"inputs": "hi", "messages": []}, "/generate"),  # TGI tries its generate body first
        ({}, "/generate"),
        (None, "/generate"),  # a body that is not JSON: the model's route refuses it
        ([1, 2], "/generate"),
    ],
)
def test_a_generation_model_s_invocations_are_tgis_three_bodies(body, path):
    assert invocation_path(body, GENERATION) == path


@pytest.mark.parametrize(
    ("parameters", "full_text"),
    [
        (None, True),
        ({}, True),
        ({"return_full_text": None}, True),
        ({"return_full_text": False}, False),
    ],
)
def test_a_generation_asked_through_invocations_is_answered_as_tgis_post_slash(
    parameters, full_text
):
    """TGI's SageMaker route is its `POST /`: the prompt and its continuation unless the
    body says otherwise, streamed or not, and an answer whole in a list."""
    for stream, path in ((False, "/generate"), (True, "/generate_stream")):
        document = {"inputs": "hi", "stream": stream}
        if parameters is not None:
            document["parameters"] = parameters
        asked = request("/invocations", json.dumps(document).encode())
        routed = target(asked, GENERATION)
        assert routed.path == path
        assert json.loads(routed.body)["parameters"]["return_full_text"] is full_text
    answer = HttpResponse(200, b'{"generated_text":"hi there"}')
    assert (
        answered(asked, target(asked, GENERATION), answer).body == b'{"generated_text":"hi there"}'
    )
    plain = request("/invocations", b'{"inputs": "hi"}')
    listed = answered(plain, target(plain, GENERATION), answer)
    assert json.loads(listed.body) == [{"generated_text": "hi there"}]
    refused = HttpResponse(422, b'{"error":"no","error_type":"validation"}')
    assert answered(plain, target(plain, GENERATION), refused) is refused
    odd = request("/invocations", b'{"inputs": "hi", "parameters": [1]}')  # (the route refuses)
    assert target(odd, GENERATION).body == odd.body


def test_an_encoder_s_invocations_are_tei_s_route_for_it():
    embedder = ServedModels([served("emb", "feature-extraction")])
    assert invocation_path({"inputs": "hi"}, embedder) == "/embed"
    splade = replace(served("splade", "feature-extraction"), facts={"pooling": "splade"})
    assert invocation_path({"inputs": "hi"}, ServedModels([splade])) == "/embed_sparse"
    similarity = {"inputs": {"source_sentence": "a", "sentences": ["b"]}}  # (HF_TASK's)
    assert invocation_path(similarity, embedder) == "/similarity"
    classifier = ServedModels([with_labels(served("cls", "text-classification"), {0: "a", 1: "b"})])
    assert invocation_path({"inputs": "hi"}, classifier) == "/predict"
    assert invocation_path({"query": "q", "texts": ["a"]}, classifier) == "/predict"
    reranker = ServedModels([with_labels(served("rr", "text-classification"), {0: "LABEL_0"})])
    assert invocation_path({"query": "q", "texts": ["a"]}, reranker) == "/rerank"
    # before its labels are known, the body says whether it asks to rank
    unloaded = ServedModels([served("new", "text-classification")])
    assert invocation_path({"query": "q", "texts": ["a"]}, unloaded) == "/rerank"
    assert invocation_path({"inputs": "hi"}, unloaded) == "/predict"
    other = ServedModels([served("qa", "question-answering")])
    assert invocation_path({"inputs": {"question": "q", "context": "c"}}, other) == "/models/qa"


def test_invocations_goes_to_the_route_of_the_model_its_body_names():
    models = ServedModels([served("emb", "feature-extraction"), served("gen", "text-generation")])
    assert invocation_path({"inputs": "hi"}, models) == "/embed"  # the default: the first
    assert invocation_path({"inputs": "hi", "model": "gen"}, models) == "/generate"
    # a name not served: the default's route, which answers it 404 naming the served ones
    assert invocation_path({"inputs": "hi", "model": "nope"}, models) == "/embed"


def test_openai_bodies_naming_no_model_go_to_openai_s_routes_whatever_the_first_model():
    """Served after a fill-mask model, a chat's body naming no model went to fill-mask's
    route, which refused it 400 "must be an object with an "inputs" field" (a tester):
    OpenAI's routes pick the model that can answer it, as when they are called by name."""
    models = ServedModels([served("fm", "fill-mask"), served("gen", "text-generation")])
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert invocation_path(chat, models) == "/v1/chat/completions"
    assert invocation_path({**chat, "model": None}, models) == "/v1/chat/completions"
    assert invocation_path({"prompt": "hi"}, models) == "/v1/completions"
    assert invocation_path({"inputs": "a [MASK]"}, models) == "/models/fm"  # the first's
    assert invocation_path({"inputs": "hi", "messages": []}, models) == "/models/fm"
    # named, a model that cannot answer it: OpenAI's route says so in OpenAI's words, as
    # it does where none is named (fill-mask's refused it as a body without "inputs")
    assert invocation_path({**chat, "model": "fm"}, models) == "/v1/chat/completions"
    alone = ServedModels([served("fm", "fill-mask")])
    for named in ({}, {"model": "fm"}, {"model": "tgi"}):
        assert invocation_path({**chat, **named}, alone) == "/v1/chat/completions"
        assert invocation_path({"prompt": "hi", **named}, alone) == "/v1/completions"


def test_the_other_names_stand_for_their_routes_and_the_rest_for_themselves():
    models = ServedModels([served("emb", "feature-extraction")])
    ping = target(request("/ping", method="GET"), models)
    assert (ping.path, ping.query) == ("/ready", "full=ok")  # SageMaker's: ready for work
    assert target(request("/embeddings", b"{}"), models).path == "/v1/embeddings"
    body = json.dumps({"inputs": "hi"}).encode()
    moved = target(request("/invocations", body), models)
    assert (moved.path, moved.body, moved.request_id) == ("/embed", body, "t")
    # the head alone: not yet the route of a model (the body names it)
    head = request("/invocations")
    assert target(head, models, body_read=False) is head
    assert target(request("/v1/embeddings", b"{}"), models).path == "/v1/embeddings"


def test_another_task_s_invocations_go_to_its_model_s_own_path_without_the_name():
    """POST /models/<name> takes no "model" field: it is left out of the body."""
    models = ServedModels([served("emb", "feature-extraction"), served("s2s", "summarization")])
    body = json.dumps({"inputs": "a long text", "model": "s2s"}).encode()
    moved = target(request("/invocations", body), models)
    assert moved.path == "/models/s2s" and json.loads(moved.body) == {"inputs": "a long text"}


@pytest.mark.parametrize(
    ("name", "error", "says"),
    [
        ("nope", ModelNotFound, "no model named 'nope' is served (served: s2s, emb)"),
        (5, BadRequest, '"model" must be a string'),
    ],
)
def test_invocations_naming_no_served_model_is_refused_where_its_route_reads_no_name(
    name, error, says
):
    """The first model a summarizer (its route, /models/<name>, reads no "model"): a body
    naming a model not served, or a number, was served by it, 200. One served model
    answers to any name, as on every route."""
    models = ServedModels([served("s2s", "summarization"), served("emb", "feature-extraction")])
    body = json.dumps({"inputs": "a long text", "model": name}).encode()
    with pytest.raises(error, match=re.escape(says)):
        target(request("/invocations", body), models)
    alone = ServedModels([served("s2s", "summarization")])
    if isinstance(name, str):
        assert target(request("/invocations", body), alone).path == "/models/s2s"


def test_before_a_worker_loads_invocations_go_by_the_task_it_was_started_with():
    model = served("emb", "feature-extraction")
    model.serving.workers.loaded = None
    starting = ServedModels([replace(model, facts={"task": "feature-extraction"})])
    assert invocation_path({"inputs": "hi"}, starting) == "/embed"


async def test_from_the_head_only_the_method_and_the_key_are_checked():
    """Which model an /invocations asks for is in its body: a busy default model must not
    refuse a request for another (a tester's: 20 of 20 were 503 while the other was idle)."""
    from rawserve.api.app import App
    from rawserve.api.settings import AppSettings
    from rawserve.http.errors import MethodNotAllowed, Unauthorized

    app = App(ServedModels([served("emb", "feature-extraction")]), AppSettings(api_key="k"))
    keyed = [("authorization", "Bearer k")]
    head = HttpRequest("POST", "/invocations", "", keyed, b"", "t")
    assert app.answer_now(head) is None  # nothing refused before the body
    with pytest.raises(Unauthorized):
        app.answer_now(HttpRequest("POST", "/invocations", "", [], b"", "t"))
    with pytest.raises(MethodNotAllowed):
        app.answer_now(HttpRequest("GET", "/invocations", "", keyed, b"", "t"))


async def test_ping_is_503_while_the_model_cannot_take_work():
    from rawserve.api.app import App

    model = served("emb", "feature-extraction")
    app = App(ServedModels([model]))
    ping = HttpRequest("GET", "/ping", "", [], b"", "t")
    assert app.answer_now(ping).status == 200
    model.serving.workers.ready = False
    assert app.answer_now(ping).status == 503


@pytest.mark.parametrize(
    ("task", "invoked"),
    [("feature-extraction", "/embed"), ("text-generation", "/generate"), ("fill-mask", "/")],
)
async def test_openapi_documents_the_names_sagemaker_calls_as_the_routes_they_stand_for(
    task, invoked
):
    """/ping, /invocations and /embeddings answer, and /openapi.json (which says it lists
    the routes the server serves) left them out."""
    from rawserve.api.app import App

    app = App(ServedModels([served("m", task)]))
    openapi = await app.handle(HttpRequest("GET", "/openapi.json", "", [], b"", "t"))
    paths = json.loads(openapi.body)["paths"]
    assert paths["/ping"]["get"]["responses"] == paths["/ready"]["get"]["responses"]
    invocations = paths["/invocations"]["post"]
    path = invoked if invoked != "/" else "/models/m"
    stands_for = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = invocations["requestBody"]["content"]["application/json"]["schema"]
    if path == "/models/m":  # (the body's "model" is read before that route takes it)
        stands_for = {**stands_for, "properties": {**stands_for["properties"], "model": ANY}}
    assert stands_for in body.get("anyOf", [body])
    assert f"POST {path}" in invocations["summary"]
    # every media type the route takes (a fill-mask model's text/plain too)
    taken = set(paths[path]["post"]["requestBody"]["content"])
    assert taken <= set(invocations["requestBody"]["content"])
    assert ("/embeddings" in paths) == (task == "feature-extraction")
    ids = [op["operationId"] for methods in paths.values() for op in methods.values()]
    assert len(ids) == len(set(ids))  # OpenAPI's rule: each its own


async def test_openapi_documents_invocations_as_every_route_it_may_stand_for():
    """A review found /invocations described as the default model's /generate alone,
    though a body naming another model goes to that one's route, and one with
    `messages` to OpenAI's chat: each answered 200 in a shape the document refused."""
    from rawserve.api.app import App

    models = [served("gen", "text-generation"), served("emb", "feature-extraction")]
    app = App(ServedModels(models))
    openapi = await app.handle(HttpRequest("GET", "/openapi.json", "", [], b"", "t"))
    paths = json.loads(openapi.body)["paths"]
    invocations = paths["/invocations"]["post"]
    bodies = invocations["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    routes = ["/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions"]
    for path in [*routes, "/embed", "/similarity"]:
        assert f"POST {path}" in invocations["summary"], path
        assert paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"] in (
            bodies
        )
    answers = invocations["responses"]["200"]["content"]
    whole = answers["application/json"]["schema"]["anyOf"]
    generated = paths["/generate"]["post"]["responses"]["200"]["content"]["application/json"]
    assert {"type": "array", "items": generated["schema"]} in whole  # (in a list, as TGI's)
    embedded = paths["/embed"]["post"]["responses"]["200"]["content"]["application/json"]
    assert embedded["schema"] in whole and "text/event-stream" in answers

"""SageMaker's routes (`rawserve.api.sagemaker`): the route `/invocations` stands for, by
the model its body names and what the body holds, and the other names TEI serves. The
answers themselves are checked on real servers in test_tei.py and
test_openai_generation.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rawserve.api.sagemaker import invocation_path, target
from rawserve.api.served import ServedModels
from rawserve.http.exchange import HttpRequest
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


def test_an_encoder_s_invocations_are_tei_s_route_for_it():
    embedder = ServedModels([served("emb", "feature-extraction")])
    assert invocation_path({"inputs": "hi"}, embedder) == "/embed"
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
    assert invocation_path({"inputs": {"question": "q", "context": "c"}}, other) == "/"


def test_invocations_goes_to_the_route_of_the_model_its_body_names():
    models = ServedModels([served("emb", "feature-extraction"), served("gen", "text-generation")])
    assert invocation_path({"inputs": "hi"}, models) == "/embed"  # the default: the first
    assert invocation_path({"inputs": "hi", "model": "gen"}, models) == "/generate"
    # a name not served: the default's route, which answers it 404 naming the served ones
    assert invocation_path({"inputs": "hi", "model": "nope"}, models) == "/embed"


def test_the_other_names_stand_for_their_routes_and_the_rest_for_themselves():
    models = ServedModels([served("emb", "feature-extraction")])
    assert target(request("/ping", method="GET"), models).path == "/health"
    assert target(request("/embeddings", b"{}"), models).path == "/v1/embeddings"
    body = json.dumps({"inputs": "hi"}).encode()
    moved = target(request("/invocations", body), models)
    assert (moved.path, moved.body, moved.request_id) == ("/embed", body, "t")
    # the head alone (the body not read yet): the route the model says
    assert target(request("/invocations"), models).path == "/embed"
    assert target(request("/v1/embeddings", b"{}"), models).path == "/v1/embeddings"

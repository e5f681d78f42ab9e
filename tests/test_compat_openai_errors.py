"""OpenAI's error object on the `/v1/` routes, whatever refuses the request (the API key,
the router, the body, the gate), while every other route keeps rawserve's shape.

The app runs on fake models (tests/test_model_selection.py); the openai SDK showing these
messages against the real server is in tests/test_compat_clients.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import openai
import pytest

from rawserve.api.app import App
from rawserve.api.outcomes import http_error
from rawserve.api.served import ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.errors import (
    InternalError,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
    UnprocessableInput,
    openai_error_document,
    openai_error_response,
)
from rawserve.http.exchange import HttpRequest, HttpResponse
from rawserve.http.limits import ProtocolSettings
from rawserve.protocol import HttpProtocol
from rawserve.serving.face import Reason, Refusal
from tests.fake_transport import FakeTransport, read_responses
from tests.test_model_selection import KEY, ReadyWorkers, served

KEY_FIELD = b"".join(f"{name}: {value}\r\n".encode() for name, value in KEY)


def app(**settings: Any) -> App:
    models = ServedModels([served("emb", "feature-extraction")])
    return App(models, AppSettings(api_key="secret", max_client_batch_size=2, **settings))


def request(method: str, path: str, document: Any = None, headers=KEY) -> HttpRequest:
    body = json.dumps(document).encode() if document is not None else b""
    return HttpRequest(
        method, path, "", [*headers, ("content-type", "application/json")], body, request_id="t"
    )


def openai_error(response: HttpResponse | None, status: int) -> dict[str, Any]:
    assert response is not None and response.status == status
    document = json.loads(response.body)
    assert set(document) == {"error", "error_type"}  # (TGI's type, for TGI's clients)
    assert set(document["error"]) == {"message", "type", "param", "code"}
    return document["error"]


INVALID = "invalid_request_error"
MISSING = "not_found_error"


@pytest.mark.parametrize(
    ("method", "path", "document", "headers", "status", "kind", "says"),
    [
        ("GET", "/v1/models", None, [], 401, "authentication_error", "Bearer"),
        ("POST", "/v1/nothing", {}, KEY, 404, MISSING, "no route"),
        ("GET", "/v1/embeddings", None, KEY, 405, INVALID, "not allowed"),
        ("POST", "/v1/embeddings", {"input": ["a", "b", "c"]}, KEY, 413, INVALID, "at most 2"),
        ("POST", "/v1/embeddings", {"inputs": "a"}, KEY, 400, INVALID, "unknown field"),
        ("POST", "/v1/chat/completions", {"messages": []}, KEY, 404, MISSING, "text-generation"),
    ],
)  # fmt: skip
async def test_v1_refusals_are_openais_error_object(
    method, path, document, headers, status, kind, says
):
    response = await app().handle(request(method, path, document, headers))
    error = openai_error(response, status)
    assert error["type"] == kind and says in error["message"], error
    if status == 405:
        assert ("Allow", "POST") in response.headers


@pytest.mark.parametrize(
    ("document", "param"),
    [
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 5}, "input"),
        ({"input": "a", "model": 7}, "model"),  # (read before the body's other fields)
        ({"input": "a", "extra": 1}, None),  # an unknown field: OpenAI names none either
    ],
    ids=repr,
)
async def test_a_refused_field_is_named_as_openais_param(document, param):
    error = openai_error(await app().handle(request("POST", "/v1/embeddings", document)), 400)
    assert error["param"] == param, error


def test_v1_refusals_from_the_head_are_openais_error_object_too():
    server = app()
    workers = server.models.default.serving.workers
    assert isinstance(workers, ReadyWorkers)
    workers.ready = False
    answer = server.answer_now(request("POST", "/v1/embeddings", {"input": "a"}))
    error = openai_error(answer, 503)
    assert error == {
        "message": "the model is loading",
        "type": "server_error",
        "param": None,
        "code": "unavailable",
    }
    assert answer is not None and dict(answer.headers)["Retry-After"]
    with pytest.raises(Unauthorized):  # other routes: raised for the protocol to render
        server.answer_now(request("POST", "/", {"inputs": "a"}, headers=[]))


@pytest.mark.parametrize(
    ("fields", "body", "status"),
    [
        (b"Content-Length: 2000000\r\n", b"", 413),  # over --max-body-bytes, from the head
        (b"Content-Encoding: br\r\nContent-Length: 2\r\n", b"{}", 415),  # a coding not read
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"", 400),  # two framings
    ],
    ids=["body over the limit", "coding not read", "two framings"],
)
async def test_the_protocols_own_refusals_on_v1_are_openais_error_object(fields, body, status):
    """Refused before any route ran, they came in rawserve's shape on /v1/ too, which the
    openai SDK does not read as an error object (a security reviewer's finding); other
    routes keep rawserve's, TGI's too (its rules would make a framing's 400 a 422)."""
    loop = asyncio.get_running_loop()
    for path, shape in (
        (b"/v1/embeddings", "openai"),
        (b"/embeddings", "openai"),  # (TEI's name for it: one shape a route)
        (b"/", "rawserve"),
        (b"/generate", "rawserve"),
    ):
        protocol = HttpProtocol(app(), ProtocolSettings(max_body_bytes=2**20), loop=loop)
        transport = FakeTransport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        head = b"POST " + path + b" HTTP/1.1\r\nHost: a\r\n" + KEY_FIELD + fields + b"\r\n"
        protocol.data_received(head + body)
        for _ in range(5):
            await asyncio.sleep(0)
        [(response, answer)] = read_responses(transport.written, [head + body])
        # (/generate with no generation model served: the route's own 404 may come first)
        assert response.status_code in ((status, 404) if path == b"/generate" else (status,))
        document = json.loads(answer)
        if shape == "openai":
            assert set(document["error"]) == {"message", "type", "param", "code"}
        else:
            assert set(document) == {"error", "error_type"}


async def test_other_routes_keep_rawserves_shape():
    with pytest.raises(NotFound):
        await app().handle(request("POST", "/nothing", {}))
    # rendered by the app where a browser page must read it (CORS): rawserve's shape
    answer = await app(cors_allow_origins=("*",)).handle(request("POST", "/nothing", {}))
    assert answer.status == 404 and json.loads(answer.body) == {
        "error": "no route for /nothing",
        "error_type": "not_found",
    }


async def test_an_unexpected_failure_on_v1_is_a_bare_500_in_openais_shape(caplog):
    server = app()

    async def broken(request: HttpRequest) -> HttpResponse:
        raise RuntimeError("/secret/path")

    server.routes["/v1/models"]["GET"] = broken
    with caplog.at_level("ERROR", logger="rawserve.errors"):
        error = openai_error(await server.handle(request("GET", "/v1/models")), 500)
    assert error["message"] == "internal server error" and error["type"] == "server_error"
    # the traceback's line names the request, as the access line and the client do
    [record] = caplog.records
    assert record.getMessage().endswith("request t") and record.exc_info is not None


@pytest.mark.parametrize(
    ("error", "tgi_type"),
    [
        (UnprocessableInput("a prompt too long"), "validation"),
        (http_error(Refusal(Reason.QUEUE_FULL, "server busy: queue full", 1.0)), "overloaded"),
        (Unauthorized("no key"), "unauthorized"),
        (InternalError("boom"), "generation"),  # TGI's clients raise GenerationError
    ],
)
def test_openais_error_object_carries_tgis_type_beside_it(error, tgi_type):
    """TGI's client and InferenceClient post to /v1/chat/completions too, and tell errors
    apart by the `error_type` beside `error` alone: without it, TGI's client raised
    `UnknownError` where its `generate` raised `ValidationError` for the same prompt."""
    document = openai_error_document(error)
    assert document["error_type"] == tgi_type
    assert document["error"]["message"] == error.message


def test_openai_error_document_keeps_messages_short_and_statuses_typed():
    long = openai_error_document(ServiceUnavailable("x" * 1000))["error"]
    assert long["message"] is not None and len(long["message"]) == 300
    assert openai_error_document(InternalError("boom"))["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("refusal", "attempts"),
    [
        # a passed deadline spans the retries (as gRPC's does): a retry only runs the model
        # again to the same 504, and keeps the caller three deadlines and two back-offs
        (Refusal(Reason.DEADLINE_PASSED, "the request's deadline passed"), 1),
        # a busy queue: retried, after the milliseconds the answer asks for
        (Refusal(Reason.QUEUE_FULL, "server busy: queue full", 0.01), 3),
    ],
)
def test_the_openai_sdk_retries_a_busy_queue_but_not_a_passed_deadline(refusal, attempts):
    answer = openai_error_response(http_error(refusal))
    sent = []

    def reply(request: httpx2.Request) -> httpx2.Response:
        sent.append(request.headers["x-stainless-retry-count"])
        return httpx2.Response(answer.status, headers=answer.headers, content=answer.body)

    transport = httpx2.Client(transport=httpx2.MockTransport(reply))
    client = openai.OpenAI(base_url="http://rawserve/v1", api_key="k", http_client=transport)
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model="m", prompt="a")
    assert raised.value.status_code == answer.status and len(sent) == attempts

"""Input a careless or hostile client sends: always a clear 4xx, never a 500.

Real servers on tiny random models (built locally), real sockets. Also the requests that
can never be admitted (413, not a 503 that invites retries) and the raw-text answer
shape the contract promises.
"""

from __future__ import annotations

import json

import pytest

from tests.server import RunningServer

pytestmark = pytest.mark.slow

SURROGATE_BODY = b'{"inputs": "a\\ud800b"}'  # a lone surrogate, as JSON escapes allow


def nested(depth: int) -> bytes:
    return b'{"inputs": ' + b"[" * depth + b'"x"' + b"]" * depth + b"}"


@pytest.fixture(scope="module")
def classifier(tiny_model):
    with RunningServer(["--model", tiny_model("text-classification"), "--threads", "1"]) as server:
        yield server


@pytest.fixture(scope="module")
def generator(tiny_model):
    with RunningServer(["--model", tiny_model("text-generation"), "--threads", "1"]) as server:
        yield server


@pytest.fixture(scope="module")
def summarizer(tiny_model):
    args = ["--model", tiny_model("seq2seq"), "--task", "summarization", "--threads", "1"]
    with RunningServer(args) as server:
        yield server


def post(server: RunningServer, body: bytes) -> tuple[int, dict]:
    status, _, answer = server.request("POST", "/", body, {"Content-Type": "application/json"})
    return status, json.loads(answer)


def assert_clear_client_error(status: int, answer: dict, expected: int) -> None:
    assert status == expected, answer
    assert set(answer) == {"error", "error_type"}
    assert "Traceback" not in answer["error"] and "/" not in answer["error"]


# --- 5. input that used to reach a 500 --------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 5_000, 100_000])
def test_deeply_nested_json_is_a_400(classifier, depth):
    status, answer = post(classifier, nested(depth))
    assert_clear_client_error(status, answer, 400)


def test_a_number_too_long_to_read_is_a_400(classifier):
    # Python reads at most 4,300 digits of a whole number, and says so with a ValueError
    status, answer = post(
        classifier, b'{"inputs": "x", "parameters": {"top_k": ' + b"1" * 4301 + b"}}"
    )
    assert_clear_client_error(status, answer, 400)
    assert "a number too long" in answer["error"]


def test_a_lone_surrogate_is_refused_at_parse(classifier):
    status, answer = post(classifier, SURROGATE_BODY)
    assert_clear_client_error(status, answer, 400)
    assert "surrogate" in answer["error"]


def test_a_lone_surrogate_in_a_list_is_refused_at_parse(classifier):
    status, answer = post(classifier, b'{"inputs": ["fine", "a\\udc00"]}')
    assert_clear_client_error(status, answer, 400)


@pytest.mark.parametrize("model", ["classifier", "generator", "summarizer"])
@pytest.mark.parametrize("blank", ["", " \n\t"], ids=["empty", "whitespace"])
def test_blank_text_is_a_422_alone_in_a_list_and_raw(request, model, blank):
    server = request.getfixturevalue(model)
    for inputs in (blank, ["fine", blank]):
        status, answer = post(server, json.dumps({"inputs": inputs}).encode())
        assert_clear_client_error(status, answer, 422)
        assert "empty" in answer["error"]
    status, _, body = server.request("POST", "/", blank.encode(), {"Content-Type": "text/plain"})
    assert status == 422, body


@pytest.mark.parametrize("model", ["generator", "summarizer"])
@pytest.mark.parametrize("temperature", [1e-300, 1e-45])
def test_sampling_that_fails_numerically_is_a_422(request, model, temperature):
    server = request.getfixturevalue(model)
    document = {
        "inputs": "hello world",
        "parameters": {"do_sample": True, "temperature": temperature, "max_new_tokens": 4},
    }
    status, answer = post(server, json.dumps(document).encode())
    if status == 200:
        return  # this torch turned it into a valid distribution: nothing failed
    assert_clear_client_error(status, answer, 422)


@pytest.mark.parametrize(
    ("model", "length", "expected"),
    [
        ("generator", "max_new_tokens", 422),  # TGI's status: TGI's clients post here
        ("summarizer", "max_new_tokens", 400),
        ("summarizer", "max_length", 400),  # transformers 4's name for the summarizer's length
        ("summarizer", "min_length", 400),
    ],
)
def test_a_length_beyond_the_models_positions_is_refused(request, model, length, expected):
    server = request.getfixturevalue(model)
    document = {"inputs": "hello world", "parameters": {length: 1000}}
    status, answer = post(server, json.dumps(document).encode())
    assert_clear_client_error(status, answer, expected)
    assert length in answer["error"]


# --- 6. a request that can never be admitted is 413, not 503 ------------------------


def test_a_list_longer_than_the_queue_is_413_without_retry_after():
    with RunningServer(["--handler", "tests.handlers:echo", "--max-queue", "4"]) as server:
        status, headers, body = server.request(
            "POST", "/", json.dumps({"inputs": list("abcde")}), {"Content-Type": "application/json"}
        )
        assert status == 413, body
        assert "retry-after" not in headers
        assert json.loads(body)["error_type"] == "payload_too_large"
        status, answer = server.post_json({"inputs": list("abcd")})  # the bound itself fits
        assert status == 200 and len(answer) == 4


# --- 11. a raw-text body is answered with the pipeline's output for that string -------


def test_a_raw_text_body_to_a_classifier_is_answered_with_one_list_of_labels(classifier):
    status, _, body = classifier.request(
        "POST", "/", b"hello world", {"Content-Type": "text/plain"}
    )
    answer = json.loads(body)
    assert status == 200
    assert isinstance(answer, list) and answer
    assert all(isinstance(entry, dict) and set(entry) == {"label", "score"} for entry in answer)


def test_a_json_body_keeps_the_inference_api_shape(classifier):
    status, answer = classifier.post_json({"inputs": "hello world"})
    assert status == 200
    assert isinstance(answer, list)

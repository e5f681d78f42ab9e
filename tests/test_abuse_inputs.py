"""Input a careless or hostile client sends: always a clear 4xx, never a 500.

Real servers on tiny random models (built locally), real sockets. Also the requests that
can never be admitted (413, not a 503 that invites retries) and the raw-text answer
shape the contract promises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server import RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow

JSON = {"Content-Type": "application/json"}
SURROGATE_BODY = b'{"inputs": "a\\ud800b"}'  # a lone surrogate, as JSON escapes allow


def nested(depth: int) -> bytes:
    return b'{"inputs": ' + b"[" * depth + b'"x"' + b"]" * depth + b"}"


@pytest.fixture(scope="module")
def servers(request, tiny_model):
    """The module's servers its selected tests use, started together."""
    one = ["--threads", "1"]
    with started_as_used(
        request,
        {
            "classifier": lambda: RunningServer(
                ["--model", tiny_model("text-classification"), *one]
            ),
            "generator": lambda: RunningServer(["--model", tiny_model("text-generation"), *one]),
            "summarizer": lambda: RunningServer(
                ["--model", tiny_model("seq2seq"), "--task", "summarization", *one]
            ),
            "tagger": lambda: RunningServer(["--model", tiny_model("token-classification"), *one]),
            "reader": lambda: RunningServer(["--model", tiny_model("question-answering"), *one]),
            "chooser": lambda: RunningServer(
                [
                    "--model",
                    tiny_model("zero-shot-classification"),
                    "--task",
                    "zero-shot-classification",
                    *one,
                ]
            ),
            "small_queue": lambda: RunningServer(
                ["--handler", "tests.handlers:echo", "--max-queue", "4"]
            ),
        },
    ) as server:
        yield server


classifier = module_server("classifier")
generator = module_server("generator")
summarizer = module_server("summarizer")
small_queue = module_server("small_queue")
tagger = module_server("tagger")
reader = module_server("reader")
chooser = module_server("chooser")


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


def test_a_long_word_is_answered_once_the_speed_is_measured(classifier):
    # 200,000 letters without a space: one unknown token to the model, but 50,000 tokens
    # to an estimate by characters, whose measured speed then predicted it could not end
    # before its deadline: it sat queued until a 504
    for _ in range(6):  # short calls: the cost model trusts its measurements
        assert classifier.post_json({"inputs": "hello world"})[0] == 200
    body = json.dumps({"inputs": "a" * 200_000})
    headers = {"Content-Type": "application/json", "X-Request-Timeout": "20"}
    status, _, answer = classifier.request("POST", "/", body, headers)
    assert status == 200, answer


def batches_run(server: RunningServer) -> float:
    """How many batches the server's workers have run (the batch-size histogram's count)."""
    _, _, body = server.request("GET", "/metrics")
    counts = re.findall(r"^rawserve_batch_size_count\{[^}]*\} (\S+)$", body.decode(), re.M)
    return sum(float(count) for count in counts)


def test_texts_longer_than_a_classifier_reads_are_refused_before_they_are_queued(classifier):
    """A task that never cuts its inputs refuses one longer than the model reads. The
    worker found that out by tokenizing each text whole, again at each step of the
    bisection: 32 texts of 32 KB cost it 3 to 4.6 s for their 422, and clients sending
    them starved the others (a short request's median 12 s). Counted in the server a
    piece at a time, they are refused before they reach a worker."""
    assert classifier.post_json({"inputs": "warm"})[0] == 200  # (its positions known)
    before = batches_run(classifier)
    long_pair = {"text": "x", "text_pair": "word " * 6000}  # its second text as long
    cases = [
        ("word " * 6000, ""),
        (["word " * 6000] * 32, "the input at index 0: "),
        (["fine", "word " * 200], "the input at index 1: "),  # (which, as the worker says)
        ([long_pair] * 32, "the input at index 0: "),
    ]
    for inputs, which in cases:
        status, answer = post(classifier, json.dumps({"inputs": inputs}).encode())
        assert_clear_client_error(status, answer, 422)
        assert answer["error"] == (
            f"{which}the input is more than 128 tokens and this model reads at most 128"
        )
    # TEI's /predict too, where `truncate: false` asks for it, in its words
    body = json.dumps({"inputs": [["x", "word " * 200]], "truncate": False})
    status, _, answer = classifier.request("POST", "/predict", body, JSON)
    assert status == 422 and json.loads(answer)["error"] == (
        "the input is more than 128 tokens and the model takes at most 128: send truncate: "
        "true to cut it"
    )
    assert batches_run(classifier) == before  # no worker saw them
    assert classifier.post_json({"inputs": "word " * 100})[0] == 200  # within 128 tokens


def test_a_dense_stride_on_a_long_text_is_refused_before_it_is_queued(tagger):
    """A 100 KB text at stride 125 of 128 positions is 20,000 windows: the worker's
    tokenizer made them all at once (1.5 GB, and the worker busy past the 504 until the
    batch timeout). Counted in the server a piece at a time, it is refused at once, in
    words that name the bound and what to change; a normal stride is still answered."""
    assert tagger.post_json({"inputs": "warm"})[0] == 200  # (its positions known)
    before = batches_run(tagger)
    params = {"aggregation_strategy": "simple", "stride": 125}
    body = {"inputs": ["fine", "word " * 20_000], "parameters": params}
    status, answer = post(tagger, json.dumps(body).encode())
    assert_clear_client_error(status, answer, 422)
    assert answer["error"] == (
        "the text's windows of 128 tokens at stride 125 would hold more than 524,288 "
        "tokens, the most a request's windows may hold (4,096 windows of 128): send a "
        "smaller stride or a shorter text"
    )
    assert batches_run(tagger) == before  # no worker saw it
    # 6,000 tokens at stride 110: counted (its characters alone could make too many
    # windows), 375 windows, answered
    body = {"inputs": "word " * 6_000, "parameters": {**params, "stride": 110}}
    status, answer = post(tagger, json.dumps(body).encode())
    assert status == 200, answer


def test_a_dense_doc_stride_on_a_long_context_is_refused_before_it_is_queued(reader):
    """The same for a question-answering context: 100 KB at doc_stride 120 of 128 is
    6,700 windows (1 MB: the worker grew by 4 GB and kept 3 GB of it)."""
    item = {"question": "what?", "context": "word " * 20_000}
    assert reader.post_json({"inputs": {**item, "context": "warm"}})[0] == 200
    before = batches_run(reader)
    body = {"inputs": item, "parameters": {"doc_stride": 120, "max_answer_len": 1000}}
    status, answer = post(reader, json.dumps(body).encode())
    assert_clear_client_error(status, answer, 422)
    assert "the context's windows of 128 tokens at doc_stride 120" in answer["error"]
    assert "send a smaller doc_stride or a shorter context" in answer["error"]
    assert batches_run(reader) == before
    status, answer = post(reader, json.dumps({"inputs": item}).encode())  # doc_stride 64
    assert status == 200, answer


def test_a_hypothesis_that_leaves_the_text_no_room_is_refused_before_it_is_queued(chooser):
    """The model reads the text and each label's hypothesis together, the text cut to fit:
    a hypothesis of all its positions can never be read. The worker refused it after the
    request's other pairs had run (32 texts, 100 labels: 9 s), blaming "the input";
    counted in the server it is refused at once, in words that name the hypothesis."""
    labels = {"candidate_labels": ["a", "b"]}
    assert chooser.post_json({"inputs": "warm", "parameters": labels})[0] == 200
    before = batches_run(chooser)

    # the tiny model's 128 positions: "[CLS] text [SEP] hypothesis [SEP]"; the hypothesis
    # "This example is a." and n times " x" is 5 + n tokens: 125 leave an empty text room
    def asking(n: int) -> dict:
        template = "This example is {}." + " x" * n
        return {
            "inputs": ["hello world"] * 32,
            "parameters": {**labels, "hypothesis_template": template},
        }

    # 125: all the room, none left for a text's token (let through, the worker refused
    # it seconds later, blaming the texts: "each of the 32 inputs: the input is 146 tokens")
    for n in (121, 120):
        status, answer = post(chooser, json.dumps(asking(n)).encode())
        assert_clear_client_error(status, answer, 422)
        assert "is longer than the 124 tokens the model reads beside a text" in answer["error"]
        assert "send a shorter hypothesis_template or label" in answer["error"]
    assert batches_run(chooser) == before  # no worker saw it
    # a hypothesis of all the room left, beside a text of no tokens, is read (a tester)
    empty = {**asking(120), "inputs": "\u0301"}  # (a lone accent)
    assert post(chooser, json.dumps(empty).encode())[0] == 200
    status, answer = post(chooser, json.dumps(asking(119)).encode())  # the text cut to 1
    assert status == 200 and len(answer) == 32, answer


@pytest.mark.parametrize("model", ["classifier", "generator", "summarizer"])
@pytest.mark.parametrize("blank", ["", " \n\t"], ids=["empty", "whitespace"])
def test_blank_text_is_a_422_alone_in_a_list_and_raw(request, model, blank):
    server = request.getfixturevalue(model)
    for inputs, which in [(blank, ""), (["fine", blank], "the input at index 1: ")]:
        status, answer = post(server, json.dumps({"inputs": inputs}).encode())
        assert_clear_client_error(status, answer, 422)
        assert answer["error"].startswith(f"{which}invalid input for ")  # (which: of a list)
        assert "empty" in answer["error"]
    status, _, body = server.request("POST", "/", blank.encode(), {"Content-Type": "text/plain"})
    assert status == 422, body


@pytest.mark.parametrize("model", ["generator", "summarizer"])
@pytest.mark.parametrize("temperature", [1e-300, 1e-45])
def test_a_temperature_near_0_draws_as_at_the_least_temperature(request, model, temperature):
    """Below 1e-5 a draw is made at 1e-5 (README), on both paths: an answer of new text,
    not a 422 or 500 for scores divided into infinities, nor an empty summary (every draw
    the end, as it was at such a temperature)."""
    server = request.getfixturevalue(model)
    document = {
        "inputs": "hello world",
        "parameters": {"do_sample": True, "temperature": temperature, "max_new_tokens": 4},
    }
    status, answer = post(server, json.dumps(document).encode())
    assert status == 200, answer
    [item] = answer
    if model == "generator":  # the prompt, and new tokens after it
        assert item["generated_text"].startswith("hello world")
        assert len(item["generated_text"]) > len("hello world")
    else:  # (this tiny model's bytes are no UTF-8: each is read as U+FFFD, greedily too)
        assert item["summary_text"]


def test_sampling_that_fails_numerically_is_a_422(generator):
    """A repetition_penalty near 0 divides the seen tokens' scores into infinities: no
    probabilities are left to draw from, which the client is told (a 422), not a 500."""
    document = {
        "inputs": "hello world",
        "parameters": {"do_sample": True, "repetition_penalty": 1e-300, "max_new_tokens": 4},
    }
    status, answer = post(generator, json.dumps(document).encode())
    assert_clear_client_error(status, answer, 422)
    assert answer["error"].startswith("sampling failed numerically with these parameters")
    assert answer["error_type"] == "validation"


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


def test_a_list_longer_than_the_queue_is_413_without_retry_after(small_queue):
    with small_queue as server:
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


# --- 12. every route's body, fuzzed: a 4xx in the route's dialect, never a 500 ------------

# Leaks of the server's insides into a message: tracebacks, paths, Python's reprs and
# the words of its TypeErrors.
LEAK = re.compile(
    r"Traceback|<class |NoneType|object at 0x|\.py\b|has no attribute|unsupported operand"
    r"|not subscriptable|positional argument|unhashable|is not iterable|invalid literal"
    r"|'(?:str|int|float|list|dict|bool)' object"
)
# A valid body of each route, whose every field the fuzzer replaces with hostile values.
CLASSIFIER_BODIES = [
    ("/", {"inputs": "hello", "parameters": {"top_k": 2, "function_to_apply": "softmax"}}),
    ("/predict", {"inputs": ["hello", "world"], "raw_scores": False, "truncate": False}),
    ("/tokenize", {"inputs": "hello", "add_special_tokens": True, "truncate": False}),
    ("/decode", {"ids": [1, 2, 3], "skip_special_tokens": True}),
]
SAMPLING = {"max_new_tokens": 2, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 1}
GENERATOR_BODIES = [
    ("/", {"inputs": "hello", "parameters": {**SAMPLING, "stop": ["x"], "details": True}}),
    ("/generate", {"inputs": "hi", "parameters": {**SAMPLING, "top_n_tokens": 2}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {**SAMPLING, "details": True}}),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "n": 2, "logprobs": 2, "echo": True, "seed": 3,
         "stop": ["x"], "logit_bias": {"5": 1}, "frequency_penalty": 0.1},
    ),
    ("/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 2, "stream": True}),
]  # fmt: skip
ROUTE_BODIES = {"classifier": CLASSIFIER_BODIES, "generator": GENERATOR_BODIES}
FIELD_NAMES = ["model", "stream", "parameters", "options", "inputs", "n", "top_k", "zzz"]
HOSTILE_SCALARS = [
    None, True, 0, -1, 2**64, -(2**63), 10**30, 1e308, 1e-9, 1.0000001, float("nan"),
    float("inf"), "", " ", "\x00", "\u202e\u200f", "\ud800", "a" * 100_000, "{}", "<|endoftext|>",
]  # fmt: skip
HOSTILE_LISTS = [[], [[]], [{}], ["x"] * 100, [f"l{i}" for i in range(1000)], [[1, 2]] * 40]
hostile_values = st.recursive(
    st.sampled_from(HOSTILE_SCALARS) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=4,
) | st.sampled_from(HOSTILE_LISTS)


def field_paths(document: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every place in `document` a value sits, the document itself first."""
    yield path
    if isinstance(document, (dict, list)):
        children = document.items() if isinstance(document, dict) else enumerate(document)
        for key, child in children:
            yield from field_paths(child, (*path, key))


def with_value(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    copy = json.loads(json.dumps(document))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


@st.composite
def hostile_bodies(draw: st.DrawFn, bodies: list[tuple[str, dict]]) -> tuple[str, str]:
    """A route and a body: its valid one with a field replaced, an extra field added, or a
    key repeated (JSON allows it: the last one counts), as JSON text (NaN and Infinity
    too, which Python's json writes and reads)."""
    path, valid = draw(st.sampled_from(bodies))
    how = draw(st.sampled_from(["replace", "extra", "repeat"]))
    value = draw(hostile_values)
    if how == "replace":
        document = with_value(valid, draw(st.sampled_from(list(field_paths(valid)))), value)
        return path, json.dumps(document)
    if how == "extra":
        return path, json.dumps({**valid, draw(st.sampled_from(FIELD_NAMES)): value})
    text = json.dumps(valid)
    return path, text[:-1] + f", {json.dumps(draw(st.sampled_from(list(valid))))}: " + (
        json.dumps(value) + "}"
    )


@pytest.mark.parametrize("model", ROUTE_BODIES)
@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples on every run
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # `request`: it only looks up
)
@given(data=st.data())
def test_every_route_answers_any_body_clearly(request, model, data):
    server: RunningServer = request.getfixturevalue(model)
    path, body = data.draw(hostile_bodies(ROUTE_BODIES[model]))
    status, _, answer = server.request(
        "POST", path, body.encode("utf-8", "surrogatepass"), {"Content-Type": "application/json"}
    )
    text = answer.decode("utf-8", "replace")
    assert status < 500 or status == 503, (path, body[:300], text)
    assert not LEAK.search(text), (path, body[:300], text)
    if status >= 400:
        error = json.loads(answer)
        if path.startswith("/v1/"):
            assert set(error["error"]) == {"message", "type", "param", "code"}, text
        else:
            assert set(error) == {"error", "error_type"} and error["error"], text


@pytest.mark.parametrize("model", ROUTE_BODIES)
def test_every_route_still_serves_after_the_fuzzing(request, model):
    server: RunningServer = request.getfixturevalue(model)
    path, body = ROUTE_BODIES[model][0]
    assert server.post_json(body, path)[0] == 200
    assert not [line for line in server.read_log() if "Traceback" in line]

"""Answers at their edges, one check each, fast: TEI's bounds and spellings, OpenAI's
chunks, errors answered whole, admission refusals of streamed choices, HTTP processes'
restarts and drains, a sampling failure's words. Each asserts what a user sees where a
small change to the code (a bound off by one, a branch dropped) would pass the rest of
the suite."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from rawserve.api.app import App
from rawserve.api.inference import check_fillings_size, parse_json_body
from rawserve.api.openai_answers import Answer
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.errors import (
    BadRequest,
    HTTPError,
    MalformedRequest,
    ModelNotFound,
    PayloadTooLarge,
    UnknownFields,
    error_response,
    openai_error_response,
    tgi_error,
    tgi_error_response,
)
from rawserve.http.exchange import HttpRequest
from rawserve.serving.bridge import DRAIN_SILENCE_SECONDS, Bridge, BridgedModel, Peer
from rawserve.serving.fleet import LONGEST_RESTART_PAUSE, RESTART_PAUSE, restart_pause
from rawserve.serving.service import ModelService
from rawserve.shared.board import Board
from rawserve.shared.messages import FailureKind
from rawserve.worker.runner import SAMPLING_FAILED, SAMPLING_FAILED_MESSAGE, Runner
from tests.test_api_shapes import Embedding, FinishedStream, Idle, Loaded, get, reranked
from tests.test_compat_tgi_rules import generation_model, post
from tests.test_http_channel import Runs


def test_an_error_answered_whole_is_not_cut_in_any_shape():
    message = "takes: " + ", ".join(f"field_{i}" for i in range(60))  # ~600 chars
    assert len(message) > 300
    for render in (error_response, tgi_error_response):
        assert json.loads(render(UnknownFields(message)).body)["error"] == message
    body = json.loads(openai_error_response(ModelNotFound(message)).body)
    assert body["error"]["message"] == message
    # and another's is cut
    assert len(json.loads(error_response(BadRequest(message)).body)["error"]) == 300


def test_tgi_s_validation_keeps_a_whole_message_whole():
    message = "x, " * 200
    assert json.loads(tgi_error_response(UnknownFields(message)).body)["error"] == message


def test_a_body_that_cannot_be_read_keeps_its_400_on_tgi_s_routes():
    response = tgi_error_response(MalformedRequest("the body is not valid JSON"))
    assert response.status == 400
    assert json.loads(response.body)["error_type"] == "bad_request"
    assert tgi_error(BadRequest("x")).status == 422  # (a validation failure is TGI's 422)


def test_a_model_not_served_has_openai_s_code_and_param():
    body = json.loads(openai_error_response(ModelNotFound("the model 'x' is not served")).body)
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"
    assert body["error"]["type"] == "not_found_error"


def info_of(batching, details):
    model = ServedModel(
        "m",
        ModelService(Idle(), Loaded("feature-extraction", details, "{}")),
        {"batching": batching},
    )
    app = App(ServedModels([model]), AppSettings())
    return json.loads(asyncio.run(app.handle(get("/info"))).body)


def test_teis_info_max_batch_tokens_is_what_the_batch_size_allows_without_a_budget():
    info = info_of({"max_batch_size": 8}, {"max_input_length": 512})
    assert info["max_batch_requests"] == 8
    assert info["max_batch_tokens"] == 8 * 512
    assert (
        info_of({"max_batch_size": 8, "max_batch_tokens": 1000}, {"max_input_length": 512})[
            "max_batch_tokens"
        ]
        == 1000
    )


OVER_ONE = [
    0.06750061362981796,
    -0.07092296332120895,
    0.3438228666782379,
    0.056317586451768875,
    -0.287584125995636,
    0.1941290646791458,
    0.7000767588615417,
    0.508458137512207,
]


class AnswersEach:
    """A model that answers every input with `output()` (subclasses say what)."""

    full = False
    max_batch_size = 32
    most_admitted = None

    def admission(self, deadline=None):
        return None

    def output(self) -> dict:
        raise NotImplementedError

    async def run(self, inputs, params, deadline, control=None):
        from rawserve.serving.face import ItemResult

        return [ItemResult(self.output(), 0.0, len(inputs), 0.0) for _ in inputs]


class UnitVectors(AnswersEach):
    """A float32 unit vector whose float64 square sum is 1.0000001."""

    def output(self) -> dict:
        import numpy as np

        return {"embedding": np.array(OVER_ONE, dtype=np.float32), "tokens": 1}


def test_a_sentence_s_similarity_to_itself_is_never_past_one():
    from rawserve.http.exchange import HttpRequest

    served = ServedModel(
        "m", ModelService(UnitVectors(), Loaded("feature-extraction", {}, "{}")), {}
    )
    app = App(ServedModels([served]), AppSettings())
    document = {"inputs": {"source_sentence": "a", "sentences": ["a", "a"]}}
    for path in ("/similarity", "/"):
        request = HttpRequest(
            "POST",
            path,
            "",
            [("content-type", "application/json")],
            json.dumps(document).encode(),
            request_id="t",
        )
        answer = asyncio.run(app.handle(request))
        assert answer.status == 200, answer.body
        scores = json.loads(answer.body)
        assert len(scores) == 2 and all(-1 <= score <= 1 for score in scores), scores


def test_teis_embed_passes_dimensions_to_the_model():
    from rawserve.http.exchange import HttpRequest
    from tests.test_api_shapes import Embedding

    model = Embedding()
    served = ServedModel(
        "m", ModelService(model, Loaded("feature-extraction", {"dimensions": 2}, "{}")), {}
    )
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps({"inputs": "a", "dimensions": 1}).encode()
    request = HttpRequest("POST", "/embed", "", [("content-type", "application/json")], body, "t")
    assert asyncio.run(app.handle(request)).status == 200
    assert [params.get("dimensions") for params in model.params] == [1]


def test_embed_all_counts_token_ids_as_cut_to_the_model_s_length():
    """Token ids past the model's length are cut (truncate: true): the answer's bound
    counts what is answered, not the ids sent (a spurious 413)."""
    from rawserve.http.exchange import HttpRequest
    from tests.test_api_shapes import Recording

    details = {"token_dimensions": 4, "max_input_length": 8}
    served = ServedModel(
        "m", ModelService(Recording(), Loaded("feature-extraction", details, "{}")), {}
    )
    app = App(ServedModels([served]), AppSettings(max_answer_bytes=500))
    body = json.dumps({"inputs": [[5] * 100, [5]]}).encode()
    request = HttpRequest(
        "POST", "/embed_all", "", [("content-type", "application/json")], body, "t"
    )
    answer = asyncio.run(app.handle(request))
    assert answer.status == 200, answer.body


class SparseWeights(AnswersEach):
    """A SPLADE model's 10 words of nonzero weight an input."""

    def output(self) -> dict:
        import numpy as np

        return {"indices": np.arange(10), "values": [0.5] * 10, "tokens": 1}


def test_embed_sparse_counts_an_index_and_a_weight_a_word_against_the_answer_bound():
    from rawserve.http.exchange import HttpRequest

    def status(largest):
        workers = Loaded("feature-extraction", {"pooling": "splade"}, "{}")
        served = ServedModel("m", ModelService(SparseWeights(), workers), {"pooling": "splade"})
        app = App(ServedModels([served]), AppSettings(max_answer_bytes=largest))
        body = json.dumps({"inputs": ["a", "b"]}).encode()
        request = HttpRequest(
            "POST", "/embed_sparse", "", [("content-type", "application/json")], body, "t"
        )
        return asyncio.run(app.handle(request)).status

    # 2 inputs x 10 words x 2 numbers x 12 bytes = 480
    assert status(480) == 200
    assert status(479) == 413
    assert status(300) == 413  # (counted one number a word: 240, it passed)


def test_teis_rerank_refuses_top_n_and_top_k_that_differ():
    document = {"query": "q", "texts": ["ab", "abcd", "abc"]}
    status, body = reranked("/rerank", {**document, "top_n": 1, "top_k": 2})
    assert status == 400 and "different counts" in body["error"], body
    status, body = reranked("/rerank", {**document, "top_n": 2, "top_k": 2})
    assert status == 200 and [rank["index"] for rank in body] == [1, 2]


def test_a_truncation_direction_in_either_spelling_reaches_the_worker_lower_case():
    for spelt in ("Left", "left", "Right"):
        model = Embedding()
        served = ServedModel("m", ModelService(model, Loaded("feature-extraction", {}, "{}")), {})
        app = App(ServedModels([served]), AppSettings())
        body = json.dumps({"inputs": "a", "truncation_direction": spelt}).encode()
        request = HttpRequest(
            "POST", "/embed", "", [("content-type", "application/json")], body, "t"
        )
        assert asyncio.run(app.handle(request)).status == 200
        assert [params["truncation_direction"] for params in model.params] == [spelt.lower()]


def test_a_blank_input_of_a_list_is_refused_naming_its_index():
    with pytest.raises(HTTPError) as refused:
        parse_json_body("text-classification", {"inputs": ["fine", "   "]})
    assert refused.value.status == 422
    assert "index 1" in refused.value.message, refused.value.message
    with pytest.raises(HTTPError) as alone:
        parse_json_body("text-classification", {"inputs": "   "})
    assert "index" not in alone.value.message


def test_a_fill_mask_answer_s_size_counts_only_the_targets_named():
    model = SimpleNamespace(
        serving=SimpleNamespace(loaded=SimpleNamespace(details={"mask_token": "[MASK]"}))
    )
    text = "a [MASK] " * 10
    one = 10 * 1 * (len(text.encode()) + 80)
    # one target: one candidate a mask, whatever top_k (5 by default) says
    check_fillings_size(model, [text], {"targets": ["b"]}, one)
    check_fillings_size(model, [text], {"targets": "b", "top_k": 5}, one)
    with pytest.raises(PayloadTooLarge):
        check_fillings_size(model, [text], {}, one)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_with_include_usage_says_usage_null_in_every_chunk_but_the_last(chat):
    async def read():
        events = Answer(chat, "m").events([FinishedStream(["he", "llo"])], [], True)
        return [event async for event in events]

    raw = asyncio.run(read())
    assert raw[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in raw[:-1]]
    *before, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 1
    assert before and all("usage" in chunk and chunk["usage"] is None for chunk in before)

    async def read_plain():
        events = Answer(chat, "m").events([FinishedStream(["he", "llo"])], [], False)
        return [event async for event in events]

    plain = [json.loads(e.removeprefix(b"data: ")) for e in asyncio.run(read_plain())[:-1]]
    assert all("usage" not in chunk for chunk in plain)


@pytest.mark.parametrize(
    ("choice", "content"), [("required", None), ("get_weather", None), ("auto", "")]
)
def test_a_streamed_answer_that_must_call_opens_with_null_content(choice, content):
    """OpenAI's first chunk of a call says content null, as the call's message does."""
    from rawserve.api.openai_tools import Tools

    tools = Tools([{"name": "get_weather"}], choice)
    stream = FinishedStream(['{"name": "get_weather", ', '"arguments": {}}'])

    async def read():
        events = Answer(True, "m", tools=tools).events([stream], [], False)
        return [event async for event in events]

    first = json.loads(asyncio.run(read())[0].removeprefix(b"data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": content}


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/generate_stream", {"inputs": "once", "parameters": {"decoder_input_details": True}}),
        ("/", {"inputs": "once", "stream": True, "parameters": {"decoder_input_details": True}}),
    ],
)
async def test_decoder_input_details_on_a_stream_is_422(path, document):
    app = App(ServedModels([generation_model()]))
    response = await app.handle(post(path, document))
    assert response.status == 422, (response.status, response.body)
    assert b"decoder_input_details" in response.body


class FirstWaitsSecondRefused:
    """The first choice is admitted and waits for a row that never comes; the second is
    refused at admission (the queue full)."""

    most_admitted = None

    def __init__(self, executor):
        self.executor, self.calls = executor, 0

    def admission(self, deadline=None):
        return None

    async def run(self, inputs, params, deadline, control):
        from rawserve.serving.face import Reason, Refused

        self.calls += 1
        if self.calls == 1:
            await asyncio.Event().wait()
        raise Refused.because(Reason.QUEUE_FULL, "server busy")


async def test_a_choice_refused_at_admission_refuses_the_stream_at_once():
    """OpenAI's n streamed: the second choice's 503 is raised without waiting for the
    first choice's first token (a queue place held for nobody meanwhile)."""
    from rawserve.api.served import ServedModel
    from rawserve.api.streaming import TokenStream, start_choices
    from rawserve.http.errors import ServiceUnavailable
    from rawserve.serving.service import ModelService
    from tests.test_streaming import FakeExecutor

    executor = FakeExecutor()
    model = ServedModel("tiny-gpt", ModelService(FirstWaitsSecondRefused(executor), executor))
    streams = [TokenStream(model, "hello", {"max_new_tokens": 3}, deadline=1e9) for _ in "ab"]
    try:
        with pytest.raises(ServiceUnavailable):
            await asyncio.wait_for(start_choices(streams, None), 2.0)
    finally:
        for stream in streams:
            stream.close()


def test_an_http_process_that_dies_right_after_listening_is_replaced_after_a_pause():
    assert restart_pause(0, RESTART_PAUSE / 2) == RESTART_PAUSE  # (not a tight loop)
    assert restart_pause(0, 60.0) == 0.0  # one that served a while: at once
    assert restart_pause(1, 0.1) == RESTART_PAUSE
    assert restart_pause(50, 0.1) == LONGEST_RESTART_PAUSE


def test_a_drain_does_not_wait_for_an_http_process_that_fell_silent():
    """A drain is done once every HTTP process has said "drained" - or stopped speaking
    (stopped, or stuck): it waited the whole grace period for one that never would."""

    async def run():
        board = Board.create(1)
        try:
            bridge = Bridge(
                [BridgedModel(Runs(), lambda: 1.0)],
                board,
                lambda: [],
                lambda families: [],
                serving_pid=1,
            )
            peer = Peer(0, 2, SimpleNamespace(send=lambda message: None))
            bridge.peers[0] = peer
            peer.listening.set()
            peer.heard_at = time.monotonic()
            speaking = await bridge.requests_answered(0.2)  # speaks, not drained: waits
            peer.heard_at = time.monotonic() - DRAIN_SILENCE_SECONDS - 1
            started = time.monotonic()
            silent = await bridge.requests_answered(5.0)
            return speaking, silent, time.monotonic() - started
        finally:
            board.remove()

    speaking, silent, waited = asyncio.run(run())
    assert speaking is False
    assert silent is True and waited < 1.0


def test_torch_s_sampling_failure_is_the_client_s_422_in_words():
    runner = Runner("text-generation", "cpu")
    failure = runner.describe_failure(RuntimeError(f"{SAMPLING_FAILED} (from torch.multinomial)"))
    assert (failure.kind, failure.message) == (FailureKind.INPUT, SAMPLING_FAILED_MESSAGE)
    other = runner.describe_failure(RuntimeError("some other failure"))
    assert other.kind is FailureKind.INTERNAL

"""TGI's request on rawserve, without a model: which of the parameters TGI's client sends
are served, ignored or refused, and which served model TGI's routes pick.

The real server and TGI's own client are in tests/test_compat_clients.py.
"""

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
from rawserve.serving.face import NO_CONTROL, Control, ItemResult, Refusal
from rawserve.serving.service import ModelService
from rawserve.shared.messages import FailureKind, ItemFailure
from rawserve.tasks import InvalidRequest, UnservedParameter, check_params, task_rules
from rawserve.tasks.text_generation import API_SAMPLING, MAX_BEST_OF, MAX_STOP_SEQUENCES
from tests.test_model_selection import ReadyWorkers, served

TASK = task_rules("text-generation")
# what text-generation 0.7.0's Client.generate sends when only the prompt is given
CLIENT_DEFAULTS = {
    "best_of": None,
    "details": True,
    "do_sample": False,
    "max_new_tokens": 20,
    "repetition_penalty": None,
    "frequency_penalty": None,
    "return_full_text": False,
    "seed": None,
    "stop": [],
    "temperature": None,
    "top_k": None,
    "top_p": None,
    "truncate": None,
    "typical_p": None,
    "watermark": False,
    "decoder_input_details": False,
    "top_n_tokens": None,
    "grammar": None,
}


def test_the_parameters_tgis_client_sends_unset_are_taken_and_left_out():
    assert TASK is not None
    assert check_params(TASK, CLIENT_DEFAULTS) == {
        "details": True,
        "decoder_input_details": False,
        "do_sample": False,
        "max_new_tokens": 20,
        "return_full_text": False,
        "stop": [],
    }


@pytest.mark.parametrize(
    ("name", "neutral"),
    [("best_of", 1), ("frequency_penalty", 0.0)],
)
def test_a_neutral_value_is_taken_as_unset(name, neutral):
    assert TASK is not None
    assert check_params(TASK, {name: neutral}) == {}


@pytest.mark.parametrize("value", [2, -2, 0.5, -0.25])
def test_tgis_frequency_penalty_goes_to_the_worker_as_tgis_not_openais(value):
    """TGI's penalty (each token's share of the sequence, the prompt's tokens too) is
    not OpenAI's (its count among the new tokens), which the OpenAI routes send the
    worker as `frequency_penalty`: TGI's travels under a name of its own."""
    assert TASK is not None
    assert check_params(TASK, {"frequency_penalty": value}) == {
        "sequence_frequency_penalty": float(value)
    }
    for wrong in (2.01, -2.5, "0.5", True):
        with pytest.raises(InvalidRequest, match="'frequency_penalty' must be"):
            check_params(TASK, {"frequency_penalty": wrong})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("adapter_id", "lora"),
        ("adapter_id", 0),
    ],
)
def test_a_value_rawserve_cannot_honour_is_refused_naming_it(name, value):
    assert TASK is not None
    with pytest.raises(UnservedParameter, match=f"'{name}' is not supported"):
        check_params(TASK, {name: value})


def test_tgis_watermark_goes_to_the_worker_when_true_and_is_left_out_when_false():
    assert TASK is not None
    assert check_params(TASK, {"watermark": True}) == {"watermark": True}
    assert check_params(TASK, {"watermark": False}) == {}
    for wrong in (0, 1, "true", "yes"):
        with pytest.raises(InvalidRequest, match="'watermark' must be true or false"):
            check_params(TASK, {"watermark": wrong})


@pytest.mark.parametrize("value", [1, 1000, 5000, 2**31 - 1])
def test_top_k_is_any_positive_k_as_tgi_takes_it(value):
    # (refused past 1,000, the classifiers' bound, where TGI and the OpenAI routes took it)
    assert TASK is not None
    assert check_params(TASK, {"top_k": value}) == {"top_k": value}
    for wrong in (0, -1, 2**31, 1.5):
        with pytest.raises(ValueError, match="top_k"):
            check_params(TASK, {"top_k": wrong})


@pytest.mark.parametrize("stop", ["", [""], ["a"] * 17, ["x" * 201]])
def test_a_stop_refused_says_a_string_or_a_list_is_taken(stop):
    # (a plain string is taken: the refusal said a list only)
    assert TASK is not None
    assert check_params(TASK, {"stop": "is"}) == {"stop": ["is"]}
    with pytest.raises(ValueError, match="must be a non-empty string, or a list of at most 16"):
        check_params(TASK, {"stop": stop})


def test_a_stop_holding_a_replacement_character_is_refused():
    """A decoder writes U+FFFD for bytes that make no character, a byte each: a stop
    found in them ended answers said "stop_sequence" whose text held no stop (cut short,
    the bytes read otherwise)."""
    assert TASK is not None
    with pytest.raises(ValueError, match="may not hold U\\+FFFD, the replacement character"):
        check_params(TASK, {"stop": ["ok", "a\ufffd"]})


@pytest.mark.parametrize("value", [0.95, 0.01, 1.0])
def test_typical_p_is_served_from_above_0_to_1_which_is_off(value):
    # LangChain's HuggingFaceEndpoint sends typical_p 0.95 unless told otherwise
    assert TASK is not None
    assert check_params(TASK, {"typical_p": value}) == {"typical_p": value}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("given", "taken"),
    [
        ({"type": "json", "value": SCHEMA}, {"type": "json", "value": SCHEMA}),
        ({"type": "json", "value": json.dumps(SCHEMA)}, {"type": "json", "value": SCHEMA}),
        (
            {"type": "json_schema", "value": {"name": "a", "schema": SCHEMA}},
            {"type": "json", "value": SCHEMA},
        ),
        ({"type": "regex", "value": "[0-9]+"}, {"type": "regex", "value": "[0-9]+"}),
    ],
    ids=["json", "json-text", "json_schema", "regex"],
)
def test_a_grammar_is_taken_in_each_of_tgis_forms(given, taken):
    assert TASK is not None
    assert check_params(TASK, {"grammar": given}) == {"grammar": taken}


@pytest.mark.parametrize(
    "given",
    [
        {"type": "xml", "value": "a"},
        {"type": "json"},
        {"type": "json", "value": "not json"},
        {"type": "json", "value": [1]},
        {"type": "json_schema", "value": {"name": "a"}},
        {"type": "regex", "value": ""},
        {"type": "regex", "value": "a", "extra": 1},
        "[0-9]+",
    ],
    ids=repr,
)
def test_a_grammar_of_no_form_tgi_has_is_refused(given):
    assert TASK is not None
    with pytest.raises(InvalidRequest, match="'grammar'"):
        check_params(TASK, {"grammar": given})


def test_a_grammar_of_an_unknown_type_is_told_every_type_taken():
    assert TASK is not None
    with pytest.raises(InvalidRequest, match='"json", "json_object", "json_schema" or "regex"'):
        check_params(TASK, {"grammar": {"type": "xml", "value": "a"}})


def test_the_likeliest_tokens_are_served_up_to_twenty():
    assert TASK is not None
    assert check_params(TASK, {"top_n_tokens": 3}) == {"top_n_tokens": 3}
    for wrong in (21, -1, 2.5, True):
        with pytest.raises(InvalidRequest, match="top_n_tokens"):
            check_params(TASK, {"top_n_tokens": wrong})


def test_a_parameter_tgi_does_not_have_is_still_unknown():
    assert TASK is not None
    with pytest.raises(InvalidRequest, match="unknown parameter"):
        check_params(TASK, {"beam_width": 2})


# a worker's details: TGI's fields, and beside them what the OpenAI routes read
WORKER_DETAILS = {
    "finish_reason": "length",
    "generated_tokens": 1,
    "prompt_tokens": 2,
    "stops_from": 0,
    "seed": None,
    "prefill": [
        {"id": 1, "text": "on", "logprob": None, "special": False},
        {"id": 2, "text": "ce", "logprob": -1.5, "special": False},
    ],
    "tokens": [{"id": 3, "text": " and", "logprob": -0.5, "special": False}],
}


class GeneratingQueue:
    """A generation model's queue that answers at once, as the worker shapes it."""

    def __init__(self) -> None:
        self.full = False
        self.max_batch_size = 8
        self.most_admitted: int | None = None  # no bound of its own
        self.params: list[Mapping[str, Any]] = []

    def admission(self, deadline: float | None = None) -> Refusal | None:
        return None

    async def run(
        self,
        inputs: Sequence[Any],
        params: Mapping[str, Any],
        deadline: float,
        control: Control = NO_CONTROL,
    ) -> list[ItemResult]:
        self.params.append(dict(params))
        return self.answers(inputs, params)

    def answers(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[ItemResult]:
        output: dict[str, Any] = {"generated_text": " and so on"}
        if params.get("details"):
            output["details"] = WORKER_DETAILS
        return [ItemResult([output], 0.0, 1, 0.001) for _ in inputs]


def generation_model() -> ServedModel:
    return ServedModel("gen", ModelService(GeneratingQueue(), ReadyWorkers("text-generation")))


def post(path: str, document: Any) -> HttpRequest:
    headers = [("content-type", "application/json")]
    return HttpRequest("POST", path, "", headers, json.dumps(document).encode(), request_id="t")


async def test_generate_uses_the_first_model_that_generates_wherever_it_is_listed():
    gen = generation_model()
    app = App(ServedModels([served("emb", "feature-extraction"), gen]))
    response = await app.handle(post("/generate", {"inputs": "once", "parameters": {}}))
    assert response.status == 200
    assert json.loads(response.body) == {"generated_text": " and so on"}
    queue = gen.serving.queue
    assert isinstance(queue, GeneratingQueue)
    # TGI's defaults: the continuation, greedy (unless a sampling setting asks otherwise),
    # and TGI's temperature when sampling (not the pipeline's)
    assert queue.params == [{"return_full_text": False, "do_sample": False, API_SAMPLING: True}]


async def test_generate_takes_the_sampling_asked_for():
    gen = generation_model()
    app = App(ServedModels([gen]))
    asked = {"do_sample": True, "return_full_text": True}
    response = await app.handle(post("/generate", {"inputs": "once", "parameters": asked}))
    assert response.status == 200
    assert isinstance(gen.serving.queue, GeneratingQueue)
    assert gen.serving.queue.params == [{**asked, API_SAMPLING: True}]


@pytest.mark.parametrize("path", ["/generate", "/"])
async def test_details_hold_tgis_fields_only(path):
    app = App(ServedModels([generation_model()]))
    document = {"inputs": "once", "parameters": {"details": True, "decoder_input_details": True}}
    response = await app.handle(post(path, document))
    assert response.status == 200, response.body
    answer = json.loads(response.body)
    [details] = [each["details"] for each in (answer if path == "/" else [answer])]
    # TGI's Details: clients typed from TGI's OpenAPI document read these, and no more
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["prefill"] == [
        {"id": 1, "text": "on", "logprob": None},
        {"id": 2, "text": "ce", "logprob": -1.5},
    ]
    assert details["tokens"] == WORKER_DETAILS["tokens"]


@pytest.mark.parametrize("path", ["/generate", "/"])
async def test_decoder_input_details_alone_turns_details_on_as_tgis_does(path):
    """On every route TGI's parameters apply to: `POST /` ignored it without `details`."""
    app = App(ServedModels([generation_model()]))
    document = {"inputs": "once", "parameters": {"decoder_input_details": True}}
    response = await app.handle(post(path, document))
    assert response.status == 200, response.body
    answer = json.loads(response.body)
    [details] = [each["details"] for each in (answer if path == "/" else [answer])]
    assert details["prefill"][0] == {
        "id": 1,
        "text": "on",
        "logprob": None,
    }


async def test_a_failure_of_the_model_is_tgis_generation_error():
    """TGI's clients raise `GenerationError` for the type "generation" (a worker lost
    mid-stream among them); "internal_error" was their `UnknownError`."""

    class FailingQueue(GeneratingQueue):
        async def run(self, inputs, params, deadline, control=NO_CONTROL):
            failed = ItemFailure(FailureKind.INTERNAL, "the model failed")
            return [ItemResult(failed, 0.0, 1, 0.001) for _ in inputs]

    gen = ServedModel("gen", ModelService(FailingQueue(), ReadyWorkers("text-generation")))
    response = await App(ServedModels([gen])).handle(post("/generate", {"inputs": "once"}))
    assert response.status == 500
    assert json.loads(response.body)["error_type"] == "generation"


async def test_info_holds_what_tgis_info_requires_for_a_model_that_generates():
    gen = generation_model()
    assert isinstance(gen.serving.workers, ReadyWorkers)
    gen.serving.workers.loaded = replace(
        gen.serving.workers.loaded, details={"max_input_length": 64}
    )
    app = App(ServedModels([gen, served("emb", "feature-extraction")]))
    response = await app.handle(HttpRequest("GET", "/info", "", [], b"", request_id="t"))
    info = json.loads(response.body)
    assert info["model_pipeline_tag"] == "text-generation"
    assert info["max_input_tokens"] == 63 and info["max_total_tokens"] == 64
    assert info["max_input_length"] == 63  # TGI 1.x's name of max_input_tokens
    # with no token budget, a batch holds its items' prompts and new tokens (the README)
    assert info["max_batch_tokens"] == info["max_batch_requests"] * info["max_total_tokens"]
    assert info["max_best_of"] == MAX_BEST_OF and info["max_stop_sequences"] == MAX_STOP_SEQUENCES
    assert isinstance(info["validation_workers"], int) and isinstance(info["router"], str)
    # and not where the model /info describes does not generate
    emb = served("emb", "feature-extraction")
    assert isinstance(emb.serving.workers, ReadyWorkers)
    emb.serving.workers.loaded = replace(
        emb.serving.workers.loaded, details={"max_input_length": 128}
    )
    app = App(ServedModels([emb, generation_model()]))
    response = await app.handle(HttpRequest("GET", "/info", "", [], b"", request_id="t"))
    info = json.loads(response.body)
    assert "max_total_tokens" not in info
    assert info["max_input_length"] == 128  # TEI's: the encoder's length, as it is


async def test_generate_refuses_an_unserved_parameter_with_422_in_tgis_shape():
    app = App(ServedModels([generation_model()]))
    body = {"inputs": "once", "parameters": {"adapter_id": "lora"}}
    response = await app.handle(post("/generate", body))
    assert response.status == 422
    assert "'adapter_id' is not supported" in json.loads(response.body)["error"]


@pytest.mark.parametrize("stream", ["zzz", "yes", {}, 1.5, 2**70], ids=repr)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/", "/invocations"])
async def test_a_stream_that_is_not_a_boolean_is_refused_on_every_generate_route(path, stream):
    """/generate and /generate_stream dropped "stream" unread, though /openapi.json
    documents it a boolean there (and SageMaker's /invocations, which reads only true as
    streamed, went on to /generate with it): any value was taken, 200, where POST / says
    422."""
    app = App(ServedModels([generation_model()]))
    response = await app.handle(post(path, {"inputs": "once", "stream": stream}))
    assert response.status == 422, response.body
    assert json.loads(response.body) == {
        "error": '"stream" must be true or false',
        "error_type": "validation",
    }


@pytest.mark.parametrize("stream", [True, False, None])
async def test_the_generate_routes_take_a_boolean_stream_and_stream_as_their_path_says(stream):
    """As TGI's router ignores "stream" on /generate and /generate_stream."""
    app = App(ServedModels([generation_model()]))
    answer = await app.handle(post("/generate", {"inputs": "once", "stream": stream}))
    assert (answer.status, json.loads(answer.body)) == (200, {"generated_text": " and so on"})
    answer = await app.handle(post("/generate_stream", {"inputs": "once", "stream": stream}))
    assert (answer.status, answer.content_type) == (200, "text/event-stream")
    assert answer.stream is not None
    await answer.stream.aclose()


# --- errors typed as TGI types them -------------------------------------------------

# what TGI's validation refuses (422 "validation", which TGI's client and InferenceClient
# raise as ValidationError); rawserve's own checks answer some of them 400
REFUSED_BY_VALIDATION = [
    pytest.param({"max_new_tokens": 0}, id="max_new_tokens 0"),
    pytest.param({"max_new_tokens": "many"}, id="max_new_tokens not a number"),
    pytest.param({"temperature": -1}, id="temperature below 0"),
    pytest.param({"temperature": 0}, id="temperature 0"),  # OpenAI's greedy; TGI refuses it
    pytest.param({"top_p": 1.5}, id="top_p above 1"),
    pytest.param({"top_p": 0}, id="top_p 0"),
    pytest.param({"typical_p": 0}, id="typical_p 0"),
    pytest.param({"typical_p": 1.5}, id="typical_p above 1"),
    pytest.param({"stop": [""]}, id="blank stop"),
    pytest.param({"best_of": 2}, id="best_of without sampling"),
    pytest.param({"best_of": 2, "do_sample": True, "seed": 1}, id="best_of with a seed"),
    pytest.param({"best_of": MAX_BEST_OF + 1, "do_sample": True}, id="best_of past its most"),
    pytest.param({"best_of": 0, "do_sample": True}, id="best_of 0"),
    pytest.param({"frequency_penalty": 2.5}, id="frequency_penalty above 2"),
    pytest.param({"frequency_penalty": -3}, id="frequency_penalty below -2"),
    pytest.param({"truncate": 0}, id="truncate 0"),
    pytest.param({"truncate": 1.5}, id="truncate not a whole number"),
    pytest.param({"beam_width": 2}, id="unknown parameter"),
]


@pytest.mark.parametrize("parameters", REFUSED_BY_VALIDATION)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_what_tgis_validation_refuses_is_422_validation(path, parameters):
    app = App(ServedModels([generation_model()]))
    response = await app.handle(post(path, {"inputs": "once", "parameters": parameters}))
    assert response.status == 422, response.body
    assert json.loads(response.body)["error_type"] == "validation"


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({"inputs": ""}, id="blank"),
        pytest.param({"inputs": ["once"]}, id="a list"),
        pytest.param({"inputs": "once", "parameters": []}, id="parameters not an object"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
async def test_an_input_tgi_cannot_take_is_422_validation(path, document):
    app = App(ServedModels([generation_model()]))
    response = await app.handle(post(path, document))
    assert response.status == 422, response.body
    assert json.loads(response.body)["error_type"] == "validation"


@pytest.mark.parametrize("values", [["0"], ["2", "3"]], ids=["zero", "two headers"])
@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_a_bad_request_timeout_is_422_validation_however_it_is_bad(path, values):
    """Two X-Request-Timeout headers were 400 `bad_request` where one bad value is 422
    `validation`: TGI's client raised another error for them (a tester)."""
    app = App(ServedModels([generation_model()]))
    request = post(path, {"inputs": "once"})
    request.headers.extend(("x-request-timeout", value) for value in values)
    response = await app.handle(request)
    assert response.status == 422, response.body
    assert json.loads(response.body)["error_type"] == "validation"


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_a_body_that_is_not_json_stays_400_as_tgis_json_reader_answers(path):
    app = App(ServedModels([generation_model()]))
    request = HttpRequest(
        "POST", path, "", [("content-type", "application/json")], b"{no", request_id="t"
    )
    response = await app.handle(request)
    assert response.status == 400
    assert json.loads(response.body)["error_type"] == "bad_request"


async def test_a_refusal_tgi_has_no_type_for_keeps_its_status():
    app = App(ServedModels([generation_model()]))
    app.start_draining()
    response = await app.handle(post("/generate", {"inputs": "once"}))
    assert response.status == 503 and ("Retry-After", "1") in response.headers
    assert json.loads(response.body)["error_type"] == "unavailable"


async def test_post_root_keeps_rawserves_types_for_a_model_that_does_not_generate():
    app = App(ServedModels([served("emb", "feature-extraction"), generation_model()]))
    body = {"inputs": "once", "parameters": {"max_new_tokens": 0}}
    with pytest.raises(BadRequest):  # rendered by the protocol, in rawserve's types
        await app.handle(post("/", body))
    response = await app.handle(post("/models/gen", body))  # the generation model's path
    assert response.status == 422
    assert json.loads(response.body)["error_type"] == "validation"


def sampled_answer(text: str, logprobs: list[float]) -> dict[str, Any]:
    """A worker's answer whose new tokens have these log probabilities (in columns)."""
    from rawserve.shared.token_columns import TokenColumns, columns

    tokens = columns([{"id": 5, "text": "x", "logprob": p, "special": False} for p in logprobs])
    assert isinstance(tokens, TokenColumns)
    details = {"finish_reason": "length", "generated_tokens": len(logprobs), "seed": 7}
    return {"generated_text": text, "details": {**details, "prompt_tokens": 3, "tokens": tokens}}


def test_best_of_gives_the_answer_whose_tokens_are_likeliest_the_first_of_equals():
    """TGI's choice: the answer whose new tokens' log probabilities add up highest (read
    from the worker's columns), the first of equals; the others follow in order, in
    TGI's shape, where details are asked, and no details otherwise."""
    from rawserve.api.best_of import best_output

    answer = sampled_answer
    outputs = [answer("a", [-1.0, -2.0]), answer("b", [-0.5, -1.0]), answer("c", [-1.5])]
    chosen = best_output(outputs, details=True)
    assert chosen["generated_text"] == "b"
    others = chosen["details"]["best_of_sequences"]
    assert [other["generated_text"] for other in others] == ["a", "c"]  # ("c" ties "b")
    assert all("prompt_tokens" not in other for other in others)  # (TGI's fields only)
    assert [len(other["tokens"]) for other in others] == [2, 1]
    assert best_output(outputs, details=False) == {"generated_text": "b"}


def test_openais_best_of_answers_each_prompts_n_likeliest_per_token():
    """OpenAI's completions' choice: of each prompt's generations in a row, the `n` with
    the highest log probability per token (not in all: a longer answer is not less
    likely for its length), likeliest first, the earlier of equals."""
    from rawserve.api.best_of import likeliest_choices

    outputs = [
        sampled_answer("a", [-1.0, -2.0]),  # the first prompt's: -1.5 a token
        sampled_answer("b", [-0.5, -1.0]),  # -0.75
        sampled_answer("c", [-1.5]),  # -1.5, as a
        sampled_answer("d", [-3.0]),  # the second prompt's: -3
        sampled_answer("e", [-0.1, -0.1, -0.1, -2.0]),  # -0.575 (-2.3 in all)
        sampled_answer("f", [-1.0, -1.0]),  # -1 (-2 in all)
    ]
    chosen = likeliest_choices(outputs, 3, 2)
    assert [output["generated_text"] for output in chosen] == ["b", "a", "e", "f"]
    assert [o["generated_text"] for o in likeliest_choices(outputs, 3, 1)] == ["b", "e"]


class RankedQueue(GeneratingQueue):
    """Answers each call's items with the call's number after their text, the middle
    call's (1) likeliest: its token's log probability 0, the others' -1 (the later the
    further from 1); an item whose text is "fails" fails."""

    def answers(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[ItemResult]:
        call = len(self.params) - 1
        results = []
        for text in inputs:
            if text == "fails":
                failure = ItemFailure(FailureKind.INPUT, "no answer to that")
                results.append(ItemResult(failure, 0.0, 1, 0.001))
                continue
            token = {"id": 3, "text": "x", "logprob": -float(abs(call - 1)), "special": False}
            details = {**WORKER_DETAILS, "seed": params.get("seed"), "tokens": [token]}
            output = {"generated_text": f"{text}{call}", "details": details}
            results.append(ItemResult([output], 0.0, 1, 0.001))
        return results


async def test_post_roots_best_of_answers_each_prompt_with_the_best_of_its_own_answers():
    """Each answer is a call of its own, with a seed of its own (so that it repeats on
    either generation path), sampled, its details asked of the worker and `best_of` not
    sent it; each prompt is answered with its own best, as the pipeline shapes a list's
    answers; a failed answer fails the request, named as its prompt's."""
    queue = RankedQueue()
    gen = ServedModel("gen", ModelService(queue, ReadyWorkers("text-generation")))
    app = App(ServedModels([gen]))
    asked = {"best_of": 3, "temperature": 1.0}  # (TGI's check: a temperature samples)
    response = await app.handle(post("/", {"inputs": ["a", "b"], "parameters": asked}))
    assert response.status == 200, response.body
    assert json.loads(response.body) == [[{"generated_text": "a1"}], [{"generated_text": "b1"}]]
    sent = queue.params[-3:]
    assert all(p["details"] and p["do_sample"] and "best_of" not in p for p in sent)
    assert len({p["seed"] for p in sent}) == 3
    queue.params.clear()
    with_details = await app.handle(
        post("/generate", {"inputs": "b", "parameters": {**asked, "details": True}})
    )
    chosen = json.loads(with_details.body)
    assert chosen["generated_text"] == "b1" and chosen["details"]["seed"] == queue.params[1]["seed"]
    others = chosen["details"]["best_of_sequences"]
    assert [o["generated_text"] for o in others] == ["b0", "b2"]
    assert [o["seed"] for o in others] == [queue.params[0]["seed"], queue.params[2]["seed"]]
    failed = await app.handle(post("/", {"inputs": ["a", "fails"], "parameters": asked}))
    assert failed.status == 422, failed.body
    assert json.loads(failed.body)["error"] == "the input at index 1: no answer to that"


async def test_best_of_past_what_admission_takes_of_one_request_is_413_at_once():
    """Each answer is an item of the request: more than the queue ever takes of one was a
    503 (the first copies queued, the rest refused as the queue filled), asking for
    retries that would all fail; /info's max_best_of says the bound."""
    queue = GeneratingQueue()
    queue.most_admitted = 3
    gen = ServedModel("gen", ModelService(queue, ReadyWorkers("text-generation")))
    app = App(ServedModels([gen]))
    asked = {"best_of": 4, "do_sample": True}
    for path, inputs in (("/generate", "a"), ("/", ["a"])):
        response = await app.handle(post(path, {"inputs": inputs, "parameters": asked}))
        assert response.status == 413, response.body
        assert "takes at most 3 of one request" in json.loads(response.body)["error"]
    assert queue.params == []  # (nothing queued)
    response = await app.handle(
        post("/generate", {"inputs": "a", "parameters": {**asked, "best_of": 3}})
    )
    assert response.status == 200, response.body
    info = await app.handle(HttpRequest("GET", "/info", "", [], b"", request_id="t"))
    assert json.loads(info.body)["max_best_of"] == 3

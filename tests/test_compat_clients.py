"""The clients of the dialects rawserve speaks, unmodified, against the real server: TGI's
routes and its own client (text-generation 0.7.0, in a virtual environment of its own:
it pins huggingface_hub < 1), and the openai SDK showing rawserve's error messages.

The virtual environment is made once, while the servers start (pytest's cache keeps it
between runs); the test that needs it is skipped, saying why, only when pip cannot reach
the package index.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.compat_venvs import installing
from tests.server import RunningServer, running_together
from tests.test_compat_tgi_rules import CLIENT_DEFAULTS

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TGI_CLIENT = "text-generation==0.7.0"
PROMPT = "the movie was"


@pytest.fixture(scope="module")
def tgi_client_installing(request) -> Iterator[Future[Path]]:
    with installing(
        request, "compat-text-generation-0.7.0", [TGI_CLIENT], "tgi_client_python"
    ) as made:
        yield made


@pytest.fixture(scope="module")
def servers(tiny_model, tgi_client_installing):  # the client's environment is made meanwhile
    started = {
        # a generation model with a chat template, prompts capped at 2 per request
        "chat": RunningServer(
            ["--model", tiny_model("chat"), "--max-client-batch-size", "2", "--threads", "1"]
        ),
        # a model that never finishes loading: every inference request is 503
        "loading": RunningServer(
            ["--handler", "tests.handlers:slow_loading"],
            env={"RAWSERVE_TEST_LOAD_SECONDS": "3600"},
        ),
    }
    try:
        with running_together({"chat": started["chat"]}):
            started["loading"].start(wait_ready=False)
            yield started
    finally:
        if started["loading"].process is not None:
            started["loading"].stop()


def events(server: RunningServer, path: str, document: dict) -> list[dict]:
    status, headers, body = server.request(
        "POST", path, json.dumps(document), {"Content-Type": "application/json"}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), body
    return [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]


# --- TGI's routes ---------------------------------------------------------------------


def test_generate_answers_tgis_object_the_same_text_as_post_root(servers):
    chat = servers["chat"]
    parameters = {"max_new_tokens": 6, "return_full_text": False}
    status, whole = chat.post_json({"inputs": PROMPT, "parameters": parameters}, "/generate")
    assert status == 200 and set(whole) == {"generated_text"}, whole
    greedy = {"inputs": PROMPT, "parameters": {**parameters, "do_sample": False}}
    assert chat.post_json(greedy)[1][0] == chat.post_json(greedy, "/generate")[1]


def test_generate_details_list_every_token_with_its_logprob(servers):
    document = {"inputs": PROMPT, "parameters": {**CLIENT_DEFAULTS, "max_new_tokens": 6}}
    status, answer = servers["chat"].post_json(document, "/generate")
    assert status == 200, answer
    details = answer["details"]
    # TGI's Details, no more: clients typed from TGI's OpenAPI document read these
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["finish_reason"] in ("length", "eos_token")
    assert details["prefill"] == [] and details["seed"] is None
    tokens = details["tokens"]
    assert len(tokens) == details["generated_tokens"] >= 1
    assert all(set(token) == {"id", "text", "logprob", "special"} for token in tokens)
    assert all(token["logprob"] <= 0 for token in tokens)
    words = "".join(token["text"] for token in tokens if not token["special"])
    # the pieces are the text as it grew (a character cut at the end waits for its rest)
    assert answer["generated_text"].startswith(words) and words


def test_generate_stream_sends_tgis_events_the_text_on_the_last(servers):
    document = {"inputs": PROMPT, "parameters": {**CLIENT_DEFAULTS, "max_new_tokens": 6}}
    streamed = events(servers["chat"], "/generate_stream", document)
    status, whole = servers["chat"].post_json(document, "/generate")
    assert [event["token"]["id"] for event in streamed] == [
        token["id"] for token in whole["details"]["tokens"]
    ]
    *middle, last = streamed
    assert all(event["generated_text"] is None and event["details"] is None for event in middle)
    assert last["generated_text"] == whole["generated_text"]
    assert last["details"]["generated_tokens"] == len(streamed)
    # TGI's StreamDetails: the prompt's length as `input_length` (InferenceClient types it)
    assert set(last["details"]) == {"finish_reason", "generated_tokens", "input_length", "seed"}
    parameters = {**CLIENT_DEFAULTS, "max_new_tokens": 1, "decoder_input_details": True}
    prefilled = {"inputs": PROMPT, "parameters": parameters}
    prefill = servers["chat"].post_json(prefilled, "/generate")[1]["details"]["prefill"]
    assert last["details"]["input_length"] == len(prefill) >= 2


def test_top_n_tokens_lists_the_likeliest_tokens_beside_each_as_tgi_does(servers):
    parameters = {**CLIENT_DEFAULTS, "max_new_tokens": 5, "top_n_tokens": 3}
    document = {"inputs": PROMPT, "parameters": parameters}
    status, whole = servers["chat"].post_json(document, "/generate")
    assert status == 200, whole
    details = whole["details"]
    assert len(details["top_tokens"]) == len(details["tokens"]) == details["generated_tokens"]
    for token, top in zip(details["tokens"], details["top_tokens"], strict=True):
        assert len(top) == 3 and all(set(t) == {"id", "text", "logprob", "special"} for t in top)
        assert top[0]["id"] == token["id"]  # greedy (the client's default): the likeliest
    streamed = events(servers["chat"], "/generate_stream", document)

    def ids(tops):  # (log probabilities move in their last digits with batch-mates)
        return [[t["id"] for t in top] for top in tops]

    assert ids(event["top_tokens"] for event in streamed) == ids(details["top_tokens"])
    assert all("top_tokens" not in event["token"] for event in streamed)


def test_decoder_input_details_lists_the_prompts_tokens_as_tgi_does(servers):
    parameters = {**CLIENT_DEFAULTS, "max_new_tokens": 3, "decoder_input_details": True}
    document = {"inputs": PROMPT, "parameters": parameters}
    status, whole = servers["chat"].post_json(document, "/generate")
    assert status == 200, whole
    prefill = whole["details"]["prefill"]
    assert len(prefill) >= 2 and all(set(token) == {"id", "text", "logprob"} for token in prefill)
    assert prefill[0]["logprob"] is None and all(t["logprob"] <= 0 for t in prefill[1:])
    assert "".join(token["text"] for token in prefill) == PROMPT
    # as TGI: not with a stream
    status, headers, body = servers["chat"].request(
        "POST", "/generate_stream", json.dumps(document), {"Content-Type": "application/json"}
    )
    assert status == 422 and b"decoder_input_details" in body


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("adapter_id", "lora"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/"])
def test_tgi_parameters_rawserve_does_not_serve_are_422_naming_them(servers, path, name, value):
    parameters = {**CLIENT_DEFAULTS, name: value}
    status, answer = servers["chat"].post_json({"inputs": PROMPT, "parameters": parameters}, path)
    assert status == 422 and name in answer["error"], answer


# what langchain-huggingface 1.2.3's HuggingFaceEndpoint sends by default (InferenceClient
# drops its nulls), with a seed
LANGCHAIN_DEFAULTS = {
    "max_new_tokens": 8,
    "top_p": 0.95,
    "typical_p": 0.95,
    "temperature": 0.8,
    "return_full_text": False,
    "stop": [],
    "do_sample": False,
    "watermark": False,
}


@pytest.mark.parametrize("path", ["/generate", "/"])
def test_typical_p_samples_and_a_seed_repeats_it(servers, path):
    chat = servers["chat"]
    typical = {**CLIENT_DEFAULTS, "max_new_tokens": 8, "typical_p": 0.95}
    status, answer = chat.post_json({"inputs": PROMPT, "parameters": typical}, path)
    assert status == 200, answer
    answer = answer if path == "/generate" else answer[0]
    seed = answer["details"]["seed"]
    assert isinstance(seed, int)  # it sampled (greedy names no seed)
    again = {"inputs": PROMPT, "parameters": {**typical, "seed": seed}}
    assert chat.post_json(again, path)[1] == (answer if path == "/generate" else [answer])
    defaults = {"inputs": PROMPT, "parameters": {**LANGCHAIN_DEFAULTS, "seed": 3}}
    status, first = chat.post_json(defaults, path)
    assert status == 200 and chat.post_json(defaults, path) == (200, first), first


def test_generate_takes_one_text(servers):
    status, answer = servers["chat"].post_json({"inputs": [PROMPT]}, "/generate")
    assert status == 422 and "one text" in answer["error"]


# what TGI's validation refuses: (the prompt, its parameters)
REFUSED_BY_VALIDATION = [
    pytest.param(PROMPT, {"max_new_tokens": 0}, id="max_new_tokens 0"),
    pytest.param(PROMPT, {"max_new_tokens": 100_000}, id="max_new_tokens past the positions"),
    pytest.param(PROMPT, {"do_sample": True, "temperature": -1}, id="temperature below 0"),
    pytest.param(PROMPT, {"best_of": 2}, id="best_of without sampling"),
    pytest.param(PROMPT, {"do_sample": True, "best_of": 2, "seed": 5}, id="best_of with a seed"),
    pytest.param("", {"max_new_tokens": 2}, id="blank prompt"),
    pytest.param("word " * 400, {"max_new_tokens": 2}, id="prompt past the positions"),
]
TGI_ROUTES = [
    pytest.param("/generate", {}, id="generate"),
    pytest.param("/generate_stream", {}, id="generate_stream"),
    pytest.param("/", {}, id="root"),
    pytest.param("/", {"stream": True}, id="root streamed"),
]


@pytest.mark.parametrize(("prompt", "parameters"), REFUSED_BY_VALIDATION)
@pytest.mark.parametrize(("path", "fields"), TGI_ROUTES)
def test_what_tgis_validation_refuses_is_422_validation(servers, path, fields, prompt, parameters):
    document = {"inputs": prompt, "parameters": parameters, **fields}
    status, answer = servers["chat"].post_json(document, path)
    assert status == 422 and answer["error_type"] == "validation", answer


# --- InferenceClient, which posts to POST / ---------------------------------------------


@pytest.fixture
def inference_client(servers):
    from huggingface_hub import InferenceClient, constants

    # HF_HUB_OFFLINE=1 (the suite's) makes the client refuse every URL, loopback included
    saved, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    client = InferenceClient(base_url=base_url(servers["chat"]))
    yield client
    client.close()
    constants.HF_HUB_OFFLINE = saved


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("prompt", "parameters"), REFUSED_BY_VALIDATION)
def test_inference_client_raises_validation_error(inference_client, prompt, parameters, stream):
    from huggingface_hub.errors import ValidationError

    with pytest.raises(ValidationError):
        answer = inference_client.text_generation(prompt, stream=stream, **parameters)
        if stream:
            list(answer)


@pytest.mark.parametrize("full_text", [None, True, False], ids=["default", "full", "new"])
def test_post_root_streams_the_text_it_answers_whole(inference_client, full_text):
    asked = {"max_new_tokens": 6, "do_sample": False}
    if full_text is not None:
        asked["return_full_text"] = full_text
    whole = inference_client.text_generation(PROMPT, **asked)
    events = list(inference_client.text_generation(PROMPT, stream=True, details=True, **asked))
    assert events[-1].generated_text == whole
    # POST /'s default is the Inference API's: the prompt, then what was generated
    shown = PROMPT if full_text is not False else ""
    assert whole.startswith(shown)
    assert "".join(event.token.text for event in events) == whole.removeprefix(shown)


def test_inference_clients_frequency_penalty_is_served_as_tgi_serves_it(servers, inference_client):
    """InferenceClient's `frequency_penalty` (TGI's: each token's share of the prompt and
    the tokens made so far) answers, the same on every TGI route and streamed."""
    asked = {"max_new_tokens": 8, "do_sample": False, "frequency_penalty": 2.0}
    asked["return_full_text"] = False
    penalized = inference_client.text_generation(PROMPT, **asked)
    streamed = list(inference_client.text_generation(PROMPT, stream=True, **asked))
    assert "".join(streamed) == penalized
    document = {"inputs": PROMPT, "parameters": {**CLIENT_DEFAULTS, **asked}}
    status, answer = servers["chat"].post_json(document, "/generate")
    assert status == 200 and answer["generated_text"] == penalized, answer
    plain = inference_client.text_generation(PROMPT, **{**asked, "frequency_penalty": 0})
    assert plain != penalized  # (the tiny model repeats itself: the penalty changes that)


def test_inference_clients_watermark_is_found_in_its_answer(inference_client, tiny_model):
    """InferenceClient's `watermark` (TGI's): the answer's tokens, read after the prompt's
    last, are green far past chance (`z_score`); the same request without it is not."""
    from transformers import AutoConfig, AutoTokenizer

    from rawserve.worker.watermark import MARKED_Z, z_score

    model = tiny_model("chat")
    vocabulary = AutoConfig.from_pretrained(model).vocab_size
    last = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"][-1]
    asked = {"max_new_tokens": 64, "do_sample": True, "seed": 5, "details": True}
    found = {}
    for watermark in (True, False):
        answer = inference_client.text_generation(PROMPT, watermark=watermark, **asked)
        ids = [token.id for token in answer.details.tokens]
        assert len(ids) >= 32, answer
        found[watermark] = z_score([last, *ids], vocabulary)
    assert found[True] > MARKED_Z > found[False], found


def test_inference_clients_truncate_reads_a_long_prompts_last_tokens(
    servers, inference_client, tiny_model
):
    """TGI's `truncate`: a prompt past the model's positions (refused whole) is answered
    from its last tokens, as those tokens alone; more than `max_input_tokens` is TGI's
    validation error."""
    from huggingface_hub.errors import ValidationError

    long = "the movie was good and the film was bad " * 40
    asked = {"max_new_tokens": 4, "do_sample": False, "details": True}
    with pytest.raises(ValidationError, match="context length"):
        inference_client.text_generation(long, **asked)
    cut = inference_client.text_generation(long, truncate=12, **asked)
    assert cut.generated_text.startswith(long)  # (POST /'s full text: the prompt as sent)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model("chat"))(long)["input_ids"][-12:]
    status, alone = servers["chat"].post_json(
        {"prompt": ids, "max_tokens": 4, "temperature": 0}, "/v1/completions"
    )
    assert status == 200 and cut.generated_text == long + alone["choices"][0]["text"], alone
    streamed = list(inference_client.text_generation(long, truncate=12, stream=True, **asked))
    assert streamed[-1].details.input_length == 12  # (the prompt's tokens, as TGI counts)
    status, _, info = servers["chat"].request("GET", "/info")
    past = json.loads(info)["max_input_tokens"] + 1
    status, refused = servers["chat"].post_json({"inputs": long}, "/generate")
    assert status == 422 and 'send "truncate" to read only its last tokens' in refused["error"]
    for path in ("/generate", "/generate_stream"):
        document = {"inputs": "the movie", "parameters": {"truncate": past}}
        status, answer = servers["chat"].post_json(document, path)
        assert status == 422 and answer["error_type"] == "validation", answer
        assert f"truncate is {past}" in answer["error"]


def test_inference_clients_best_of_gives_the_likeliest_of_its_sampled_answers(
    servers, inference_client
):
    """TGI's `best_of`: as many answers sampled, each with a seed of its own, the one whose
    tokens' log probabilities add up highest given, the others under `best_of_sequences`;
    the answer given is the one its seed makes alone. Streamed, it is TGI's 422."""
    from huggingface_hub.errors import ValidationError

    asked = {"max_new_tokens": 6, "do_sample": True, "return_full_text": False}
    answer = inference_client.text_generation(PROMPT, best_of=2, details=True, **asked)
    others = answer.details.best_of_sequences
    assert len(others) == 1
    seeds = {answer.details.seed, *(other.seed for other in others)}
    assert len(seeds) == 2  # (each sampled with a seed of its own)

    def chance(tokens: list) -> float:
        return sum(token.logprob for token in tokens)

    assert all(chance(answer.details.tokens) >= chance(other.tokens) for other in others)
    alone = inference_client.text_generation(PROMPT, seed=answer.details.seed, **asked)
    assert alone == answer.generated_text
    for other in others:
        again = inference_client.text_generation(PROMPT, seed=other.seed, **asked)
        assert again == other.generated_text
    plain = inference_client.text_generation(PROMPT, best_of=2, **asked)
    assert isinstance(plain, str)  # (without details, the text alone)
    # (each answer an item: no more than --max-client-batch-size, 2 here, as /info says)
    status, _, info = servers["chat"].request("GET", "/info")
    assert json.loads(info)["max_best_of"] == 2
    with pytest.raises(ValidationError, match="best_of 3 for 1 prompt makes 3 generations"):
        inference_client.text_generation(PROMPT, best_of=3, **asked)
    with pytest.raises(ValidationError, match="best_of above 1 is not allowed"):
        list(inference_client.text_generation(PROMPT, best_of=2, stream=True, **asked))
    document = {"inputs": PROMPT, "parameters": {**asked, "best_of": 2}}
    status, refused = servers["chat"].post_json(document, "/generate_stream")
    assert status == 422 and refused["error_type"] == "validation", refused


def test_post_root_and_generate_stream_send_the_same_tokens(servers):
    parameters = {"max_new_tokens": 8, "do_sample": False, "return_full_text": False}
    document = {"inputs": PROMPT, "parameters": parameters}
    from_tgi = events(servers["chat"], "/generate_stream", document)
    from_root = events(servers["chat"], "/", {**document, "stream": True})

    def shown(streamed):  # (log probabilities move in their last digits with batch-mates)
        return [(e["token"]["id"], e["token"]["text"], e["generated_text"]) for e in streamed]

    assert shown(from_root) == shown(from_tgi)


# --- TGI's own client ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tgi_client_python(tgi_client_installing) -> Path:
    return tgi_client_installing.result()


@pytest.fixture(scope="module")
def tgi_client_answers(servers, tgi_client_python):
    """What TGI's client got for each call of tests/compat_tgi_client.py."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    ran = subprocess.run(
        [str(tgi_client_python), str(HERE / "compat_tgi_client.py"), base_url(servers["chat"])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout)


def base_url(server: RunningServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def test_tgi_client_generates(servers, tgi_client_answers):
    answer = tgi_client_answers["generate"]
    assert "raised" not in answer, answer
    status, direct = servers["chat"].post_json(
        {"inputs": PROMPT, "parameters": {**CLIENT_DEFAULTS, "max_new_tokens": 5}}, "/generate"
    )
    assert answer["generated_text"] == direct["generated_text"]
    assert len(answer["details"]["tokens"]) == answer["details"]["generated_tokens"]
    assert "raised" not in tgi_client_answers["generate_stop"]
    best = tgi_client_answers["generate_best_of"]
    assert "raised" not in best, best
    assert len(best["details"]["best_of_sequences"]) == 1
    penalized = tgi_client_answers["generate_penalized"]
    assert "raised" not in penalized, penalized
    parameters = {**CLIENT_DEFAULTS, "max_new_tokens": 5, "frequency_penalty": 2.0}
    status, direct = servers["chat"].post_json(
        {"inputs": PROMPT, "parameters": parameters}, "/generate"
    )
    assert status == 200 and penalized["generated_text"] == direct["generated_text"]
    assert penalized["generated_text"] != answer["generated_text"]
    marked = tgi_client_answers["watermark"]
    assert "raised" not in marked, marked
    parameters = {**CLIENT_DEFAULTS, "max_new_tokens": 12, "do_sample": True, "seed": 3}
    for watermark in (True, False):
        # (where the client posts: `POST /` samples at the pipeline's defaults, 0.7 and
        # the 50 likeliest, /generate at TGI's)
        document = {"inputs": PROMPT, "parameters": {**parameters, "watermark": watermark}}
        status, [direct] = servers["chat"].post_json(document, "/")
        assert status == 200, direct
        same = marked["generated_text"] == direct["generated_text"]
        assert same == watermark  # (the client's watermark was sent, and applied)


def test_tgi_client_streams(tgi_client_answers):
    streamed = tgi_client_answers["generate_stream"]
    assert isinstance(streamed, list) and streamed, streamed
    assert streamed[-1]["generated_text"] == tgi_client_answers["generate"]["generated_text"]
    assert streamed[-1]["details"]["finish_reason"] in ("length", "eos_token")


def test_tgi_client_chats_naming_its_model_tgi(servers, tgi_client_answers):
    answer = tgi_client_answers["chat"]
    assert "raised" not in answer, answer
    assert answer["model"] == "chat"  # the served model's name, whatever the client sent
    assert answer["choices"][0]["message"]["role"] == "assistant"


def test_tgi_client_fails_to_stream_a_chat_as_the_readme_says(tgi_client_answers):
    """Its chunk type requires `tool_calls` in every delta, and its report of that reads
    a `status` the response has not (TGI's own answers fail it the same way)."""
    failed = tgi_client_answers["chat_stream"]
    assert failed == {
        "raised": "AttributeError",
        "message": "'Response' object has no attribute 'status'",
    }


def test_tgi_client_shows_rawserves_refusals(tgi_client_answers):
    too_long = tgi_client_answers["too_long"]
    assert too_long["raised"] == "ValidationError" and "max_new_tokens" in too_long["message"]
    # its chat reads TGI's type beside OpenAI's error object (its message: that object)
    chat_too_long = tgi_client_answers["chat_too_long"]
    assert chat_too_long["raised"] == "ValidationError", chat_too_long
    assert "max_tokens" in chat_too_long["message"]


# --- the openai SDK shows rawserve's messages ------------------------------------------


@pytest.fixture
def openai_api(servers):
    import openai

    clients = []

    def make(name: str) -> openai.OpenAI:
        api = openai.OpenAI(base_url=base_url(servers[name]) + "/v1", api_key="x", max_retries=0)
        clients.append(api)
        return api

    yield make
    for api in clients:
        api.close()


def test_openai_sdk_shows_a_404s_message(openai_api):
    import openai

    with pytest.raises(openai.NotFoundError) as raised:
        openai_api("chat").embeddings.create(model="chat", input="hello")
    assert "this route needs a feature-extraction model" in str(raised.value)
    assert raised.value.type == "not_found_error"


def test_openai_sdk_retrieves_a_served_model_as_listed_and_not_one_not_served(openai_api):
    import openai

    api = openai_api("chat")
    assert api.models.retrieve("chat") == api.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as raised:
        api.models.retrieve("org/gpt-4o")
    assert raised.value.code == "model_not_found" and "'org/gpt-4o'" in raised.value.message


def test_openai_sdk_shows_a_413s_message(openai_api):
    import openai

    with pytest.raises(openai.APIStatusError) as raised:
        openai_api("chat").completions.create(model="chat", prompt=["a", "b", "c"], max_tokens=2)
    assert raised.value.status_code == 413
    assert "at most 2" in str(raised.value), raised.value


def test_openai_sdk_shows_a_422s_message(openai_api):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as raised:
        openai_api("chat").completions.create(model="chat", prompt="word " * 400, max_tokens=2)
    assert "a prompt is longer than the model's context length: it takes at most 255 tokens" in str(
        raised.value
    ), raised.value
    assert raised.value.param == "prompt"  # the field at fault ("messages" on chat)


def test_openai_sdk_shows_a_503s_message(openai_api):
    import openai

    with pytest.raises(openai.InternalServerError) as raised:
        openai_api("loading").embeddings.create(model="x", input="hello")
    assert raised.value.status_code == 503
    assert "the model is loading" in str(raised.value)
    assert raised.value.type == "server_error"


def test_openai_sdk_shows_a_stream_errors_message(openai_api):
    import openai

    # refused before it queues (a status of its own), or, were it refused once running, in
    # the stream's error event: the SDK shows the message either way
    with pytest.raises(openai.APIError) as raised:
        for _ in openai_api("chat").completions.create(
            model="chat", prompt="word " * 400, max_tokens=2, stream=True
        ):
            pass
    assert "a prompt is longer than the model's context length: it takes at most 255 tokens" in str(
        raised.value
    ), raised.value

"""The clients users already have, against the real server: huggingface_hub's
InferenceClient for every served task, the openai client for embeddings.

Each answer is compared with what the model gives in-process (the transformers
pipeline where there is one, rawserve's own adapter run in-process where there is not).
The servers start together, once for the module.
"""

from __future__ import annotations

import base64
import json
import socket

import numpy as np
import pytest

from tests.server import RunningServer, running_together

pytestmark = pytest.mark.slow

EMBEDDING = "sentence-embedding"  # the served name: the model folder's name
SERVED = {
    # name: (tiny model kind, extra arguments)
    "embedding": ("sentence-embedding", []),
    "classifier": ("text-classification", []),
    "fill-mask": ("fill-mask", ["--task", "fill-mask"]),
    "ner": ("token-classification", []),
    "qa": ("question-answering", []),
    "zero-shot": ("zero-shot-classification", ["--task", "zero-shot-classification"]),
    "generation": ("text-generation", []),
    "summarization": ("seq2seq", ["--task", "summarization"]),
    "translation": ("seq2seq", ["--task", "translation"]),
    "image": ("image-classification", []),
}


@pytest.fixture(scope="module")
def servers(tiny_model):
    started = {
        name: RunningServer(["--model", tiny_model(kind), "--threads", "1", *extra])
        for name, (kind, extra) in SERVED.items()
    }
    with running_together(started, OPEN_CLIENTS):
        yield started


@pytest.fixture(scope="module", autouse=True)
def hub_client_may_reach_loopback():
    """HF_HUB_OFFLINE=1 (set for the whole suite) makes huggingface_hub refuse every
    request, its InferenceClient's to our loopback server included. The test process
    still downloads nothing: its models are local folders and the clients' base URL is
    127.0.0.1."""
    from huggingface_hub import constants

    saved, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    yield
    constants.HF_HUB_OFFLINE = saved


OPEN_CLIENTS: dict[tuple[str, int], object] = {}  # closed with the servers


def client(server):
    from huggingface_hub import InferenceClient

    key = ("hub", server.port)
    if key not in OPEN_CLIENTS:
        OPEN_CLIENTS[key] = InferenceClient(base_url=f"http://127.0.0.1:{server.port}")
    return OPEN_CLIENTS[key]


@pytest.fixture(scope="module")
def local(tiny_model):
    """In-process references, loaded once."""
    cache = {}

    def get(kind, task=None):
        from transformers import pipeline

        key = (kind, task)
        if key not in cache:
            cache[key] = pipeline(task or kind, model=tiny_model(kind))
        return cache[key]

    return get


def in_process_runner(tiny_model, kind, task):
    from rawserve.worker.loading import load_runner
    from tests.tiny_models import worker_config

    return load_runner(worker_config(tiny_model(kind), task, dtype="float32"), "cpu")


# --- InferenceClient ------------------------------------------------------------------


def test_feature_extraction_is_the_pooled_normalized_sentence_vector(servers, tiny_model):
    import torch
    import transformers

    got = client(servers["embedding"]).feature_extraction("hello world")
    folder = tiny_model("sentence-embedding")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    encoded = tokenizer(["hello world"], return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1)
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert got.shape == (1, 32) or got.shape == (32,)
    np.testing.assert_allclose(got.reshape(-1), expected[0].numpy(), atol=1e-5)
    unnormalized = client(servers["embedding"]).feature_extraction("hello world", normalize=False)
    assert np.linalg.norm(unnormalized) != pytest.approx(1.0, abs=1e-3)
    # its encoding_format, floats (was 400 "unknown field(s)": TEI takes it; a tester)
    floats = client(servers["embedding"]).feature_extraction("hello world", encoding_format="float")
    np.testing.assert_allclose(floats, got)
    with pytest.raises(Exception, match="encoding_format"):  # (base64: /v1/embeddings')
        client(servers["embedding"]).feature_extraction("hello world", encoding_format="base64")


def test_text_classification(servers, local):
    got = client(servers["classifier"]).text_classification("i like this movie")
    expected = local("text-classification")("i like this movie", top_k=None)
    assert got[0].label == expected[0]["label"]
    assert got[0].score == pytest.approx(expected[0]["score"], abs=1e-5)
    both = client(servers["classifier"]).text_classification("i like this movie", top_k=2)
    assert [e.label for e in both] == [e["label"] for e in expected]


def test_fill_mask(servers, local):
    got = client(servers["fill-mask"]).fill_mask("paris is the [MASK] of france", top_k=3)
    expected = local("fill-mask")("paris is the [MASK] of france", top_k=3)
    assert [g.token_str for g in got] == [e["token_str"] for e in expected]
    assert [g.score for g in got] == pytest.approx([e["score"] for e in expected], abs=1e-5)


def test_token_classification(servers, local):
    text = "john lives in paris"
    got = client(servers["ner"]).token_classification(text, aggregation_strategy="simple")
    expected = local("token-classification")(text, aggregation_strategy="simple")
    assert [(g.entity_group, g.word, g.start, g.end) for g in got] == [
        (e["entity_group"], e["word"], e["start"], e["end"]) for e in expected
    ]


def test_token_classification_of_a_whole_long_text_with_a_stride(servers, local):
    """InferenceClient's `stride`: the whole text read in windows, as the pipeline does;
    without an aggregation to merge the windows' overlaps, a 422 that says so."""
    from huggingface_hub.errors import HfHubHTTPError

    text = " ".join(["john lives in paris and mary lives in london"] * 40)
    ner = client(servers["ner"])
    got = ner.token_classification(text, aggregation_strategy="first", stride=32)
    pipe = local("token-classification")
    # the tiny tokenizer declares no length: windows of the model's positions, as served
    pipe.tokenizer.model_max_length = pipe.model.config.max_position_embeddings
    expected = pipe(text, aggregation_strategy="first", stride=32)
    assert [(g.entity_group, g.start, g.end) for g in got] == [
        (e["entity_group"], e["start"], e["end"]) for e in expected
    ]
    assert max(g.end for g in got) > 1000  # past the model's 128 positions
    with pytest.raises(HfHubHTTPError) as refused:
        ner.token_classification(text, stride=32)
    assert refused.value.response.status_code == 422
    assert "stride needs an aggregation_strategy" in refused.value.response.text


def test_question_answering(servers, tiny_model):
    question, context = "who lives in paris", "john lives in paris and mary lives in london"
    got = client(servers["qa"]).question_answering(question=question, context=context)
    runner = in_process_runner(tiny_model, "question-answering", None)
    [expected] = runner.run([{"question": question, "context": context}], {})
    assert (got.answer, got.start, got.end) == (
        expected["answer"],
        expected["start"],
        expected["end"],
    )
    assert got.answer == context[got.start : got.end]
    assert got.score == pytest.approx(expected["score"], abs=1e-5)
    several = client(servers["qa"]).question_answering(question=question, context=context, top_k=3)
    assert len(several) == 3 and several[0].score >= several[1].score >= several[2].score
    # every option the client sends, as transformers 4's pipeline took them
    options = {
        "top_k": 2,
        "align_to_words": False,
        "doc_stride": 4,
        "max_seq_len": 16,
        "max_question_len": 8,
        "max_answer_len": 3,
        "handle_impossible_answer": True,
    }
    answers = client(servers["qa"]).question_answering(
        question=question, context=context, **options
    )
    expected = runner.run([{"question": question, "context": context}], options)[0]
    assert [(a.answer, a.start, a.end) for a in answers] == [
        (e["answer"], e["start"], e["end"]) for e in expected
    ]


def test_zero_shot_classification(servers, local):
    labels = ["movie", "city", "name"]
    got = client(servers["zero-shot"]).zero_shot_classification(
        "i like this film", labels, multi_label=True, hypothesis_template="This is about {}."
    )
    expected = local("zero-shot-classification")(
        "i like this film",
        candidate_labels=labels,
        multi_label=True,
        hypothesis_template="This is about {}.",
    )
    assert [g.label for g in got] == expected["labels"]
    assert [g.score for g in got] == pytest.approx(expected["scores"], abs=1e-5)


def test_text_generation_is_the_pipelines_greedy_text(servers, local):
    got = client(servers["generation"]).text_generation(
        "the capital of france is", max_new_tokens=6, do_sample=False
    )
    [expected] = local("text-generation")(
        "the capital of france is", max_new_tokens=6, do_sample=False
    )
    assert got == expected["generated_text"]
    new_only = client(servers["generation"]).text_generation(
        "the capital of france is", max_new_tokens=6, do_sample=False, return_full_text=False
    )
    assert "the capital of france is" + new_only == expected["generated_text"]


def test_text_generation_streams_one_event_per_token(servers):
    generation = client(servers["generation"])
    whole = generation.text_generation(
        "hello world", max_new_tokens=8, do_sample=False, details=True, return_full_text=False
    )
    events = list(
        generation.text_generation(
            "hello world", max_new_tokens=8, do_sample=False, stream=True, details=True
        )
    )
    assert len(events) == whole.details.generated_tokens == 8
    assert [e.index for e in events] == list(range(1, 9))  # numbered from 1, as TGI does
    assert all(e.generated_text is None for e in events[:-1])
    # POST /'s default, streamed too: the prompt, then the tokens' text
    assert events[-1].generated_text == "hello world" + whole.generated_text
    assert events[-1].details.finish_reason == "length"
    assert "".join(e.token.text for e in events) == whole.generated_text
    assert all(e.token.logprob <= 0 for e in events)


def test_summarization_and_translation(servers, tiny_model):
    text = "the movie was very good and i like it"
    summary = client(servers["summarization"]).summarization(text)
    runner = in_process_runner(tiny_model, "seq2seq", "summarization")
    assert summary.summary_text == runner.run([text], {})[0]["summary_text"]
    translation = client(servers["translation"]).translation(text, src_lang="en", tgt_lang="fr")
    runner = in_process_runner(tiny_model, "seq2seq", "translation")
    expected = runner.run([text], {"src_lang": "en", "tgt_lang": "fr"})[0]
    assert translation.translation_text == expected["translation_text"]


def test_image_classification_from_bytes_and_base64(servers, local):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buffer, "PNG")
    image = buffer.getvalue()
    expected = local("image-classification")(Image.open(io.BytesIO(image)).convert("RGB"))
    raw = client(servers["image"]).image_classification(image)  # the bytes, no Content-Type
    assert [(r.label, round(r.score, 5)) for r in raw] == [
        (e["label"], round(e["score"], 5)) for e in expected
    ]
    top = client(servers["image"]).image_classification(image, top_k=1)  # JSON, base64
    assert [r.label for r in top] == [expected[0]["label"]]
    status, _, body = servers["image"].request("POST", "/", image, {"Content-Type": "image/png"})
    assert status == 200 and json.loads(body)[0]["label"] == expected[0]["label"]
    status, _, _ = servers["image"].request("POST", "/", b"not an image")
    assert status == 422


def test_unknown_parameters_are_refused_by_the_client_too(servers):
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as caught:
        client(servers["summarization"]).summarization(
            "john lives in paris", generate_parameters={"eos_token_id": 2}
        )
    assert caught.value.response.status_code == 400


# --- streaming over a raw socket: TGI's events, and a client that leaves ---------------


def read_events(server, document, stop_after=None):
    """POST a stream request; the parsed `data:` events (stops reading after `stop_after`)."""
    body = json.dumps(document).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    events = []
    try:
        while stop_after is None or len(events) < stop_after:
            data = sock.recv(65536)
            if not data:
                break
            received += data
            events = [
                json.loads(line[5:]) for line in received.split(b"\n") if line.startswith(b"data:")
            ]
            if events and events[-1].get("generated_text") is not None:
                break
    finally:
        sock.close()
    head = received.split(b"\r\n\r\n", 1)[0].decode().lower()
    return head, events


def test_stream_answers_event_stream_in_tgi_shape(servers):
    head, events = read_events(
        servers["generation"],
        {
            "inputs": "hello",
            "parameters": {"max_new_tokens": 3, "do_sample": False},
            "stream": True,
        },
    )
    assert "content-type: text/event-stream" in head
    assert len(events) == 3
    for event in events:
        assert set(event) == {"index", "token", "generated_text", "details"}
        assert set(event["token"]) == {"id", "text", "logprob", "special"}
    assert events[-1]["generated_text"] == "hello" + "".join(e["token"]["text"] for e in events)


def test_a_client_that_leaves_stops_the_generation(servers):
    server = servers["generation"]
    _, events = read_events(
        server,
        # greedy: this random model never picks its end-of-text token then, so the stream
        # cannot end by itself before the client leaves (sampling sometimes did)
        {
            "inputs": "hello",
            "parameters": {"max_new_tokens": 250, "do_sample": False},
            "stream": True,
        },
        stop_after=2,
    )
    assert len(events) >= 2
    import re

    # named by its request's id, as its access line is
    server.wait_for_log(
        re.compile(r"generation stopped after \d+ tokens \(request [0-9a-f]{32}\): the client left")
    )
    status, answer = server.post_json(
        {"inputs": "hello", "parameters": {"max_new_tokens": 2, "do_sample": False}}
    )
    assert status == 200 and answer[0]["generated_text"].startswith("hello")


def test_stream_errors_before_the_first_token_keep_their_status(servers):
    # typed as TGI types them (TGI's clients post here): 422 "validation"
    status, answer = servers["generation"].post_json({"inputs": ["a", "b"], "stream": True})
    assert status == 422 and answer["error_type"] == "validation"
    status, answer = servers["generation"].post_json(
        {"inputs": "a", "parameters": {"max_new_tokens": 0}, "stream": True}
    )
    assert status == 422 and answer["error_type"] == "validation"


# --- the openai client ----------------------------------------------------------------


def openai_client(server):
    import openai

    key = ("openai", server.port)
    if key not in OPEN_CLIENTS:
        OPEN_CLIENTS[key] = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused"
        )
    return OPEN_CLIENTS[key]


def test_openai_embeddings_float_and_base64(servers):
    reference = client(servers["embedding"]).feature_extraction("hello world").reshape(-1)
    api = openai_client(servers["embedding"])
    for encoding_format in ("float", "base64"):
        answer = api.embeddings.create(
            model=EMBEDDING, input=["hello world", "the movie"], encoding_format=encoding_format
        )
        assert [d.index for d in answer.data] == [0, 1]
        got = answer.data[0].embedding
        if encoding_format == "base64":  # asked for explicitly: the client leaves it encoded
            got = np.frombuffer(base64.b64decode(got), dtype="<f4")
        np.testing.assert_allclose(got, reference, atol=1e-6)
    default = api.embeddings.create(model=EMBEDDING, input="hello world")  # base64 on the wire
    np.testing.assert_allclose(default.data[0].embedding, reference, atol=1e-6)
    # [CLS] hello world [SEP] + [CLS] the movie [SEP]: real token counts
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == 8


def test_openai_base64_is_little_endian_float32(servers):
    status, answer = servers["embedding"].post_json(
        {"input": "hello world", "model": EMBEDDING, "encoding_format": "base64"},
        path="/v1/embeddings",
    )
    assert status == 200
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (32,) and np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


def test_openai_dimensions_truncate_then_renormalize(servers):
    api = openai_client(servers["embedding"])
    full = np.array(api.embeddings.create(model=EMBEDDING, input="hello world").data[0].embedding)
    short = np.array(
        api.embeddings.create(model=EMBEDDING, input="hello world", dimensions=8).data[0].embedding
    )
    assert short.shape == (8,) and np.linalg.norm(short) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
    status, _ = servers["embedding"].post_json(
        {"input": "x", "dimensions": 33}, path="/v1/embeddings"
    )
    assert status == 422


def test_openai_models_lists_the_served_model(servers, tiny_model):
    models = openai_client(servers["embedding"]).models.list()
    assert [m.id for m in models.data] == [EMBEDDING]


@pytest.mark.parametrize(
    "document",
    [
        {"model": EMBEDDING},
        {"input": 5},
        {"input": [[1, 2, 3], "x"]},  # token arrays or texts, one form for all
        {"input": [-1]},
        {"input": []},
        {"input": "x", "encoding_format": "int8"},
        {"input": "x", "dimensions": 0},
        {"input": "x", "unknown": 1},
    ],
)
def test_openai_embeddings_refuses_bad_bodies(servers, document):
    status, answer = servers["embedding"].post_json(document, path="/v1/embeddings")
    assert status == 400, answer


def test_openai_embeddings_only_for_feature_extraction(servers):
    status, _ = servers["classifier"].post_json({"input": "x"}, path="/v1/embeddings")
    assert status == 404

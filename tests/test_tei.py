"""Text Embeddings Inference's routes, as a TEI user's code calls them.

Each route's request and response shapes are checked field by field against TEI's
published API description (its `docs/openapi.json`), and each answer against what the
tiny model gives in-process: `/embed` and `/embed_all` on a sentence-transformers model,
`/predict` on a two-label classifier, `/rerank` on a cross-encoder (one label),
`/tokenize` and `/decode` on the tokenizer, and TEI's fields in `/info`. The servers start
together, once for the module.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.server import RunningServer, running_together
from tests.tiny_models import SENTENCE_PROMPTS

pytestmark = pytest.mark.slow

CLIENT_BATCH = 4  # the embedding server's --max-client-batch-size, to reach 413 cheaply
SERVED = {
    # name: (tiny model kind, extra arguments)
    "embedding": ("sentence-embedding", ["--max-client-batch-size", str(CLIENT_BATCH)]),
    "classifier": ("text-classification", []),  # the default cap: 32
    "reranker": ("reranker", []),
}
TOKEN_FIELDS = {"id", "text", "special", "start", "stop"}


@pytest.fixture(scope="module")
def servers(tiny_model):
    started = {
        name: RunningServer(["--model", tiny_model(kind), "--threads", "1", *extra])
        for name, (kind, extra) in SERVED.items()
    }
    with running_together(started):
        yield started


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The tiny models and their tokenizers, loaded in this process once."""
    import transformers

    cache: dict[str, tuple] = {}

    def get(kind):
        if kind not in cache:
            folder = tiny_model(kind)
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            if kind in ("reranker", "text-classification"):
                model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
            else:
                model = transformers.AutoModel.from_pretrained(folder)
            cache[kind] = (tokenizer, model.eval())
        return cache[kind]

    return get


def hidden_states(reference, texts):
    import torch

    tokenizer, model = reference("sentence-embedding")
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    return hidden.numpy(), encoded["attention_mask"].numpy()


def mean_pooled(reference, texts, normalize=True):
    hidden, mask = hidden_states(reference, texts)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    if normalize:
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    return pooled


def logits(reference, kind, pairs):
    """The classifier's logits for texts or (text, text_pair) tuples."""
    import torch

    tokenizer, model = reference(kind)
    firsts = [p if isinstance(p, str) else p[0] for p in pairs]
    seconds = None if all(isinstance(p, str) for p in pairs) else [p[1] for p in pairs]
    encoded = tokenizer(firsts, seconds, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**encoded).logits.numpy()


def softmax(row):
    exp = np.exp(row - row.max())
    return exp / exp.sum()


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def assert_error(status, body, expected_status, *words):
    """TEI's (and rawserve's) error body: {"error": message, "error_type": kind}."""
    assert status == expected_status, body
    if isinstance(body.get("error"), dict):  # the OpenAI routes: OpenAI's error object
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        body = {"error": body["error"]["message"], "error_type": body["error"]["code"]}
    assert set(body) == {"error", "error_type"}
    assert isinstance(body["error"], str) and isinstance(body["error_type"], str)
    for word in words:
        assert word in body["error"], body


# --- /embed ---------------------------------------------------------------------------


def test_embed_one_string_is_a_list_of_one_normalized_vector(servers, reference):
    status, body = servers["embedding"].post_json({"inputs": "hello world"}, "/embed")
    assert status == 200
    # EmbedResponse: array of arrays of numbers, one vector per input even for one string
    assert isinstance(body, list) and len(body) == 1
    [vector] = body
    assert len(vector) == 32 and all(isinstance(x, float) for x in vector)
    np.testing.assert_allclose(vector, mean_pooled(reference, ["hello world"])[0], atol=1e-5)
    assert np.linalg.norm(vector) == pytest.approx(1, abs=1e-5)


def test_embed_a_list_answers_in_order_and_matches_each_alone(servers, reference):
    texts = ["hello world", "the movie was very good", "paris"]
    status, body = servers["embedding"].post_json({"inputs": texts}, "/embed")
    assert status == 200 and len(body) == 3
    np.testing.assert_allclose(body, mean_pooled(reference, texts), atol=1e-5)


def test_embed_normalize_false_gives_the_raw_pooled_vector(servers, reference):
    status, body = servers["embedding"].post_json(
        {"inputs": ["hello world"], "normalize": False}, "/embed"
    )
    assert status == 200
    expected = mean_pooled(reference, ["hello world"], normalize=False)
    np.testing.assert_allclose(body, expected, atol=1e-5)
    assert np.linalg.norm(body[0]) != pytest.approx(1, abs=1e-3)


def test_embed_equals_openai_embeddings_for_the_same_input(servers):
    texts = ["hello world", "i like it"]
    status, embedded = servers["embedding"].post_json({"inputs": texts}, "/embed")
    assert status == 200
    status, openai = servers["embedding"].post_json({"input": texts}, "/v1/embeddings")
    assert status == 200
    np.testing.assert_allclose(embedded, [d["embedding"] for d in openai["data"]], atol=1e-6)


def test_embed_dimensions_keeps_the_first_dimensions(servers, reference):
    status, body = servers["embedding"].post_json(
        {"inputs": "hello world", "dimensions": 8, "normalize": False}, "/embed"
    )
    assert status == 200 and len(body[0]) == 8
    full = mean_pooled(reference, ["hello world"], normalize=False)[0]
    np.testing.assert_allclose(body[0], full[:8], atol=1e-5)


@pytest.mark.parametrize("name", sorted(SENTENCE_PROMPTS))
def test_embed_prompt_name_prepends_the_models_prompt(servers, name):
    server = servers["embedding"]
    text = "what is the capital of france"
    status, prompted = server.post_json({"inputs": text, "prompt_name": name}, "/embed")
    assert status == 200
    status, by_hand = server.post_json({"inputs": SENTENCE_PROMPTS[name] + text}, "/embed")
    assert status == 200
    np.testing.assert_allclose(prompted, by_hand, atol=1e-6)


def test_embed_an_unknown_prompt_name_is_refused_naming_the_known_ones(servers):
    status, body = servers["embedding"].post_json(
        {"inputs": "hello", "prompt_name": "nope"}, "/embed"
    )
    assert_error(status, body, 400, "nope", "query", "passage")


def test_post_root_takes_prompt_name_as_inference_client_sends_it(servers):
    """InferenceClient's feature_extraction(prompt_name=...) posts it at the top of the
    body to POST /: the same vectors as /embed's, the unknown name the same 400."""
    server = servers["embedding"]
    texts = ["what is the capital of france", "paris"]
    status, on_root = server.post_json({"inputs": texts, "prompt_name": "query"})
    assert status == 200
    status, on_embed = server.post_json({"inputs": texts, "prompt_name": "query"}, "/embed")
    assert status == 200
    np.testing.assert_allclose(on_root, on_embed, atol=1e-6)
    status, body = server.post_json({"inputs": "hello", "prompt_name": "nope"})
    assert_error(status, body, 400, "nope", "query", "passage")


def test_embed_too_long_is_cut_unless_truncate_is_false(servers, reference):
    """As TEI 1.9's (its auto-truncate on by default): cut where the request does not
    say `truncate: false`."""
    server = servers["embedding"]
    long_text = " ".join(["hello"] * 400)  # the tiny model takes 128 positions
    status, body = server.post_json({"inputs": long_text, "truncate": False}, "/embed")
    assert_error(status, body, 422, "128")
    status, right = server.post_json({"inputs": long_text, "truncate": True}, "/embed")
    assert status == 200 and len(right[0]) == 32
    for unsaid in ({"inputs": long_text}, {"inputs": long_text, "truncate": None}):
        status, cut = server.post_json(unsaid, "/embed")
        assert status == 200 and cut == right
    status, tokens = server.post_json({"inputs": long_text}, "/embed_all")
    assert status == 200 and len(tokens[0]) == 128


def test_embed_truncation_direction_chooses_which_end_is_kept(servers):
    server = servers["embedding"]
    words = " ".join(["hello"] * 200 + ["paris"] * 200)
    answers = {}
    for direction in ("left", "right", "Left", "Right"):  # TEI takes both spellings
        status, body = server.post_json(
            {"inputs": words, "truncate": True, "truncation_direction": direction}, "/embed"
        )
        assert status == 200, body
        answers[direction] = body[0]
    np.testing.assert_allclose(answers["left"], answers["Left"], atol=1e-6)
    np.testing.assert_allclose(answers["right"], answers["Right"], atol=1e-6)
    # keeping the "paris" end differs from keeping the "hello" end
    assert not np.allclose(answers["left"], answers["right"], atol=1e-3)


def test_more_inputs_than_the_client_batch_cap_is_413_at_once(servers):
    server = servers["embedding"]
    texts = ["hello"] * (CLIENT_BATCH + 1)
    for path, document in [
        ("/embed", {"inputs": texts}),
        ("/embed_all", {"inputs": texts}),
        ("/tokenize", {"inputs": texts}),
        ("/decode", {"ids": [[5, 6]] * (CLIENT_BATCH + 1)}),
        ("/v1/embeddings", {"input": texts}),
        ("/", {"inputs": texts}),
    ]:
        status, body = server.post_json(document, path)
        assert_error(status, body, 413, str(CLIENT_BATCH + 1), str(CLIENT_BATCH))
    status, body = server.post_json({"inputs": texts[:CLIENT_BATCH]}, "/embed")
    assert status == 200 and len(body) == CLIENT_BATCH


@pytest.mark.parametrize(
    "document",
    [
        {},
        {"inputs": []},
        {"inputs": None},
        {"inputs": 5},
        {"inputs": [["nested"]]},
        {"inputs": "hello", "normalize": "yes"},
        {"inputs": "hello", "truncate": 1},
        {"inputs": "hello", "truncation_direction": "up"},
        {"inputs": "hello", "dimensions": 0},
        {"inputs": "hello", "dimensions": -3},
        {"inputs": "hello", "dimensions": 33},
        {"inputs": "hello", "prompt_name": 7},
    ],
    ids=repr,
)
def test_embed_bad_requests_are_4xx_with_tei_error_bodies(servers, document):
    status, body = servers["embedding"].post_json(document, "/embed")
    assert status in (400, 422), (status, body)
    assert_error(status, body, status)


HIDDEN = 32  # the tiny sentence-embedding model's vector size
# (NaN is no JSON: a body that holds it is refused before any field is read)
DIMENSIONS = [
    0, -1, 1, HIDDEN, HIDDEN + 1, 65536, 65537, 2**63, 2**64, 1.5, 1e308, -0.0,
    True, False, "3", "", [], {},
]  # fmt: skip


@pytest.mark.parametrize("route", ["/embed", "/v1/embeddings", "/"])
def test_any_dimensions_value_keeps_that_many_or_is_refused_naming_it(servers, route):
    """Every embedding route keeps the first `dimensions` of the vector, or refuses the value
    with a 4xx that names the field (OpenAI's `param` too), wherever it is checked: each
    value on each route, the vector's own size and one past it among them."""
    text = {"input": "hello"} if route.startswith("/v1/") else {"inputs": "hello"}
    for dimensions in DIMENSIONS:
        status, _, raw = servers["embedding"].request(
            "POST", route, json.dumps({**text, "dimensions": dimensions}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        body = json.loads(raw)
        if status == 200:
            vector = body["data"][0]["embedding"] if route.startswith("/v1/") else body
            vector = vector[0] if route == "/embed" else vector
            assert len(vector) == dimensions, (dimensions, body)
            continue
        assert status in (400, 422), (dimensions, body)
        if route.startswith("/v1/"):
            assert body["error"]["param"] == "dimensions", (dimensions, body)
        else:
            assert "dimensions" in body["error"], (dimensions, body)


# --- /similarity, and sentence-similarity on POST / ---------------------------------------


def test_similarity_is_each_sentence_s_cosine_with_the_source(servers, reference):
    source, sentences = "hello world", ["the movie was very good", "hello world", "paris"]
    vectors = mean_pooled(reference, [source, *sentences])
    expected = vectors[1:] @ vectors[0]
    document = {"inputs": {"source_sentence": source, "sentences": sentences}}
    status, body = servers["embedding"].post_json(document, "/similarity")
    assert status == 200 and len(body) == 3
    np.testing.assert_allclose(body, expected, atol=1e-5)
    assert body[1] == pytest.approx(1, abs=1e-5)
    # the Inference API's sentence-similarity: the same body, on the model's URL
    assert servers["embedding"].post_json(document) == (200, body)


def test_a_similarity_is_never_past_1(servers):
    """Unit vectors in float32 gave a cosine of 1.00000006 (for "hi" and "bye", on a tiny
    model whose vectors are all alike), and a client's math.acos of it failed."""
    words = ["hi", "bye", "a", "b", "yes", "no", "up", "down", "cat", "dog", "sun", "sea"]
    scores = []
    for source in words[:4]:
        for first in range(0, len(words), 3):  # (the server takes 4 texts a request)
            sentences = words[first : first + 3]
            document = {"inputs": {"source_sentence": source, "sentences": sentences}}
            status, body = servers["embedding"].post_json(document, "/similarity")
            assert status == 200, body
            scores += body
    assert all(-1 <= score <= 1 for score in scores), max(scores)


def test_inference_client_sentence_similarity(servers, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's, for the Hub

    client = InferenceClient(model=f"http://127.0.0.1:{servers['embedding'].port}")
    scores = client.sentence_similarity("hello world", other_sentences=["paris", "hello world"])
    assert len(scores) == 2 and scores[1] == pytest.approx(1, abs=1e-5)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"parameters": {"truncate": True, "nromalize": False}}, "nromalize"),
        ({"top_k": 2}, "top_k"),
        ({}, '"inputs" must be'),  # (a key beside the two, in "inputs")
    ],
)
def test_sentence_similarity_on_the_inference_api_refuses_what_it_does_not_read(
    servers, extra, named
):
    # POST / refuses unknown fields and parameters for every task: a misspelt one would
    # silently change nothing (TEI's /similarity ignores them, as TEI does, in "inputs" too)
    inputs = {"source_sentence": "hello", "sentences": ["paris"]}
    if not extra:
        inputs["x"] = 1
    document = {"inputs": inputs, **extra}
    assert_error(*servers["embedding"].post_json(document), 400, named)
    assert servers["embedding"].post_json(document, "/similarity")[0] == 200


def test_similarity_parameters_are_tei_s(servers, reference):
    server = servers["embedding"]
    long = {"inputs": {"source_sentence": "hello " * 200, "sentences": ["paris"]}}
    refused = {**long, "parameters": {"truncate": False}}
    assert_error(*server.post_json(refused, "/similarity"), 422, "truncate")
    assert server.post_json(long, "/similarity")[0] == 200  # cut, as TEI 1.9 cuts
    cut = {**long, "parameters": {"truncate": True, "truncation_direction": "left"}}
    assert server.post_json(cut, "/similarity")[0] == 200
    document = {"inputs": {"source_sentence": "hello", "sentences": ["paris"]}}
    status, body = server.post_json(
        {**document, "parameters": {"prompt_name": "query"}}, "/similarity"
    )
    prefix = SENTENCE_PROMPTS["query"]
    vectors = mean_pooled(reference, [prefix + "hello", prefix + "paris"])
    assert status == 200 and body == pytest.approx([vectors[1] @ vectors[0]], abs=1e-5)
    too_many = {"inputs": {"source_sentence": "a", "sentences": ["b"] * CLIENT_BATCH}}
    assert_error(*server.post_json(too_many, "/similarity"), 413)  # the source counts too
    blank = {"inputs": {"source_sentence": "a", "sentences": [" "]}}
    assert_error(*server.post_json(blank, "/similarity"), 422)


# --- /embed_all -----------------------------------------------------------------------


def test_embed_all_answers_every_tokens_vector_unpooled(servers, reference):
    texts = ["hello world", "the movie was very good"]
    status, body = servers["embedding"].post_json({"inputs": texts}, "/embed_all")
    assert status == 200
    # EmbedAllResponse: per input, per token (special tokens included), a vector
    hidden, mask = hidden_states(reference, texts)
    assert len(body) == 2
    for row, answer in enumerate(body):
        tokens = int(mask[row].sum())
        assert np.shape(answer) == (tokens, 32)
        np.testing.assert_allclose(answer, hidden[row, :tokens], atol=1e-5)


def test_embed_all_one_string_is_a_list_of_one(servers, reference):
    status, body = servers["embedding"].post_json({"inputs": "hello world"}, "/embed_all")
    assert status == 200 and len(body) == 1
    tokenizer, _ = reference("sentence-embedding")
    assert len(body[0]) == len(tokenizer("hello world")["input_ids"])


# --- /predict -------------------------------------------------------------------------


def test_predict_one_text_gives_every_label_sorted_by_softmax_score(servers, reference):
    status, body = servers["classifier"].post_json({"inputs": "i like it"}, "/predict")
    assert status == 200
    # PredictResponse for one input: an array of Prediction {label, score}
    assert isinstance(body, list) and len(body) == 2
    assert all(set(p) == {"label", "score"} for p in body)
    assert {p["label"] for p in body} == {"NEGATIVE", "POSITIVE"}
    scores = [p["score"] for p in body]
    assert scores == sorted(scores, reverse=True)
    expected = softmax(logits(reference, "text-classification", ["i like it"])[0])
    by_label = {p["label"]: p["score"] for p in body}
    assert by_label["NEGATIVE"] == pytest.approx(float(expected[0]), abs=1e-5)
    assert by_label["POSITIVE"] == pytest.approx(float(expected[1]), abs=1e-5)


def test_predict_raw_scores_are_the_logits(servers, reference):
    status, body = servers["classifier"].post_json(
        {"inputs": "i like it", "raw_scores": True}, "/predict"
    )
    assert status == 200
    raw = logits(reference, "text-classification", ["i like it"])[0]
    by_label = {p["label"]: p["score"] for p in body}
    assert by_label["NEGATIVE"] == pytest.approx(float(raw[0]), abs=1e-5)
    assert by_label["POSITIVE"] == pytest.approx(float(raw[1]), abs=1e-5)


def test_predict_a_pair_of_strings_is_one_input_scored_as_a_pair(servers, reference):
    pair = ["who lives in paris", "john lives in paris"]
    status, body = servers["classifier"].post_json({"inputs": pair}, "/predict")
    assert status == 200 and len(body) == 2 and all(isinstance(p, dict) for p in body)
    expected = softmax(logits(reference, "text-classification", [tuple(pair)])[0])
    by_label = {p["label"]: p["score"] for p in body}
    assert by_label["POSITIVE"] == pytest.approx(float(expected[1]), abs=1e-5)


def test_predict_a_batch_mixes_singles_and_pairs_and_answers_a_list_each(servers, reference):
    batch = [["i like it"], ["who lives in paris", "john lives in paris"], ["bad movie"]]
    status, body = servers["classifier"].post_json({"inputs": batch}, "/predict")
    assert status == 200 and len(body) == 3
    references = [
        logits(reference, "text-classification", ["i like it"])[0],
        logits(reference, "text-classification", [tuple(batch[1])])[0],
        logits(reference, "text-classification", ["bad movie"])[0],
    ]
    for predictions, raw in zip(body, references, strict=True):
        assert isinstance(predictions, list) and len(predictions) == 2
        expected = softmax(raw)
        by_label = {p["label"]: p["score"] for p in predictions}
        assert by_label["NEGATIVE"] == pytest.approx(float(expected[0]), abs=1e-5)


def test_predict_a_list_longer_than_32_is_413(servers):
    status, body = servers["classifier"].post_json({"inputs": [["hello"]] * 33}, "/predict")
    assert_error(status, body, 413, "33", "32")


@pytest.mark.parametrize(
    "inputs",
    [[], ["a", "b", "c"], [["a", "b", "c"]], [[]], [5], [["a"], "b"], {"text": "a"}],
    ids=repr,
)
def test_predict_inputs_that_are_neither_text_pair_nor_batch_are_400(servers, inputs):
    status, body = servers["classifier"].post_json({"inputs": inputs}, "/predict")
    assert_error(status, body, 400)


def test_predict_on_a_reranker_scores_its_one_label_with_a_sigmoid(servers, reference):
    status, body = servers["reranker"].post_json({"inputs": "i like it"}, "/predict")
    assert status == 200 and len(body) == 1
    [prediction] = body
    raw = logits(reference, "reranker", ["i like it"])[0][0]
    assert prediction["score"] == pytest.approx(float(sigmoid(raw)), abs=1e-5)
    assert prediction["label"] == "LABEL_0"


# --- /rerank --------------------------------------------------------------------------

QUERY = "who lives in paris"
TEXTS = ["john lives in paris", "the movie was bad", "mary works in london", "paris"]


def test_rerank_scores_each_query_text_pair_and_sorts_by_score(servers, reference):
    status, body = servers["reranker"].post_json({"query": QUERY, "texts": TEXTS}, "/rerank")
    assert status == 200
    # RerankResponse: an array of Rank {index, score, text?}; text only when asked
    assert len(body) == len(TEXTS)
    assert all(set(rank) == {"index", "score"} for rank in body)
    assert sorted(rank["index"] for rank in body) == list(range(len(TEXTS)))
    scores = [rank["score"] for rank in body]
    assert scores == sorted(scores, reverse=True)
    raw = logits(reference, "reranker", [(QUERY, text) for text in TEXTS])[:, 0]
    for rank in body:
        assert rank["score"] == pytest.approx(float(sigmoid(raw[rank["index"]])), abs=1e-5)


def test_rerank_raw_scores_and_return_text(servers, reference):
    """raw_scores answers every text, once each and best first, with its logit unsquashed;
    return_text adds the text."""
    status, body = servers["reranker"].post_json(
        {"query": QUERY, "texts": TEXTS, "raw_scores": True, "return_text": True}, "/rerank"
    )
    assert status == 200
    assert sorted(rank["index"] for rank in body) == list(range(len(TEXTS)))
    scores = [rank["score"] for rank in body]
    assert scores == sorted(scores, reverse=True)
    raw = logits(reference, "reranker", [(QUERY, text) for text in TEXTS])[:, 0]
    for rank in body:
        assert set(rank) == {"index", "score", "text"}
        assert rank["text"] == TEXTS[rank["index"]]
        assert rank["score"] == pytest.approx(float(raw[rank["index"]]), abs=1e-5)


@pytest.mark.parametrize("field", ["top_n", "top_k"])
def test_rerank_top_n_answers_only_the_best_n(servers, field):
    """litellm's rerank sends top_n (Cohere's name); the best n, in the same order."""
    server = servers["reranker"]
    status, every = server.post_json({"query": QUERY, "texts": TEXTS}, "/rerank")
    assert status == 200
    status, best = server.post_json({"query": QUERY, "texts": TEXTS, field: 2}, "/rerank")
    assert status == 200 and same_ranking(best, every[:2])
    status, body = server.post_json({"query": QUERY, "texts": TEXTS, field: 10}, "/rerank")
    assert status == 200 and same_ranking(body, every)  # more than there are: all of them


def same_ranking(ranks: list[dict], expected: list[dict]) -> bool:
    """The same texts in the same order, with the same scores but for rounding: a batch
    run on another worker's number of threads sums in another order (one float32 unit
    apart was seen)."""
    if [r["index"] for r in ranks] != [r["index"] for r in expected]:
        return False
    scores = [r["score"] for r in ranks]
    return scores == pytest.approx([r["score"] for r in expected], rel=1e-5)


def test_rerank_truncate_cuts_a_pair_that_is_too_long(servers):
    server = servers["reranker"]
    long_text = " ".join(["paris"] * 300)
    status, body = server.post_json(
        {"query": QUERY, "texts": [long_text], "truncate": False}, "/rerank"
    )
    assert_error(status, body, 422)
    status, body = server.post_json(
        {"query": QUERY, "texts": [long_text], "truncate": True}, "/rerank"
    )
    assert status == 200 and len(body) == 1
    status, unsaid = server.post_json({"query": QUERY, "texts": [long_text]}, "/rerank")
    assert status == 200 and unsaid == body
    # /v1/rerank answers in OpenAI's shape: its `param` names the field (a tester)
    document = {"query": QUERY, "documents": ["paris", long_text], "truncate": False}
    status, body = server.post_json(document, "/v1/rerank")
    assert status == 422 and body["error"]["param"] == "documents", body


@pytest.mark.parametrize(
    "document",
    [
        {"query": QUERY},
        {"texts": TEXTS},
        {"query": QUERY, "texts": []},
        {"query": QUERY, "texts": "paris"},
        {"query": 5, "texts": TEXTS},
        {"query": QUERY, "texts": [5]},
        {"query": QUERY, "texts": TEXTS, "return_text": "yes"},
        {"query": QUERY, "texts": TEXTS, "top_n": 0},
        {"query": QUERY, "texts": TEXTS, "top_n": "2"},
        {"query": QUERY, "texts": TEXTS, "top_n": 2, "top_k": 3},
    ],
    ids=repr,
)
def test_rerank_bad_requests_are_400(servers, document):
    status, body = servers["reranker"].post_json(document, "/rerank")
    assert_error(status, body, 400)


def test_rerank_more_texts_than_the_cap_is_413(servers):
    status, body = servers["reranker"].post_json(
        {"query": QUERY, "texts": ["paris"] * 33}, "/rerank"
    )
    assert_error(status, body, 413, "33", "32")


# --- what TEI tolerates, and blank text ------------------------------------------------


@pytest.mark.parametrize(
    ("server", "path", "document"),
    [
        # tei-client's embed_all always sends normalize; TEI's /embed_all has no such field
        ("embedding", "/embed_all", {"inputs": "hello", "normalize": True}),
        ("embedding", "/embed", {"inputs": "hello", "pooling": "cls", "user": "x"}),
        ("embedding", "/tokenize", {"inputs": "hello", "return_offsets": True}),
        ("embedding", "/decode", {"ids": [5, 7], "clean_up": None}),
        ("classifier", "/predict", {"inputs": "hello", "top_k": 1, "function_to_apply": "x"}),
        ("reranker", "/rerank", {"query": QUERY, "texts": TEXTS, "return_documents": True}),
    ],
    ids=repr,
)
def test_tei_routes_ignore_fields_they_do_not_use(servers, server, path, document):
    status, body = servers[server].post_json(document, path)
    assert status == 200, body
    plain = {k: v for k, v in document.items() if k in ("inputs", "ids", "query", "texts")}
    status, unadorned = servers[server].post_json(plain, path)
    # the same answer; its floats as a batch's of other shapes may differ in the last bits
    # (1e-9 apart, where an earlier request was batched beside it)
    assert status == 200 and same_numbers(unadorned, body), (unadorned, body)


def same_numbers(found, expected, tolerance=1e-6) -> bool:
    """JSON values equal but for floats within `tolerance` of each other."""
    if isinstance(found, float) or isinstance(expected, float):
        return found == pytest.approx(expected, abs=tolerance)
    if isinstance(found, list) and isinstance(expected, list):
        return len(found) == len(expected) and all(map(same_numbers, found, expected))
    if isinstance(found, dict) and isinstance(expected, dict):
        return found.keys() == expected.keys() and all(
            same_numbers(found[key], expected[key]) for key in found
        )
    return found == expected


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
@pytest.mark.parametrize(
    ("server", "path", "document", "where"),
    [
        ("embedding", "/embed", {"inputs": "BLANK"}, '"inputs" is'),
        ("embedding", "/embed", {"inputs": ["hello", "BLANK"]}, '"inputs" at index 1 is'),
        ("embedding", "/embed", {"inputs": ["a", [5, 6], "BLANK"]}, '"inputs" at index 2 is'),
        ("embedding", "/embed_all", {"inputs": "BLANK"}, '"inputs" is'),
        ("embedding", "/tokenize", {"inputs": "BLANK"}, '"inputs" is'),
        ("embedding", "/v1/embeddings", {"input": "BLANK"}, '"input" is'),
        ("embedding", "/v1/embeddings", {"input": ["hello", "BLANK"]}, '"input" at index 1 is'),
        ("embedding", "/", {"inputs": "BLANK"}, "is"),
        ("embedding", "/", {"inputs": ["hello", "BLANK"]}, "at index 1:"),
        (
            "embedding",
            "/similarity",
            {"inputs": {"source_sentence": "a", "sentences": ["b", "c", "BLANK"]}},
            '"sentences" at index 2 is',
        ),
        ("classifier", "/predict", {"inputs": "BLANK"}, '"inputs" is'),
        ("classifier", "/predict", {"inputs": ["hello", "BLANK"]}, '"inputs" is'),  # one pair
        ("classifier", "/predict", {"inputs": [["a"], ["b", "BLANK"]]}, '"inputs" at index 1 is'),
        ("reranker", "/rerank", {"query": "BLANK", "texts": ["paris"]}, '"query" is'),
        (
            "reranker",
            "/rerank",
            {"query": QUERY, "texts": ["paris", "BLANK"]},
            '"texts" at index 1',
        ),
    ],
    ids=repr,
)
def test_blank_text_is_422_on_every_route_naming_which_it_was(
    servers, server, path, document, where, blank
):
    """Of several inputs, which one was blank (it said only the field: a client with one
    blank text among 32 could not tell which)."""
    document = json.loads(json.dumps(document).replace('"BLANK"', json.dumps(blank)))
    status, body = servers[server].post_json(document, path)
    assert_error(status, body, 422, "empty or only whitespace")
    message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    assert where in message, message
    assert ("at index" in message) == ("at index" in where), message


LONG_TEXT = "hello " * 300  # 302 tokens: the tiny models read 128


@pytest.mark.parametrize(
    ("server", "path", "document", "where"),
    [
        ("reranker", "/rerank", {"query": "q", "texts": ["a", LONG_TEXT]}, '"texts" at index 1:'),
        ("reranker", "/rerank", {"query": "q", "texts": [LONG_TEXT]}, '"texts":'),
        ("reranker", "/rerank", {"query": LONG_TEXT, "texts": ["a", "b"]}, '"query":'),
        (
            "reranker",
            "/v1/rerank",
            {"query": "q", "documents": ["a", LONG_TEXT]},
            '"documents" at index 1:',
        ),
        (
            "embedding",
            "/similarity",
            {"inputs": {"source_sentence": "a", "sentences": ["b", LONG_TEXT]}},
            '"sentences" at index 1:',
        ),
        (
            "embedding",
            "/similarity",
            {"inputs": {"source_sentence": LONG_TEXT, "sentences": ["b", "c"]}},
            '"source_sentence":',
        ),
        (
            "embedding",
            "/",
            {"inputs": {"source_sentence": "a", "sentences": ["b", LONG_TEXT]}},
            '"sentences" at index 1:',
        ),
        ("embedding", "/embed", {"inputs": ["a", LONG_TEXT]}, "the input at index 1:"),
    ],
    ids=repr,
)
def test_a_text_too_long_is_named_as_the_body_has_it(servers, server, path, document, where):
    """/rerank's query and texts, and /similarity's source and sentences, run as one list:
    a refusal counted in it (texts[1] was "index 2", the query "index 0")."""
    document = {**document, "truncate": False}
    if "inputs" in document and isinstance(document["inputs"], dict):
        document = {"inputs": document["inputs"], "parameters": {"truncate": False}}
    status, body = servers[server].post_json(document, path)
    assert status == 422, body
    message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
    assert message.startswith(where) and "128" in message, message


# --- routes that do not fit the model -------------------------------------------------


@pytest.mark.parametrize(
    ("server", "path", "document", "needed"),
    [
        ("classifier", "/embed", {"inputs": "hello"}, "feature-extraction"),
        ("reranker", "/embed_all", {"inputs": "hello"}, "feature-extraction"),
        ("embedding", "/predict", {"inputs": "hello"}, "text-classification"),
        ("embedding", "/rerank", {"query": "a", "texts": ["b"]}, "text-classification"),
        # a two-label classifier is not a cross-encoder
        ("classifier", "/rerank", {"query": "a", "texts": ["b"]}, "one label"),
        ("classifier", "/v1/embeddings", {"input": "hello"}, "feature-extraction"),
    ],
)
def test_a_route_that_does_not_fit_the_model_is_404_naming_the_task(
    servers, server, path, document, needed
):
    status, body = servers[server].post_json(document, path)
    assert_error(status, body, 404, needed)


# --- /tokenize and /decode ------------------------------------------------------------


def test_tokenize_gives_each_token_its_id_text_and_byte_offsets(servers, reference):
    text = "hello world, paris"
    status, body = servers["embedding"].post_json({"inputs": text}, "/tokenize")
    assert status == 200
    # TokenizeResponse: per input, an array of SimpleToken {id, text, special, start, stop}
    assert len(body) == 1
    tokens = body[0]
    tokenizer, _ = reference("sentence-embedding")
    assert [t["id"] for t in tokens] == tokenizer(text)["input_ids"]
    for token in tokens:
        assert set(token) == TOKEN_FIELDS
    first, *words, last = tokens
    # special tokens: their own text, no offsets
    assert first == {"id": tokenizer.cls_token_id, "text": "[CLS]", "special": True,
                     "start": None, "stop": None}  # fmt: skip
    assert last["special"] is True and last["text"] == "[SEP]" and last["start"] is None
    for token in words:
        assert token["special"] is False
        assert token["text"] == text.encode()[token["start"] : token["stop"]].decode()
    assert [t["text"] for t in words] == ["hello", "world", ",", "paris"]
    assert (words[1]["start"], words[1]["stop"]) == (6, 11)


def test_tokenize_offsets_count_utf8_bytes_as_tei_does(servers):
    text = "é hello"  # "é" is two bytes in UTF-8
    status, body = servers["embedding"].post_json(
        {"inputs": text, "add_special_tokens": False}, "/tokenize"
    )
    assert status == 200
    hello = [t for t in body[0] if t["text"] == "hello"]
    assert hello and (hello[0]["start"], hello[0]["stop"]) == (3, 8)


def test_tokenize_without_special_tokens_and_a_list(servers, reference):
    texts = ["hello world", "paris"]
    status, body = servers["embedding"].post_json(
        {"inputs": texts, "add_special_tokens": False}, "/tokenize"
    )
    assert status == 200 and len(body) == 2
    tokenizer, _ = reference("sentence-embedding")
    for text, tokens in zip(texts, body, strict=True):
        assert [t["id"] for t in tokens] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert not any(t["special"] for t in tokens)


def test_tokenize_with_a_prompt_name_tokenizes_the_prompted_text(servers, reference):
    status, body = servers["embedding"].post_json(
        {"inputs": "paris", "prompt_name": "query", "add_special_tokens": False}, "/tokenize"
    )
    assert status == 200
    tokenizer, _ = reference("sentence-embedding")
    expected = tokenizer(SENTENCE_PROMPTS["query"] + "paris", add_special_tokens=False)
    assert [t["id"] for t in body[0]] == expected["input_ids"]


def test_decode_one_list_of_ids_and_a_batch(servers, reference):
    tokenizer, _ = reference("sentence-embedding")
    ids = tokenizer("hello world")["input_ids"]
    other = tokenizer("the movie was good")["input_ids"]
    server = servers["embedding"]
    status, body = server.post_json({"ids": ids}, "/decode")
    # DecodeResponse: an array of strings, one per id list
    assert status == 200 and body == [tokenizer.decode(ids, skip_special_tokens=True)]
    assert body == ["hello world"]
    status, body = server.post_json({"ids": [ids, other]}, "/decode")
    assert status == 200 and body == ["hello world", "the movie was good"]
    status, body = server.post_json({"ids": ids, "skip_special_tokens": False}, "/decode")
    assert status == 200 and body == [tokenizer.decode(ids, skip_special_tokens=False)]
    assert body[0].startswith("[CLS]")


def test_tokenize_and_decode_serve_every_tokenized_model(servers, reference):
    for name, kind in [("classifier", "text-classification"), ("reranker", "reranker")]:
        tokenizer, _ = reference(kind)
        status, body = servers[name].post_json({"inputs": "paris"}, "/tokenize")
        assert status == 200 and [t["id"] for t in body[0]] == tokenizer("paris")["input_ids"]
        status, body = servers[name].post_json({"ids": [[t["id"] for t in body[0]]]}, "/decode")
        assert status == 200 and body == ["paris"]


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/tokenize", {}),
        ("/tokenize", {"inputs": []}),
        ("/tokenize", {"inputs": 5}),
        ("/tokenize", {"inputs": [5]}),
        ("/tokenize", {"inputs": "a", "add_special_tokens": "no"}),
        ("/decode", {}),
        ("/decode", {"ids": []}),
        ("/decode", {"ids": [[]]}),
        ("/decode", {"ids": "5"}),
        ("/decode", {"ids": [-1]}),
        ("/decode", {"ids": [1.5]}),
        ("/decode", {"ids": [True]}),
        ("/decode", {"ids": [[1], 2]}),
        ("/decode", {"ids": [2**40]}),
        ("/decode", {"ids": [1], "skip_special_tokens": 1}),
    ],
    ids=repr,
)
def test_tokenize_and_decode_bad_requests_are_4xx(servers, path, document):
    status, body = servers["embedding"].post_json(document, path)
    assert status in (400, 422), (status, body)
    assert_error(status, body, status)


def test_decode_an_id_outside_the_vocabulary_is_422(servers, reference):
    tokenizer, _ = reference("sentence-embedding")
    status, body = servers["embedding"].post_json({"ids": [len(tokenizer) + 10]}, "/decode")
    assert_error(status, body, 422, str(len(tokenizer) + 10))


# --- /info ----------------------------------------------------------------------------


def test_info_carries_teis_fields_beside_rawserves(servers, tiny_model):
    infos = {
        name: json.loads(server.request("GET", "/info")[2]) for name, server in servers.items()
    }
    for name, info in infos.items():
        # TEI's required Info fields, with their types
        assert info["model_id"] == tiny_model(SERVED[name][0])
        assert isinstance(info["served_model_name"], str) and info["served_model_name"]
        assert info["model_dtype"] == "float32"
        assert info["max_input_length"] == 128  # the tiny models' positions
        assert isinstance(info["max_concurrent_requests"], int)
        assert isinstance(info["max_batch_tokens"], int) and info["max_batch_tokens"] > 0
        assert info["auto_truncate"] is True  # TEI 1.9's default: `truncate` unsaid cuts
        assert isinstance(info["tokenization_workers"], int)
        assert isinstance(info["version"], str)
        # rawserve's own fields stay
        assert "task" in info and "batching" in info and "workers" in info
    assert infos["embedding"]["max_client_batch_size"] == CLIENT_BATCH
    assert infos["classifier"]["max_client_batch_size"] == 32
    # TEI's ModelType: one key saying the kind of model
    assert infos["embedding"]["model_type"] == {"embedding": {"pooling": "mean"}}
    assert infos["classifier"]["model_type"] == {
        "classifier": {
            "id2label": {"0": "NEGATIVE", "1": "POSITIVE"},
            "label2id": {"NEGATIVE": 0, "POSITIVE": 1},
        }
    }
    assert infos["reranker"]["model_type"] == {
        "reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    }


@pytest.mark.parametrize(
    ("pooling", "tei_pooling"),
    [(None, "mean"), ("none", "mean"), ("cls", "cls"), ("lasttoken", "last_token")],
)
def test_info_names_the_pooling_as_tei_does(pooling, tei_pooling):
    """TEI's `model_type.embedding.pooling` says `last_token` where sentence-transformers
    says `lasttoken`: a client that checks TEI's names finds it."""
    from rawserve.api.tei import tei_model_type

    details = {"pooling": pooling}
    assert tei_model_type("feature-extraction", details) == {"embedding": {"pooling": tei_pooling}}


# --- SageMaker's routes, as TEI's container serves them -----------------------------------


def test_invocations_is_the_model_s_own_route_and_ping_its_health(servers):
    """SageMaker posts to /invocations and probes /ping: TEI answers them as /embed,
    /predict or /rerank, by what the model is, and /health."""
    embedding, classifier, reranker = (servers[k] for k in ("embedding", "classifier", "reranker"))
    asked = {"inputs": ["hello world", "paris"]}
    assert embedding.post_json(asked, "/invocations") == embedding.post_json(asked, "/embed")
    pair = {"inputs": [["i love", "this movie"]]}
    assert classifier.post_json(pair, "/invocations") == classifier.post_json(pair, "/predict")
    ranked = {"query": QUERY, "texts": ["paris is a city", "bananas"]}
    status, body = reranker.post_json(ranked, "/invocations")
    assert status == 200 and same_ranking(body, reranker.post_json(ranked, "/rerank")[1])
    # refused in the shape of the route it stands for (TEI's)
    blank = {"inputs": ""}
    status, body = embedding.post_json(blank, "/invocations")
    assert status == 422 and body["error_type"] == "Validation"
    assert (status, body) == embedding.post_json(blank, "/embed")
    status, _, answer = embedding.request("GET", "/ping")  # SageMaker's readiness
    assert status == 200 and answer == embedding.request("GET", "/ready?full=ok")[2]
    status, headers, _ = embedding.request("GET", "/invocations")
    assert status == 405 and headers["allow"] == "POST"
    # counted by the path the client asked for, not as "other"
    _, _, metrics = embedding.request("GET", "/metrics")
    assert b'route="/invocations"' in metrics and b'route="/ping"' in metrics


def test_embeddings_is_openai_s_embeddings_as_on_tei(servers):
    server = servers["embedding"]
    asked = {"input": ["hello world"], "model": "m"}
    status, body = server.post_json(asked, "/embeddings")
    assert status == 200 and body["object"] == "list"
    assert body["data"] == server.post_json(asked, "/v1/embeddings")[1]["data"]
    status, body = server.post_json({"input": []}, "/embeddings")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"  # OpenAI's

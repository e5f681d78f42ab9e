"""vLLM's `/classify` and `/score` (rawserve.api.vllm_pooling), and the `usage` of its
`/v1/rerank`, answered by the real workers of tiny models.

One server serves a cross-encoder (the default), a two-label classifier and a sentence
embedding model. The scores and token counts are checked against the models themselves,
loaded in this process with transformers, and against the server's own embeddings.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from tests.server import RunningServer

pytestmark = pytest.mark.slow

# the served names: the model folders'
RERANKER, CLASSIFIER, EMBEDDER = "reranker", "text-classification", "sentence-embedding"
PROMPTED = "prompted"  # the embedding model with a default prompt
LONG = "the movie was long and slow " * 200  # past the tiny models' 128 positions


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    kinds = (RERANKER, CLASSIFIER, EMBEDDER)
    args = [arg for kind in kinds for arg in ("--model", tiny_model(kind))]
    # the embedding model again, its files naming a prompt put before every text
    prompted = tmp_path_factory.mktemp("prompted") / "model"
    shutil.copytree(tiny_model(EMBEDDER), prompted)
    settings = prompted / "config_sentence_transformers.json"
    settings.write_text(
        json.dumps({**json.loads(settings.read_text()), "default_prompt_name": "query"})
    )
    running = RunningServer([*args, "--model", f"{PROMPTED}={prompted}"]).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def local(tiny_model):
    """Each model's tokenizer and classifier, loaded here: what the answers must match."""
    import transformers

    def load(kind):
        folder = tiny_model(kind)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
        return tokenizer, model.eval()

    return {kind: load(kind) for kind in (RERANKER, CLASSIFIER)}


def logits_of(local, kind, texts, pairs=None, **cut):
    """The model's logits for `texts` (and `pairs`), one row each, and their token counts."""
    import torch

    tokenizer, model = local[kind]
    encoded = tokenizer(texts, pairs, padding=True, return_tensors="pt", **cut)
    with torch.inference_mode():
        logits = model(**encoded).logits.float().numpy()
    return logits, int(encoded["attention_mask"].sum())


def softmax(row):
    exp = np.exp(row - row.max())
    return exp / exp.sum()


def sigmoid(value):
    return 1 / (1 + math.exp(-value))


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_each_input_gets_its_labels_probabilities_and_the_likeliest(server, local, path):
    texts = ["i loved this film", "the worst evening"]
    status, body = server.post_json({"model": CLASSIFIER, "input": texts}, path)
    assert status == 200, body
    logits, tokens = logits_of(local, CLASSIFIER, texts)
    labels = local[CLASSIFIER][1].config.id2label
    assert body["object"] == "list" and body["model"] == CLASSIFIER
    assert body["id"].startswith("classify-") and isinstance(body["created"], int)
    for index, (entry, row) in enumerate(zip(body["data"], logits, strict=True)):
        assert entry["index"] == index and entry["num_classes"] == 2
        assert entry["probs"] == pytest.approx(softmax(row.astype(np.float64)), abs=1e-5)
        assert entry["label"] == labels[int(np.argmax(row))]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    assert body["usage"] == {**usage, "prompt_tokens_details": None}


def test_use_activation_false_answers_the_logits(server, local):
    status, body = server.post_json(
        {"model": CLASSIFIER, "input": "a film", "use_activation": False}, "/classify"
    )
    assert status == 200, body
    logits, _ = logits_of(local, CLASSIFIER, ["a film"])
    assert body["data"][0]["probs"] == pytest.approx(logits[0].tolist(), abs=1e-5)


def test_a_cross_encoder_scores_one_text_against_each_of_a_list(server, local):
    documents = ["paris is a city", "the cat sat on the mat", "paris"]
    document = {"text_1": "where is paris", "text_2": documents}
    status, body = server.post_json(document, "/score")  # (the default model)
    assert status == 200, body
    logits, tokens = logits_of(local, RERANKER, ["where is paris"] * 3, documents)
    assert body["id"].startswith("score-") and body["model"] == RERANKER
    assert [entry["index"] for entry in body["data"]] == [0, 1, 2]
    assert {entry["object"] for entry in body["data"]} == {"score"}
    scores = [entry["score"] for entry in body["data"]]
    assert scores == pytest.approx([sigmoid(row[0]) for row in logits], abs=1e-5)
    assert body["usage"]["prompt_tokens"] == tokens == body["usage"]["total_tokens"]
    # vLLM's other names of the two sides, and two lists paired in order
    pairwise = {"queries": ["where is paris", "a cat"], "documents": documents[:2]}
    status, body = server.post_json(pairwise, "/v1/score")
    logits, _ = logits_of(local, RERANKER, pairwise["queries"], documents[:2])
    assert status == 200, body
    scores = [entry["score"] for entry in body["data"]]
    assert scores == pytest.approx([sigmoid(row[0]) for row in logits], abs=1e-5)


def test_an_embedding_model_scores_the_cosine_of_its_own_vectors(server):
    document = {"model": EMBEDDER, "data_1": ["a red car", "a cat"], "data_2": ["a car", "a cat"]}
    status, body = server.post_json(document, "/score")
    assert status == 200, body
    texts = ["a red car", "a cat", "a car"]
    status, embedded = server.post_json({"model": EMBEDDER, "input": texts}, "/v1/embeddings")
    assert status == 200, embedded
    vectors = [np.asarray(entry["embedding"], dtype=np.float64) for entry in embedded["data"]]
    cosines = [vectors[0] @ vectors[2], vectors[1] @ vectors[1]]
    assert [entry["score"] for entry in body["data"]] == pytest.approx(cosines, abs=1e-5)
    # each text embedded once ("a cat" is on both sides)
    assert body["usage"]["prompt_tokens"] == embedded["usage"]["prompt_tokens"]


def test_a_long_input_is_refused_before_it_is_queued_unless_cut(server, local):
    status, body = server.post_json({"model": CLASSIFIER, "input": ["ok", LONG]}, "/classify")
    assert status == 422, body
    error = body["error"]
    assert error["param"] == "input" and '"input" at index 1' in error["message"]
    assert "truncate_prompt_tokens" in error["message"]
    # -1: cut to the model's length
    status, body = server.post_json(
        {"model": CLASSIFIER, "input": LONG, "truncate_prompt_tokens": -1}, "/classify"
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 128
    # N: cut to N tokens, special tokens included, as the tokenizer cuts it
    for kind, path, document in [
        (CLASSIFIER, "/classify", {"model": CLASSIFIER, "input": LONG}),
        (RERANKER, "/score", {"text_1": "where", "text_2": [LONG]}),
    ]:
        status, body = server.post_json({**document, "truncate_prompt_tokens": 9}, path)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == 9
        pair = ([LONG], None) if kind == CLASSIFIER else (["where"], [LONG])
        logits, tokens = logits_of(local, kind, *pair, truncation=True, max_length=9)
        assert tokens == 9
        found = body["data"][0]["probs"] if kind == CLASSIFIER else [body["data"][0]["score"]]
        expected = softmax(logits[0]) if kind == CLASSIFIER else [sigmoid(logits[0][0])]
        assert found == pytest.approx(list(expected), abs=1e-5)
    status, body = server.post_json(
        {"model": EMBEDDER, "text_1": LONG, "text_2": "a", "truncate_prompt_tokens": 5}, "/score"
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == 5 + 3, body  # [CLS] a [SEP]


@pytest.mark.parametrize(
    ("path", "document", "status", "param", "says"),
    [
        ("/classify", {"input": [1, 2, 3]}, 400, "input", "token ids is not served"),
        ("/classify", {"input": []}, 400, "input", "non-empty list"),
        ("/classify", {"input": ["a", " "]}, 422, "input", '"input" at index 1'),
        ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, 400, None, "above 0"),
        ("/classify", {"input": "a", "truncate_prompt_tokens": 129}, 400, None, "(128 tokens)"),
        ("/classify", {"input": "a", "truncate_prompt_tokens": -2}, 400, None, "from -1"),
        ("/classify", {"input": "a", "truncate_prompt_tokens": 2}, 422, None, "no room"),
        ("/classify", {"input": "a", "user": 5}, 400, "user", "must be a string"),
        ("/score", {"text_1": "a", "text_2": "b", "user": 5}, 400, "user", "must be a string"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, 400, None, "one length"),
        ("/score", {"text_1": "a"}, 400, None, '"text_2" is required'),
        ("/score", {"queries": "a"}, 400, None, '"documents" or "items" is required'),
        ("/score", {"text_1": "a", "documents": ["b"]}, 400, None, "one pair of sides, one of"),
        ("/score", {"queries": "a", "items": "b", "model": CLASSIFIER}, 404, "model", "2 labels"),
        ("/classify", {"input": "a", "model": EMBEDDER}, 404, "model", "text-classification"),
    ],
)
def test_what_is_refused_is_refused_in_openais_error_object(
    server, path, document, status, param, says
):
    """vLLM answers these routes' errors as its OpenAI routes do; a field at fault is
    named (a 2-label classifier scores no pairs: /score needs a cross-encoder or dense
    vectors)."""
    model = {"model": CLASSIFIER} if path == "/classify" else {}
    got, body = server.post_json({**model, **document}, path)
    assert got == status, body
    error = body["error"]
    assert says in error["message"] and {"type", "code", "param"} <= set(error)
    if param is not None:
        assert error["param"] == param


def test_vllms_rerank_counts_the_tokens_of_its_pairs(server, local):
    documents = ["paris is a city", "a cat"]
    status, body = server.post_json(
        {"query": "where is paris", "documents": documents}, "/v1/rerank"
    )
    assert status == 200, body
    _, tokens = logits_of(local, RERANKER, ["where is paris"] * 2, documents)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_openais_embeddings_take_vllms_truncate_prompt_tokens(server, tiny_model):
    """vLLM's clients send `truncate_prompt_tokens` to /v1/embeddings too (the openai
    SDK's `extra_body`): it was 400, an unknown field. The vector is that of the text's
    first N tokens, special tokens included, sent as ids."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model(EMBEDDER))
    ids = tokenizer(LONG, truncation=True, max_length=6)["input_ids"]
    document = {"model": EMBEDDER, "input": [LONG], "truncate_prompt_tokens": 6}
    status, cut = server.post_json(document, "/v1/embeddings")
    assert status == 200, cut
    status, sent = server.post_json({"model": EMBEDDER, "input": [ids]}, "/v1/embeddings")
    assert status == 200, sent
    assert cut["usage"]["prompt_tokens"] == 6 == sent["usage"]["prompt_tokens"]
    expected = sent["data"][0]["embedding"]
    assert cut["data"][0]["embedding"] == pytest.approx(expected, abs=1e-5)
    status, body = server.post_json({**document, "truncate_prompt_tokens": 0}, "/v1/embeddings")
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", body


def test_an_embedding_models_score_is_the_cosine_of_its_prompted_vectors(server):
    """A model whose files name a default prompt puts it before every text, on every
    embedding route: /score left it out, and its score was not the cosine of the
    /v1/embeddings vectors of the same texts (a tester)."""
    texts = ["a red car", "a car"]
    document = {"model": PROMPTED, "text_1": texts[0], "text_2": texts[1]}
    status, body = server.post_json(document, "/score")
    assert status == 200, body
    status, embedded = server.post_json({"model": PROMPTED, "input": texts}, "/v1/embeddings")
    one, other = (np.asarray(entry["embedding"]) for entry in embedded["data"])
    assert body["data"][0]["score"] == pytest.approx(float(one @ other), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == embedded["usage"]["prompt_tokens"]


def test_a_pair_too_long_together_is_refused_before_it_queues_naming_it(server):
    """Each side fits, the pair does not: the worker's 422 said "send truncate: true",
    which /score does not read, after the pair had queued (a tester)."""
    half = "the movie was good " * 16  # 64 words: each alone fits the 128 positions
    document = {"text_1": half, "text_2": ["short", half]}
    status, body = server.post_json(document, "/score")
    assert status == 422, body
    error = body["error"]
    assert error["param"] == "text_2" and "truncate_prompt_tokens" in error["message"]
    assert error["message"].startswith('the pair of "text_1" and "text_2" at index 1: ')
    document = {"text_1": half, "text_2": half, "truncate_prompt_tokens": -1}
    status, body = server.post_json(document, "/score")
    assert status == 200 and body["usage"]["prompt_tokens"] == 128, body


@pytest.mark.parametrize(
    ("document", "param", "says"),
    [
        ({"text_1": LONG, "text_2": ["a"]}, "text_1", '"text_1": the input'),
        ({"queries": "a", "documents": ["b", LONG]}, "documents", '"documents" at index 1'),
        (
            {"model": EMBEDDER, "text_1": "a", "text_2": ["b", LONG]},
            "text_2",
            '"text_2" at index 1',
        ),
        (
            {"model": EMBEDDER, "text_1": ["a", "b"], "text_2": [LONG, "a"]},
            "text_2",
            '"text_2" at index 0',
        ),
    ],
)
def test_a_long_text_of_score_is_named_by_its_side_and_place(server, document, param, says):
    """The refusal named the second side for every pair (a long `text_1` was "text_2" at
    index 0), and on an embedding model the place in a list of the texts deduplicated
    ("text_1" at index 3, of one text)."""
    status, body = server.post_json(document, "/score")
    assert status == 422, body
    assert body["error"]["param"] == param and body["error"]["message"].startswith(says), body


def test_vllms_rerank_takes_truncate_prompt_tokens(server):
    """It was ignored on /v1/rerank (vLLM's RerankRequest has it), where /score cut."""
    document = {"query": "where is paris", "documents": [LONG, LONG]}
    status, body = server.post_json({**document, "truncate_prompt_tokens": 10}, "/v1/rerank")
    assert status == 200 and body["usage"]["prompt_tokens"] == 2 * 10, body
    status, body = server.post_json({**document, "truncate_prompt_tokens": 0}, "/v1/rerank")
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens", body


def test_token_ids_are_cut_on_the_side_asked_with_no_room_kept_for_special_tokens(server):
    """Ids get no special tokens added: a cut of 3 ids to 2 was 422 "no room beside the
    model's 2 special tokens". `truncation_side: left` keeps the last ids, as vLLM's cut
    of token ids does."""
    ids = [2, 10, 11, 12, 3]  # [CLS] ... [SEP] of the tiny vocabulary
    for side, kept in (("right", ids[:2]), ("left", ids[-2:])):
        document = {"model": EMBEDDER, "input": [ids], "truncate_prompt_tokens": 2}
        status, cut = server.post_json({**document, "truncation_side": side}, "/v1/embeddings")
        assert status == 200 and cut["usage"]["prompt_tokens"] == 2, cut
        status, sent = server.post_json({"model": EMBEDDER, "input": [kept]}, "/v1/embeddings")
        expected = sent["data"][0]["embedding"]
        assert cut["data"][0]["embedding"] == pytest.approx(expected, abs=1e-5), side


def test_an_embedding_cut_at_the_models_length_keeps_the_side_asked(server):
    """With no `truncate_prompt_tokens` an embedding's input is cut at the model's length
    all the same, on the side `truncation_side` asks: "left" kept the start, silently."""
    got, text = {}, LONG + "paris is the capital of france"  # (its ends differ)
    for side in ("left", "right"):
        document = {"model": EMBEDDER, "input": text, "truncation_side": side}
        status, cut = server.post_json(document, "/v1/embeddings")
        assert status == 200, cut
        asked = {**document, "truncate_prompt_tokens": -1}
        status, expected = server.post_json(asked, "/v1/embeddings")
        got[side] = cut["data"][0]["embedding"]
        assert got[side] == pytest.approx(expected["data"][0]["embedding"], abs=1e-6), side
    assert got["left"] != pytest.approx(got["right"], abs=1e-4)


def test_the_document_says_what_each_route_does_with_a_long_input_not_cut(server):
    status, _, body = server.request("GET", "/openapi.json")
    paths = json.loads(body)["paths"]

    def said(path):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return schema["properties"]["truncate_prompt_tokens"]["description"]

    assert said("/classify").endswith(
        "none: an input longer than the model takes is refused (422)."
    )
    assert said("/v1/embeddings").endswith(
        "none: cut to the model's length, as sentence-transformers cuts it."
    )

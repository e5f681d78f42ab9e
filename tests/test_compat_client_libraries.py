"""The client libraries people point at TEI and OpenAI-compatible servers, unmodified,
against real rawserve servers: tei-client, litellm, langchain-openai, llama-index's TEI
embedder and haystack's Hugging Face API components, each called the way its own
documentation shows (one script per client, tests/compat_*_client.py, printing JSON).

They share one virtual environment of their own (they install together; rawserve's stays
free of their hundreds of dependencies), made once, while the servers start, and kept in
pytest's cache (tests/compat_venvs.py). Each answer is compared with what rawserve answers
the same request sent directly, and each client's refusal with rawserve's own message.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.compat_venvs import INSTALL_SECONDS, client_env, installing
from tests.server import RunningServer, running_together
from tests.tiny_models import SENTENCE_PROMPTS

# the first test to run makes the clients' environment (about 2 minutes on 2 cores) before
# the servers start; every subprocess has a timeout of its own
pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_SECONDS + 300)]

HERE = Path(__file__).parent
# the versions run here, all installed together (pip resolves the rest)
CLIENTS = (
    "tei-client==0.2.4",
    "litellm==1.110.2",
    "langchain-openai==1.7.4",
    "llama-index-embeddings-text-embeddings-inference==0.6.0",
    "haystack-ai==3.4.1",
    "huggingface-api-haystack==3.1.0",
)
# nothing but loopback is reached: litellm would fetch its price list at import (and fall
# back to its own copy after retries), haystack would send usage telemetry
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "HAYSTACK_TELEMETRY_ENABLED": "False"}
# what the scripts send (tests/compat_*_client.py)
TEXT = "the movie was good"
PROMPT = "the movie was"
QUESTION = "hello, what is a good movie"
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "berlin is a city", "i like it"]
BLANK = "is empty or only whitespace"


@pytest.fixture(scope="module")
def clients_installing(request) -> Iterator[Future[Path]]:
    with installing(request, "compat-client-libraries", CLIENTS, "clients_python") as made:
        yield made


@pytest.fixture(scope="module")
def servers(tiny_model, clients_installing):  # the clients' environment is made meanwhile
    threads = ["--threads", "1"]
    started = {
        # TEI's routes take the first model that fits them, POST / (where haystack's TEI
        # embedder posts) the first model: the embedder is listed first
        "several": RunningServer(
            [
                *("--model", f"emb={tiny_model('sentence-embedding')}"),
                *("--model", f"rank={tiny_model('reranker')}"),
                *("--model", f"chat={tiny_model('chat')}"),
                *threads,
            ]
        ),
        # tei-client asks /info which kind of model the server holds (TEI serves one): a
        # classifier and a reranker of their own for it
        "classifier": RunningServer(
            ["--model", f"cls={tiny_model('text-classification')}", *threads]
        ),
        "reranker": RunningServer(["--model", f"rank={tiny_model('reranker')}", *threads]),
    }
    with running_together(started):
        yield started


@pytest.fixture(scope="module")
def clients_python(clients_installing) -> Path:
    return clients_installing.result()


def url(server: RunningServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def run_client(python: Path, script: str, *servers: RunningServer) -> dict[str, Any]:
    """What each call of a client script answered, or the error its client raised."""
    ran = subprocess.run(
        [str(python), str(HERE / script), *map(url, servers)],
        capture_output=True,
        text=True,
        timeout=180,
        env=client_env(**OFFLINE),
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    # the JSON is the last line: litellm prints advice of its own on errors
    return json.loads(ran.stdout.splitlines()[-1])


def direct(server: RunningServer, path: str, document: dict) -> Any:
    status, answer = server.post_json(document, path)
    assert status == 200, answer
    return answer


def close(got: Any, expected: Any) -> bool:
    return np.allclose(np.asarray(got), np.asarray(expected), atol=1e-6)


# --- tei-client ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tei(servers, clients_python):
    return run_client(
        clients_python,
        "compat_tei_client.py",
        servers["several"],
        servers["classifier"],
        servers["reranker"],
    )


def test_tei_client_embeds_as_embed_answers(servers, tei):
    expected = direct(servers["several"], "/embed", {"inputs": [TEXT]})
    assert len(tei["embed"]) == 1 and close(tei["embed"], expected)


def test_tei_client_embed_all_sends_normalize_and_gets_every_tokens_vector(servers, tei):
    expected = direct(servers["several"], "/embed_all", {"inputs": [TEXT]})
    assert np.asarray(tei["embed_all"]).shape == (1, 6, 32)  # [CLS] 4 words [SEP]
    assert close(tei["embed_all"], expected)


def test_tei_client_tokenizes_and_decodes(servers, tei):
    expected = direct(servers["several"], "/tokenize", {"inputs": ["hello world"]})
    assert tei["tokenize"] == [{"tokens": expected[0]}]
    assert [token["text"] for token in expected[0]] == ["[CLS]", "hello", "world", "[SEP]"]
    assert tei["decode"] == ["hello world"]
    assert tei["tokenize_long"] == 302  # [CLS], 300 words, [SEP]: the model takes 128


def test_tei_client_reads_the_models_prompt_names(tei):
    # (it asks for a prompt no model has and reads the list out of the error message)
    assert sorted(tei["prompt_names"]) == sorted(SENTENCE_PROMPTS)


def test_tei_client_classifies_a_text_and_a_pair(servers, tei):
    for name, inputs in [("classify", [[TEXT]]), ("classify_pair", [[TEXT, "i like it"]])]:
        expected = direct(servers["classifier"], "/predict", {"inputs": inputs})
        assert tei[name] == [{"scores": expected[0]}], name
    assert {score["label"] for score in tei["classify"][0]["scores"]} == {"NEGATIVE", "POSITIVE"}


def test_tei_client_reranks_returning_the_texts(servers, tei):
    texts = DOCUMENTS[:2]
    expected = direct(
        servers["reranker"], "/rerank", {"query": QUERY, "texts": texts, "return_text": True}
    )
    assert tei["rerank"] == {"ranks": expected}
    assert sorted(rank["text"] for rank in expected) == sorted(texts)


def test_tei_client_hands_its_user_rawserves_refusal(tei):
    # the client returns what the server answered, without looking at the status
    assert BLANK in tei["blank"]["error"] and tei["blank"]["error_type"], tei["blank"]
    # where it reads the body as an answer, its own parsing fails on the refusal, as the
    # README says (TEI's refusal is the same object)
    for name in ("blank_classify", "blank_rerank"):
        assert tei[name]["raised"] == "ValidationError", tei[name]


# --- litellm ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(servers, clients_python):
    return run_client(clients_python, "compat_litellm_client.py", servers["several"])


def test_litellm_embeds_through_its_openai_provider(servers, litellm):
    expected = direct(servers["several"], "/v1/embeddings", {"model": "emb", "input": [PROMPT]})
    answer = litellm["embedding"]
    assert "raised" not in answer, answer
    assert close(answer["data"][0]["embedding"], expected["data"][0]["embedding"])


def test_litellm_chats_and_completes_through_its_openai_provider(servers, litellm):
    asked = {"model": "chat", "max_tokens": 5, "temperature": 0}
    messages = [{"role": "user", "content": QUESTION}]
    chat = direct(servers["several"], "/v1/chat/completions", {**asked, "messages": messages})
    text = chat["choices"][0]["message"]["content"]
    completion = litellm["completion"]
    assert completion["choices"][0]["message"]["content"] == text and completion["model"] == "chat"
    streamed = litellm["completion_stream"]
    assert "".join(chunk["choices"][0]["delta"]["content"] or "" for chunk in streamed) == text
    prompted = direct(servers["several"], "/v1/completions", {**asked, "prompt": PROMPT})
    assert litellm["text_completion"]["choices"][0]["text"] == prompted["choices"][0]["text"]


def test_litellm_reranks_the_top_n_through_its_tei_provider(servers, litellm):
    expected = direct(
        servers["several"], "/rerank", {"query": QUERY, "texts": DOCUMENTS, "top_n": 2}
    )
    results = litellm["rerank"]["results"]
    assert [result["index"] for result in results] == [rank["index"] for rank in expected]
    assert len(results) == 2


def test_litellm_shows_rawserves_messages(litellm):
    unknown = litellm["unknown_model"]
    assert unknown["raised"] == "NotFoundError", unknown
    assert "no model named 'text-embedding-3-small' is served (served: emb" in unknown["message"]
    assert litellm["blank"]["raised"] == "BadRequestError"  # litellm's class for a 422
    assert 'a text of "input" ' + BLANK in litellm["blank"]["message"]
    # the rerank provider shows the body as it came
    assert BLANK in litellm["blank_query"]["message"], litellm["blank_query"]


# --- langchain-openai ------------------------------------------------------------------


@pytest.fixture(scope="module")
def langchain(servers, clients_python):
    return run_client(clients_python, "compat_langchain_client.py", servers["several"])


def test_langchain_openai_embeddings(servers, langchain):
    expected = direct(servers["several"], "/v1/embeddings", {"model": "emb", "input": [TEXT]})
    vector = expected["data"][0]["embedding"]
    assert close(langchain["embed_query"], vector)
    assert len(langchain["embed_documents"]) == 2 and close(langchain["embed_documents"][0], vector)
    # more texts than the client batch cap: chunked as the README says, else 413 in words
    assert len(langchain["embed_many"]) == 40 and close(langchain["embed_many"][39], vector)
    assert "at most 32" in langchain["embed_many_unchunked"]["message"]


def test_langchain_chat_openai_invokes_and_streams(servers, langchain):
    document = {
        "model": "chat",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 5,
        "temperature": 0,
    }
    text = direct(servers["several"], "/v1/chat/completions", document)["choices"][0]
    assert langchain["invoke"]["content"] == text["message"]["content"], langchain["invoke"]
    assert langchain["invoke"]["metadata"]["model_name"] == "chat"
    assert "".join(langchain["stream"]) == text["message"]["content"]


def test_langchain_binds_tools_and_asks_for_structured_output(langchain):
    called = langchain["tool_call"]
    assert "raised" not in called, called
    [call] = called["tool_calls"]
    assert call["name"] == "weather" and call["args"]["city"] in ("paris", "rome"), call
    structured = langchain["structured"]
    assert "raised" not in structured, structured
    assert set(structured) == {"name"} and len(structured["name"]) <= 5, structured


def test_langchain_shows_rawserves_messages(langchain):
    unknown = langchain["unknown_model"]
    assert unknown["raised"] == "OpenAIModelNotFoundError", unknown
    assert "no model named 'gpt-4o' is served" in unknown["message"]
    assert 'a text of "input" ' + BLANK in langchain["blank"]["message"], langchain["blank"]


# --- llama-index -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_index(servers, clients_python):
    return run_client(clients_python, "compat_llama_index_client.py", servers["several"])


def test_llama_index_tei_embedder(servers, llama_index):
    expected = direct(servers["several"], "/embed", {"inputs": [TEXT, "i like it"]})
    assert close(llama_index["text_embedding"], expected[0])
    assert close(llama_index["query_embedding"], expected[0])
    assert close(llama_index["text_embedding_batch"], expected)


def test_llama_index_gets_a_refusal_it_cannot_show(llama_index):
    # the embedder reads any answer as a list of vectors: rawserve's 422 (TEI's error
    # object, as TEI answers) reaches its user as `KeyError: 0`, its message unread
    assert llama_index["blank"] == {"raised": "KeyError", "message": "0"}


# --- haystack --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def haystack(servers, clients_python):
    return run_client(clients_python, "compat_haystack_client.py", servers["several"])


def test_haystack_tei_embedder(servers, haystack):
    # it sends normalize=false, truncate=true
    expected = direct(servers["several"], "/embed", {"inputs": [TEXT], "normalize": False})
    assert "raised" not in haystack["embed"], haystack["embed"]
    assert close(haystack["embed"]["embedding"], expected[0])


def test_haystack_tei_ranker_keeps_the_top_k(servers, haystack):
    expected = direct(
        servers["several"], "/rerank", {"query": QUERY, "texts": DOCUMENTS, "top_n": 2}
    )
    assert haystack["rank"] == [
        {"content": DOCUMENTS[rank["index"]], "score": rank["score"]} for rank in expected
    ]


def test_haystack_shows_rawserves_messages(haystack):
    assert haystack["blank"]["raised"] == "HfHubHTTPError", haystack["blank"]
    assert "invalid input for feature-extraction: the text " + BLANK in haystack["blank"]["message"]
    assert haystack["blank_query"]["raised"] == "RuntimeError"
    assert BLANK in haystack["blank_query"]["message"]

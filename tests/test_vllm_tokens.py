"""vLLM's /tokenize (a body with `prompt`, beside TEI's with `inputs`) and /detokenize,
through the whole app in-process with a tiny BERT's tokenizer (rawserve.api.vllm_tokens)."""

from __future__ import annotations

import pytest
import tokenizers

from rawserve.api.vllm_tokens import MAX_PROMPT_TOKENS
from tests.test_request_cost import LIMIT, app_for, post


@pytest.fixture(scope="module")
def app(tokenizer_json):
    return app_for("feature-extraction", tokenizer_json, {})


@pytest.fixture(scope="module")
def library(tokenizer_json):
    return tokenizers.Tokenizer.from_str(tokenizer_json)


@pytest.fixture(scope="module")
def tokenizer_json(tiny_model) -> str:
    from pathlib import Path

    return (Path(tiny_model("sentence-embedding")) / "tokenizer.json").read_text()


def test_a_prompts_ids_are_the_tokenizers_with_the_models_length(app, library):
    """vLLM's answer: the ids (special tokens added unless asked not to), their count,
    the model's length, and each token's string only where asked."""
    status, body = post(app, "/tokenize", {"model": "m", "prompt": "hello world"})
    expected = library.encode("hello world")
    assert status == 200, body
    assert body == {
        "count": len(expected.ids),
        "max_model_len": LIMIT,
        "tokens": expected.ids,
        "token_strs": None,
    }
    status, bare = post(app, "/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert bare["tokens"] == library.encode("hello world", add_special_tokens=False).ids
    assert bare["count"] == len(expected.ids) - 2  # ([CLS] and [SEP] left out)
    status, named = post(app, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert named["token_strs"] == expected.tokens and named["tokens"] == expected.ids
    # (an `inputs` of null is none, as every field's)
    status, nulled = post(app, "/tokenize", {"prompt": "hello world", "inputs": None})
    assert status == 200 and nulled["tokens"] == expected.ids, nulled
    # TEI's body on the same path keeps TEI's answer
    status, tei = post(app, "/tokenize", {"inputs": "hello world"})
    assert status == 200 and [token["id"] for token in tei[0]] == expected.ids


def test_detokenize_gives_the_ids_text_special_tokens_kept(app, library):
    ids = library.encode("hello world").ids
    status, body = post(app, "/detokenize", {"model": "m", "tokens": ids})
    assert status == 200 and body == {"prompt": library.decode(ids, skip_special_tokens=False)}
    assert "[CLS]" in body["prompt"]


@pytest.mark.parametrize(
    ("path", "document", "status", "said"),
    [
        # (a chat's form is for a text-generation model: tests/test_chat_tokens.py)
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, 404, "text-generation"),
        ("/tokenize", {"prompt": 5}, 400, '"prompt" must be a string'),
        ("/tokenize", {"prompt": None}, 400, '"prompt" must be a string'),
        ("/tokenize", {"prompt": "a " * (MAX_PROMPT_TOKENS + 10)}, 422, "the most /tokenize"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "list of token ids"),
        ("/detokenize", {"tokens": "1 2"}, 400, "list of token ids"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 422, "not in the vocabulary"),
    ],
)
def test_what_vllms_token_routes_cannot_take_is_refused_saying_why(
    app, path, document, status, said
):
    answered, body = post(app, path, document)
    assert answered == status and said in str(body), body


def test_an_answer_over_the_bound_is_413(tokenizer_json):
    small = app_for("feature-extraction", tokenizer_json, {}, max_answer_bytes=1_000)
    status, body = post(small, "/tokenize", {"prompt": "hello world " * 200})
    assert status == 413 and "1,000 bytes" in str(body), body
    status, body = post(small, "/detokenize", {"tokens": [50] * 400})
    assert status == 413, body


@pytest.mark.parametrize("text", ["\u200b", "\ufeff", "\u0000"])
def test_teis_body_lists_an_invisible_prompt_as_the_model_reads_it(tokenizer_json, library, text):
    """A zero-width space is a prompt a generation model takes (as vLLM's body listed it):
    TEI's body refused it 422 "empty to a model", where an encoder's task does refuse it."""
    generating = app_for("text-generation", tokenizer_json, {})
    status, body = post(generating, "/tokenize", {"inputs": text})
    assert status == 200, body
    assert [token["id"] for token in body[0]] == library.encode(text).ids
    status, body = post(generating, "/tokenize", {"inputs": ["hello", "   "]})
    assert status == 422 and "at index 1 is empty or only whitespace" in str(body), body
    encoding = app_for("feature-extraction", tokenizer_json, {})
    status, body = post(encoding, "/tokenize", {"inputs": text})
    assert status == 422 and "empty to a model" in str(body), body

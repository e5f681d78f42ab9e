"""A generation's listed tokens cross the worker's pipe as columns and come out as the
lists they were: every answer made from them is byte for byte the one made from the lists."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from rawserve.api.openai_answers import Answer, Echo
from rawserve.http.encoding import dumps
from rawserve.shared.token_columns import (
    TokenColumns,
    TokenLists,
    columns,
    listed,
    logprob_sum,
    token_count,
    token_lists,
)
from rawserve.tasks.text_generation import listed_tokens, tgi_output

TEXTS = ["<s>", "The", " qu", "ï", "", "\ufffd", " fox", "\n", "</s>"]


def token(index: int, logprob: float | None, top: int | None = None) -> dict:
    """A token as the worker lists it: a float32's log probability, as `tolist` gives it."""
    special = TEXTS[index % len(TEXTS)] in ("<s>", "</s>")
    made = {
        "id": 7 * index % 400,
        "text": TEXTS[index % len(TEXTS)],
        "logprob": logprob if logprob is None else float(np.float32(logprob)),
        "special": special,
    }
    if top is not None:
        made["top_tokens"] = [token(index + k + 1, -0.37 * (k + 1) - index) for k in range(top)]
    return made


def worker_output(top_n: int) -> dict:
    """A worker's output with its details, as `_output` lists them (lists, as before)."""
    prefill = [token(0, None, 0 if top_n else None)]  # the first: no alternatives
    prefill += [token(i, -1.1 * i, top_n if top_n else None) for i in range(1, 40)]
    tokens = [token(i, -0.01 * i - math.pi, top_n) for i in range(12)]
    tokens.append(token(8, -math.inf, top_n))  # a token its bias ruled out, still chosen
    top = [each.pop("top_tokens") for each in tokens]
    details = {
        "finish_reason": "length",
        "generated_tokens": len(tokens),
        "prompt_tokens": len(prefill),
        "seed": None,
        "prefill": prefill,
        "tokens": tokens,
    }
    if top_n:
        details["top_tokens"] = top
    text = "".join(each["text"] for each in tokens if not each["special"])
    return {"generated_text": text, "details": details}


def as_columns(output: dict) -> dict:
    """The output as the worker sends it now, after the pipe's pickle."""
    details = dict(output["details"])
    details["prefill"] = columns(details["prefill"])
    details["tokens"] = columns(details["tokens"])
    if "top_tokens" in details:
        details["top_tokens"] = token_lists(details["top_tokens"])
    return pickle.loads(pickle.dumps({**output, "details": details}, protocol=5))


@pytest.mark.parametrize("top_n", [0, 3])
def test_the_columns_unpickle_as_the_lists_they_were(top_n):
    output = worker_output(top_n)
    sent = as_columns(worker_output(top_n))["details"]
    assert isinstance(sent["prefill"], TokenColumns)
    assert isinstance(sent["tokens"], TokenColumns)
    for name in ("prefill", "tokens", "top_tokens"):
        if name in output["details"]:
            assert listed(sent[name]) == output["details"][name]
            assert dumps(listed(sent[name])) == dumps(output["details"][name])
    assert len(sent["prefill"]) == 40 and sent["prefill"][0]["logprob"] is None
    assert sent["tokens"][-1]["logprob"] == -math.inf
    assert listed_tokens({"details": sent}) == listed_tokens(output)
    if top_n:
        assert isinstance(sent["top_tokens"], TokenLists)
        assert listed_tokens(output) == 40 + 39 * 3 + 13 + 13 * 3
    assert columns([]) == [] and pickle.loads(pickle.dumps(columns([]))) == []


@pytest.mark.parametrize(
    "tokens",
    [
        [{"id": 1, "text": "a", "logprob": -1.0}],  # no "special"
        [{"id": 1, "text": "a", "logprob": -1.0, "special": False, "more": 1}],
        [{"id": 1, "text": "a", "logprob": np.float32(-1.0), "special": False}],
        [{"id": 1, "text": "a", "logprob": math.nan, "special": False}],
        [{"id": 1, "text": "a", "logprob": -1.0, "special": False, "top_tokens": [{"id": 2}]}],
        [{"id": 1, "text": "a", "logprob": -1.0, "special": False, "top_tokens": []}, {}],
    ],
)
def test_tokens_of_another_shape_travel_as_they_are(tokens):
    assert columns(tokens) is tokens
    assert token_count(tokens) >= len(tokens)


@pytest.mark.parametrize("top_n", [0, 3])
def test_tgi_answers_are_the_same_bytes_from_columns(top_n):
    lists, sent = worker_output(top_n), as_columns(worker_output(top_n))
    assert dumps([tgi_output(sent)]) == dumps([tgi_output(lists)])
    assert dumps(tgi_output(sent, streamed=True)) == dumps(tgi_output(lists, streamed=True))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("top_n", [0, 3])
def test_openai_answers_are_the_same_bytes_from_columns(chat, top_n):
    def answered(output: dict) -> bytes:
        shape = Answer(chat, "m", logprobs=top_n, clock=lambda: 0.0)
        shape.id = "cmpl-x"
        echoed = None if chat else [Echo("The prompt", False)]
        return dumps(shape.whole([output], ["fox"], echoed))

    assert answered(as_columns(worker_output(top_n))) == answered(worker_output(top_n))


def test_a_lists_log_probabilities_add_up_the_same_from_columns():
    """(TGI's best_of picks by them) a prompt's first token, without one, adds nothing."""
    output = worker_output(0)
    for name in ("prefill", "tokens"):
        plain = output["details"][name]
        held = as_columns(output)["details"][name]
        assert isinstance(held, TokenColumns)
        expected = sum(each["logprob"] for each in plain if each["logprob"] is not None)
        assert logprob_sum(plain) == logprob_sum(held) == expected

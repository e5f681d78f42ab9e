"""Per-task input rules and output shaping, in one place."""

from __future__ import annotations

import pytest

from rawserve.errors import BadRequest
from rawserve.tasks import batch_key, parse_json_body, parse_text_body, split_outputs


def test_raw_text_is_one_input():
    parsed = parse_text_body("fill-mask", "test [MASK]")
    assert parsed.inputs == ["test [MASK]"] and parsed.params == {} and not parsed.is_list


def test_json_list_is_split_into_items():
    parsed = parse_json_body(
        "fill-mask", {"inputs": ["a [MASK]", "b [MASK]"], "parameters": {"top_k": 2}}
    )
    assert (
        parsed.inputs == ["a [MASK]", "b [MASK]"]
        and parsed.params == {"top_k": 2}
        and parsed.is_list
    )


@pytest.mark.parametrize(
    "document",
    [
        {"inputs": "x", "parameters": {"unknown": 1}},
        {"inputs": "x", "parameters": {"top_k": 0}},
        {"inputs": "x", "parameters": {"top_k": True}},
        {"inputs": "x", "parameters": []},
        {"inputs": 5},
        {"inputs": []},
        {"inputs": ["x", 5]},
        {"input": "x"},
        ["x"],
        "x",
        {"inputs": "x", "extra": 1},
    ],
)
def test_invalid_documents_are_400(document):
    with pytest.raises(BadRequest):
        parse_json_body("fill-mask", document)


def test_required_parameters():
    with pytest.raises(BadRequest, match="candidate_labels"):
        parse_text_body("zero-shot-classification", "hello")
    parsed = parse_json_body(
        "zero-shot-classification", {"inputs": "hi", "parameters": {"candidate_labels": ["a", "b"]}}
    )
    assert parsed.params == {"candidate_labels": ["a", "b"]}


def test_pairs_and_question_answering_inputs():
    assert parse_json_body(
        "text-classification", {"inputs": {"text": "a", "text_pair": "b"}}
    ).inputs == [{"text": "a", "text_pair": "b"}]
    with pytest.raises(BadRequest):
        parse_json_body("question-answering", {"inputs": {"question": "q"}})


def test_batch_key_ignores_parameter_order():
    assert batch_key({"a": 1, "b": 2}) == batch_key({"b": 2, "a": 1})
    assert batch_key({"a": 1}) != batch_key({"a": 2})


def test_split_outputs_puts_back_the_list_a_one_item_call_dropped():
    predictions = [{"score": 0.5, "token": 1}]
    assert split_outputs("fill-mask", ["a [MASK]"], predictions) == [predictions]
    assert split_outputs("fill-mask", ["a", "b"], [predictions, predictions]) == [predictions] * 2
    assert split_outputs("text-classification", ["a"], [{"label": "x"}]) == [{"label": "x"}]
    with pytest.raises(RuntimeError):
        split_outputs("text-classification", ["a", "b"], [{"label": "x"}])

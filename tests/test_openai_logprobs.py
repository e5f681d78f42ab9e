"""OpenAI's log-probability shapes made from the worker's tokens (TGI's shape)."""

from __future__ import annotations

import pytest

from rawserve.api.openai_answers import Answer, Echo
from rawserve.api.openai_logprobs import (
    answer_tokens,
    chat_logprobs,
    completion_logprobs,
    listed,
    listed_entries,
    prompt_tokens,
)


def token(text: str, logprob: float, special: bool = False, top=None) -> dict:
    found = {"id": 1, "text": text, "logprob": logprob, "special": special}
    if top is not None:
        found["top_tokens"] = [{"id": 2, "text": t, "logprob": p, "special": False} for t, p in top]
    return found


def test_an_answers_special_tokens_add_no_text_and_the_list_ends_at_the_texts_cut():
    details = {
        "tokens": [token(" the", -0.5), token("</s>", -0.1, special=True), token(" end", -1.0)],
        "top_tokens": [[], [], []],
    }
    listed = answer_tokens(details, len(" the end"))
    assert [(t.text, t.logprob) for t in listed] == [(" the", -0.5), ("", -0.1), (" end", -1.0)]
    # a stop sequence cut the text after " the": the tokens after it are not listed
    assert [t.text for t in answer_tokens(details, len(" the"))] == [" the"]
    # not cut: tokens that add no text are listed too, as usage counts them
    details = {"tokens": [token("a", -0.5), token("", -0.7), token("", -0.9)]}
    assert [t.logprob for t in answer_tokens(details, 1, 1)] == [-0.5, -0.7, -0.9]
    assert [t.logprob for t in answer_tokens(details, 1)] == [-0.5]  # cut after "a"
    # no details' alternatives (none asked): each token alone
    assert answer_tokens({"tokens": [token("a", -2.0)]}, 1)[0].top == ()


def test_an_echoed_prompt_leaves_out_special_tokens_unless_sent_as_ids():
    details = {"prefill": [token("<s>", None, special=True), token("hi", -1.5)]}
    assert [(t.text, t.logprob) for t in prompt_tokens(details)] == [("hi", -1.5)]
    assert [t.text for t in prompt_tokens(details, special=True)] == ["<s>", "hi"]
    assert prompt_tokens({"prefill": None}) == []


def test_an_echoed_prompt_lists_the_special_tokens_it_spelled_out():
    """A text prompt that wrote "</s>" echoes it: its token is listed where it comes, so
    the tokens add up to the text and their offsets stay on it; the start the tokenizer
    added is not in the echo, nor listed."""
    prefill = [token("<s>", None, special=True), token("hi", -1.5)]
    prefill += [token("</s>", -2.0, special=True), token(" you", -1.0)]
    prefill += [token("\ufffd</s>", -2.5, special=True)]  # a run of byte tokens it ended
    details = {"prefill": prefill, "tokens": [token(" we", -0.5)], "prompt_tokens": 5}
    output = {"generated_text": " we", "details": {**details, "generated_tokens": 1}}
    echo = Echo("hi</s> you\ufffd</s>", token_ids=False)
    [choice] = Answer(False, "m", logprobs=0).whole([output], [], [echo])["choices"]
    assert choice["text"] == "hi</s> you\ufffd</s> we"
    listed = choice["logprobs"]
    assert listed["tokens"] == ["hi", "</s>", " you", "\ufffd</s>", " we"]
    where = zip(listed["tokens"], listed["text_offset"], strict=True)
    assert all(choice["text"].startswith(text, at) for text, at in where)
    assert [t.text for t in prompt_tokens(details, text="hi you")] == ["hi", " you"]


# a Llama's prompt tokens as its worker lists them: its decoder strips the space that
# starts a text, so the first word comes without it ("▁" alone adds "")
STRIPPED = [
    (" hello world", False, ["", "hello", " wor", "l", "d"]),
    ("  hello", False, ["", " ", "hello"]),
    ("<s> hello", False, ["<s>", "", "hello"]),  # "<s>" spelled out, its token listed
    ("<s> hello world", True, ["<s>", "", "hello", " wor", "l", "d"]),  # ids, decoded
]


@pytest.mark.parametrize(("echoed", "ids", "texts"), STRIPPED)
def test_an_echoed_prompts_tokens_add_up_to_it_where_the_decoding_stripped_its_space(
    echoed, ids, texts
):
    """The space is the first word's token's: the tokens add up to the echo, and each
    offset is where its token's text starts in the answer's text, the completion's too."""
    prefill = [
        token(text, None if n == 0 else -1.0, special=text == "<s>") for n, text in enumerate(texts)
    ]
    details = {"prefill": prefill, "tokens": [token(" we", -0.5)], "prompt_tokens": len(texts)}
    output = {"generated_text": " we", "details": {**details, "generated_tokens": 1}}
    [choice] = Answer(False, "m", logprobs=0).whole([output], [], [Echo(echoed, ids)])["choices"]
    listed = choice["logprobs"]
    assert choice["text"] == echoed + " we" == "".join(listed["tokens"])
    where = zip(listed["tokens"], listed["text_offset"], strict=True)
    assert all(choice["text"].startswith(text, at) for text, at in where)
    assert listed["tokens"][-1] == " we" and listed["text_offset"][-1] == len(echoed)
    # no echo to follow (TGI's details): the texts as the worker made them
    assert [t.text for t in prompt_tokens(details, special=True)] == texts


def test_chat_lists_each_token_with_its_bytes_and_alternatives():
    shaped = chat_logprobs([listed(token("é", -0.25, top=[("é", -0.25), ("e", -1.5)]))])
    assert shaped == {
        "content": [
            {
                "token": "é",
                "logprob": -0.25,
                "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                    {"token": "e", "logprob": -1.5, "bytes": [101]},
                ],
            }
        ],
        "refusal": None,
    }


def test_completions_list_offsets_from_where_the_chunk_starts_and_the_chosen_among_the_top():
    tokens = [
        listed(token(" a", -3.0, top=[(" b", -0.5), (" c", -1.0)])),  # sampled, not the likeliest
        listed(token(" d", -0.2, top=[(" d", -0.2), (" e", -2.0)])),
    ]
    assert completion_logprobs(tokens, 10, 2) == {
        "tokens": [" a", " d"],
        "token_logprobs": [-3.0, -0.2],
        "top_logprobs": [{" b": -0.5, " c": -1.0, " a": -3.0}, {" d": -0.2, " e": -2.0}],
        "text_offset": [10, 12],
    }
    assert completion_logprobs(tokens, 0, 0)["top_logprobs"] is None


def test_completion_alternatives_that_read_the_same_keep_the_likeliest_figure():
    """Byte tokens all read "\ufffd": by text, the lower-ranked one's figure was kept, and
    the chosen token's over a likelier alternative's, so lm-eval read a token that was not
    the likeliest as greedy (the largest figure listed was the chosen one's)."""
    chosen = listed(token("\ufffd", -5.65, top=[("\ufffd", -5.63), ("t", -5.72), ("\ufffd", -5.9)]))
    [top] = completion_logprobs([chosen], 0, 3)["top_logprobs"]
    assert top == {"\ufffd": -5.63, "t": -5.72}
    assert max(top.values()) > chosen.logprob  # not the likeliest: not greedy


def test_the_entries_an_answer_lists_count_the_prompts_tokens_and_alternatives():
    details = {"prefill": [token("<s>", None), token("hi", -1.5)], "tokens": [token("a", -0.5)]}
    outputs = [{"generated_text": "a", "details": details}, {"generated_text": ""}]
    assert listed_entries(outputs, 2) == 3 * 3
    assert listed_entries(outputs, 0) == 3
    assert listed_entries(outputs, None) == 0  # no log probabilities asked for


def test_a_token_that_ends_inside_a_character_shows_as_itself_among_its_alternatives():
    # "日" is three bytes, three byte-level tokens: the first two add no text, and decoded
    # alone each is a U+FFFD; listed among its step's alternatives, the chosen token reads
    # as it does in the answer, once, so that a client finds it there (lm-evaluation-harness
    # counts an answer greedy when each token is the likeliest key of its alternatives)
    first = {
        "id": 162,
        "text": "",
        "logprob": -0.25,
        "special": False,
        "top_tokens": [
            {"id": 162, "text": "\ufffd", "logprob": -0.25, "special": False},
            {"id": 163, "text": "\ufffd", "logprob": -1.5, "special": False},
        ],
    }
    tokens = [listed(first)]
    (top,) = completion_logprobs(tokens, 0, 2)["top_logprobs"]
    assert list(top.items()) == [("", -0.25), ("\ufffd", -1.5)]  # likeliest first
    chat = chat_logprobs(tokens)["content"][0]
    assert chat["top_logprobs"][0] == {"token": "", "logprob": -0.25, "bytes": []}
    assert chat["top_logprobs"][0]["bytes"] == chat["bytes"]

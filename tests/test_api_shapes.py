"""The pure parts of the TEI and OpenAI routes: stop sequences in streamed text, TEI's
input forms and byte offsets, the /openapi.json of every task (validated), CORS, and each
request body's checks against its own schema (declared once, they take the same documents)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import orjson
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from rawserve.api.app import App
from rawserve.api.bodies import (
    LARGE_ANSWER_ENTRIES,
    NUMBERS_PER_ENTRY,
    built_answer,
    media_type_parameter,
    read_json,
    server_timing,
    vector_entries,
)
from rawserve.api.inference import parse_body
from rawserve.api.openai_answers import Answer, Streamed, cut_at_stop, releasable
from rawserve.api.openai_generation import (
    GenerationRequest,
    check_token_ids,
    parse_chat,
    parse_completion,
)
from rawserve.api.openai_messages import MESSAGE, MESSAGE_KEYS, messages
from rawserve.api.openai_responses import ResponseAnswer, parse_response
from rawserve.api.openai_responses_input import read_input
from rawserve.api.openai_tools import Tools
from rawserve.api.routing import DocContext
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.api.tei import scores
from rawserve.api.tei_bodies import id_inputs, predict_inputs, text_inputs
from rawserve.api.tokens import utf8_starts
from rawserve.http.errors import (
    BadRequest,
    GatewayTimeout,
    HTTPError,
    InternalError,
    PayloadTooLarge,
    UnprocessableInput,
    UnsupportedMediaType,
    as_http_error,
    error_response,
)
from rawserve.http.exchange import HttpRequest
from rawserve.serving.core import SchedulerCore
from rawserve.serving.face import ItemResult
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState
from rawserve.shared.messages import ModelLimits, TokenChunk, WorkerReady
from rawserve.tasks import TASKS
from rawserve.tasks.rules import UNKNOWN_POSITIONS_NEW_TOKENS

# --- stop sequences, streamed ------------------------------------------------------------

pieces = st.lists(st.text(alphabet="ab c", min_size=0, max_size=3), max_size=12)
stops = st.lists(st.text(alphabet="ab c", min_size=1, max_size=3), min_size=1, max_size=3)


@given(pieces, stops)
def test_streamed_text_is_the_whole_answer_cut_before_the_first_stop(tokens, stop):
    """What streaming sends, token by token, never holds a stop sequence, never takes
    back what it sent, and ends as the whole text cut before its first stop sequence."""
    text, sent = "", ""
    for token in tokens:
        text += token
        ready, reached = releasable(text, stop)
        assert ready.startswith(sent)  # nothing sent is taken back
        assert not any(s in ready for s in stop)
        sent = ready
        if reached:
            break
    whole = cut_at_stop(text, stop)
    assert whole.startswith(sent)
    assert not any(s in whole for s in stop)


@given(pieces, stops, st.integers(0, 6))
def test_a_streamed_choice_sends_what_its_whole_text_releases(tokens, stop, stops_after):
    """Token by token, a choice sends what `releasable` lets go of the whole text so far
    (stops counted from the `stops_after`-th token's text on), though it keeps and
    searches only the end of it."""
    streamed = Streamed(stops_after)
    text, sent, stops_from = "", "", 0
    for number, token in enumerate(tokens, 1):
        if number <= stops_after:
            stops_from = len(text)
        text += token
        ready, _ = releasable(text, stop, stops_from)
        expected = ready[len(sent) :] if len(ready) > len(sent) else None
        sent = ready if expected is not None else sent
        release = streamed.add({"text": token, "special": False}, stop, None)
        assert (release[0] if release is not None else None) == expected
    assert streamed.sent == sent


def test_a_long_streamed_choice_searches_only_the_end_of_its_text(monkeypatch):
    """Each token's search for stop sequences covers the text not sent yet and the last
    characters sent (one fewer than the longest stop), not all of it: a long answer's
    stream costs the server no more per token as it grows."""
    from rawserve.api import openai_answers

    searched = []

    def spied(text: str, stops: list[str], stops_from: int = 0) -> tuple[str, bool]:
        searched.append(len(text))
        return releasable(text, stops, stops_from)

    monkeypatch.setattr(openai_answers, "releasable", spied)
    streamed = Streamed()
    for _ in range(1000):
        streamed.add({"text": " word", "special": False}, ["\n\n"], None)
    assert len(streamed.sent) == 5000
    assert max(searched) == len(" word") + 1


def test_a_streamed_choice_without_stop_sequences_sends_each_token_as_it_comes(monkeypatch):
    """Without stop sequences nothing is held back: each token's text goes as it comes
    (an empty one sends nothing), and no token's work searches the text for stops."""
    from rawserve.api import openai_answers

    def searched(*args: object) -> None:
        raise AssertionError("a text searched for stop sequences where none were asked")

    monkeypatch.setattr(openai_answers, "releasable", searched)
    monkeypatch.setattr(openai_answers, "stop_tail", searched)
    streamed = Streamed(stops_after=2)
    texts = [" a", "", " b", "\n\n", " c"]
    released = [streamed.add({"text": text, "special": False}, [], None) for text in texts]
    assert [r[0] if r is not None else None for r in released] == [" a", None, " b", "\n\n", " c"]
    assert streamed.sent == " a b\n\n c"


def test_text_that_may_start_a_stop_sequence_waits():
    assert releasable("hello wor", ["world"]) == ("hello ", False)
    assert releasable("hello world!", ["world"]) == ("hello ", True)
    assert releasable("hello", ["xyz"]) == ("hello", False)


# --- TEI's inputs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "items", "is_batch"),
    [
        ("a", ["a"], False),
        (["a"], ["a"], False),
        (["a", "b"], [{"text": "a", "text_pair": "b"}], False),
        ([["a"], ["a", "b"]], ["a", {"text": "a", "text_pair": "b"}], True),
    ],
)
def test_predict_inputs_are_a_text_a_pair_or_a_batch(value, items, is_batch):
    assert predict_inputs(value, 32) == (items, is_batch)


@pytest.mark.parametrize(
    "value",
    [
        None,
        5,
        [],
        ["a", "b", "c"],
        [["a", "b", "c"]],
        [[]],
        [["a"], "b"],
        ["\ud800"],
        [5] * 40,  # no inputs, however many: its shape's 400, not a count's 413
    ],
)
def test_predict_inputs_refused(value):
    with pytest.raises(BadRequest):
        predict_inputs(value, 32)


@pytest.mark.parametrize("read", [predict_inputs, lambda value, cap: tei_embed(value, cap)])
def test_a_tei_batch_is_counted_before_any_of_its_items_is_read(read):
    """A 1 MB /predict of 160,000 items had each text read before the count refused it
    (413): a quarter of a second of the event loop, /health 0.9 s behind four such
    clients (a TEI review). Counted first, a batch one over the cap is 413 whatever its
    items hold."""
    with pytest.raises(PayloadTooLarge, match="33 inputs in one request: at most 32"):
        read([["\ud800"], *[["a"]] * 32], 32)
    for no_input in ({"a": 1}, ["a", "b", "c"], [1.5], [[1]]):  # (not counted as inputs)
        with pytest.raises(BadRequest) as refused:
            read([["a"], *[no_input] * 40], 32)
        assert not isinstance(refused.value, PayloadTooLarge), no_input


def tei_embed(value, cap):
    from types import SimpleNamespace

    from rawserve.api.tei_bodies import read_embed_inputs

    context = SimpleNamespace(max_inputs=cap, model=None)

    def as_embedded(item):  # a [text] of /predict is /embed's text
        one_text = isinstance(item, list) and len(item) == 1 and isinstance(item[0], str)
        return item[0] if one_text else item

    return read_embed_inputs("inputs", [[5, 6], *map(as_embedded, value[1:])], context)


@pytest.mark.parametrize("value", [None, [], [1, 2], [["a"]], [None], "\udc00", ["ok", "\ud800"]])
def test_text_inputs_refused(value):
    with pytest.raises(BadRequest):
        text_inputs(value, 32)


@pytest.mark.parametrize(
    ("value", "status"),
    [
        *[(value, 400) for value in ([], [[]], [-1], [1.5], [True], [[1], 2], [2**32], "5")],
        ([[1]] * 33, 413),  # more lists than one request may carry: it never fits
    ],
)
def test_token_ids_refused(value, status):
    """Ids that are no token ids are a 400; more lists than a request may carry, a 413."""
    with pytest.raises(HTTPError) as raised:
        id_inputs(value, 32)
    assert raised.value.status == status
    assert isinstance(raised.value, PayloadTooLarge if status == 413 else BadRequest)


def test_scores_are_a_softmax_a_sigmoid_or_raw_and_never_nan():
    assert scores([0.0, 0.0], raw=False).tolist() == [0.5, 0.5]
    assert scores([0.0], raw=False).tolist() == [0.5]
    assert scores([2.0, -1.0], raw=True).tolist() == [2.0, -1.0]
    with pytest.raises(InternalError):  # the model's fault: 500
        scores([float("nan"), 1.0], raw=False)


def test_byte_offsets_of_each_character():
    assert utf8_starts("aé€😀") == [0, 1, 3, 6, 10]


def test_chat_messages_keep_text_only():
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert messages(parts) == [{"role": "user", "content": "ab"}]
    # an empty list of calls is none; a call's arguments go to the template as an object
    assert messages([{"role": "assistant", "content": "x", "tool_calls": []}]) == [
        {"role": "assistant", "content": "x"}
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert messages([{"role": "assistant", "content": None, "tool_calls": [call]}]) == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "c1"}
            ],
        }
    ]
    # none written (as clients send a call of a function without parameters): none
    for written in ("", " "):
        unwritten = {**call, "function": {"name": "f", "arguments": written}}
        (sent,) = messages([{"role": "assistant", "content": None, "tool_calls": [unwritten]}])
        assert sent["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(BadRequest, match="only an assistant's message has tool calls"):
        messages([{"role": "user", "content": "x", "tool_calls": [call]}])
    # the older form is named as it was sent (it was blamed on tool_calls, never sent)
    older = {"role": "user", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}
    with pytest.raises(BadRequest, match="only an assistant's message has a function call") as e:
        messages([older])
    assert e.value.param == "messages[0].function_call"
    with pytest.raises(BadRequest, match="each tool call must be"):
        messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}])


@pytest.mark.parametrize("depth", [65, 500, 2000])
def test_a_calls_arguments_nested_past_a_bodys_levels_are_given_as_written(depth):
    """Arguments 500 deep (5 KB) were read into an object that pickling to the worker
    could not take: a 500, and the worker killed as hung, again and again, every client
    refused meanwhile. Past a body's 64 levels they are the text, as past the parser's."""
    import pickle

    written = '{"a":' * depth + "1" + "}" * depth
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": written}}
    (sent,) = messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert sent["tool_calls"][0]["function"]["arguments"] == written
    pickle.dumps(sent)
    shallow = {**call, "function": {"name": "f", "arguments": '{"a":' * 63 + "1" + "}" * 63}}
    (sent,) = messages([{"role": "assistant", "content": None, "tool_calls": [shallow]}])
    assert isinstance(sent["tool_calls"][0]["function"]["arguments"], dict)


HELLO = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("message", "param", "words"),
    [
        # an ill-typed tool_calls was a 500 (iterating a bool), which the SDK re-sent twice
        ({"role": "assistant", "content": "x", "tool_calls": True}, "tool_calls", "a list"),
        ({"role": "assistant", "content": None, "tool_calls": 1.5}, "tool_calls", "a list"),
        ({"role": "assistant", "content": None, "tool_calls": {}}, "tool_calls", "a list"),
        ({"role": "assistant", "content": None, "tool_calls": []}, None, "content or its tool"),
        ({"role": "user", "content": []}, "content", "non-empty list of text parts"),
        (
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
            "content[1]",
            "reads no images, audio or files (not 'image_url')",
        ),
        (  # a text part with a key it does not take is told so, not "text only"
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]},
            "content[0]",
            "a text part cannot have 'cache_control'",
        ),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "content[0]", "'text' must"),
        (
            {"role": "assistant", "tool_calls": [CALL, {"function": {"name": "f"}}]},
            "tool_calls[1]",
            "each tool call must be",
        ),
        ({"role": "assistant", "function_call": {"name": "f"}}, "function_call", "each tool call"),
        ({"role": "robot", "content": "x"}, "role", "role must be one of"),
        ({"role": "user", "content": "x", "name": 3}, "name", "name must be a string"),
    ],
)
def test_a_refused_message_is_named_where_its_fault_is(message, param, words):
    """As OpenAI's errors do, the refusal names the message and the part at fault, in its
    `param` and its text: `messages[1].content[0]`, not "messages" alone."""
    with pytest.raises(BadRequest) as refused:
        messages([HELLO, message])
    where = "messages[1]" + (f".{param}" if param else "")
    assert refused.value.param == where
    assert refused.value.message.startswith(f"{where}: ")
    assert words in refused.value.message


def test_an_answer_sent_back_as_openais_sdk_dumps_it_is_its_text():
    # `messages.append(completion.choices[0].message.model_dump())`: every field of the answer
    dumped = {"role": "assistant", "content": "yo", "refusal": None, "annotations": None}
    dumped |= {"audio": None, "function_call": None, "tool_calls": None}
    assert messages([dumped]) == [{"role": "assistant", "content": "yo"}]
    refused = {**dumped, "content": None, "refusal": "I cannot help with that"}
    assert messages([refused]) == [{"role": "assistant", "content": "I cannot help with that"}]
    # an empty content beside the refusal (as some clients send it) is the refusal too
    refused = {**dumped, "content": "", "refusal": "I cannot help with that"}
    assert messages([refused]) == [{"role": "assistant", "content": "I cannot help with that"}]
    parts = {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    assert messages([parts]) == [{"role": "assistant", "content": "no"}]
    with pytest.raises(BadRequest, match="audio is not supported"):
        messages([{**dumped, "audio": {"id": "audio_1"}}])
    with pytest.raises(BadRequest, match="only an assistant's message has a refusal"):
        messages([{"role": "user", "content": "hi", "refusal": "no"}])


def test_a_response_s_refusal_sent_back_as_the_sdk_dumps_it_is_the_text_it_answered():
    """An earlier Response's message whose content is a refusal part was 400, though its
    text parts were taken; chat takes an assistant's refusal as the text it answered."""
    from openai.types.responses import ResponseOutputMessage, ResponseOutputRefusal

    refusal = ResponseOutputRefusal(type="refusal", refusal="I cannot help with that")
    answer = ResponseOutputMessage(
        id="msg_1", type="message", role="assistant", status="completed", content=[refusal]
    )
    given = [
        {"role": "user", "content": "do it"},
        answer.model_dump(mode="json"),
        {"role": "user", "content": "why?"},
    ]
    generation, _ = parse_response({"input": given})
    [chat] = generation.items
    assert chat["messages"][1] == {"role": "assistant", "content": "I cannot help with that"}
    # a user's message holds no refusal
    with pytest.raises(BadRequest, match="only an assistant's message holds a refusal") as held:
        parse_response({"input": [{"role": "user", "content": [refusal.model_dump()]}]})
    assert held.value.param == "input[0].content[0].type"


def test_an_answer_of_the_sdks_parse_sent_back_is_its_text_and_calls():
    # `chat.completions.parse(...)`'s message appended as it is: the SDK sends its `parsed`
    # (the structured answer, or null) and each call's `parsed_arguments`
    function = {"name": "f", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}}
    call = {"id": "c1", "type": "function", "function": function}
    parsed = {"role": "assistant", "content": '{"a": 1}', "refusal": None, "parsed": {"a": 1}}
    assert messages([parsed]) == [{"role": "assistant", "content": '{"a": 1}'}]
    called = {**parsed, "content": None, "parsed": None, "tool_calls": [call]}
    assert messages([called])[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "c1"}
    ]
    with pytest.raises(BadRequest, match="a message cannot have 'weight'"):
        messages([{"role": "user", "content": "hi", "weight": 1}])
    # and the schema /openapi.json shows takes them too (it refused `parsed`)
    for message in (parsed, called):
        jsonschema.validate(message, MESSAGE)
    assert set(MESSAGE["properties"]) == MESSAGE_KEYS  # every key read, and no other


def test_chat_template_kwargs_go_to_the_template_with_the_chat():
    hi = [{"role": "user", "content": "hi"}]
    chat = parse_chat({"messages": hi, "chat_template_kwargs": {"enable_thinking": False}})
    assert chat.items == [{"messages": hi, "template_kwargs": {"enable_thinking": False}}]
    assert parse_chat({"messages": hi, "chat_template_kwargs": None}).items == [{"messages": hi}]
    with pytest.raises(BadRequest, match="cannot set add_generation_prompt, tokenize"):
        parse_chat(
            {"messages": hi, "chat_template_kwargs": {"tokenize": 1, "add_generation_prompt": 0}}
        )
    # Jinja's own names: shadowed, a template calling namespace() failed, blaming the chat
    with pytest.raises(BadRequest, match="cannot set namespace, range") as refused:
        parse_chat({"messages": hi, "chat_template_kwargs": {"range": "x", "namespace": 1}})
    assert refused.value.param == "chat_template_kwargs"
    # and the names apply_chat_template's own calls take ("got multiple values for self")
    with pytest.raises(BadRequest, match="cannot set conversations, self"):
        parse_chat({"messages": hi, "chat_template_kwargs": {"self": 1, "conversations": 1}})
    for wrong in ([], {"no-name": 1}, {"_private": 1}, {f"k{i}": i for i in range(33)}):
        with pytest.raises(BadRequest, match="must be an object of at most 32 values by name"):
            parse_chat({"messages": hi, "chat_template_kwargs": wrong})


def test_stop_sequences_end_an_answer_that_may_be_words_and_never_one_held_to_json():
    """With tools and "auto" the answer may be words, held as `{"content": "..."}`: the
    stops are kept for them (ReAct agents send "Observation:" beside their tools; they
    were dropped). A required call, or a JSON response_format's answer, has none: the
    grammar says where it ends."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    stops = ["Observation:", 'a\n"b']
    asked = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "stop": stops}
    auto = parse_chat(asked)  # (the worker has none: they cut the answer's words alone)
    assert auto.stop == stops and "stop" not in auto.params
    for held in (
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"response_format": {"type": "json_object"}},
    ):
        request = parse_chat({**asked, **held})
        assert request.stop == [] and "stop" not in request.params
    assert parse_chat({**asked, "tool_choice": "none"}).stop == stops


@pytest.mark.parametrize(
    ("asked", "generations"),
    [
        ({"best_of": 4}, 4),  # (the model's own sampling)
        ({"best_of": 4, "n": 2, "temperature": 0.7}, 4),
        ({"best_of": 4, "n": 2, "temperature": 0}, 2),  # greedy: every one the same
        ({"best_of": 2, "n": 2}, 2),
    ],
)
def test_completions_best_of_generates_so_many_unless_greedy(asked, generations):
    served = ServedModel("m", ModelService(Idle(), Loaded("text-generation", {}, "{}")))
    completion = parse_completion({"prompt": "hi", **asked}, DocContext(served, 32))
    assert completion.generations == len(completion.choice_params()) == generations


@pytest.mark.parametrize(("top_k", "asked"), [(5, 5), (0, 0), (-1, 0), (None, None)])
def test_vllms_top_k_is_taken_on_both_routes(top_k, asked):
    """litellm forwards `top_k` on every OpenAI-compatible provider (`openai/`,
    `hosted_vllm/`, `huggingface/`), as vLLM takes it: it was a 400 (unknown field). -1
    and 0 are vLLM's "every token"."""
    hi = [{"role": "user", "content": "hi"}]
    served = ServedModel("m", ModelService(Idle(), Loaded("text-generation", {}, "{}")))
    context = DocContext(served, 32)
    chat = parse_chat({"messages": hi, "max_tokens": 3, "top_k": top_k})
    completion = parse_completion({"prompt": "hi", "top_k": top_k}, context)
    assert chat.params.get("top_k") == completion.params.get("top_k") == asked
    assert ("top_k" in chat.params) == (top_k is not None)


@pytest.mark.parametrize("top_k", [-2, 1.5, "5", True])
def test_vllms_top_k_refuses_what_vllm_refuses(top_k):
    with pytest.raises(BadRequest, match='"top_k" must be an integer from -1') as refused:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_k": top_k})
    assert refused.value.param == "top_k"


def test_a_prefill_is_asked_as_vllm_asks_it():
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    prefill = {"add_generation_prompt": False, "continue_final_message": True}
    chat = parse_chat({"messages": said, **prefill})
    assert chat.items == [{"messages": said, "opening": prefill}]
    assert parse_chat({"messages": said, "add_generation_prompt": True}).items == [
        {"messages": said}
    ]
    with pytest.raises(BadRequest, match='needs "add_generation_prompt": false') as refused:
        parse_chat({"messages": said, "continue_final_message": True})
    assert refused.value.param == "continue_final_message"
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(BadRequest, match="cannot go with tools"):
        parse_chat({"messages": said, **prefill, "tools": tools})


# --- /openapi.json for every task, and CORS -----------------------------------------------


class Loaded:
    """A model's workers as the app reads them, loaded."""

    def __init__(
        self, task: str, details: dict, tokenizer: str | None, limits: ModelLimits | None = None
    ):
        self.task, self.ready, self.healthy = task, True, True
        self.loaded = WorkerReady(
            1,
            task,
            "cpu",
            "float32",
            0.1,
            details,
            tokenizer=tokenizer,
            limits=limits or ModelLimits(),
        )

    def load_state(self):
        return LoadState.LOADING, None

    def back_in(self):
        return None

    def status(self):
        return []

    def open_stream(self, on_token):
        return 1

    def close_stream(self, stream_id):
        pass


class Idle:
    full = False
    max_batch_size = 32
    most_admitted = None  # no bound of its own

    def admission(self, deadline=None):
        return None

    async def run(self, inputs, params, deadline, control=None):
        raise AssertionError("not called")


def app_for(task, details=None, tokenizer="{}", **settings):
    workers = Loaded(task, details or {}, tokenizer)
    model = ServedModel("m", ModelService(Idle(), workers), {"batching": {}})
    return App(ServedModels([model]), AppSettings(**settings))


def get(path, headers=()):
    return HttpRequest("GET", path, "", list(headers), b"", request_id="test")


@pytest.mark.parametrize("task", [*sorted(TASKS), "custom"])
def test_the_document_of_every_task_validates(task):
    from openapi_spec_validator import validate
    from openapi_spec_validator.validation import OpenAPIV31SpecValidator

    app = app_for(task, {"id2label": {"0": "a"}, "chat_template": True}, api_key="k")
    document = json.loads(asyncio.run(app.openapi(get("/openapi.json"))).body)
    validate(document, cls=OpenAPIV31SpecValidator)
    root = document["paths"]["/"]["post"]
    assert root["security"] == [{"apiKey": []}] and "401" in root["responses"]
    assert document["paths"]["/health"]["get"]["security"] == []


@pytest.mark.parametrize(
    ("task", "raw"),
    [
        ("image-classification", {"image/*", "application/octet-stream"}),
        ("text-classification", {"text/plain"}),
        ("custom", {"text/plain"}),
    ],
)
def test_the_document_says_which_raw_bodies_post_takes(task, raw):
    """An image model takes its image's bytes as the body (`curl --data-binary
    @cat.png`), not a text: /openapi.json listed JSON and text/plain for it."""
    document = json.loads(asyncio.run(app_for(task).openapi(get("/openapi.json"))).body)
    for path in ("/", "/models/m"):
        content = document["paths"][path]["post"]["requestBody"]["content"]
        assert set(content) == {"application/json", *raw}


def post_answers(document, path="/"):
    """The validator of `path`'s 200 answer, as the document describes it."""
    answer = document["paths"][path]["post"]["responses"]["200"]
    return jsonschema.Draft202012Validator(answer["content"]["application/json"]["schema"])


@pytest.mark.parametrize(
    ("task", "key"),
    [
        ("summarization", "summary_text"),
        ("translation", "translation_text"),
        ("text2text-generation", "generated_text"),
    ],
)
def test_a_seq2seq_answer_of_several_sequences_per_input_is_as_documented(task, key):
    """A list of inputs with num_return_sequences=2 is answered a list of lists (as the
    pipeline answers it): the document allowed a list of objects only."""
    document = json.loads(asyncio.run(app_for(task).openapi(get("/openapi.json"))).body)
    one = {key: "a"}
    for path in ("/", "/models/m"):
        answers = post_answers(document, path)
        for answer in ([one], [one, one], [[one, one], [one, one]]):
            answers.validate(answer)
        assert not answers.is_valid({key: "a"}) and not answers.is_valid([{"other": "a"}])


def request_schema(task, path):
    details = {"id2label": {"0": "a"}, "chat_template": True}
    document = json.loads(asyncio.run(app_for(task, details).openapi(get("/openapi.json"))).body)
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return jsonschema.Draft202012Validator(body["schema"])


@pytest.mark.parametrize(
    ("task", "path", "body", "valid"),
    [
        ("feature-extraction", "/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, 0),
        ("feature-extraction", "/v1/embeddings", {"input": "a", "truncate_prompt_tokens": -1}, 1),
        ("feature-extraction", "/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 3}, 1),
        ("text-classification", "/classify", {"input": "a", "truncate_prompt_tokens": 0}, 0),
        ("text-classification", "/classify", {"input": "a", "truncate_prompt_tokens": None}, 1),
        ("text-generation", "/v1/chat/completions", {"messages": [{"role": "system"}]}, 0),
        (
            "text-generation",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": None}]},
            0,
        ),
        (
            "text-generation",
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
            1,
        ),
        (
            "text-generation",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}]},
            1,
        ),
        ("text-generation", "/v1/responses", {"input": [None]}, 0),
        ("text-generation", "/v1/responses", {"input": [{"role": "user", "content": "a"}]}, 1),
    ],
)
def test_the_documents_request_schemas_refuse_what_the_server_refuses(task, path, body, valid):
    """A fuzzer found bodies the document took that the server answers 400: vLLM's
    truncate_prompt_tokens 0, a system message without content, an input item null."""
    assert request_schema(task, path).is_valid(body) is bool(valid)


@pytest.mark.parametrize("task", ["feature-extraction", "image-classification"])
def test_the_document_asked_while_the_model_loads_is_its_tasks(task):
    """While the model loads, /openapi.json already listed its task's routes but
    described POST / for no task ("what the handler answers"): a gateway that reads the
    document as the pod starts got placeholders. The task it was started with is known,
    and an image model's says it has no tokenizer (/tokenize was listed, then 404)."""

    class Loading(Loaded):
        def __init__(self, task):
            super().__init__(task, {}, None)
            self.ready, self.loaded = False, None

    def document(workers):
        facts = {"task": task, "batching": {}}
        model = ServedModel("m", ModelService(Idle(), workers), facts)
        app = App(ServedModels([model]), AppSettings())
        return json.loads(asyncio.run(app.openapi(get("/openapi.json"))).body)

    loading = document(Loading(task))
    loaded = document(Loaded(task, {}, None if task == "image-classification" else "{}"))
    assert set(loading["paths"]) == set(loaded["paths"])
    for path in ("/", "/models/m", "/invocations"):
        assert loading["paths"][path] == loaded["paths"][path], path
    assert task in json.dumps(loading["paths"]["/"]["post"])
    if task == "feature-extraction":
        post_answers(loading).validate([[0.5, 0.25]])
    else:
        assert "/tokenize" not in loading["paths"]


@pytest.mark.parametrize(
    ("method", "path", "headers", "seconds"),
    [
        ("POST", "/", [], 30.0),  # --timeout
        ("POST", "/embed", [("x-request-timeout", "2.5")], 2.5),
        ("POST", "/v1/embeddings", [("x-request-timeout", "900")], 300.0),  # --max-timeout
        ("POST", "/invocations", [], 30.0),
        ("POST", "/embeddings", [("x-request-timeout", "3")], 3.0),  # SageMaker's /v1/embeddings
        ("POST", "/models/m", [], 30.0),
        ("POST", "/embed", [("x-request-timeout", "abc")], None),  # refused once read
        ("POST", "/tokenize", [("x-request-timeout", "0.001")], None),  # (no deadline)
        ("GET", "/info", [], None),
        ("POST", "/nowhere", [], None),
    ],
)
def test_a_body_is_bounded_by_the_deadline_of_a_route_that_runs_the_model(
    method, path, headers, seconds
):
    """The protocol stops waiting for a body at its request's deadline: a route that
    runs no model (/tokenize) has none, and its slow body met a 504 saying to ask for a
    longer X-Request-Timeout, which it ignores."""
    app = app_for("feature-extraction")
    request = HttpRequest(method, path, "", headers, b"", "test")
    assert app.deadline_seconds(request) == seconds


def test_a_models_name_is_percent_encoded_in_the_documents_paths():
    """A folder named `my cls` made the path keys `/models/my cls`, which no URL is
    (generated clients broke); the server reads `/models/my%20cls` as that name."""
    from openapi_spec_validator import validate
    from openapi_spec_validator.validation import OpenAPIV31SpecValidator

    workers = Loaded("text-classification", {"id2label": {"0": "a"}}, "{}")
    model = ServedModel("my cls {x}", ModelService(Idle(), workers), {"batching": {}})
    app = App(ServedModels([model]), AppSettings())
    document = json.loads(asyncio.run(app.openapi(get("/openapi.json"))).body)
    validate(document, cls=OpenAPIV31SpecValidator)
    named = sorted(path for path in document["paths"] if "my" in path)
    assert named == [
        "/models/my%20cls%20%7Bx%7D",
        "/ready/my%20cls%20%7Bx%7D",
        "/v1/models/my%20cls%20%7Bx%7D",
    ]


def test_preflight_and_answers_for_an_allowed_origin():
    app = app_for("custom", tokenizer=None, cors_allow_origins=("https://a.example",))
    preflight = HttpRequest(
        "OPTIONS", "/", "",
        [("origin", "https://a.example"), ("access-control-request-method", "POST")],
        b"", request_id="test",
    )  # fmt: skip
    answer = asyncio.run(app.handle(preflight))
    assert answer.status == 204
    assert ("Access-Control-Allow-Origin", "https://a.example") in answer.headers
    health = app.answer_now(get("/health", [("origin", "https://a.example")]))
    assert ("Access-Control-Allow-Origin", "https://a.example") in health.headers
    missing = asyncio.run(app.handle(get("/nowhere", [("origin", "https://a.example")])))
    assert missing.status == 404
    assert ("Access-Control-Allow-Origin", "https://a.example") in missing.headers


@pytest.mark.parametrize(
    ("path", "method"),
    [("/models/nope", "POST"), ("/v1/models/nope", "GET"), ("/ready/nope", "GET")],
)
def test_a_preflight_to_a_model_not_served_is_answered_without_the_key(path, method):
    """A browser's preflight carries no API key: it got 401, which the browser reports as
    a CORS failure; it is answered with the methods of the path's kind, naming no model,
    and the request itself, with its key, gets the 404 naming the served ones."""
    app = app_for("text-classification", api_key="k", cors_allow_origins=("https://a.example",))
    origin = [("origin", "https://a.example")]
    preflight = HttpRequest(
        "OPTIONS", path, "", [*origin, ("access-control-request-method", method)], b"", "t"
    )
    answer = asyncio.run(app.handle(preflight))
    assert answer.status == 204 and not answer.body
    assert not any("m" in value.split(", ") for _, value in answer.headers), answer.headers
    keyed = HttpRequest(method, path, "", [*origin, ("authorization", "Bearer k")], b"x", "t")
    assert asyncio.run(app.handle(keyed)).status == 404
    unkeyed = HttpRequest(method, path, "", origin, b"x", "t")
    assert asyncio.run(app.handle(unkeyed)).status == 401  # the names stay behind the key


# --- each body declared once: its checks and its schema agree ---------------------------

HI = [{"role": "user", "content": "hi"}]
AGREEMENT = [
    # (body, document, taken): the schema and the checks take it, or both refuse it
    ("EMBED", {"inputs": "a"}, True),
    ("EMBED", {"inputs": ["a", "b"], "normalize": False, "dimensions": 8}, True),
    ("EMBED", {"inputs": "a", "anything": 1}, True),  # TEI ignores what it does not use
    ("EMBED", {}, False),
    ("EMBED", {"inputs": []}, False),
    ("EMBED", {"inputs": ["a"] * 33}, False),
    ("EMBED", {"inputs": "a", "normalize": "yes"}, False),
    ("EMBED", {"inputs": "a", "dimensions": 0}, False),
    ("EMBED", {"inputs": "a", "truncation_direction": "up"}, False),
    ("EMBED", {"inputs": "a", "prompt_name": 7}, False),
    ("EMBED", {"inputs": [[2, 9, 3], [2, 10]]}, True),  # TEI's token ids
    ("EMBED", {"inputs": [2, 9, 3]}, True),
    ("EMBED", {"inputs": [[2, 9], "a"]}, True),  # TEI mixes texts and ids
    ("EMBED", {"inputs": [[2, 9], 3]}, False),
    ("EMBED", {"inputs": [[2, 9], "a"] * 17}, False),
    ("EMBED", {"inputs": [[-1]]}, False),
    ("SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": ["b", "c"]}}, True),
    (
        "SIMILARITY",
        {
            "inputs": {"source_sentence": "a", "sentences": ["b"]},
            "parameters": {"truncate": True, "truncation_direction": "Left", "prompt_name": None},
        },
        True,
    ),
    (
        "SIMILARITY",
        {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": None},
        True,
    ),
    ("SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 31}}, True),
    ("SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 32}}, False),  # 33
    ("SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": []}}, False),
    ("SIMILARITY", {"inputs": {"source_sentence": "a"}}, False),
    ("SIMILARITY", {"inputs": {"source_sentence": 5, "sentences": ["b"]}}, False),
    ("SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": "b"}}, False),
    ("SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": ["b"], "x": 1}}, True),  # TEI
    (
        "INFERENCE_SIMILARITY",
        {"inputs": {"source_sentence": "a", "sentences": ["b"], "x": 1}},
        False,
    ),
    ("SIMILARITY", {"inputs": ["a", "b"]}, False),
    (
        "SIMILARITY",
        {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": 5},
        False,
    ),
    (
        "SIMILARITY",
        {
            "inputs": {"source_sentence": "a", "sentences": ["b"]},
            "parameters": {"truncation_direction": "up"},
        },
        False,
    ),
    # the same body on the Inference API's POST /, which refuses what it does not read
    ("INFERENCE_SIMILARITY", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}, True),
    (
        "INFERENCE_SIMILARITY",
        {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "options": {"use_cache": 1}},
        True,
    ),
    (
        "INFERENCE_SIMILARITY",
        {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "x": 1},
        False,
    ),
    (
        "INFERENCE_SIMILARITY",
        {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"x": 1}},
        False,
    ),
    ("PREDICT", {"inputs": [["a"], ["a", "b"]]}, True),
    ("PREDICT", {"inputs": ["a", "b", "c"]}, False),
    ("RERANK", {"query": "q", "texts": ["a"], "top_n": 1}, True),
    ("RERANK", {"query": "q", "texts": ["a"], "top_n": 0}, False),
    ("RERANK", {"query": 5, "texts": ["a"]}, False),
    ("TOKENIZE", {"inputs": "a", "truncate": True, "add_special_tokens": False}, True),
    ("TOKENIZE", {"inputs": "a", "truncate": 1}, False),
    ("DECODE", {"ids": [[1, 2], [3]]}, True),
    ("DECODE", {"ids": [-1]}, False),
    ("DECODE", {"ids": [[]]}, False),
    ("EMBEDDINGS", {"input": ["a"], "encoding_format": "base64", "user": "u"}, True),
    ("EMBEDDINGS", {"input": "a", "encoding_format": "int8"}, False),
    ("EMBEDDINGS", {"input": "a", "unknown": 1}, False),  # OpenAI's routes refuse it
    ("EMBEDDINGS", {"input": [[2, 9, 3], [2, 10]], "encoding_format": "base64"}, True),
    ("EMBEDDINGS", {"input": [2, 9, 3]}, True),  # one token array
    ("EMBEDDINGS", {"input": [[2, 9], "a"]}, False),  # one form for all
    ("EMBEDDINGS", {"input": [[-1]]}, False),
    ("RERANK_DOCUMENTS", {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 0}, True),
    ("RERANK_DOCUMENTS", {"query": "q", "documents": ["a"], "rank_fields": ["x"]}, True),
    ("RERANK_DOCUMENTS", {"query": "q", "documents": [{"title": "b"}]}, False),
    ("RERANK_DOCUMENTS", {"query": "q", "documents": []}, False),
    ("RERANK_DOCUMENTS", {"documents": ["a"]}, False),
    ("CHAT", {"messages": HI, "max_completion_tokens": 5, "stream": True}, True),
    ("CHAT", {"messages": HI, "stream": True, "stream_options": {"include_usage": True}}, True),
    ("CHAT", {"messages": HI, "tools": [], "tool_choice": "none", "logprobs": False}, True),
    ("CHAT", {"messages": HI, "tools": [{"type": "function"}]}, False),
    ("CHAT", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, True),
    ("CHAT", {"messages": HI, "tool_choice": {"type": "function", "function": {}}}, False),
    # OpenAI's and vLLM's rules: a named choice's type is "function" (left out, vLLM's
    # default), a tool's "strict" and a json_schema's are true or false, its name OpenAI's
    # (1 to 64 letters, digits, _ or -: vLLM takes any, a request OpenAI refuses, and
    # /v1/responses holds to it), a field it does not know refused (it was dropped)
    ("CHAT", {"messages": HI, "tool_choice": {"function": {"name": "f"}}}, True),
    ("CHAT", {"messages": HI, "tool_choice": {"type": "file", "function": {"name": "f"}}}, False),
    (
        "CHAT",
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
        False,
    ),
    *(
        (
            "CHAT",
            {"messages": HI, "response_format": {"type": "json_schema", "json_schema": described}},
            taken,
        )
        for described, taken in [
            ({"name": "a-b_9", "schema": {}, "strict": None, "description": None}, True),
            ({"name": "a b", "schema": {}}, False),
            ({"name": "x" * 65, "schema": {}}, False),
            ({"name": "x", "schema": {}, "foo": 1}, False),
            ({"name": "x", "schema": {}, "strict": "yes"}, False),
            ({"schema": {}}, False),
            ({"name": 3, "schema": {}}, False),
            ({"name": "x", "schema": {}, "description": 3}, False),
        ]
    ),
    (
        "CHAT",
        {
            "messages": [
                *HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "1", "content": "done"},
            ]
        },
        True,
    ),
    ("CHAT", {"messages": HI, "response_format": {"type": "json_object"}}, True),
    ("CHAT", {"messages": HI, "response_format": {"type": "text"}}, True),
    ("CHAT", {"messages": HI, "response_format": {"type": "yaml"}}, False),
    ("CHAT", {"messages": HI, "response_format": {"type": "json_schema"}}, False),
    # a field its type has not (a misspelt "json_schema" was dropped without a word)
    ("CHAT", {"messages": HI, "response_format": {"type": "text", "extra": 1}}, False),
    ("CHAT", {"messages": HI, "response_format": {"type": "json_object", "jsonschema": {}}}, False),
    # TGI's grammars, as its chat takes them
    ("CHAT", {"messages": HI, "response_format": {"type": "json", "value": {}}}, True),
    (
        "CHAT",
        {"messages": HI, "response_format": {"type": "json", "value": '{"type": "object"}'}},
        True,
    ),
    ("CHAT", {"messages": HI, "response_format": {"type": "regex", "value": "[a-z]+"}}, True),
    (
        "CHAT",
        {"messages": HI, "response_format": {"type": "json_schema", "value": {"schema": {}}}},
        True,
    ),
    ("CHAT", {"messages": HI, "response_format": {"type": "json_schema", "value": {}}}, False),
    ("CHAT", {"messages": HI, "response_format": {"type": "regex", "value": ""}}, False),
    ("CHAT", {"messages": HI, "response_format": {"type": "regex"}}, False),
    ("CHAT", {"messages": HI, "response_format": {"type": "json", "value": 5}}, False),
    ("CHAT", {"messages": HI, "tool_prompt": "use a tool"}, True),
    ("CHAT", {"messages": HI, "tool_prompt": 5}, False),
    ("CHAT", {"messages": HI, "stream": True, "stream_options": {"include_usage": "x"}}, False),
    # OpenAI's include_obfuscation, off: no delta is padded (on is refused)
    (
        "CHAT",
        {"messages": HI, "stream": True, "stream_options": {"include_obfuscation": False}},
        True,
    ),
    (
        "COMPLETION",
        {"prompt": "a", "stream": True, "stream_options": {"include_obfuscation": None}},
        True,
    ),
    (
        "CHAT",
        {"messages": HI, "stream": True, "stream_options": {"include_obfuscation": True}},
        False,
    ),
    ("CHAT", {"messages": [{"role": "robot", "content": "hi"}]}, False),
    # OpenAI's fields at their off or default values, and its bookkeeping, are taken
    (
        "CHAT",
        {
            "messages": HI,
            "store": False,
            "metadata": {"run": "7"},
            "service_tier": "auto",
            "modalities": ["text"],
            "reasoning_effort": "none",
            "verbosity": "medium",
            "prediction": None,
            "user": "u",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
            "moderation": None,
        },
        True,
    ),
    # a text part that marks where a cacheable prefix ends (the openai SDK's)
    (
        "CHAT",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {}}],
                }
            ]
        },
        True,
    ),
    ("CHAT", {"messages": HI, "prompt_cache_retention": "forever"}, False),
    ("CHAT", {"messages": HI, "prompt_cache_options": {"mode": "explicit", "size": 4}}, False),
    ("CHAT", {"messages": HI, "moderation": {"model": "omni-moderation-latest"}}, False),
    # vLLM's continuous_usage_stats, off: usage in the last chunk only (on is refused)
    (
        "CHAT",
        {"messages": HI, "stream": True, "stream_options": {"continuous_usage_stats": False}},
        True,
    ),
    (
        "CHAT",
        {"messages": HI, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        False,
    ),
    ("CHAT", {"messages": HI, "service_tier": "default", "metadata": {}}, True),
    ("CHAT", {"messages": HI, "store": True}, False),
    ("CHAT", {"messages": HI, "service_tier": "flex"}, False),
    ("CHAT", {"messages": HI, "modalities": ["text", "audio"]}, False),
    ("CHAT", {"messages": HI, "reasoning_effort": "high"}, True),  # (the model's to read)
    ("CHAT", {"messages": HI, "reasoning_effort": "extreme"}, False),
    ("CHAT", {"messages": HI, "prediction": {"type": "content", "content": "x"}}, False),
    ("CHAT", {"messages": HI, "audio": {"voice": "alloy", "format": "mp3"}}, False),
    ("CHAT", {"messages": HI, "metadata": {"run": 7}}, False),
    ("CHAT", {"messages": HI, "metadata": {str(i): "" for i in range(17)}}, False),
    ("CHAT", {"messages": HI, "metadata": {"k" * 65: ""}}, False),
    ("CHAT", {"messages": HI, "user": 5}, False),
    ("CHAT", {"messages": []}, False),
    ("COMPLETION", {"prompt": ["a", "b"], "max_tokens": 3, "stop": ["."], "seed": 1}, True),
    ("COMPLETION", {"prompt": "a", "n": 1, "best_of": 1, "echo": False}, True),
    ("COMPLETION", {"prompt": "a", "max_tokens": 0, "echo": True}, True),
    ("COMPLETION", {"prompt": "a", "repetition_penalty": 0}, False),
    ("COMPLETION", {"prompt": "a", "n": 2}, True),
    ("COMPLETION", {"prompt": "a", "n": 129}, False),
    ("COMPLETION", {"prompt": [1, 2]}, True),  # token ids
    ("COMPLETION", {"prompt": [[1, 2], [3]]}, True),
    ("COMPLETION", {"prompt": [1, -2]}, False),
    ("COMPLETION", {"prompt": "a", "top_p": 0}, False),
    ("COMPLETION", {"prompt": "a", "temperature": 2.5}, False),
    ("COMPLETION", {"prompt": "a", "stop": ["."] * 17}, False),
    ("COMPLETION", {"prompt": ""}, True),  # well-formed; blank: 422 once read
    ("COMPLETION", {"prompt": "a", "frequency_penalty": 0.5, "logit_bias": {"5": -1}}, True),
    ("COMPLETION", {"prompt": "a", "frequency_penalty": 2.5}, False),
    ("COMPLETION", {"prompt": "a", "logit_bias": {"a": 1}}, False),
    ("COMPLETION", {"prompt": "a", "guided_regex": "a+", "guided_choice": None}, True),
    ("COMPLETION", {"prompt": "a", "guided_choice": ["yes", "no"]}, True),
    ("COMPLETION", {"prompt": "a", "guided_choice": []}, False),
    ("COMPLETION", {"prompt": "a", "guided_json": {"type": "object"}}, True),
    ("COMPLETION", {"prompt": "a", "guided_json": 5}, False),
    ("COMPLETION", {"prompt": "a", "min_tokens": 3, "ignore_eos": True}, True),
    ("COMPLETION", {"prompt": "a", "min_tokens": -1}, False),
    ("COMPLETION", {"prompt": "a", "suffix": "b"}, False),
    ("COMPLETION", {"prompt": "a", "unknown": 1}, False),
    ("COMPLETION", {"prompt": "a", "model": "m"}, True),  # every body names its model
    ("COMPLETION", {"prompt": "a", "model": 7}, False),
]


def body_named(name):
    from rawserve.api import openai, openai_generation, tei_bodies

    for module in (tei_bodies, openai, openai_generation):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(name)


@pytest.mark.parametrize(("name", "document", "taken"), AGREEMENT, ids=repr)
def test_a_bodys_checks_and_its_schema_take_the_same_documents(name, document, taken):
    """The schema `/openapi.json` shows and the checks the handler runs come from one
    declaration: a document one takes, the other takes."""
    import jsonschema

    from rawserve.api.routing import DocContext
    from rawserve.http.errors import HTTPError

    body = body_named(name)
    loaded = Loaded("feature-extraction", {"dimensions": 32}, "{}")
    model = ServedModel("m", ModelService(Idle(), loaded), {})
    context = DocContext(model, 32)
    valid = jsonschema.Draft202012Validator(body.schema(context)).is_valid(document)
    try:
        fields = body.read(document)
        for field in body.names:
            fields.value(field, context)
        parsed = True
    except HTTPError as error:
        assert error.status in (400, 413), error
        parsed = False
    assert (valid, parsed) == (taken, taken)


def test_a_fields_schema_documents_its_default_and_description():
    from rawserve.api.fields import flag, text

    context = None  # a field of a fixed schema documents it whatever the route serves
    assert flag(False, "said").schema_in(context) == {
        "type": ["boolean", "null"],
        "default": False,
        "description": "said",
    }
    assert text().schema_in(context) == {"type": ["string", "null"]}


def test_unknown_fields_are_named_at_most_ten_each_cut_to_60_characters():
    from rawserve.api.fields import Body

    document = {f"{n:02}" + "x" * 100: 1 for n in range(12)}
    with pytest.raises(BadRequest) as raised:
        Body({}).read(document)
    names = str(raised.value).removeprefix("unknown field(s): ").split(" (allowed")[0]
    assert names.split(", ") == [repr(name)[:60] for name in sorted(document)[:10]]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_answered_with_every_field_the_route_takes(route):
    """Cut at 300 characters, the list of fields a route takes ended mid-way (`stream,
    st...`): a client looking for one could not tell whether it is served."""
    from rawserve.api.openai_generation import CHAT, COMPLETION
    from rawserve.http.errors import error_document, openai_error_document, tgi_error

    body = COMPLETION if route == "/v1/completions" else CHAT
    with pytest.raises(BadRequest) as raised:
        body.read({"stop_token_ids": [5], "x" * 100: 1})
    error = raised.value
    # in OpenAI's shape, and in TGI's (its routes answer the same check so)
    for message in (
        openai_error_document(error)["error"]["message"],
        error_document(tgi_error(error))["error"],
    ):
        taken = message.split("(allowed: ")[1].removesuffix(")").split(", ")
        assert taken == sorted(body.names) and len(message) > 300


def test_a_refused_field_is_named_as_the_param_unless_its_reader_named_one():
    from rawserve.api.fields import Body, Field, whole

    def named_inside(name, value, context):
        raise BadRequest("no", param=f"{name}[0]")

    fields = Body({"n": whole(1, 5), "list": Field({}, named_inside)}).read({"n": 9, "list": 1})
    for name, param in [("n", "n"), ("list", "list[0]")]:
        with pytest.raises(BadRequest) as raised:
            fields.value(name)
        assert raised.value.param == param


@pytest.mark.parametrize(
    ("value", "taken"),
    [(2, True), (5, True), (1, False), (6, False), (True, False), ("3", False), (3.0, False)],
)
def test_an_integer_field_takes_whole_numbers_from_its_low_to_its_high(value, taken):
    from rawserve.api.fields import read_integer

    if taken:
        assert read_integer("n", value, 2, 5) == value
    else:
        with pytest.raises(BadRequest, match='"n" must be an integer from 2 to 5'):
            read_integer("n", value, 2, 5)


@pytest.mark.parametrize(
    ("value", "taken"),
    [(0.5, True), (2, True), (0.25, False), (2.5, False), (True, False), ("1", False)]
    + [(float("nan"), False)],
)
def test_a_number_field_takes_numbers_from_its_low_to_its_high(value, taken):
    from rawserve.api.fields import read_number

    if taken:
        assert read_number("x", value, 0.5, 2.0) == value
    else:
        with pytest.raises(BadRequest, match='"x" must be'):
            read_number("x", value, 0.5, 2.0)


# --- a sentence-transformers model's default prompt ----------------------------------------


class Recording(Idle):
    """A model that answers every input with a zero vector, keeping what it was sent."""

    def __init__(self):
        self.sent: list[list] = []

    async def run(self, inputs, params, deadline, control=None):
        import numpy as np

        from rawserve.serving.face import ItemResult

        self.sent.append(list(inputs))
        vector = np.ones(2, dtype=np.float32)
        if control is None or not control.embedding_route:  # token vectors, as a pipeline's
            output = vector[None, None, :]
        else:
            output = {"embedding": vector, "tokens": 1}
        return [ItemResult(output, 0.0, len(inputs), 0.0) for _ in inputs]


@pytest.mark.parametrize(
    ("path", "document", "sent"),
    [
        ("/", {"inputs": ["a", "b"]}, ["query: a", "query: b"]),
        ("/", {"inputs": "a", "prompt_name": "doc"}, ["passage: a"]),
        ("/embed", {"inputs": "a"}, ["query: a"]),
        ("/embed", {"inputs": "a", "prompt_name": "doc"}, ["passage: a"]),
        ("/v1/embeddings", {"input": ["a"]}, ["query: a"]),
        (
            "/similarity",
            {"inputs": {"source_sentence": "a", "sentences": ["b"]}},
            ["query: a", "query: b"],
        ),
    ],
)
def test_a_text_sent_without_a_prompt_name_gets_the_model_s_default_prompt(path, document, sent):
    """sentence-transformers' encode() puts `default_prompt_name`'s prompt before every
    text not given another; the vectors served are the model's only with it there too."""
    model = Recording()
    details = {"prompts": {"query": "query: ", "doc": "passage: "}, "default_prompt_name": "query"}
    served = ServedModel("m", ModelService(model, Loaded("feature-extraction", details, "{}")), {})
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps(document).encode()
    request = HttpRequest(
        "POST", path, "", [("content-type", "application/json")], body, request_id="test"
    )
    answer = asyncio.run(app.handle(request))
    assert answer.status == 200, answer.body
    assert model.sent == [sent]


def embeddings_of(document, details, path="/v1/embeddings", tokenizer="{}"):
    """(the answer, what the model was sent) of POST `path` with `document`."""
    model = Recording()
    workers = Loaded("feature-extraction", details, tokenizer)
    served = ServedModel("m", ModelService(model, workers), {})
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps(document).encode()
    request = HttpRequest("POST", path, "", [("content-type", "application/json")], body, "test")
    return asyncio.run(app.handle(request)), model.sent


def test_openai_embeddings_take_token_arrays_as_the_models_input():
    """langchain-openai's OpenAIEmbeddings (by default) and OpenAI's API send token
    arrays: they were a 400. The ids go to the model as they are, without a prompt."""
    details = {"prompts": {"query": "query: "}, "default_prompt_name": "query", "vocabulary": 30}
    document = {"input": [[2, 9, 10, 3], [2, 5]], "model": "m", "encoding_format": "base64"}
    answer, sent = embeddings_of(document, details)
    assert answer.status == 200, answer.body
    assert sent == [[[2, 9, 10, 3], [2, 5]]]
    assert [item["index"] for item in json.loads(answer.body)["data"]] == [0, 1]
    answer, sent = embeddings_of({"input": [2, 9, 3]}, details)
    assert (answer.status, sent) == (200, [[[2, 9, 3]]])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[2, 30]], "the token id 30 is not in the model's vocabulary (ids run from 0 to 29)"),
        ([[2, 9], []], 'a token array of "input" at index 1 has no ids'),
        (
            [[2, 9], [2, 30]],
            'the token id 30 of "input" at index 1 is not in the model\'s vocabulary (ids run '
            "from 0 to 29)",
        ),
        (["a", " "], 'a text of "input" at index 1 is empty or only whitespace'),
    ],
)
def test_openai_embeddings_refuse_a_token_array_the_model_cannot_read(ids, message):
    answer, sent = embeddings_of({"input": ids}, {"vocabulary": 30})
    assert answer.status == 422 and sent == []
    error = json.loads(answer.body)["error"]
    assert (error["message"], error["param"]) == (message, "input")


@pytest.mark.parametrize("path", ["/embed", "/embed_all"])
def test_teis_embed_routes_take_token_ids_as_the_models_input(path):
    """TEI's `inputs` may be token ids (its `Input::Ids`), one list or a list of them:
    they were a 400. The ids go to the model as they are, without the default prompt."""
    details = {"prompts": {"query": "query: "}, "default_prompt_name": "query", "vocabulary": 30}
    answer, sent = embeddings_of({"inputs": [[2, 9, 10, 3], [2, 5]]}, details, path)
    assert (answer.status, sent) == (200, [[[2, 9, 10, 3], [2, 5]]]), answer.body
    answer, sent = embeddings_of({"inputs": [2, 9, 3]}, details, path)
    assert (answer.status, sent) == (200, [[[2, 9, 3]]]), answer.body


@pytest.mark.parametrize("path", ["/embed", "/embed_all"])
@pytest.mark.parametrize(
    ("document", "status", "message"),
    [
        ({"inputs": [[2, 30]]}, 422, "the token id 30 is not in the model's vocabulary"),
        ({"inputs": [[2, 9], []]}, 422, 'a token array of "inputs" at index 1 has no ids'),
        ({"inputs": [[2, 9], 3]}, 400, "a non-empty list of texts and lists of token ids"),
        ({"inputs": [[2, 9], " "]}, 422, 'a text of "inputs" at index 1 is empty'),
        ({"inputs": "  "}, 422, 'a text of "inputs" is empty'),
        # (tei-client's `prompt_names()` reads the list out of TEI's words)
        (
            {"inputs": [2, 9], "prompt_name": "doc"},
            400,
            '\'doc\' is not a prompt of this model. Available prompts: ["passage", "query"]',
        ),
    ],
)
def test_teis_embed_routes_refuse_token_ids_the_model_cannot_read(path, document, status, message):
    details = {"prompts": {"query": "query: ", "passage": "passage: "}, "vocabulary": 30}
    answer, sent = embeddings_of(document, details, path)
    assert (answer.status, sent) == (status, []), answer.body
    assert message in json.loads(answer.body)["error"]


def test_the_requests_that_come_as_a_tokenizer_is_built_wait_for_that_one_build(
    tiny_model, monkeypatch
):
    """Each request that came before the model's tokenizer was built (just after ready)
    built one of its own: 20 at once, 20 builds; one that fails is built anew after."""
    from types import SimpleNamespace

    from rawserve.api import tokens

    tokenizer = (Path(tiny_model("sentence-embedding")) / "tokenizer.json").read_text()
    built, real = [], tokens.ServerTokenizer

    def counted(source):
        built.append(source)
        if len(built) == 1:
            raise OSError("the first build fails")
        return real(source)

    monkeypatch.setattr(tokens, "ServerTokenizer", counted)
    loaded = SimpleNamespace(tokenizer=tokenizer)
    model = SimpleNamespace(name="m", serving=SimpleNamespace(loaded=loaded))
    kept = tokens.ServerTokenizers()

    async def twenty():
        return await asyncio.gather(*(kept.get(model) for _ in range(20)), return_exceptions=True)

    assert all(isinstance(got, OSError) for got in asyncio.run(twenty()))
    got = asyncio.run(twenty())
    assert len(built) == 2 and len({id(each) for each in got}) == 1


@pytest.mark.parametrize("path", ["/embed", "/embed_all"])
def test_teis_embed_routes_take_texts_and_token_ids_mixed_as_tei_does(path, tiny_model):
    """TEI's `inputs` may mix texts and token ids in one batch, and with `prompt_name` it
    decodes the ids (without their special tokens) and puts the prompt first: both were a
    400. Without a prompt named, the ids go as they are."""
    tokenizer = (Path(tiny_model("sentence-embedding")) / "tokenizer.json").read_text()
    ids = tokenizers.Tokenizer.from_str(tokenizer).encode("hello world").ids  # [CLS] ... [SEP]
    details = {"prompts": {"query": "query: "}, "default_prompt_name": "query"}
    document = {"inputs": ["a", ids, "b"]}
    answer, sent = embeddings_of(document, details, path, tokenizer)
    assert (answer.status, sent) == (200, [["query: a", ids, "query: b"]]), answer.body
    answer, sent = embeddings_of({**document, "prompt_name": "query"}, details, path, tokenizer)
    assert (answer.status, sent) == (200, [["query: a", "query: hello world", "query: b"]])
    answer, sent = embeddings_of({"inputs": ids, "prompt_name": "query"}, details, path, tokenizer)
    assert (answer.status, sent) == (200, [["query: hello world"]]), answer.body


class Scoring(Idle):
    """A cross-encoder whose logit for a (query, text) pair is the text's length, and
    which counts a pair's characters as its tokens."""

    async def run(self, inputs, params, deadline, control=None):
        assert params.get("logits")
        return [
            ItemResult(
                {
                    "logits": [float(len(pair["text_pair"]))],
                    "tokens": len(pair["text"] + pair["text_pair"]),
                },
                0.0,
                1,
                0.0,
            )
            for pair in inputs
        ]


def reranked(path, document):
    details = {"id2label": {"0": "LABEL_0"}}
    served = ServedModel("m", ModelService(Scoring(), Loaded("text-classification", details, "{}")))
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps(document).encode()
    request = HttpRequest("POST", path, "", [("content-type", "application/json")], body, "test")
    answer = asyncio.run(app.handle(request))
    return answer.status, json.loads(answer.body)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_the_rerank_of_cohere_jina_and_vllm_is_answered_in_their_shape(path):
    """litellm's `hosted_vllm/` and `infinity/` providers post vLLM's and Infinity's
    rerank to /rerank (`documents` where TEI's has `texts`), its `cohere/` provider to
    /v2/rerank: they were a 400 ("texts" is required) and a 404."""
    document = {"model": "m", "query": "q", "documents": ["ab", "abcd", {"text": "abc"}]}
    status, body = reranked(path, {**document, "top_n": 2})
    assert status == 200, body
    assert body["model"] == "m" and body["id"].startswith("rerank-")
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}  # vLLM's, Jina's
    results = body["results"]
    assert [(r["index"], r["document"]["text"]) for r in results] == [(1, "abcd"), (2, "abc")]
    assert results[0]["relevance_score"] == pytest.approx(1 / (1 + np.exp(-4.0)))
    status, body = reranked(path, {**document, "top_n": 0, "return_documents": False})
    assert [r["index"] for r in body["results"]] == [1, 2, 0]
    assert all("document" not in r for r in body["results"])


@pytest.mark.parametrize(
    ("document", "status"),
    [({"query": "q", "documents": []}, 400), ({"query": "q", "documents": ["a", " "]}, 422)],
)
def test_the_rerank_of_cohere_jina_and_vllm_refuses_what_teis_refuses(document, status):
    refused, body = reranked("/v1/rerank", document)
    assert refused == status and body["error"]["param"] == "documents", body
    assert reranked("/rerank", document)[0] == status


def test_documents_of_another_kind_are_refused_saying_the_kinds_taken():
    status, body = reranked("/v1/rerank", {"query": "q", "documents": [1, 2]})
    assert status == 400 and body["error"]["param"] == "documents"
    assert 'a non-empty list of strings or {"text": string} objects' in body["error"]["message"]


@pytest.mark.parametrize(
    ("content_type", "body", "text"),
    [
        ("text/plain", "héllo wörld".encode(), "héllo wörld"),
        ("application/x-www-form-urlencoded", b"hello world", "hello world"),  # curl -d
        ("text/plain; charset=utf-16le", "héllo".encode("utf-16-le"), "héllo"),
        ("text/plain; charset=UTF-16", "héllo".encode("utf-16"), "héllo"),  # BOM dropped
        ('text/plain;charset="latin-1"', "héllo".encode("latin-1"), "héllo"),
        ("text/plain; format=flowed; charset=utf-8", "héllo".encode(), "héllo"),
        ("text/plain", "\ufeffhéllo".encode(), "héllo"),  # a UTF-8 byte order mark
        ("text/plain; charset=utf-16le", "\ufeffhéllo".encode("utf-16-le"), "héllo"),
    ],
)
def test_a_text_body_is_read_in_the_charset_its_type_names(content_type, body, text):
    request = HttpRequest("POST", "/", "", [("content-type", content_type)], body, "test")
    assert parse_body("text-classification", request, 32).inputs == [text]


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", b"\xff\xfe\x00"),
        ("text/plain; charset=utf-16", b"\x00"),  # an odd byte count
        ("text/plain; charset=no-such-charset", b"hello"),
        ("text/plain; charset=base64", b"aGk="),  # a codec, but not a text encoding
        # Python's own encodings: punycode decodes a megabyte in a minute
        ("text/plain; charset=punycode", b"a" * 1000),
        ("text/plain; charset=IDNA", b"xn--" + b"a" * 1000),
        ("text/plain; charset=unicode_escape", b"\\u00e9"),
        # a form upload (curl -F): its parts' framing is no text to run the model on
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data"),
        # a short WAV or an image whose bytes happen to be valid UTF-8: no text
        ("audio/wav", b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00"),
        ("Image/PNG", b"not really a png"),
    ],
)
def test_a_text_body_not_in_its_charset_is_415(content_type, body):
    request = HttpRequest("POST", "/", "", [("content-type", content_type)], body, "test")
    with pytest.raises(UnsupportedMediaType):
        parse_body("text-classification", request, 32)


@pytest.mark.parametrize("charset", ["utf-7", "UTF7"])
def test_a_text_body_that_decodes_to_a_lone_surrogate_is_400(charset):
    """UTF-7's "+2AA-" is U+D800 alone, which no tokenizer takes: every task answered 500
    (a generation's with a traceback in the log), where JSON's "\\ud800" is a 400."""
    headers = [("content-type", f"text/plain; charset={charset}")]
    request = HttpRequest("POST", "/", "", headers, b"john +2AA- paris", "test")
    with pytest.raises(BadRequest, match="lone surrogate"):
        parse_body("text-classification", request, 32)
    fine = HttpRequest("POST", "/", "", headers, b"caf+AOk-", "test")  # é, as UTF-7 writes it
    assert parse_body("text-classification", fine, 32).inputs == ["café"]


def test_a_json_body_not_in_utf8_says_json_is_read_as_utf8():
    headers = [("content-type", "application/json; charset=latin-1")]
    request = HttpRequest("POST", "/", "", headers, '{"inputs": "héllo"}'.encode("latin-1"), "t")
    with pytest.raises(BadRequest, match="JSON is read as UTF-8"):
        parse_body("text-classification", request, 32)


@pytest.mark.parametrize("media_type", ["image/png", "audio/wav"])
def test_media_sent_to_a_route_that_reads_json_is_415(media_type):
    """TGI's /generate said "not valid JSON: JSON is read as UTF-8" to a PNG, where POST /
    says 415; JSON typed as an image is still read (a mistyped client keeps working)."""
    headers = [("content-type", media_type)]
    png = HttpRequest("POST", "/generate", "", headers, b"\x89PNG\r\n\x1a\n\xff", "t")
    with pytest.raises(
        UnsupportedMediaType, match=f"the body is {media_type}: this route reads JSON"
    ):
        read_json(png)
    assert read_json(HttpRequest("POST", "/generate", "", headers, b'{"inputs": "a"}', "t"))


@pytest.mark.parametrize(
    ("headers", "body", "inputs"),
    [
        ([], b' {"inputs": "a"}', ["a"]),  # InferenceClient posts JSON untyped
        ([("content-type", "Application/JSON; charset=utf-8")], b'"a"', None),
        ([], b'["a"]', ['["a"]']),  # untyped, and not an object: text
        ([], b"a {", ["a {"]),
        # curl -d types every body so: a JSON object had its own text scored, answered 200
        ([("content-type", "application/x-www-form-urlencoded")], b'{"inputs": "a"}', ["a"]),
        ([("content-type", "application/x-www-form-urlencoded")], b"a [MASK]", ["a [MASK]"]),
        ([("content-type", "text/plain")], b'{"inputs": "a"}', ['{"inputs": "a"}']),
        # JSON's other types: its text had been filled in, scored or embedded
        ([("content-type", "text/json")], b'{"inputs": "a"}', ["a"]),
        ([("content-type", "application/vnd.api+json")], b'{"inputs": "a"}', ["a"]),
        ([("content-type", "Application/Merge-Patch+JSON; x=1")], b'{"inputs": "a"}', ["a"]),
        # `curl -d @body.json` of a file Notepad saved: a byte order mark before the object
        # (the JSON's own text was scored)
        (
            [("content-type", "application/x-www-form-urlencoded")],
            b'\xef\xbb\xbf{"inputs": "a"}',
            ["a"],
        ),
        ([], b'\xef\xbb\xbf {"inputs": "a"}', ["a"]),
        # JSON in UTF-16 or UTF-32 (PowerShell's Out-File, Notepad's "Unicode"), as
        # json.loads reads it: with a byte order mark it was 415 "not UTF-8 text", and
        # UTF-16BE without one was read as text with a NUL between the letters
        *(
            ([], ("\ufeff" * bom + ' {"inputs": "a"}').encode(encoding), ["a"])
            for encoding in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
            for bom in (0, 1)
        ),
        ([], "\ufeff a {".encode("utf-16-be"), [" a {"]),  # text: its mark says UTF-16
        # JSON's whitespace before the object, however much (a first fix looked 64 bytes in)
        ([], b"\n" * 70 + b'{"inputs": "a"}', ["a"]),
        ([], (" " * 40 + '{"inputs": "a"}').encode("utf-16-le"), ["a"]),
        # a UTF-32 text: its mark is no UTF-16 mark and two NULs (read so, a fix made it
        # "\x00h\x00e..."), typed or not
        ([("content-type", "text/plain; charset=utf-32")], "hello".encode("utf-32"), ["hello"]),
        ([], "hello".encode("utf-32"), ["hello"]),
    ],
)
def test_a_body_is_read_as_json_when_so_typed_or_untyped_and_an_object(headers, body, inputs):
    request = HttpRequest("POST", "/", "", headers, body, "test")
    if inputs is None:  # JSON, but no object: refused as JSON is, not taken as text
        with pytest.raises(BadRequest, match="object"):
            parse_body("text-classification", request, 32)
    else:
        assert parse_body("text-classification", request, 32).inputs == inputs


def test_a_request_of_exactly_the_input_cap_is_taken():
    def request(count):
        body = json.dumps({"inputs": ["a"] * count}).encode()
        return HttpRequest("POST", "/", "", [("content-type", "application/json")], body, "t")

    assert len(parse_body("text-classification", request(3), 3).inputs) == 3
    with pytest.raises(PayloadTooLarge, match="4 inputs in one request: at most 3"):
        parse_body("text-classification", request(4), 3)


def test_a_media_types_parameter_is_found_by_its_name_in_any_case():
    assert media_type_parameter('text/plain; Charset="utf-8"', "charset") == "utf-8"
    assert media_type_parameter("text/plain; format=flowed; charset=x", "format") == "flowed"
    assert media_type_parameter("text/plain; format=flowed", "charset") is None
    assert media_type_parameter("charset=utf-8", "charset") is None  # the type, no parameter


def test_server_timing_gives_the_longest_queue_and_model_times_and_the_largest_batch():
    results = [ItemResult(None, 0.5, 3, 0.125), ItemResult(None, 0.25, 4, 0.375)]
    assert server_timing(results) == 'queue;dur=500.00, model;dur=375.00, batch;desc="4"'


def test_an_image_sent_as_a_form_upload_is_415_saying_what_to_send():
    # curl -F file=@cat.png: the form's framing around the image is no image Pillow reads
    body = b'--x\r\nContent-Disposition: form-data; name="file"\r\n\r\n\x89PNG\r\n--x--\r\n'
    headers = [("content-type", "multipart/form-data; boundary=x")]
    request = HttpRequest("POST", "/", "", headers, body, "test")
    with pytest.raises(UnsupportedMediaType, match="the image's bytes"):
        parse_body("image-classification", request, 32)


@pytest.mark.parametrize(
    "body",
    [
        b'--x\r\nContent-Disposition: form-data; name="inputs"\r\n\r\nhi\r\n--x--',
        b'{"inputs": "hi"}',
    ],
)
def test_a_form_upload_to_a_json_route_is_415_saying_what_to_send(body):
    """curl -F to /embed, /rerank, /v1/embeddings... was a 400 "not valid JSON" (and JSON
    typed as a form was read): the README's 415 for a form upload, as on POST /."""
    headers = [("content-type", "multipart/form-data; boundary=x")]
    request = HttpRequest("POST", "/embed", "", headers, body, "test")
    with pytest.raises(UnsupportedMediaType, match="a form upload is not read: send the JSON"):
        read_json(request)


class TimedOutStream:
    """A streamed generation whose deadline passed after its first tokens."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.closed = False
        self.ended: list[HTTPError] = []  # the errors its events ended with (logged)

    async def chunks(self):
        for text in self.texts:
            yield TokenChunk(1, 0, {"id": 1, "text": text, "logprob": 0.0, "special": False})

    def output(self):
        raise GatewayTimeout("the request timed out after 1 s")

    def ended_with(self, error: HTTPError) -> HTTPError:
        self.ended.append(error)
        return error

    def failed(self, exc: Exception) -> HTTPError:
        return self.ended_with(as_http_error(exc))

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("text", ["a\u2028b", "a\x85b", "a\u2029b", "–“x”\x0b\x1c"])
def test_an_event_of_any_text_is_one_line_to_a_reader_that_splits_as_python_does(text):
    """httpx's line reader (huggingface_hub's streams read with it) ends lines where
    `str.splitlines` does: an event of generated text holding U+2028, raw in its JSON,
    came to InferenceClient in two halves, neither JSON (a faults review)."""
    from httpx2._decoders import LineDecoder

    from rawserve.api.openai_responses import event
    from rawserve.api.streaming import spaced_sse, sse

    document = {"token": {"text": text}}
    for payload, opening in [
        (sse(document), "data:"),
        (spaced_sse(document), "data: "),
        (event("response.output_text.delta", 1, delta=text), "data: "),
    ]:
        lines = LineDecoder().decode(payload.decode()) + LineDecoder().flush()
        data = [line for line in lines if line.startswith("data:")]
        assert len(data) == 1 and lines[-1] == "", lines
        said = json.loads(data[0].removeprefix(opening))
        assert said.get("delta", said.get("token", {}).get("text")) == text


def test_a_response_stream_that_fails_once_begun_ends_with_response_failed():
    from tests.test_reasoning import responded

    _, settings = parse_response({"input": "hi", "stream": True})
    stream = TimedOutStream(["he", "llo"])
    events = responded(ResponseAnswer("m", settings), stream)  # type: ignore[arg-type]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hello"
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error" and "timed out" in last.response.error.message
    # what was said before the failure stays in the Response, as OpenAI's keeps it
    [message] = last.response.output
    assert message.status == "incomplete" and message.content[0].text == "hello"
    assert [error.status for error in stream.ended] == [504]  # and its log line says so
    assert stream.closed


def test_a_response_stream_that_fails_before_its_first_token_keeps_the_message_it_announced():
    """The message opens as a stream begins: failed before any text, the Response still
    lists it (empty, incomplete), at the index its events named."""
    from tests.test_reasoning import responded

    _, settings = parse_response({"input": "hi", "stream": True})
    events = responded(ResponseAnswer("m", settings), TimedOutStream([]))  # type: ignore[arg-type]
    [added] = [e for e in events if e.type == "response.output_item.added"]
    last = events[-1]
    assert last.type == "response.failed" and added.output_index == 0
    [message] = last.response.output
    assert message.id == added.item.id and message.status == "incomplete"
    assert message.content[0].text == ""


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_an_openai_stream_that_fails_once_begun_ends_with_its_error_then_done(chat):
    """As vLLM ends one: the error event, then `data: [DONE]`, so a client that reads up to
    [DONE] sees the stream end rather than a cut connection."""
    stream = TimedOutStream(["he", "llo"])

    async def read() -> list[bytes]:
        events = Answer(chat, "m").events([stream], [], False)  # type: ignore[list-item]
        return [event async for event in events]

    raw = asyncio.run(read())
    assert raw[-1] == b"data: [DONE]\n\n"
    error = json.loads(raw[-2].removeprefix(b"data:"))["error"]
    assert error["code"] == "timeout" and "timed out" in error["message"], error
    assert [error.status for error in stream.ended] == [504]  # and its log line says so
    assert stream.closed


class FinishedStream(TimedOutStream):
    """A streamed generation that ended at a stop sequence (the worker's text goes past it)."""

    def output(self):
        details = {"finish_reason": "stop_sequence", "generated_tokens": 4, "prompt_tokens": 1}
        return {"generated_text": "".join(self.texts), "details": details}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stream_a_stop_cut_at_once_lists_no_tokens_as_its_whole_answer_does(chat):
    """Its whole answer lists `[]`; every chunk of its stream said null, so a client that
    adds the chunks up had no listing at all."""
    stream = FinishedStream(["\n", "a"])

    async def read() -> list[bytes]:
        events = Answer(chat, "m", logprobs=0).events([stream], ["\n"], False)  # type: ignore[list-item]
        return [event async for event in events]

    from rawserve.api.openai_logprobs import chat_logprobs, completion_logprobs

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    [last] = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["finish_reason"]]
    assert last["logprobs"] == (chat_logprobs([]) if chat else completion_logprobs([], 0, 0))
    assert all(chunk["choices"][0]["logprobs"] is None for chunk in chunks[:-1])


def formatting_fails(monkeypatch, module, name):
    """Make `module.name` fail as a bug of the server's would, past the stream's head."""

    def failing(*args, **kwargs):
        raise KeyError("finish_reason")

    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_an_openai_stream_whose_last_chunk_fails_to_form_ends_with_an_error_then_done(
    chat, monkeypatch, caplog
):
    """A bug in forming the last chunk (its generation done) cut the transfer off: the
    client saw a broken connection, not the error and `data: [DONE]`."""
    from rawserve.api import openai_answers

    formatting_fails(monkeypatch, openai_answers, "finish_reason")
    stream = FinishedStream(["he", "llo"])

    async def read() -> list[bytes]:
        events = Answer(chat, "m").events([stream], [], True)  # type: ignore[list-item]
        return [event async for event in events]

    with caplog.at_level("ERROR", logger="rawserve.errors"):
        raw = asyncio.run(read())
    assert raw[-1] == b"data: [DONE]\n\n"
    error = json.loads(raw[-2].removeprefix(b"data:"))["error"]
    assert error["message"] == "internal server error" and error["type"] == "server_error"
    assert [error.status for error in stream.ended] == [500]
    assert "unexpected error while handling request" in caplog.text  # its traceback, logged
    assert stream.closed


def test_a_response_stream_whose_end_fails_to_form_ends_with_response_failed(monkeypatch):
    from tests.test_reasoning import responded

    formatting_fails(monkeypatch, ResponseAnswer, "finished")
    _, settings = parse_response({"input": "hi", "stream": True})
    stream = FinishedStream(["he", "llo"])
    last = responded(ResponseAnswer("m", settings), stream)[-1]  # type: ignore[arg-type]
    assert last.type == "response.failed"
    assert last.response.error.message == "internal server error"
    [message] = last.response.output  # what was said stays in it
    assert message.content[0].text == "hello"
    assert [error.status for error in stream.ended] == [500]


def test_a_stream_held_to_tools_sends_no_words_past_a_stop_sequence():
    """The words of an answer held to tools went out as they came, past a stop sequence,
    and then the words up to it again, whole: "hello worldhell"."""
    stream = FinishedStream(['{"content": "', "hel", "lo w", "orld"])

    async def read() -> list[bytes]:
        answer = Answer(True, "m", tools=Tools([{"name": "f"}], "auto"))
        return [event async for event in answer.events([stream], ["o w"], False)]  # type: ignore[list-item]

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "hell"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


CALLED = '{"name": "get_weather", "arguments": {"city": "paris"}}'
STOPPED_WORDS = [
    # stops in the JSON around the words, in a call, or across an escape ("\\n" + "ame"):
    # none is in what the client reads, so none cuts it (they emptied the answer)
    ('{"content": "hello world"}', [":", "{", "content", "on"], "hello world", "length"),
    (CALLED, ["name", "get_weather", "}", "ar", ","], None, "tool_calls"),
    ('{"content": "john or\\nameb"}', ["name", "nam"], "john or\nameb", "length"),
    # a stop in the words ends them before it
    ('{"content": "Thought: x Observation: y"}', ["Observation:"], "Thought: x ", "stop"),
    ('{"content": "a \\"quoted\\" b"}', ['"q'], "a ", "stop"),
]


@pytest.mark.parametrize(("raw", "stops", "words", "reason"), STOPPED_WORDS)
def test_stop_sequences_beside_tools_end_the_words_read_never_the_json(raw, stops, words, reason):
    """An answer that tools held (`tool_choice` "auto") is JSON: its stop sequences end
    the words the client reads, matched in them, whole and streamed; a call has none."""
    tools = Tools([{"name": "get_weather"}], "auto")
    details = {"finish_reason": "length", "generated_tokens": 9, "prompt_tokens": 1}
    answer = Answer(True, "m", tools=tools).whole(
        [{"generated_text": raw, "details": details}], stops
    )
    [choice] = answer["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == (words, reason)
    if words is None:
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
            "city": "paris"
        }
    pieces = [raw[i : i + 3] for i in range(0, len(raw), 3)]  # 3 characters a token

    async def read() -> list[bytes]:
        streamed = Answer(True, "m", tools=tools)
        return [event async for event in streamed.events([LengthStream(pieces)], stops, False)]  # type: ignore[list-item]

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == (words or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == reason


@pytest.mark.parametrize("raw", ['{"c', "{", '{"name": "get_wea', '[{"name": "', '[{"name": ', "["])
def test_an_answer_that_may_call_cut_before_it_named_one_says_its_text_whole_and_streamed(raw):
    """`tool_choice` "auto", cut by max_tokens before a call was named or a word written:
    the text generated is the content (it was "", though its tokens were listed), whole
    and streamed, finish_reason "length" (its JSON, which no stop sequence cuts). Cut in
    a call's name, or after its opening, where one function alone can be meant, it is
    that function's call."""
    tools = Tools([{"name": "get_weather"}], "auto", parallel=True)
    details = {"finish_reason": "length", "generated_tokens": 3, "prompt_tokens": 1}
    stops = ['"', "name"]
    answer = Answer(True, "m", tools=tools).whole(
        [{"generated_text": raw, "details": details}], stops
    )
    [choice] = answer["choices"]
    calls = raw not in ('{"c', "{")  # (either may begin words)
    called = [{"name": "get_weather", "arguments": ""}] if calls else []
    said = [call["function"] for call in choice["message"].get("tool_calls", [])]
    assert (choice["message"]["content"], choice["finish_reason"]) == (
        None if calls else raw,
        "length",
    )
    assert said == called

    async def read() -> list[bytes]:
        streamed = Answer(True, "m", tools=tools)
        pieces = [raw[i : i + 2] for i in range(0, len(raw), 2)]
        return [event async for event in streamed.events([LengthStream(pieces)], stops, False)]  # type: ignore[list-item]

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == ("" if calls else raw)
    streamed = [call["function"] for d in deltas for call in d.get("tool_calls", [])]
    assert streamed == called
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


class LengthStream(FinishedStream):
    """A streamed generation that ended at its length: no stop sequence in the worker."""

    def output(self):
        details = {"finish_reason": "length", "generated_tokens": 9, "prompt_tokens": 1}
        return {"generated_text": "".join(self.texts), "details": details}


def test_log_probabilities_beside_tools_end_where_a_stop_cut_the_words():
    """Words that tools held, cut by a stop sequence: their log probabilities end with
    the token the stop begins in, as a plain answer's do (all 40 tokens were listed,
    the stop's and those past it), whole and streamed."""
    texts = ['{"content": "', "not ", "hate", " gre", "at form", " good", '"}', "</s>"]
    tokens = [
        {"id": place, "text": text, "logprob": -0.5, "special": text == "</s>"}
        for place, text in enumerate(texts)
    ]
    for token in tokens:
        token["top_tokens"] = [dict(token)]
    tools = Tools([{"name": "f"}], "auto")
    whole = Answer(True, "m", logprobs=1, tools=tools).whole(
        [EndedStream(tokens).output()], ["great"]
    )
    [choice] = whole["choices"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("not hate ", "stop")
    listed = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert listed == ['{"content": "', "not ", "hate", " gre"]

    async def read() -> list[bytes]:
        answer = Answer(True, "m", logprobs=1, tools=tools)
        return [event async for event in answer.events([StreamedOutput(tokens)], ["great"], False)]  # type: ignore[list-item]

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert streamed == [choice["logprobs"]]


class EndedStream(TimedOutStream):
    """A streamed generation of a byte-fallback model that ended at its end of sequence
    right after a run of byte tokens: the run's text came with the end's token (TGI's)."""

    def __init__(self, tokens: list[dict]):
        super().__init__([])
        self.tokens = tokens

    async def chunks(self):
        for token in self.tokens:
            yield TokenChunk(1, 0, token)

    def output(self):
        text = "".join(t["text"].removesuffix("</s>") for t in self.tokens)
        details = {"finish_reason": "eos_token", "generated_tokens": 4, "prompt_tokens": 1}
        return {"generated_text": text, "details": {**details, "tokens": self.tokens}}


class StreamedOutput(EndedStream):
    """The same, its output as a stream's: its tokens went out one by one, not listed again."""

    def output(self):
        output = super().output()
        return {**output, "details": {k: v for k, v in output["details"].items() if k != "tokens"}}


@pytest.mark.parametrize(
    "texts", [['{"name": "f", ', '"arguments": {}}', "</s>"], ['{"content": "', "hi", '"}', "</s>"]]
)
def test_a_stream_held_to_tools_lists_its_tokens_where_log_probabilities_are_asked(texts):
    """A call (or words) sent at the stream's end comes with its tokens' log probabilities,
    as the whole answer lists them: the stream's own output lists none."""
    tokens = [
        {"id": place, "text": text, "logprob": -0.5, "special": text == "</s>"}
        for place, text in enumerate(texts)
    ]
    for token in tokens:
        token["top_tokens"] = [dict(token)]
    stream = StreamedOutput(tokens)
    tools = Tools([{"name": "f"}], "auto")

    async def read() -> list[bytes]:
        answer = Answer(True, "m", logprobs=1, tools=tools)
        return [event async for event in answer.events([stream], [], False)]  # type: ignore[list-item]

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    listed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    whole = Answer(True, "m", logprobs=1, tools=tools).whole([EndedStream(tokens).output()], [])
    assert listed == [whole["choices"][0]["logprobs"]]
    # the end of sequence too, as usage counts it, with the text it adds: none
    assert [entry["token"] for entry in listed[0]["content"]] == [*texts[:-1], ""]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_text_a_run_of_byte_tokens_held_back_to_the_end_of_sequence_is_listed_with_it(chat):
    """The end of sequence's text is "\ufffd</s>": the answer's text ends "\ufffd", and its
    tokens' texts add up to it, streamed or not, the end's listed with what it added."""

    def token(id_: int, text: str, special: bool = False) -> dict:
        top = [{"id": id_, "text": text, "logprob": -0.5, "special": special}]
        return {"id": id_, "text": text, "logprob": -0.5, "special": special, "top_tokens": top}

    ended = [token(7, " the"), token(200, ""), token(201, ""), token(2, "\ufffd\ufffd</s>", True)]

    async def read() -> list[bytes]:
        answer = Answer(chat, "m", logprobs=1)
        return [event async for event in answer.events([EndedStream(ended)], [], False)]

    chunks = [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]
    whole = Answer(chat, "m", logprobs=1).whole([EndedStream(ended).output()], [])
    for choices in ([c["choices"][0] for c in chunks], whole["choices"]):
        said = [c.get("message") or c.get("delta") for c in choices] if chat else choices
        texts = [c.get("content") or "" if chat else c["text"] for c in said]
        assert "".join(texts) == " the\ufffd\ufffd"
        listed = [c["logprobs"] for c in choices if c["logprobs"]]
        if chat:
            entries = [entry for logprobs in listed for entry in logprobs["content"]]
            made = bytes(byte for entry in entries for byte in entry["bytes"]).decode()
            assert [entry["token"] for entry in entries] == [" the", "", "", "\ufffd\ufffd"]
            assert entries[-1]["top_logprobs"][0]["token"] == "\ufffd\ufffd"
        else:
            made = "".join(text for logprobs in listed for text in logprobs["tokens"])
            assert listed[-1]["text_offset"][-1] == len(" the")
        assert made == " the\ufffd\ufffd"


def test_a_large_answer_is_built_off_the_event_loop_byte_for_byte_the_same():
    builders: list[int] = []
    document = {"choices": [{"logprobs": {"token_logprobs": [-0.5, None, 1e-9]}}], "x": "é"}

    def build() -> dict:
        builders.append(threading.get_ident())
        return document

    async def both() -> tuple[bytes, bytes, int]:
        results = [ItemResult(output=None, queue_seconds=0.0, compute_seconds=0.0, batch_size=1)]
        small = await built_answer(build, results, LARGE_ANSWER_ENTRIES)
        large = await built_answer(build, results, LARGE_ANSWER_ENTRIES + 1)
        assert small.headers == large.headers
        return small.body, large.body, threading.get_ident()

    small, large, loop_thread = asyncio.run(both())
    assert small == large == orjson.dumps(document)
    # the small one where it was asked for, the large one on another thread
    assert builders[0] == loop_thread != builders[1]


def test_token_vectors_weigh_by_their_numbers_and_a_large_set_is_built_off_the_loop():
    # /embed_all's and POST / feature-extraction's answers: a [tokens, hidden] array each
    vectors = [np.full((500, 1024), 0.1, dtype=np.float32), np.zeros((1, 3, 4), np.float32)]
    assert vector_entries(vectors) == (500 * 1024 + 12) // NUMBERS_PER_ENTRY
    assert vector_entries([{"label": "A"}, [0.5]]) == 0  # no arrays: nothing to weigh
    assert vector_entries(vectors) > LARGE_ANSWER_ENTRIES >= vector_entries(vectors[1:])
    builders: list[int] = []

    def build() -> list:
        builders.append(threading.get_ident())
        return vectors

    async def both() -> tuple[bytes, bytes]:
        results = [ItemResult(output=None, queue_seconds=0.0, compute_seconds=0.0, batch_size=1)]
        large = await built_answer(build, results, vector_entries(vectors))
        assert builders == [builders[0]] and builders[0] != threading.get_ident()
        small = await built_answer(build, results, vector_entries(vectors[1:]))
        assert builders[1] == threading.get_ident()
        return small.body, large.body

    small, large = asyncio.run(both())
    assert small == large == orjson.dumps(vectors, option=orjson.OPT_SERIALIZE_NUMPY)


def test_a_token_id_is_checked_against_the_vocabulary_up_to_its_last_id():
    last = GenerationRequest([[0, 9], "a text"], {"logit_bias": {9: 1.0}})
    check_token_ids(last, 10)  # ids run from 0 to 9
    check_token_ids(GenerationRequest([[10]], {}), None)  # not known yet: the worker checks
    for items, bias, param in (([[3], [5, 10]], {}, "prompt"), ([[3]], {10: 1.0}, "logit_bias")):
        with pytest.raises(
            UnprocessableInput,
            match=r"id 10 (of \"prompt\" at index 1 )?is not .* \(ids run from 0 to 9\)",
        ) as refused:
            check_token_ids(GenerationRequest(items, {"logit_bias": bias}), 10)
        assert refused.value.param == param


# --- new tokens past 4,096, within a model's positions ------------------------------------


class Generating(Idle):
    """A text-generation model that answers one token, keeping the parameters it was sent."""

    def __init__(self):
        self.sent: list[dict] = []

    async def run(self, inputs, params, deadline, control=None):
        self.sent.append(dict(params))
        details = {"finish_reason": "length", "generated_tokens": 1, "prompt_tokens": 1}
        output = [{"generated_text": " a", "details": details}]
        return [ItemResult(output, 0.0, 1, 0.0) for _ in inputs]


def generated(path, document, positions, settings=None, details=None):
    """(status, body, the parameters the model was sent) of `document` posted to `path` of
    a text-generation model of `positions` positions (None: unknown, as a handler's),
    whose worker reported `details` beside those."""
    model = Generating()
    details = {"chat_template": True, "max_input_length": positions or 0, **(details or {})}
    limits = ModelLimits(max_new_tokens=positions - 1 if positions else None)
    served = ServedModel("m", ModelService(model, Loaded("text-generation", details, None, limits)))
    app = App(ServedModels([served]), settings or AppSettings())
    body = json.dumps(document).encode()
    request = HttpRequest("POST", path, "", [("content-type", "application/json")], body, "test")
    answer = asyncio.run(app.handle(request))
    return answer.status, json.loads(answer.body), model.sent


def route_id(value):
    return value if isinstance(value, str) else ""


HI = [{"role": "user", "content": "hi"}]
NEW_TOKENS = [  # (path, a body asking for `n` new tokens, the field that asks them)
    ("/v1/completions", lambda n: {"prompt": "hi", "max_tokens": n}, "max_tokens"),
    ("/v1/chat/completions", lambda n: {"messages": HI, "max_tokens": n}, "max_tokens"),
    (
        "/v1/chat/completions",
        lambda n: {"messages": HI, "max_completion_tokens": n},
        "max_completion_tokens",
    ),
    ("/v1/responses", lambda n: {"input": "hi", "max_output_tokens": n}, "max_output_tokens"),
    ("/generate", lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n}}, None),
    ("/", lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n}}, None),
]


@pytest.mark.parametrize(("path", "body", "field"), NEW_TOKENS, ids=route_id)
def test_new_tokens_past_4096_are_taken_where_the_model_s_positions_hold_them(path, body, field):
    """A model of 8,192 positions was refused `max_tokens` 5,000 (400: at most 4,096) on
    every route, where vLLM and TGI take up to the context length; past its positions it
    is still a 400 naming the field."""
    status, answer, sent = generated(path, body(5000), 8192)
    assert status == 200, answer
    assert [params["max_new_tokens"] for params in sent] == [5000]
    status, answer, sent = generated(path, body(8192), 8192)
    assert status == (400 if field else 422) and sent == []  # 422: where TGI's types apply
    error = answer["error"]  # OpenAI's object, or TGI's text
    message = error["message"] if isinstance(error, dict) else error
    assert "is 8192, and this model generates at most 8191 tokens" in message
    if field is not None:
        assert (answer["error"]["param"], f'"{field}" is 8192') == (
            field,
            message[: len(field) + 10],
        )


@pytest.mark.parametrize(("path", "body", "field"), NEW_TOKENS, ids=route_id)
def test_where_the_positions_are_unknown_new_tokens_stop_at_4096(path, body, field):
    assert generated(path, body(UNKNOWN_POSITIONS_NEW_TOKENS), None)[0] == 200
    status, answer, sent = generated(path, body(UNKNOWN_POSITIONS_NEW_TOKENS + 1), None)
    assert (status, sent) == (400 if field else 422, [])


BAD_MAX_TOKENS = ["x", True, -5, [1, 2], {}, 2.5, 2**70]  # (NaN is no JSON: refused unread)


@pytest.mark.parametrize("bad", BAD_MAX_TOKENS, ids=repr)
def test_a_chat_s_max_tokens_is_checked_beside_max_completion_tokens(bad):
    """A chat's older `max_tokens` went unread where `max_completion_tokens` was sent, so
    any value of it was taken (200) that alone is a 400; OpenAI and vLLM check each field
    sent. Both good: `max_completion_tokens` wins, as before."""
    body = {"messages": HI, "max_completion_tokens": 3, "max_tokens": bad}
    status, answer, sent = generated("/v1/chat/completions", body, 8192)
    assert (status, answer["error"]["param"], sent) == (400, "max_tokens", [])
    body = {"messages": HI, "max_completion_tokens": 3, "max_tokens": 5}
    status, answer, sent = generated("/v1/chat/completions", body, 8192)
    assert status == 200, answer
    assert [params["max_new_tokens"] for params in sent] == [3]


def test_a_completion_asking_no_max_tokens_gets_16_new_tokens_as_openais_does():
    """OpenAI's documented default on /v1/completions, and the README's: without it an
    answer runs to the model's own default (its generation config's, else 256 tokens),
    far past what a client written for OpenAI's API expects. Chat has no such default:
    there the model's holds."""
    status, answer, sent = generated("/v1/completions", {"prompt": "hi"}, 8192)
    assert status == 200, answer
    assert [params["max_new_tokens"] for params in sent] == [16]
    status, answer, sent = generated("/v1/chat/completions", {"messages": HI}, 8192)
    assert status == 200, answer
    assert [params.get("max_new_tokens") for params in sent] == [None]


class Asked(Generating):
    """A model that keeps what it was asked: each chat and its parameters."""

    def __init__(self):
        super().__init__()
        self.chats: list[dict] = []

    async def run(self, inputs, params, deadline, control=None):
        self.chats.extend(inputs)
        return await super().run(inputs, params, deadline, control)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_template_that_takes_one_call_an_answer_holds_the_answer_to_one(parallel):
    """Llama 3.1-3.3's templates refuse an assistant's message of several calls: a model
    that wrote two (parallel_tool_calls allowed them) made the next turn a 422. Where the
    worker says its template does, the answer calls one tool, asked parallel or not."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    asking = {"messages": HI, "tools": [tool], "tool_choice": "required"}
    if parallel is not None:
        asking["parallel_tool_calls"] = parallel
    body = json.dumps(asking).encode()

    def held(one_call):
        model = Asked()
        details = {"chat_template": True, "chat_one_call": one_call}
        served = ServedModel("m", ModelService(model, Loaded("text-generation", details, None)))
        app = App(ServedModels([served]), AppSettings())
        headers = [("content-type", "application/json")]
        request = HttpRequest("POST", "/v1/chat/completions", "", headers, body, "test")
        assert asyncio.run(app.handle(request)).status == 200
        [chat], [params] = model.chats, model.sent
        return "parallel_tool_calls" in chat, "array" in json.dumps(params["grammar"])

    assert held(True) == (False, False)  # one call: not told of several, no list of them
    assert held(False) == ((True, True) if parallel is not False else (False, False))


TOP_TEN = {"details": True, "top_n_tokens": 10}
LISTED = [  # (path, a body listing the log probabilities of `n` new tokens, the field)
    ("/v1/completions", lambda n: {"prompt": "hi", "max_tokens": n, "logprobs": 20}, "max_tokens"),
    (
        "/v1/chat/completions",
        lambda n: {"messages": HI, "max_tokens": n, "logprobs": True, "top_logprobs": 20},
        "max_tokens",
    ),
    (
        "/generate",
        lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n, **TOP_TEN}},
        "max_new_tokens",
    ),
    (
        "/",
        lambda n: {"inputs": "hi", "parameters": {"max_new_tokens": n, **TOP_TEN}},
        "max_new_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), LISTED, ids=route_id)
def test_new_tokens_log_probabilities_past_the_answer_bound_are_413_before_the_model_runs(
    path, body, field
):
    """A model of 131,072 positions takes `max_tokens` 100,000; each of those tokens
    listed with 20 alternatives would make an answer of 40 to 130 MB (with `n` and
    several prompts, gigabytes): counted as the echo's are, it is refused before it
    queues. The same request asking for 10,000 runs."""
    status, answer, sent = generated(path, body(100_000), 131_072)
    assert (status, sent) == (413, [])
    error = answer["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert message.startswith("the answer would be larger than 32 MiB")
    assert f'ask for fewer new tokens ("{field}")' in message
    assert generated(path, body(10_000), 131_072)[0] == 200


def test_the_chosen_token_counts_among_its_listed_alternatives_in_the_answer_bound():
    """Each new token lists its `logprobs` alternatives and itself among them: counted
    without it, `logprobs: 1` was half the answer's size, queued where it cannot fit."""
    from rawserve.api.prompts import LISTED_BYTES

    app = app_for(
        "text-generation", {"max_input_length": 64}, max_answer_bytes=10 * LISTED_BYTES + 1
    )
    document = {"prompt": [1, 2], "max_tokens": 10, "logprobs": 1}
    status, body = post(app, "/v1/completions", document)
    assert (status, body["error"]["param"]) == (413, "max_tokens"), body


@pytest.mark.parametrize(
    ("path", "document", "listed"),
    [
        ("/v1/chat/completions", {"messages": HI}, False),
        ("/v1/chat/completions", {"messages": HI, "logprobs": True}, True),
        ("/v1/completions", {"prompt": "hi", "echo": True}, False),
        ("/v1/completions", {"prompt": "hi", "logprobs": 0}, True),
        ("/v1/responses", {"input": "hi"}, False),
    ],
)
def test_the_openai_routes_ask_the_worker_for_token_counts_only_without_logprobs(
    path, document, listed
):
    from rawserve.tasks.text_generation import TOKEN_COUNTS_ONLY

    status, answer, [params] = generated(path, document, 8192)
    assert status == 200, answer
    assert params["details"] and params.get(TOKEN_COUNTS_ONLY, False) is not listed


@pytest.mark.parametrize("kept", [False, True], ids=["split", "kept"])
@pytest.mark.parametrize(
    ("path", "document"),
    [("/v1/chat/completions", {"messages": HI}), ("/v1/responses", {"input": "hi"})],
)
def test_a_format_holds_a_reasoning_model_from_its_first_token_only_where_kept(
    path, document, kept
):
    """A reasoning model thinks before the JSON a format holds where its thinking is split
    off (chat's `reasoning_content`, Responses' reasoning item); kept in the text
    (`--thinking-in-content`), "<think>...</think>{...}" would be no JSON, so the answer is
    held from its first token on both routes."""
    from rawserve.tasks.text_generation import THINKING_IN_CONTENT

    settings = AppSettings(thinking_in_content=kept)
    status, answer, [params] = generated(path, document, 8192, settings)
    assert status == 200, answer
    assert params.get(THINKING_IN_CONTENT, False) is kept


def test_min_tokens_past_the_positions_is_refused_naming_it():
    """No answer of the model can reach it: refused as `max_tokens` is, not left to end
    at the positions short of what it promised."""
    document = {"messages": HI, "min_tokens": 9000}
    status, answer, sent = generated("/v1/chat/completions", document, 8192)
    assert (status, sent) == (400, [])
    assert answer["error"]["param"] == "min_tokens"
    assert answer["error"]["message"] == (
        '"min_tokens" is 9000, and this model generates at most 8191 tokens'
    )


# --- what only the slow end-to-end tests caught (a mutation run found each untested fast) -


def test_a_whole_text_is_cut_at_the_first_of_several_stops_in_it_whichever_is_listed_first():
    assert cut_at_stop("xx a yy b zz", ["b", "a"]) == "xx "


def test_one_last_character_that_may_begin_a_stop_is_held_back():
    assert releasable("ab\n", ["\n\n"]) == ("ab", False)
    streamed = Streamed()
    texts = ["ab", "\n", "\nx"]
    sent = [streamed.add({"text": text, "special": False}, ["\n\n"], None) for text in texts]
    assert "".join(release[0] for release in sent if release) == "ab"


def test_min_tokens_may_equal_max_tokens_for_an_answer_of_a_set_length():
    """vLLM takes it, and benchmarks ask it; one more than max_tokens is 400."""
    asked = parse_chat({"messages": HI, "max_tokens": 5, "min_tokens": 5})
    assert asked.params["min_new_tokens"] == 5
    with pytest.raises(BadRequest):
        parse_chat({"messages": HI, "max_tokens": 4, "min_tokens": 5})


def test_each_seeded_choice_takes_the_next_seed_wrapping_at_64_bits():
    asked = parse_chat({"messages": HI, "n": 3, "seed": 2**32 - 1})
    assert [params["seed"] for params in asked.choice_params()] == [2**32 - 1, 2**32, 2**32 + 1]
    asked = parse_chat({"messages": HI, "n": 3, "seed": -2})
    assert [params["seed"] for params in asked.choice_params()] == [2**64 - 2, 2**64 - 1, 0]


@pytest.mark.parametrize("seed", [-(2**63), -1, 2**40, 2**63 - 1])
def test_any_seed_openai_takes_is_taken(seed):
    """OpenAI's and vLLM's seed is a signed 64-bit integer: a negative one or one past 32
    bits (what a client's random seed may be) was 400. Each is one of the worker's
    unsigned seeds, a different one for each."""
    asked = parse_chat({"messages": HI, "seed": seed})
    assert asked.params["seed"] == seed % 2**64


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63, 1.5, "7", True])
def test_a_seed_openai_would_refuse_is_400(seed):
    with pytest.raises(BadRequest, match='"seed"'):
        parse_chat({"messages": HI, "seed": seed})


def test_temperature_zero_is_greedy_and_any_other_samples():
    assert parse_chat({"messages": HI, "temperature": 0}).params["do_sample"] is False
    assert parse_chat({"messages": HI, "temperature": 0.5}).params["do_sample"] is True


def test_choices_are_refused_past_each_cap_and_taken_at_it():
    from rawserve.api.openai_generation import check_choices

    eight = GenerationRequest(items=[{}, {}], params={}, n=4)  # two prompts, four choices each
    check_choices(eight, 8, 8)
    with pytest.raises(PayloadTooLarge, match="max-client-batch-size"):
        check_choices(eight, 7)
    with pytest.raises(PayloadTooLarge, match="max-queue") as refused:  # not a 503 retried
        check_choices(eight, 100, 7)
    assert refused.value.param == "n"  # the prompts alone fit
    three = GenerationRequest(items=[{}, {}, {}], params={}, n=2)
    for n in (1, 2):  # the prompts alone are too many, whatever n
        with pytest.raises(PayloadTooLarge, match="max-queue") as refused:
            check_choices(replace(three, n=n), 8, 2)
        assert refused.value.param == "prompt"


class ContinuousRows(Generating):
    """A generation model on a continuous worker's 4 rows, `--max-queue 4`: admission
    takes 8 items of one request (the queue and the rows), as a scheduler counts them."""

    most_admitted = SchedulerCore(max_queue=4, max_batch_size=1, workers=4).most_admitted


@pytest.mark.parametrize(
    ("document", "choices"),
    [({"prompt": "hi", "n": 5}, 5), ({"prompt": ["a", "b", "c"], "n": 2}, 6)],
)
def test_choices_past_the_queue_are_taken_where_admission_takes_them(document, choices):
    """`POST /` took a list of 6 from a continuous worker's idle server at `--max-queue 4`
    while `/v1/completions` refused 5 choices 413 as past the queue: its bound is now
    admission's (the queue and the one-item workers' rows), and its 413 says so."""
    model = ContinuousRows()
    loaded = Loaded("text-generation", {"max_input_length": 64}, None)
    served = ServedModel("m", ModelService(model, loaded), {"batching": {"max_queue": 4}})
    app = App(ServedModels([served]))
    status, body = post(app, "/v1/completions", {**document, "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == choices, body
    status, body = post(app, "/v1/completions", {**document, "n": 9, "max_tokens": 1})
    message = body["error"]["message"]
    assert status == 413 and "at most 8" in message and "rows" in message, body


def test_fields_that_go_only_together_are_refused_apart():
    with pytest.raises(BadRequest, match="stream_options"):
        parse_chat({"messages": HI, "stream_options": {"include_usage": True}})
    model = ServedModel("m", ModelService(Idle(), Loaded("text-generation", {}, "{}")))
    streamed_echo = {"prompt": "a", "echo": True, "logprobs": 1, "stream": True}
    with pytest.raises(BadRequest, match="echo"):
        parse_completion(streamed_echo, DocContext(model, 32))
    # as OpenAI and vLLM: the best of 1 cannot give 2 answers; 0 new tokens only echoed
    for apart, param in (({"n": 2, "best_of": 1}, "best_of"), ({"max_tokens": 0}, "max_tokens")):
        with pytest.raises(BadRequest) as refused:
            parse_completion({"prompt": "a", **apart}, DocContext(model, 32))
        assert refused.value.param == param, apart
    together = {"prompt": "a", "max_tokens": 0, "echo": True, "n": 1, "best_of": 1}
    assert parse_completion(together, DocContext(model, 32)).params["max_new_tokens"] == 0


def test_guided_choice_holds_its_texts_as_written_not_as_patterns():
    from rawserve.api.openai_generation import read_guided_choice

    assert read_guided_choice("c", ["1+1", "a.b"], None)["value"] == r"(1\+1|a\.b)"


def test_guided_json_as_a_text_says_where_it_is_no_json():
    from rawserve.api.openai_generation import read_guided_json

    with pytest.raises(BadRequest, match="its text holds NaN: NaN and Infinity are not JSON"):
        read_guided_json("guided_json", '{"const": NaN}', None)
    assert read_guided_json("guided_json", '{"const": 1e308}', None)["value"] == {"const": 1e308}


def test_structured_outputs_takes_its_other_kinds_given_as_false():
    """vLLM's clients send `{"json": schema, "json_object": false}`."""
    from rawserve.api.openai_generation import read_structured_outputs

    held = read_structured_outputs("s", {"json": {"type": "object"}, "json_object": False}, None)
    assert held["type"] == "json"
    # its options that change nothing here are taken; one that would is named
    options = {"backend": "xgrammar", "disable_any_whitespace": True, "disable_fallback": True}
    held = read_structured_outputs("s", {"regex": "a+", **options}, None)
    assert held == {"type": "regex", "value": "a+"}
    with pytest.raises(BadRequest, match="'whitespace_pattern', which this server does not"):
        read_structured_outputs("s", {"json": {}, "whitespace_pattern": " *"}, None)
    with pytest.raises(BadRequest, match="'grammar', 'structural_tag', which"):
        read_structured_outputs("s", {"grammar": "g", "structural_tag": "t"}, None)
    for option, value in (("backend", 5), ("disable_any_whitespace", "yes")):
        with pytest.raises(BadRequest, match=f'"s.{option}" must be'):
            read_structured_outputs("s", {"json": {}, option: value}, None)
    # 0 was read as absent (0 == False) where 1 was refused; a false backend was taken
    for option, value in (("backend", False), ("disable_fallback", 0), ("disable_fallback", 1)):
        with pytest.raises(BadRequest, match=f'"s.{option}" must be'):
            read_structured_outputs("s", {"json": {}, option: value}, None)
    for asked in ({"json": {}, "choice": 0}, {"json_object": 1}):
        with pytest.raises(BadRequest):
            read_structured_outputs("s", asked, None)


def test_metadata_takes_keys_and_values_at_openais_bounds():
    parse_chat({"messages": HI, "metadata": {"k" * 64: "v" * 512}})
    with pytest.raises(BadRequest):
        parse_chat({"messages": HI, "metadata": {"k" * 65: "v"}})


def test_usage_counts_each_prompt_once_whatever_its_choices():
    details = {"prompt_tokens": 7, "generated_tokens": 2, "finish_reason": "length", "tokens": []}
    outputs = [{"generated_text": text, "details": details} for text in ("a", "b")]
    whole = Answer(True, "m").whole(outputs, [], n=2)
    assert whole["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_streamed_chunks_are_named_as_openais():
    assert Answer(False, "m").chunk(0, "x")["object"] == "text_completion"
    assert Answer(True, "m").chunk(0, "x")["object"] == "chat.completion.chunk"


def test_a_stream_a_stop_cuts_lists_no_token_past_the_stop():
    streamed = Streamed()
    listed = []
    for text in ["ab", "X", "cd"]:
        token = {"id": 1, "text": text, "logprob": -1.0, "special": False}
        if (release := streamed.add(token, ["X"], 0)) is not None:
            listed += release[1]
    if (release := streamed.rest({"generated_text": "abXcd", "details": {}}, ["X"])) is not None:
        listed += release[1]
    assert [token.text for token in listed] == ["ab"]


def test_tei_predictions_are_best_first_whatever_the_labels_order():
    from rawserve.api.tei import predictions_from

    ranked = predictions_from(np.array([0.1, 0.7, 0.2]), {"0": "a", "1": "b", "2": "c"})
    assert [prediction["label"] for prediction in ranked] == ["b", "c", "a"]


# --- what a mutation run over rawserve/api/ found the fast tests let through ------------


def test_teis_rerank_answers_its_texts_best_first_and_top_n_the_best_n():
    """TEI's own body (`texts`): ranks sorted worst first, or `top_n` (`top_k`) ignored,
    answered 200 all the same."""
    document = {"query": "q", "texts": ["ab", "abcd", "abc"], "return_text": True}
    status, ranks = reranked("/rerank", document)
    assert status == 200, ranks
    assert [(rank["index"], rank["text"]) for rank in ranks] == [(1, "abcd"), (2, "abc"), (0, "ab")]
    assert ranks[0]["score"] == pytest.approx(1 / (1 + np.exp(-4.0)))
    for count in ("top_n", "top_k"):
        status, ranks = reranked("/rerank", {**document, count: 1})
        assert (status, [rank["index"] for rank in ranks]) == (200, [1])
    status, ranks = reranked("/rerank", {**document, "top_n": 9})  # more than there are: all
    assert [rank["index"] for rank in ranks] == [1, 2, 0]


class Embedding(Recording):
    """A sentence-embedding model that keeps the parameters it was sent."""

    def __init__(self):
        super().__init__()
        self.params: list[dict] = []

    async def run(self, inputs, params, deadline, control=None):
        self.params.append(dict(params))
        return await super().run(inputs, params, deadline, control)


@pytest.mark.parametrize(("asked", "normalize"), [({}, True), ({"normalize": False}, False)])
def test_teis_embed_normalizes_unless_asked_not_to(asked, normalize):
    """TEI's `normalize` is true unless the body says false: its default, or the body's
    false, was lost on the way to the model."""
    model = Embedding()
    served = ServedModel("m", ModelService(model, Loaded("feature-extraction", {}, "{}")), {})
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps({"inputs": "a", **asked}).encode()
    request = HttpRequest("POST", "/embed", "", [("content-type", "application/json")], body, "t")
    assert asyncio.run(app.handle(request)).status == 200
    assert [params["normalize"] for params in model.params] == [normalize]


def tokenizer_app(tiny_model):
    """An app whose model's tokenizer (the tiny BERT's, 128 positions) is in the server,
    and that tokenizer."""
    tokenizer = (Path(tiny_model("sentence-embedding")) / "tokenizer.json").read_text()
    workers = Loaded("feature-extraction", {"max_input_length": 128}, tokenizer)
    served = ServedModel("m", ModelService(Idle(), workers), {"batching": {}})
    return App(ServedModels([served]), AppSettings()), tokenizers.Tokenizer.from_str(tokenizer)


def post(app, path, document):
    """(status, the body as JSON) of `document` posted to `path` of `app`."""
    body = json.dumps(document).encode()
    headers = [("content-type", "application/json")]
    request = HttpRequest("POST", path, "", headers, body, request_id="test")
    try:
        answer = asyncio.run(app.handle(request))
    except HTTPError as error:  # the protocol renders it; here, as it would
        answer = error_response(error)
    return answer.status, json.loads(answer.body)


def test_teis_decode_skips_special_tokens_unless_asked_to_keep_them(tiny_model):
    """TEI's `skip_special_tokens` defaults to true: "[CLS] hello world [SEP]" came back."""
    app, library = tokenizer_app(tiny_model)
    ids = library.encode("hello world").ids  # [CLS] ... [SEP]
    assert post(app, "/decode", {"ids": ids}) == (200, ["hello world"])
    kept = post(app, "/decode", {"ids": ids, "skip_special_tokens": False})
    assert kept == (200, [library.decode(ids, skip_special_tokens=False)])
    assert kept[1][0].startswith("[CLS]")


def test_teis_decode_refuses_the_id_one_past_the_vocabulary(tiny_model):
    """The vocabulary's size is no id of it (ids run from 0 to size - 1): it was decoded,
    a 200, where the other unknown ids are 422."""
    app, library = tokenizer_app(tiny_model)
    size = max(library.get_vocab(with_added_tokens=True).values()) + 1
    assert post(app, "/decode", {"ids": [size - 1]})[0] == 200
    status, body = post(app, "/decode", {"ids": [size]})
    assert status == 422
    assert body["error"] == f"the id {size} is not in the vocabulary (ids run from 0 to {size - 1})"


def test_teis_decode_takes_every_id_tokenize_answers_where_the_vocabulary_skips_ids(tiny_model):
    """The tiny vocabulary lists two tokens twice: its size (80) is less than its largest
    id + 1 (82), and "paris!"'s ids, which /tokenize answered, were refused 422."""
    app, library = tokenizer_app(tiny_model)
    assert library.get_vocab_size(with_added_tokens=True) < max(library.get_vocab().values()) + 1
    ids = library.encode("paris!").ids
    assert max(ids) >= library.get_vocab_size(with_added_tokens=True)
    assert post(app, "/decode", {"ids": ids}) == (200, [library.decode(ids)])
    skipped = min(set(range(max(library.get_vocab().values()))) - set(library.get_vocab().values()))
    status, body = post(app, "/decode", {"ids": [skipped]})  # decoded as "", a 200
    assert (status, body["error"]) == (
        422,
        f"the id {skipped} is not in the vocabulary (no token has it)",
    )


def test_teis_tokenize_gives_special_tokens_no_offsets(tiny_model):
    """As TEI's SimpleToken: a special token has its text, and null `start` and `stop` (it
    covers no byte of the input); 0 and 0 pointed at the text's first byte."""
    app, library = tokenizer_app(tiny_model)
    status, [tokens] = post(app, "/tokenize", {"inputs": "hello world"})
    assert status == 200
    first, *words, last = tokens
    assert first == {
        "id": library.token_to_id("[CLS]"),
        "text": "[CLS]",
        "special": True,
        "start": None,
        "stop": None,
    }
    assert (last["text"], last["start"], last["stop"]) == ("[SEP]", None, None)
    assert [(t["text"], t["start"], t["stop"]) for t in words] == [
        ("hello", 0, 5),
        ("world", 6, 11),
    ]


def test_an_input_one_token_past_the_models_length_is_refused_or_cut_to_it(tiny_model):
    """128 positions: 126 words and the two special tokens fit; 127 words are 422 (they
    were taken, one token past what the model takes) unless `truncate`, which keeps 128."""
    app, _ = tokenizer_app(tiny_model)
    status, [tokens, _] = post(app, "/tokenize", {"inputs": ["a " * 126, "b"]})
    assert (status, len(tokens)) == (200, 128)
    status, body = post(app, "/tokenize", {"inputs": ["a " * 127, "b"]})
    assert status == 422 and "more than 128 tokens" in body["error"]
    status, [tokens, _] = post(app, "/tokenize", {"inputs": ["a " * 127, "b"], "truncate": True})
    assert (status, len(tokens)) == (200, 128)
    assert tokens[-1]["text"] == "[SEP]"


@pytest.mark.parametrize(
    ("labels", "kind"),
    [({"0": "LABEL_0"}, "reranker"), ({"0": "neg", "1": "pos"}, "classifier")],
)
def test_teis_info_calls_a_one_label_classifier_a_reranker(labels, kind):
    """TEI's /info `model_type`: a cross-encoder (one label) is a reranker, which is how a
    client tells it from a classifier; it was called a classifier."""
    answer = asyncio.run(app_for("text-classification", {"id2label": labels}).handle(get("/info")))
    label2id = {label: int(index) for index, label in labels.items()}
    assert json.loads(answer.body)["model_type"] == {
        kind: {"id2label": labels, "label2id": label2id}
    }


def test_a_label_the_config_does_not_name_is_called_label_and_its_index():
    """transformers' default name for it, `LABEL_{i}`, as TEI's /predict answers it."""
    from rawserve.api.tei import predictions_from

    ranked = predictions_from(np.array([0.1, 0.7]), {"0": "neg"})
    assert [prediction["label"] for prediction in ranked] == ["LABEL_1", "neg"]


def test_completions_echo_with_logprobs_asks_the_prompts_tokens_scored_too():
    """`echo` with `logprobs` lists the prompt's tokens before the completion's, each with
    as many alternatives: the worker was not asked for the prompt's scores."""
    from rawserve.tasks.text_generation import PROMPT_TOP_N

    served = ServedModel("m", ModelService(Idle(), Loaded("text-generation", {}, "{}")))
    context = DocContext(served, 32)
    asked = parse_completion({"prompt": "hi", "echo": True, "logprobs": 2}, context)
    assert asked.echo and asked.logprobs == 2
    assert asked.params["decoder_input_details"] is True
    assert (asked.params["top_n_tokens"], asked.params[PROMPT_TOP_N]) == (2, 2)
    plain = parse_completion({"prompt": "hi", "logprobs": 2}, context)
    assert "decoder_input_details" not in plain.params and PROMPT_TOP_N not in plain.params


@pytest.mark.parametrize(("top", "listed"), [(None, None), (0, None), (1, 1), (5, 5)])
def test_chat_top_logprobs_asks_the_worker_for_that_many_alternatives(top, listed):
    """`top_logprobs` n lists n alternatives per token: the worker was asked one more."""
    document = {"messages": HI, "logprobs": True}
    if top is not None:
        document["top_logprobs"] = top
    asked = parse_chat(document)
    assert asked.params.get("top_n_tokens") == listed
    assert asked.logprobs == (top or 0)


@pytest.mark.parametrize(
    ("options", "included"),
    [
        (None, False),
        ({}, False),
        ({"include_obfuscation": False}, False),
        ({"include_usage": None}, False),
        ({"include_usage": False}, False),
        ({"include_usage": True}, True),
    ],
)
def test_a_stream_ends_with_usage_only_where_include_usage_is_true(options, included):
    """OpenAI's usage chunk comes only when asked: a client that reads every chunk's
    `choices[0]` failed on the usage chunk it did not ask for."""
    document = {"messages": HI, "stream": True}
    if options is not None:
        document["stream_options"] = options
    assert parse_chat(document).include_usage is included


def streamed_chat(stream, include_usage=True):
    """The chunks of a streamed chat answer of `stream`, parsed, and the last event."""

    async def read() -> list[bytes]:
        return [event async for event in Answer(True, "m").events([stream], [], include_usage)]

    raw = asyncio.run(read())
    return [json.loads(event.removeprefix(b"data:")) for event in raw[:-1]], raw[-1]


def test_a_streamed_chat_opens_with_the_assistants_role_and_ends_with_usage_then_done():
    """As OpenAI's stream: the first delta says who speaks (`role`: "assistant"), the
    usage chunk has an empty list of choices (the SDK types it a list: null broke code
    that loops over it), and every chunk names the server's configuration (TGI's client
    types `system_fingerprint` a string)."""
    chunks, last = streamed_chat(FinishedStream(["he", "llo"]))
    assert last == b"data: [DONE]\n\n"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in chunks[1:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    fingerprints = {chunk["system_fingerprint"] for chunk in chunks}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("rawserve-")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_whole_answer_names_the_servers_configuration(chat):
    """TGI's client reads `system_fingerprint` as a string: null failed its parse."""
    details = {"finish_reason": "length", "generated_tokens": 1, "prompt_tokens": 1}
    whole = Answer(chat, "m").whole([{"generated_text": "a", "details": details}], [])
    assert isinstance(whole["system_fingerprint"], str)
    assert whole["system_fingerprint"].startswith("rawserve-")


class Choosing(Generating):
    """A model whose answer names its prompt and seed, and counts the prompt's characters
    as its tokens."""

    async def run(self, inputs, params, deadline, control=None):
        self.sent.append(dict(params))
        results = []
        for prompt in inputs:
            details = {"finish_reason": "length", "generated_tokens": 1}
            details["prompt_tokens"] = len(prompt)
            output = [{"generated_text": f"{prompt}{params['seed']}", "details": details}]
            results.append(ItemResult(output, 0.0, 1, 0.0))
        return results


def test_several_prompts_with_several_choices_answer_each_prompts_choices_together():
    """OpenAI's order: a prompt's `n` choices one after another, then the next prompt's
    (the index of a choice is prompt * n + j); usage counts each prompt once. The
    choices came choice-major, [a0, b0, a1, b1], and usage counted prompt a twice."""
    model = Choosing()
    workers = Loaded("text-generation", {"max_input_length": 64}, None, ModelLimits(63))
    app = App(ServedModels([ServedModel("m", ModelService(model, workers))]), AppSettings())
    document = {"prompt": ["a", "bbb"], "n": 2, "seed": 5, "max_tokens": 1}
    body = json.dumps(document).encode()
    headers = [("content-type", "application/json")]
    answer = asyncio.run(app.handle(HttpRequest("POST", "/v1/completions", "", headers, body, "t")))
    assert answer.status == 200, answer.body
    whole = json.loads(answer.body)
    choices = [(choice["index"], choice["text"]) for choice in whole["choices"]]
    assert choices == [(0, "a5"), (1, "a6"), (2, "bbb5"), (3, "bbb6")]
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


class PastTheContext(Idle):
    """A text-generation model whose worker refuses every prompt as too long."""

    async def run(self, inputs, params, deadline, control=None):
        from rawserve.api.openai import CONTEXT_LENGTH

        raise UnprocessableInput(f"the prompt (900 tokens) is {CONTEXT_LENGTH} (512)")


@pytest.mark.parametrize(
    ("path", "document", "param"),
    [
        ("/v1/chat/completions", {"messages": HI}, "messages"),
        ("/v1/completions", {"prompt": "hi"}, "prompt"),
    ],
)
def test_a_prompt_past_the_context_length_is_422_naming_its_field(path, document, param):
    """The error's `param` names the field at fault: the chat's "messages", the
    completion's "prompt" (they were swapped); its `code` is OpenAI's for it."""
    details = {"chat_template": True}
    served = ServedModel(
        "m", ModelService(PastTheContext(), Loaded("text-generation", details, None))
    )
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps(document).encode()
    request = HttpRequest("POST", path, "", [("content-type", "application/json")], body, "t")
    answer = asyncio.run(app.handle(request))
    error = json.loads(answer.body)["error"]
    assert (answer.status, error["param"]) == (422, param), error
    assert error["code"] == "context_length_exceeded", error


def test_a_prompt_past_the_positions_asking_min_tokens_is_422_context_length_exceeded():
    """The prompt's own length is checked first: a prompt past the context that also
    asked `min_tokens` was blamed on min_tokens (400), not the code clients act on."""
    app = app_for("text-generation", {"max_input_length": 16})
    document = {"prompt": [1] * 20, "max_tokens": 5, "min_tokens": 3}
    status, body = post(app, "/v1/completions", document)
    assert status == 422, body
    assert (body["error"]["param"], body["error"]["code"]) == (
        "prompt",
        "context_length_exceeded",
    ), body


class NoRoomForMinTokens(Idle):
    """A text-generation model whose worker refuses min_tokens past the prompt's room."""

    async def run(self, inputs, params, deadline, control=None):
        from rawserve.tasks.text_generation import MIN_TOKENS_PAST_ROOM

        raise UnprocessableInput(
            f"{MIN_TOKENS_PAST_ROOM}it is 240, and the prompt is 39 tokens of the model's "
            "context length of 256, which leaves room for 217 new tokens"
        )


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 250, "min_tokens": 240}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 250, "min_tokens": 240}),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_tokens": 250, "min_tokens": 240, "stream": True},
        ),
    ],
)
def test_min_tokens_past_the_room_the_prompt_leaves_is_400_naming_it(path, document):
    """The worker counts the prompt (its chat template's tokens too) and refuses a
    min_tokens that cannot follow it in the positions: answered 400 naming min_tokens, as
    one past max_tokens is, where it was taken and silently not met (cut at the
    positions, finish_reason "length")."""
    details = {"chat_template": True, "max_input_length": 256}
    limits = ModelLimits(max_new_tokens=255)
    loaded = Loaded("text-generation", details, None, limits)
    served = ServedModel("m", ModelService(NoRoomForMinTokens(), loaded))
    app = App(ServedModels([served]), AppSettings())
    status, body = post(app, path, document)
    error = body["error"]
    assert (status, error["param"]) == (400, "min_tokens"), error
    assert "leaves room for 217 new tokens" in error["message"], error


class RefusingTheChat(Idle):
    """A text-generation model whose worker refuses every input in `words`."""

    def __init__(self, words: str):
        super().__init__()
        self.words = words

    async def run(self, inputs, params, deadline, control=None):
        raise UnprocessableInput(self.words)


TOOLS_NAME = "the chat's tools hold '</s>', a control token of the chat template, in the name 'a'"
UNREADABLE = "the chat's messages hold '</s>', a control token of the chat template that this"
UNPLACED = "the chat holds '</s>', a control token of the chat template that this model's"


REFUSED = "the chat template refused the messages: roles must alternate"
PAST = "the prompt is longer than the model's context length"
CHAT_PATH = "/v1/chat/completions"
GRAMMAR = "the grammar cannot be used: the schema holds a keyword the grammar cannot take"
TEXT_FORM = {"type": "json_schema", "name": "a", "schema": {"type": "object"}}
JSON_FORM = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "document", "words", "param"),
    [
        (CHAT_PATH, {"messages": HI}, REFUSED, "messages"),
        (CHAT_PATH, {"messages": HI}, TOOLS_NAME, "tools"),
        (CHAT_PATH, {"messages": HI}, TOOLS_NAME.replace("tools", "messages"), "messages"),
        (
            CHAT_PATH,
            {"messages": HI},
            TOOLS_NAME.replace("tools", "template settings"),
            "chat_template_kwargs",
        ),
        (CHAT_PATH, {"messages": HI}, UNREADABLE, "messages"),
        (CHAT_PATH, {"messages": HI}, UNPLACED, None),  # (none of its texts held it)
        (CHAT_PATH, {"messages": HI, "functions": [{"name": "f"}]}, TOOLS_NAME, "functions"),
        ("/v1/responses", {"input": "hi"}, REFUSED, "input"),
        ("/v1/responses", {"input": "hi"}, PAST, "input"),
        ("/v1/completions", {"prompt": "hi"}, UNREADABLE, None),  # not a chat's
        # a grammar the worker cannot follow is the field that asked for it
        (CHAT_PATH, {"messages": HI, "response_format": JSON_FORM}, GRAMMAR, "response_format"),
        ("/v1/responses", {"input": "hi", "text": {"format": TEXT_FORM}}, GRAMMAR, "text.format"),
    ],
)
def test_a_chat_the_worker_refuses_for_its_template_is_422_naming_its_field(
    path, document, words, param
):
    """The worker's refusal of a chat (its template's, a control token in a name or one its
    tokenizer cannot read as text) names the field that holds it, as OpenAI's errors do;
    a chat's messages are the Responses API's input."""
    details = {"chat_template": True}
    model = RefusingTheChat(words)
    served = ServedModel("m", ModelService(model, Loaded("text-generation", details, None)))
    app = App(ServedModels([served]), AppSettings())
    body = json.dumps(document).encode()
    request = HttpRequest("POST", path, "", [("content-type", "application/json")], body, "t")
    answer = asyncio.run(app.handle(request))
    error = json.loads(answer.body)["error"]
    assert (answer.status, error["param"]) == (422, param), error


def test_openai_embeddings_usage_counts_every_inputs_tokens_in_its_total():
    from rawserve.api.openai import embedding_response

    outputs = [{"embedding": [1.0, 0.0], "tokens": 3}, {"embedding": [0.0, 1.0], "tokens": 4}]
    answer = embedding_response(outputs, "float", "m")
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [item["index"] for item in answer["data"]] == [0, 1]


def test_a_tools_answer_goes_to_the_template_with_the_call_it_answers():
    """A tool's message keeps its `tool_call_id` (templates match it to the call), and
    OpenAI's older `function` role is a tool's: both were lost, the template then
    refused or misread the turn."""
    answered = {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}
    assert messages([answered]) == [{"role": "tool", "content": "22 C", "tool_call_id": "call_1"}]
    older = {"role": "function", "name": "get_weather", "content": "22 C"}
    assert messages([older]) == [{"role": "tool", "content": "22 C", "name": "get_weather"}]


def test_a_response_s_instructions_come_first_as_the_system_s_and_top_p_as_top_p():
    """OpenAI's Responses: `instructions` is the system message before the input (it
    went last, or as a "developer" message, a role many chat templates do not take);
    `top_p` was sent as `top_k`."""
    asked, settings = parse_response({"input": "hi", "instructions": "be brief", "top_p": 0.5})
    [chat] = asked.items
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert asked.params["top_p"] == 0.5 and "top_k" not in asked.params
    assert (settings["instructions"], settings["top_p"]) == ("be brief", 0.5)


def test_a_response_s_usage_counts_its_input_and_output_tokens_apart():
    _, settings = parse_response({"input": "hi"})
    details = {"finish_reason": "eos_token", "generated_tokens": 2, "prompt_tokens": 7}
    answer = ResponseAnswer("m", settings).whole([{"generated_text": "yo", "details": details}], [])
    used = answer["usage"]
    assert (used["input_tokens"], used["output_tokens"], used["total_tokens"]) == (7, 2, 9)


def text_parts(*parts):
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.parametrize(
    ("given", "param", "words"),
    [
        ([{"role": "tool", "content": "x"}], "input[0].role", '"input[0].role" is "tool"'),
        ([{"content": "x"}], "input[0].role", '"input[0].role" is missing'),
        (
            text_parts({"type": "text", "text": "x"}),  # (Chat Completions' habit)
            "input[0].content[0].type",
            '"input[0].content[0].type" is "text": it takes "input_text", "output_text"',
        ),
        (
            text_parts({"type": "input_text", "text": "a"}, {"type": "input_text", "text": 5}),
            "input[0].content[1].text",
            '"input[0].content[1].text" must be a text (it is 5)',
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "a", "name": "bob"}],
            "input[1].name",
            'unknown field "input[1].name"',
        ),
        (
            [{"type": "function_call_output", "call_id": "c", "output": "x"}],
            "input[0].type",
            '"input[0].type" is "function_call_output": it takes "message", "reasoning"',
        ),
        (
            text_parts({"type": "input_image", "image_url": "x" * 400}),
            "input[0].content[0].type",
            "this server serves text messages only",
        ),
        (text_parts({"type": [1], "text": "x"}), "input[0].content[0].type", "is [1]"),
        ([{"role": "user", "content": []}], "input[0].content", "a non-empty list of text parts"),
        (["hi"], "input[0]", 'must be a message {"role", "content"}'),
        ([{"type": "reasoning", "content": 5}], "input[0]", '"reasoning" input item'),
        ([], "input", "a non-empty list of messages"),
    ],
)
def test_a_malformed_response_input_item_is_400_naming_the_item_and_its_field(given, param, words):
    """Each such input was refused with one long message and `param` "input", never
    saying which item or field was wrong; OpenAI names it (`input[0].content[0].type`)."""
    status, body, sent = generated("/v1/responses", {"input": given}, 64)
    error = body["error"]
    assert (status, error["param"], sent) == (400, param, []), error
    assert words in error["message"] and len(error["message"]) < 300, error


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'[{"role": 1e400, "content": "hi"}]', '"input[0].role" is Infinity: it takes'),
        (b'[{"role": -1e400, "content": "hi"}]', '"input[0].role" is -Infinity: it takes'),
        (b'[{"role": NaN, "content": "hi"}]', '"input[0].role" is NaN: it takes'),
        (
            b'[{"role": "user", "content": [{"type": "input_text", "text": NaN}]}]',
            "must be a text (it is NaN)",
        ),
        (
            b'[{"role": "user", "content": [{"type": "input_text", "text": [1e400, 2]}]}]',
            "must be a text (it is [Infinity,2])",
        ),
    ],
)
def test_a_refusal_quotes_a_number_past_a_float_or_nan_as_what_was_sent(raw, words):
    """A client's 1e400 (read as infinity) or NaN was quoted back as null, which it never
    sent ("input[0].role" is null)."""
    with pytest.raises(BadRequest) as refused:
        parse_response({"input": json.loads(raw)})
    assert words in str(refused.value) and "null" not in str(refused.value)


def test_a_long_value_quoted_in_a_refusal_is_cut_short():
    """(Written only as far as the refusal quotes it, as orjson's whole text was cut.)"""
    long_text = {"type": "input_text", "text": [["é"] * 10] * 100_000}
    with pytest.raises(BadRequest) as refused:
        parse_response({"input": text_parts(long_text)})
    assert str(refused.value).endswith('(it is [["é","é","é","é","é","é","é","é","é","é...)')


def test_a_responses_input_is_read_into_a_chats_messages_without_the_route():
    """The Responses API's input reader alone (`openai_responses_input`): a text is the
    user's message; a message's text parts are joined, an assistant's refusal part the
    text it answered; a reasoning item is the next assistant message's thinking; a
    malformed part is refused naming its field."""
    assert read_input("input", "hi", None) == [{"role": "user", "content": "hi"}]
    thought = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hm"}],
    }
    said = [
        {"type": "output_text", "text": "I ", "annotations": []},
        {"type": "refusal", "refusal": "cannot"},
    ]
    given = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        thought,
        {
            "type": "message",
            "role": "assistant",
            "content": said,
            "id": "msg_1",
            "status": "completed",
        },
    ]
    assert read_input("input", given, None) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "I cannot", "reasoning_content": "hm"},
    ]
    with pytest.raises(BadRequest, match="must be a text") as held:
        read_input("input", text_parts({"type": "input_text", "text": 5}), None)
    assert held.value.param == "input[0].content[0].text"


@pytest.mark.parametrize(
    ("path", "document", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": HI, "response_format": {"type": [1]}},
            "response_format",
        ),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": {"a": 1}}}}, "text.format"),
        ("/v1/responses", {"input": "hi", "text": {"verbosity": "high"}}, "text.verbosity"),
        (
            "/v1/chat/completions",
            {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": 5},
                },
            },
            "response_format.json_schema.schema",
        ),
    ],
    ids=route_id,
)
def test_a_format_whose_type_is_no_text_is_400_not_a_server_error(path, document, param):
    """Looked up as a key among the formats, a list or object `type` raised TypeError: a
    500 for the client's own mistake. The field at fault is named down to its part."""
    status, body, sent = generated(path, document, 64)
    error = body["error"]
    assert (status, error["param"], sent) == (400, param, []), error


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}}


@pytest.mark.parametrize(
    ("form", "param", "words"),
    [
        ({"name": "x", "schema": PERSON_SCHEMA, "foo": 1}, "text.format.foo", "unknown field"),
        ({"name": "a person", "schema": PERSON_SCHEMA}, "text.format.name", '"a person"'),
        ({"name": "x" * 65, "schema": PERSON_SCHEMA}, "text.format.name", "1 to 64 letters"),
        ({"name": "x\n", "schema": PERSON_SCHEMA}, "text.format.name", "1 to 64 letters"),
        ({"schema": PERSON_SCHEMA}, "text.format.name", "must be a text"),
        ({"name": "x"}, "text.format.schema", '"text.format.schema" must be a JSON schema'),
        ({"name": "x", "schema": 5}, "text.format.schema", "must be a JSON schema"),
    ],
)
def test_a_response_s_json_schema_format_with_an_unknown_field_or_name_is_400_naming_it(
    form, param, words
):
    """An unknown field beside a json_schema `text.format` was dropped without a word (as
    no other unknown field is), and a name outside OpenAI's `^[a-zA-Z0-9_-]{1,64}$` taken."""
    document = {"input": "hi", "text": {"format": {"type": "json_schema", **form}}}
    status, body, sent = generated("/v1/responses", document, 64)
    error = body["error"]
    assert (status, error["param"], sent) == (400, param, []), error
    assert words in error["message"], error
    named = {"type": "json_schema", "name": "person-1_A", "schema": PERSON_SCHEMA, "strict": True}
    status, body, sent = generated("/v1/responses", {"input": "hi", "text": {"format": named}}, 64)
    assert status == 200 and body["text"]["format"] == named, body


def test_a_response_s_text_with_an_unknown_field_is_400_naming_it():
    document = {"input": "hi", "text": {"format": {"type": "text"}, "foo": 1}}
    status, body, sent = generated("/v1/responses", document, 64)
    assert (status, body["error"]["param"], sent) == (400, "text.foo", []), body
    assert 'unknown field "text.foo"' in body["error"]["message"]


SAMPLES = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}  # (a worker's report)
GREEDY = {"do_sample": False, "temperature": 0.6, "top_p": 0.9}


@pytest.mark.parametrize(
    ("sampling", "asked", "said"),
    [
        (SAMPLES, {}, (1.0, 1.0)),  # (OpenAI's defaults too)
        (GREEDY, {}, (0.0, 0.9)),  # a model whose generation config decodes greedily
        (GREEDY, {"top_p": 0.5}, (0.6, 0.5)),  # (a top_p below 1 samples)
        (GREEDY, {"temperature": 0.3}, (0.3, 0.9)),
        (SAMPLES, {"temperature": 0, "top_p": 0.2}, (0.0, 0.2)),
        (None, {}, (None, None)),  # no report (a handler's model): as asked
    ],
)
def test_a_response_says_back_the_temperature_and_top_p_it_was_sampled_with(sampling, asked, said):
    """A request that left them out was said back `temperature: null, top_p: null`;
    OpenAI says back the values used, and so does rawserve now: its model's, as its worker
    reports them (0: greedy)."""
    details = {} if sampling is None else {"sampling": sampling}
    document = {"input": "hi", **asked}
    status, body, _ = generated("/v1/responses", document, 64, details=details)
    assert status == 200, body
    assert (body["temperature"], body["top_p"]) == said
    assert body["max_output_tokens"] is None  # (as OpenAI's, where it was not asked)


def test_a_response_says_back_who_asked_and_the_cache_key_as_sent():
    """OpenAI's Response repeats `user`, `safety_identifier` and the prompt cache's key and
    retention as sent, and says the truncation and service tier it served; each was
    taken and said back null (a tester)."""
    asked = {
        "user": "u-1",
        "safety_identifier": "s-1",
        "prompt_cache_key": "k-1",
        "prompt_cache_retention": "24h",
    }
    status, body, _ = generated("/v1/responses", {"input": "hi", **asked}, 64)
    assert status == 200, body
    assert {name: body[name] for name in asked} == asked
    assert (body["truncation"], body["service_tier"]) == ("disabled", "default")
    status, body, _ = generated("/v1/responses", {"input": "hi", "service_tier": "auto"}, 64)
    assert status == 200 and body["user"] is None and body["service_tier"] == "default"
    # and what it served of `background` and `text.verbosity`, which it said null
    asked = {"input": "hi", "background": False, "text": {"verbosity": "medium"}}
    status, body, _ = generated("/v1/responses", asked, 64)
    assert status == 200 and body["background"] is False, body
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}


def test_a_chat_answer_says_the_service_tier_it_was_served_in():
    """OpenAI's chat answers (and each chunk) say their service tier, "default" where
    "auto" was asked; rawserve's said none, where its Responses say "default"."""
    document = {"messages": HI, "service_tier": "auto"}
    status, body, _ = generated("/v1/chat/completions", document, 64)
    assert status == 200 and body["service_tier"] == "default", body
    assert Answer(True, "m").head(chunk=True)["service_tier"] == "default"
    status, body, _ = generated("/v1/completions", {"prompt": "hi"}, 64)
    assert status == 200 and "service_tier" not in body  # (no field of a completion's)


class FakeClock:
    """Wall-clock seconds that move on by 2.5 each time they are read."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 2.5
        return self.now


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_completed_response_says_when_it_completed_and_an_incomplete_one_does_not(stream):
    """OpenAI's `completed_at` (Unix seconds, as `created_at`) is set where the status is
    "completed", null otherwise; it was null always, streamed or not."""
    from tests.test_reasoning import responded

    _, settings = parse_response({"input": "hi", "stream": stream})
    for ended, completed_at in [(FinishedStream(["yo"]), 1_000_005), (LengthStream(["yo"]), None)]:
        answer = ResponseAnswer("m", settings, clock=FakeClock(1_000_000.0))
        if stream:
            events = responded(answer, ended)  # type: ignore[arg-type]
            assert events[0].response.completed_at is None  # (still in progress)
            response = events[-1].response.model_dump()
        else:
            response = answer.whole([ended.output()], [])
        assert (response["created_at"], response["completed_at"]) == (1_000_002, completed_at)


@pytest.mark.parametrize(
    ("task", "path"),
    [("text-generation", "/generate"), ("text-generation", "/"), ("feature-extraction", "/embed")],
)
def test_a_body_that_is_no_json_is_400_and_no_validation_error(task, path):
    """A body that could not be read at all had nothing in it checked: TGI's JSON reader
    answers it 400 (TGI's `validation` is a 422, for a body read), and on TEI's routes it
    is no `Validation` error either. It was typed as a field's refusal."""
    headers = [("content-type", "application/json")]
    request = HttpRequest("POST", path, "", headers, b"{not json", "t")
    answer = asyncio.run(app_for(task).handle(request))
    assert (answer.status, json.loads(answer.body)) == (
        400,
        {"error": "the body is not valid JSON", "error_type": "bad_request"},
    )


def test_v1_models_lists_each_model_as_openais_list_does():
    """The openai SDK's `models.list()` pages an `object: "list"`; each model is owned."""
    answer = asyncio.run(app_for("text-generation").handle(get("/v1/models")))
    listed = json.loads(answer.body)
    assert (answer.status, listed["object"]) == (200, "list")
    [model] = listed["data"]
    assert {key: model[key] for key in ("id", "object", "owned_by")} == {
        "id": "m",
        "object": "model",
        "owned_by": "rawserve",
    }
    assert isinstance(model["created"], int)


def test_two_tools_of_one_name_are_refused():
    """Which of the two a call of that name meant would be a guess; one was dropped."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(BadRequest, match="two tools are named f"):
        parse_chat({"messages": HI, "tools": [tool, tool]})


def test_an_answer_whose_worker_named_no_finish_reason_stopped():
    """OpenAI's `finish_reason` is "length" only where the tokens ran out: an output that
    names no reason (a handler's) or one OpenAI has no name for ended of itself."""
    from rawserve.api.openai_answers import finish_reason

    assert [finish_reason({}), finish_reason({"finish_reason": "other"})] == ["stop", "stop"]
    assert finish_reason({"finish_reason": "length"}) == "length"


def test_openai_embeddings_dimensions_past_the_models_are_422_naming_the_field():
    """Well-formed, but more than this model's vectors hold: 422 (as an id past its
    vocabulary), with `param` "dimensions"."""
    answer, sent = embeddings_of({"input": "a", "dimensions": 33}, {"dimensions": 32})
    error = json.loads(answer.body)["error"]
    assert (answer.status, error["param"], sent) == (422, "dimensions", [])
    assert error["message"] == '"dimensions" must be at most 32 for this model'
    answer, sent = embeddings_of({"input": "a", "dimensions": 32}, {"dimensions": 32})
    assert answer.status == 200, answer.body


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ([5], '"inputs" as token ids is not supported: send the text'),
        ([[5, 6], [7]], '"inputs" as token ids is not supported: send the text'),
        ([["what is it", "a city"]], '"inputs" must be a text or a non-empty list of texts'),
        (["a", ["b"]], '"inputs" must be a text or a non-empty list of texts'),
    ],
)
def test_texts_refused_say_what_was_sent(inputs, says):
    """A text pair, sent where texts go (/tokenize), was told it had sent token ids."""
    with pytest.raises(BadRequest, match=re.escape(says)):
        text_inputs(inputs, 32)


def test_the_document_declares_the_bearer_scheme_its_operations_require():
    """With --api-key each secured operation's `security` names "apiKey": the document
    declares it (Swagger UI's Authorize, generated clients), and the OpenAI routes'
    errors are OpenAI's error object, the others rawserve's."""
    app = app_for("text-generation", {"chat_template": True}, api_key="k")
    document = json.loads(asyncio.run(app.openapi(get("/openapi.json"))).body)
    assert document["components"]["securitySchemes"] == {
        "apiKey": {"type": "http", "scheme": "bearer"}
    }

    def refused(path: str) -> dict:
        answer = document["paths"][path]["post"]["responses"]["401"]
        return answer["content"]["application/json"]["schema"]

    assert refused("/v1/chat/completions") == {"$ref": "#/components/schemas/OpenAIErrorResponse"}
    assert refused("/") == {"$ref": "#/components/schemas/ErrorResponse"}
    unsecured = app_for("text-generation", {"chat_template": True})
    document = json.loads(asyncio.run(unsecured.openapi(get("/openapi.json"))).body)
    assert "securitySchemes" not in document["components"]


def test_a_task_answering_one_input_with_a_list_is_documented_so():
    """summarization answers {"inputs": "x"} with [{"summary_text"}]: the document's
    answer to one input is that one-item list, never the bare object."""
    from types import SimpleNamespace

    from rawserve.api.schemas import inference_response

    context = SimpleNamespace(model=SimpleNamespace(known_task="summarization"))
    schema = inference_response(context)
    jsonschema.validate([{"summary_text": "s"}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"summary_text": "s"}, schema)

"""A reasoning model's thinking apart from its answer (`rawserve.api.reasoning`): the
split of a whole answer and of a stream, however its tokens cut the tags; chat answers'
`reasoning_content`, whole and streamed, with their log probabilities; a message sent back
with its thinking; and which templates make a model a reasoning one (the worker's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from rawserve.api.openai_answers import Answer
from rawserve.api.openai_messages import messages
from rawserve.api.openai_responses import ResponseAnswer, parse_response
from rawserve.api.reasoning import REASONING, Thinking, split
from rawserve.http.errors import BadRequest
from rawserve.shared.messages import TokenChunk
from rawserve.tasks.text_generation import (
    CLOSED_IN_PROMPT,
    OPENED_IN_ANSWER,
    OPENED_IN_PROMPT,
    THINKING_IN_CONTENT,
)

# As Qwen3's template, shortened: the model opens its thinking; an earlier answer's goes to
# the template as `reasoning_content`, or is cut out of its content; `enable_thinking`
# false closes an empty one in the prompt.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.last and reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# As DeepSeek-R1-Distill's (and QwQ's): the template opens the thinking in the prompt
R1_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)

ANSWERS = [  # (how the thinking opens, the text generated, its reasoning and content)
    (OPENED_IN_ANSWER, "<think>\nLet me see.\n</think>\n\nHello!", "\nLet me see.\n", "Hello!"),
    (OPENED_IN_PROMPT, "Let me see.\n</think>\n\nHello!", "Let me see.\n", "Hello!"),
    (OPENED_IN_PROMPT, "<think>\nhm</think>Hello!", "\nhm", "Hello!"),  # opened twice
    (OPENED_IN_ANSWER, "Hello!", None, "Hello!"),  # Qwen3's without thinking
    (OPENED_IN_ANSWER, "  <thi", None, "  <thi"),  # not a tag after all
    (OPENED_IN_ANSWER, "a < b </think>", None, "a < b </think>"),  # never opened
    (OPENED_IN_ANSWER, "<think>\nLet me", "\nLet me", None),  # max_tokens hit inside
    (OPENED_IN_PROMPT, "Let me see. </", "Let me see. </", None),
    (OPENED_IN_PROMPT, "hm</think>\n\n", "hm", None),  # nothing after it
    (OPENED_IN_PROMPT, "</think>Hello!", "", "Hello!"),
    (OPENED_IN_PROMPT, "\n\n", "\n\n", None),  # cut inside the open thinking
    (OPENED_IN_PROMPT, " <th", " <th", None),
    (OPENED_IN_PROMPT, "", "", None),  # an empty answer: its thinking, empty
    # the prompt closed the thinking (Qwen3's enable_thinking false): a <think> is text
    (CLOSED_IN_PROMPT, "<think>hm</think>Hello", None, "<think>hm</think>Hello"),
    (CLOSED_IN_PROMPT, "", None, ""),
]


@pytest.mark.parametrize(("opened", "text", "reasoning", "content"), ANSWERS)
def test_a_whole_answer_is_split_into_its_reasoning_and_content(opened, text, reasoning, content):
    assert split(text, opened) == (reasoning, content)


@pytest.mark.parametrize(("opened", "text", "reasoning", "content"), ANSWERS)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_a_streamed_answer_is_split_as_the_whole_one_however_its_pieces_cut_it(
    opened, text, reasoning, content, size
):
    thinking = Thinking(opened)
    pieces = []
    for start in range(0, len(text), size):
        pieces += thinking.add(text[start : start + size])
    pieces += thinking.end()
    said = {kind: "".join(piece for k, piece in pieces if k == kind) for kind, _ in pieces}
    assert said.get(REASONING, "") == (reasoning or "")
    assert said.get("content", "") == (content or "")
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda kind: kind != REASONING)  # reasoning first


def output(text: str, reason: str = "eos_token") -> dict:
    details = {"finish_reason": reason, "generated_tokens": 9, "prompt_tokens": 3}
    return {"generated_text": text, "details": details}


def test_a_reasoning_models_chat_answer_carries_its_thinking_apart():
    answer = Answer(True, "m", thinking=OPENED_IN_PROMPT)
    [choice] = answer.whole([output("Let me see.\n</think>\n\nHello!")], [])["choices"]
    assert choice["message"] == {  # under vLLM's names, old and new
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "Let me see.\n",
        "reasoning": "Let me see.\n",
    }
    [cut] = answer.whole([output("Let me", "length")], [])["choices"]
    assert cut["message"]["content"] is None and cut["message"]["reasoning_content"] == "Let me"
    assert cut["finish_reason"] == "length"


def test_a_model_that_does_not_reason_answers_as_before():
    text = "<think>a</think>b"
    [chat] = Answer(True, "m").whole([output(text)], [])["choices"]
    assert chat["message"] == {"role": "assistant", "content": text}
    completions = Answer(False, "m", thinking=OPENED_IN_ANSWER)
    [completion] = completions.whole([output(text)], [])["choices"]
    assert completion["text"] == text  # (completions are never split)


class Stream:
    """A streamed generation: its tokens, then its output."""

    def __init__(self, texts: list[str], reason: str = "eos_token", opened: str | None = None):
        self.tokens = [
            {"id": place, "text": text, "logprob": -0.5, "special": False}
            for place, text in enumerate(texts)
        ]
        for token in self.tokens:
            token["top_tokens"] = [dict(token)]
        self.reason = reason
        self.opened = opened  # where the worker says the thinking opens, if it says

    async def chunks(self):
        for place, token in enumerate(self.tokens):
            yield TokenChunk(1, 0, token, opened=None if place else self.opened)

    def output(self):
        return output("".join(token["text"] for token in self.tokens), self.reason)

    def close(self) -> None:
        pass


def streamed(answer: Answer, stream: Stream, stops: list[str] = ()) -> list[dict]:  # type: ignore[assignment]
    async def read() -> list[bytes]:
        return [event async for event in answer.events([stream], stops, False)]  # type: ignore[list-item]

    return [json.loads(event.removeprefix(b"data:")) for event in asyncio.run(read())[:-1]]


TOKENS = ["<", "think", ">\n", "Let", " me</", "th", "ink", ">\n", "\nHel", "lo!"]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_stream_sends_the_thinking_then_the_answer_and_never_a_tag(logprobs):
    chunks = streamed(Answer(True, "m", logprobs, thinking=OPENED_IN_ANSWER), Stream(TOKENS))
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    thought = "".join(delta.get(REASONING, "") for delta in deltas)
    said = "".join(delta.get("content") or "" for delta in deltas)
    assert (thought, said) == ("\nLet me", "Hello!")
    assert not any("think" in text for delta in deltas for text in delta.values())
    assert [delta for delta in deltas if REASONING in delta][0] == {
        "reasoning_content": "\n",
        "reasoning": "\n",
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    if logprobs:  # every token listed once, in order, those of the tags too
        listed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        assert [entry["token"] for entry in sum((x["content"] for x in listed), [])] == TOKENS


def test_a_stream_cut_inside_its_thinking_sends_it_all_as_reasoning():
    stream = Stream(["Let", " me </", "thi"], reason="length")
    chunks = streamed(Answer(True, "m", thinking=OPENED_IN_PROMPT), stream)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(delta.get(REASONING, "") for delta in deltas) == "Let me </thi"
    assert not any(delta.get("content") for delta in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_sequence_ends_a_streamed_answer_after_its_thinking():
    stream = Stream(["hm", "</think>", "Hello", " world"], reason="stop_sequence")
    chunks = streamed(Answer(True, "m", thinking=OPENED_IN_PROMPT), stream, [" wor"])
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(delta.get("content") or "" for delta in deltas) == "Hello"
    assert "".join(delta.get(REASONING, "") for delta in deltas) == "hm"


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_an_answer_sent_back_with_its_thinking_gives_it_to_the_template(key):
    sent = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", key: "Let me see."},
        {"role": "user", "content": "again"},
    ]
    assert messages(sent)[1] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "Let me see.",
    }
    none = {"role": "assistant", "content": "Hello!", key: None}  # vLLM's, thinking none
    assert messages([none]) == [{"role": "assistant", "content": "Hello!"}]
    cut = {"role": "assistant", "content": None, key: "Let me"}  # thinking that never closed
    assert messages([cut]) == [{"role": "assistant", "content": "", "reasoning_content": "Let me"}]
    with pytest.raises(BadRequest, match="reasoning_content"):
        messages([{"role": "user", "content": "hi", key: "hm"}])
    with pytest.raises(BadRequest, match="reasoning_content"):
        messages([{"role": "assistant", "content": "hi", key: 3}])


def test_a_template_that_writes_the_closing_tag_makes_a_reasoning_model(tiny_model):
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32)
    assert runner.details["thinking"] is None
    for template, opened in ((QWEN3_TEMPLATE, OPENED_IN_ANSWER), (R1_TEMPLATE, OPENED_IN_PROMPT)):
        runner.tokenizer.chat_template = template
        assert runner.details["thinking"] == opened
    runner.tokenizer.chat_template = QWEN3_TEMPLATE  # an earlier answer's thinking, given apart
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Let me see."},
    ]
    assert "<think>\nLet me see.\n</think>\n\nHello!" in runner.chat.text(chat, None)


def replayed(shape: Callable[[dict], Any]) -> Any:
    """OpenAI's client, answered in the shape `shape` gives for each request's body: the
    answer to TOKENS, whole or streamed as the body asks."""
    import httpx2
    from openai import OpenAI

    def reply(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        answer = shape(body)
        if body.get("stream"):

            async def read() -> list[bytes]:
                return [e async for e in answer.events([Stream(TOKENS)], [], False)]

            sent = b"".join(asyncio.run(read()))
            return httpx2.Response(200, content=sent, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=answer.whole([Stream(TOKENS).output()], []))

    return OpenAI(
        base_url="http://replayed/v1",
        api_key="-",
        http_client=httpx2.Client(transport=httpx2.MockTransport(reply)),
    )


def test_openais_client_reads_the_thinking_of_an_answer_and_of_its_stream():
    """OpenAI's SDK keeps a field it does not type (`reasoning_content`) on the message and
    on the delta, where reasoning clients read it: rawserve's answers, replayed to it."""
    answer = Answer(True, "m", thinking=OPENED_IN_ANSWER)
    client = replayed(lambda body: answer)
    said = [{"role": "user", "content": "hi"}]
    message = client.chat.completions.create(model="m", messages=said).choices[0].message
    assert (message.reasoning_content, message.content) == ("\nLet me", "Hello!")  # type: ignore[attr-defined]
    deltas = [
        chunk.choices[0].delta
        for chunk in client.chat.completions.create(model="m", messages=said, stream=True)
    ]
    thought = "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
    assert (thought, "".join(delta.content or "" for delta in deltas)) == ("\nLet me", "Hello!")


ASKED = {  # what a chat body asks beside its messages, and whether the answer is split
    "free": ({}, True),
    "held": ({"response_format": {"type": "json_object"}}, True),  # held after the thinking
    "kept": ({}, False),  # --thinking-in-content
    # kept: held from the first token (its thinking would stand before its JSON)
    "kept-held": ({"response_format": {"type": "json_object"}}, False),
    # no generation prompt: the template did not open the thinking, the answer goes on
    "prefilled": ({"add_generation_prompt": False, "continue_final_message": True}, False),
}


@pytest.mark.parametrize("case", ASKED)
async def test_a_chat_stream_splits_the_thinking_its_worker_says_the_model_writes(case):
    """The route takes where the thinking opens from the worker's details (an answer held
    to a grammar too: the worker holds it only after the thinking), and leaves every answer
    whole where the operator keeps the thinking in the content (`--thinking-in-content`)."""
    from dataclasses import replace

    from rawserve.api.app import App
    from rawserve.api.served import ServedModel, ServedModels
    from rawserve.api.settings import AppSettings
    from rawserve.http.exchange import HttpRequest
    from rawserve.serving.service import ModelService
    from tests.test_streaming import FakeScheduler, StreamingWorkers

    workers = StreamingWorkers()
    details = {"chat_template": True, "thinking": OPENED_IN_PROMPT}
    workers.loaded = replace(StreamingWorkers.loaded, details=details)
    text = ["hm", "</th", "ink>", "Hello"]
    output = {"generated_text": "".join(text), "details": {"finish_reason": "eos_token"}}
    scheduler = FakeScheduler(workers, text, output)
    asked: list[dict] = []
    run = scheduler.run

    async def heard(inputs, params, deadline, control):  # the parameters the worker gets
        asked.append(params)
        return await run(inputs, params, deadline, control)

    scheduler.run = heard  # type: ignore[method-assign]
    models = ServedModels([ServedModel("m", ModelService(scheduler, workers))])
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    fields, splits = ASKED[case]
    document = {"messages": chat, "stream": True, **fields}
    body = json.dumps(document).encode()
    headers = [("content-type", "application/json")]
    request = HttpRequest("POST", "/v1/chat/completions", "", headers, body, "id")
    kept = case.startswith("kept")
    response = await App(models, AppSettings(thinking_in_content=kept)).handle(request)
    assert response is not None and response.stream is not None
    sent = [chunk async for chunk in response.stream]
    chunks = [json.loads(chunk.removeprefix(b"data:")) for chunk in sent[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    thought = "".join(delta.get(REASONING, "") for delta in deltas)
    said = "".join(delta.get("content") or "" for delta in deltas)
    assert (thought, said) == (("hm", "Hello") if splits else ("", "hm</think>Hello"))
    assert [bool(params.get(THINKING_IN_CONTENT)) for params in asked] == [kept]


def test_hugging_faces_client_reads_the_thinking_by_its_own_name():
    """huggingface_hub's InferenceClient types it `reasoning`, on the message and delta."""
    from huggingface_hub import ChatCompletionOutput, ChatCompletionStreamOutput

    answer = Answer(True, "m", thinking=OPENED_IN_ANSWER)
    whole = ChatCompletionOutput.parse_obj_as_instance(answer.whole([Stream(TOKENS).output()], []))
    assert (whole.choices[0].message.reasoning, whole.choices[0].message.content) == (
        "\nLet me",
        "Hello!",
    )
    chunks = [
        ChatCompletionStreamOutput.parse_obj_as_instance(c)
        for c in streamed(answer, Stream(TOKENS))
    ]
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.reasoning or "" for delta in deltas) == "\nLet me"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("tags", ["tokens", "text"])
def test_a_grammar_holds_a_reasoning_models_answer_only_after_its_thinking(tiny_model, tags):
    """vLLM's way: free text up to the first `</think>` (opened by the model, or in the
    prompt), then the answer held; each tag its own token (an added one: llguidance reads
    it as no text) or spelled in pieces. Without "thinking", held from the first token."""
    import transformers

    from rawserve.worker.grammars import Grammars

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model("chat"))
    if tags == "tokens":  # as Qwen3's tokenizer has them
        tokenizer.add_tokens(["<think>", "</think>"])
    grammars = Grammars(tokenizer, len(tokenizer))

    def takes(opened, text: str) -> bool:
        grammar = {"type": "json", "value": SCHEMA, **({"thinking": opened} if opened else {})}
        matcher = grammars.matcher(grammar)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    answer = '{"a": 1}'
    assert takes(OPENED_IN_ANSWER, f"<think>\nhm, {{ < </th </think>\n\n{answer}")
    assert takes(OPENED_IN_ANSWER, answer)  # (it need not think)
    assert not takes(OPENED_IN_ANSWER, f"hm</think>{answer}")  # never opened
    assert not takes(OPENED_IN_ANSWER, f"<think>a</think>b</think>{answer}")  # held after one
    assert takes(OPENED_IN_PROMPT, f"hm\n</think>\n\n{answer}")
    assert takes(OPENED_IN_PROMPT, f"</think>{answer}")
    assert not takes(OPENED_IN_PROMPT, answer)  # the thinking is open: it has to close
    assert not takes(None, f"<think>hm</think>{answer}")
    assert takes(None, answer)
    pieces = [tokenizer.convert_tokens_to_ids(c) for c in "</think>"]  # the tag as text
    matcher = grammars.matcher({"type": "json", "value": SCHEMA, "thinking": OPENED_IN_PROMPT})
    assert matcher.consume_tokens(pieces + tokenizer(answer)["input_ids"])
    assert matcher.is_accepting()


@pytest.fixture(scope="module")
def reasoner(tiny_model):
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    return CausalLMRunner(tiny_model("chat"), "cpu", torch.float32)


def test_the_worker_says_per_prompt_whether_a_grammar_waits_for_the_thinking(reasoner):
    """Read from the prompt the template rendered for the request: ending in `<think>`,
    the thinking is open; in `</think>` (Qwen3's with enable_thinking false), no thinking
    comes; else the model may open it. Only a reasoning model's chats."""
    from rawserve.tasks import CHAT_PARAM

    held = {CHAT_PARAM: True, "grammar": {"type": "json", "value": SCHEMA}}
    chat = [{"role": "user", "content": "hi"}]

    def grammar(template: str, params: dict, variables=None) -> dict | None:
        reasoner.tokenizer.chat_template = template
        item = {"messages": chat, "template_kwargs": variables or {}}
        return reasoner.held_to(params, reasoner.prompt_ids(item, {CHAT_PARAM: True}))

    try:
        assert grammar(R1_TEMPLATE, held)["thinking"] == OPENED_IN_PROMPT
        assert grammar(QWEN3_TEMPLATE, held)["thinking"] == OPENED_IN_ANSWER
        assert "thinking" not in grammar(QWEN3_TEMPLATE, held, {"enable_thinking": False})
        assert grammar(R1_TEMPLATE, {**held, CHAT_PARAM: False}) == held["grammar"]
        assert grammar(R1_TEMPLATE, {CHAT_PARAM: True}) is None
        # the thinking kept in the content: held from the first token, as vLLM's without a
        # reasoning parser (after it, the call or JSON would follow a thinking left in front)
        kept = {**held, THINKING_IN_CONTENT: True}
        assert grammar(R1_TEMPLATE, kept) == held["grammar"]
        # ... and has no thinking to count (a Response's usage said all of it was thinking)
        ids = reasoner.prompt_ids({"messages": chat}, {CHAT_PARAM: True})
        assert reasoner.opened(held, ids) == OPENED_IN_PROMPT
        assert reasoner.opened(kept, ids) is None
        assert reasoner.opened({CHAT_PARAM: True, THINKING_IN_CONTENT: True}, ids) is not None
        assert grammar("{{ messages[0]['content'] }}", held) == held["grammar"]
    finally:
        reasoner.tokenizer.chat_template = None


def test_a_reasoning_model_thinks_before_its_held_answer_on_both_paths(reasoner):
    """Held from its first token, an R1 model's answer was JSON inside its open thinking:
    now it may write what the grammar would refuse (a token forced by logit_bias)."""
    from rawserve.tasks import CHAT_PARAM
    from tests.test_generating import GREEDY, as_the_static_path

    free = reasoner.tokenizer.convert_tokens_to_ids("h")
    params = {
        **GREEDY,
        CHAT_PARAM: True,
        "return_full_text": False,
        "max_new_tokens": 3,
        "logit_bias": {free: 100.0},
        "grammar": {"type": "json", "value": SCHEMA},
    }
    reasoner.tokenizer.chat_template = R1_TEMPLATE
    try:
        item = {"messages": [{"role": "user", "content": "hi"}]}
        [(_, got, _)] = as_the_static_path(reasoner, params, [item])  # type: ignore[list-item]
    finally:
        reasoner.tokenizer.chat_template = None
    assert got[0]["generated_text"] == "hhh"


CALLED = ["Rome", "?</th", "ink>\n\n", '{"name": "weather", ', '"arguments": {"city": "rome"}}']
WORDS = ["<think>", "hm</think>", '{"content": "it is', ' sunny"}']


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_call_or_words_are_read_from_the_answer_after_its_thinking(logprobs):
    """An answer held to tools, whole or streamed: its thinking as reasoning (streamed as
    it comes where no log probabilities hold the answer to its end), the call or the
    words read from what follows; thinking never closed calls nothing."""
    from rawserve.api.openai_tools import Tools
    from tests.test_openai_tools import WEATHER

    def answer(opened: str) -> Answer:
        return Answer(True, "m", logprobs, tools=Tools([WEATHER], "auto"), thinking=opened)

    [whole] = answer(OPENED_IN_PROMPT).whole([Stream(CALLED).output()], [])["choices"]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert whole["message"][REASONING] == whole["message"]["reasoning"] == "Rome?"
    [made] = whole["message"]["tool_calls"]
    assert made["function"] == {"name": "weather", "arguments": '{"city": "rome"}'}

    def deltas(opened: str, texts: list[str], reason: str = "eos_token") -> list[dict]:
        chunks = streamed(answer(opened), Stream(texts, reason))
        said = [chunk["choices"][0]["delta"] for chunk in chunks]
        assert not any("think" in json.dumps(delta) for delta in said)
        return said

    said = deltas(OPENED_IN_PROMPT, CALLED)
    assert "".join(delta.get(REASONING, "") for delta in said) == "Rome?"
    [calls] = [delta["tool_calls"] for delta in said if "tool_calls" in delta]
    assert calls[0]["function"] == made["function"]
    said = deltas(OPENED_IN_ANSWER, WORDS)
    assert "".join(delta.get(REASONING, "") for delta in said) == "hm"
    assert "".join(delta.get("content") or "" for delta in said) == "it is sunny"
    if logprobs is None:  # the words as they come, after the thinking
        assert [delta.get("content") for delta in said][-3:] == ["it is", " sunny", None]
    [cut] = answer(OPENED_IN_PROMPT).whole([output("Rome", "length")], [])["choices"]
    assert cut["message"] == {"role": "assistant", "content": None, **said_apart("Rome")}
    said = deltas(OPENED_IN_PROMPT, ["Ro", "me"], "length")
    assert "".join(delta.get(REASONING, "") for delta in said) == "Rome"
    assert not any(delta.get("content") or "tool_calls" in delta for delta in said)


def test_words_cut_at_a_stop_list_their_tokens_past_a_thinking_that_quotes_their_opening():
    """The tokens listed of words a stop cut were counted from the first `{"content": "`
    in the text, one the thinking quoted: they ended inside the thinking, whole and
    streamed, the answer's tokens left out."""
    from rawserve.api.openai_tools import Tools
    from tests.test_openai_tools import WEATHER

    texts = ["<think>", 'I say {"content": "', "abSTOP", '"} or', "</think>"]
    texts += ['{"content": "', "ab", "STOP", " more", '"}']
    stream = Stream(texts)
    listed = stream.output()
    listed["details"]["tokens"] = stream.tokens

    def answer() -> Answer:
        return Answer(True, "m", 0, tools=Tools([WEATHER], "auto"), thinking=OPENED_IN_ANSWER)

    [whole] = answer().whole([listed], ["STOP"])["choices"]
    assert whole["message"]["content"] == "ab" and whole["finish_reason"] == "stop"
    kept = [token["token"] for token in whole["logprobs"]["content"]]
    assert kept == texts[:7]  # through the words' own "ab"
    chunks = streamed(answer(), Stream(texts), ["STOP"])
    sent = [
        token["token"]
        for chunk in chunks
        for choice in chunk.get("choices", [])
        for token in ((choice.get("logprobs") or {}).get("content") or [])
    ]
    assert sent == kept


def said_apart(thought: str) -> dict:
    return {REASONING: thought, "reasoning": thought}


# As DeepSeek-V3.1's: its `thinking` setting opens the thinking in the prompt; else closed
V31_TEMPLATE = (
    "{% for message in messages %}{{ '<｜User｜>' + message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}"
)


def test_the_worker_tells_where_each_answers_thinking_opens_on_every_path(reasoner):
    """The template's settings move it: the model's `thinking` detail is read without
    them, so DeepSeek-V3.1's answers with `thinking: true` were all taken for content."""
    from rawserve.shared.messages import Batch, Control, TokenChunks
    from rawserve.tasks import CHAT_PARAM
    from tests.test_generating import GREEDY, results, serve

    params = {**GREEDY, CHAT_PARAM: True, "return_full_text": False, "max_new_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    thinks = {**chat, "template_kwargs": {"thinking": True}}
    reasoner.tokenizer.chat_template = V31_TEMPLATE
    try:
        assert reasoner.details["thinking"] == OPENED_IN_ANSWER  # (its default)
        whole, closed = (reasoner.run([item], params)[0][0] for item in (thinks, chat))
        looped = [
            Batch(1, (thinks,), params),
            Batch(2, (thinks,), params, control=Control(stream_id=7)),
        ]
        sent = serve(reasoner, {0: looped})
        static: list = []
        reasoner.bind_stream(static.append, None)
        reasoner.run([thinks], params, Control(stream_id=8))
    finally:
        reasoner.tokenizer.chat_template = None
        reasoner.bind_stream(None, None)  # type: ignore[arg-type]
    assert whole["details"]["thinking"] == OPENED_IN_PROMPT
    assert closed["details"]["thinking"] == CLOSED_IN_PROMPT  # (all content)
    # (its two tokens in thinking never closed; none where the prompt closed it)
    assert (whole["details"]["reasoning_tokens"], closed["details"]["reasoning_tokens"]) == (2, 0)
    answered = results(sent)
    [[looped_whole]], [looped_stream] = answered[1].outputs, answered[2].outputs
    assert looped_whole["details"]["thinking"] == looped_stream["details"]["thinking"]
    assert looped_stream["details"]["thinking"] == OPENED_IN_PROMPT
    chunks = [chunk for m in sent if isinstance(m, TokenChunks) for chunk in m.chunks] + static
    assert [chunk.opened for chunk in chunks] == [OPENED_IN_PROMPT, None] * 2  # the first's


def on_every_path(reasoner, item, params: dict) -> tuple[list[dict], list]:
    """`item`'s answer's details on the four paths of an R1-templated model (static and
    looped, whole and streamed), and the token chunks its streams sent."""
    from rawserve.shared.messages import Batch, Control, TokenChunks
    from tests.test_generating import results, serve

    looped = [
        Batch(1, (item,), params),
        Batch(2, (item,), params, control=Control(stream_id=7)),
    ]
    static: list = []
    reasoner.tokenizer.chat_template = R1_TEMPLATE
    reasoner.bind_stream(static.append, None)
    try:
        assert reasoner.reasons
        [[whole]] = reasoner.run([item], params)
        reasoner.run([item], params, Control(stream_id=8))
        sent = serve(reasoner, {0: looped})
    finally:
        reasoner.tokenizer.chat_template = None
        reasoner.bind_stream(None, None)  # type: ignore[arg-type]
    [[looped_whole]], [looped_stream] = (results(sent)[key].outputs for key in (1, 2))
    chunks = [chunk for m in sent if isinstance(m, TokenChunks) for chunk in m.chunks] + static
    return [whole["details"], looped_whole["details"], looped_stream["details"]], chunks


def test_a_chat_that_goes_on_from_its_last_message_opens_no_thinking_there(reasoner):
    """A chat asking for no generation prompt (`continue_final_message`) whose last
    message ends with the text `<think>`: its answer goes on from that text, split only
    where the model opens a thinking of its own, on every path. The prompt's last
    characters were read as the template's opening: the model's `</think>` was dropped
    from the text the client continues, and counted as reasoning."""
    from rawserve.tasks import CHAT_PARAM
    from tests.test_generating import GREEDY

    params = {**GREEDY, CHAT_PARAM: True, "return_full_text": False, "max_new_tokens": 2}
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>"},
        ],
        "opening": {"add_generation_prompt": False, "continue_final_message": True},
    }
    details, chunks = on_every_path(reasoner, chat, params)
    assert all(each["thinking"] == OPENED_IN_ANSWER for each in details)
    assert [chunk.opened for chunk in chunks] == [OPENED_IN_ANSWER, None] * 2


def test_a_plain_completion_of_a_reasoning_model_carries_no_thinking(reasoner):
    """A prompt is not a chat: its answer is the model's text as written, even after a
    `<think>` of the prompt's own, with no thinking to split out or count (the
    completions route and TGI's give it whole)."""
    from tests.test_generating import GREEDY

    params = {**GREEDY, "return_full_text": False, "max_new_tokens": 2}
    details, chunks = on_every_path(reasoner, "hi <think>", params)
    for each in details:
        assert "thinking" not in each and "reasoning_tokens" not in each
    assert len(chunks) == 4 and all(chunk.opened is None for chunk in chunks)


def test_the_chat_route_splits_each_answer_where_its_worker_says_the_thinking_opens():
    answer = Answer(True, "m", thinking=OPENED_IN_ANSWER)  # (the model's default)
    told = output("hm</think>Hi")
    told["details"]["thinking"] = OPENED_IN_PROMPT
    [choice] = answer.whole([told], [])["choices"]
    assert (choice["message"][REASONING], choice["message"]["content"]) == ("hm", "Hi")
    chunks = streamed(answer, Stream(["hm</th", "ink>Hi"], opened=OPENED_IN_PROMPT))
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(delta.get(REASONING, "") for delta in deltas) == "hm"
    assert "".join(delta.get("content") or "" for delta in deltas) == "Hi"


def test_usage_counts_the_tokens_the_thinking_took(reasoner):
    """OpenAI's `completion_tokens_details.reasoning_tokens` (vLLM's too): the tokens up to
    the one that ends `</think>`, however the tag is spelled; all where it never closes,
    none where it never opens. Only a reasoning model's chat answers say it."""
    from rawserve.api.openai_answers import usage
    from rawserve.api.openai_responses import ResponseAnswer, parse_response

    def ids(text: str) -> list[int]:
        return reasoner.tokenizer(text, add_special_tokens=False)["input_ids"]

    thinking, answer = ids("hm, ") + ids("</think>"), ids("\n\nHi")
    assert reasoner.thought_tokens(thinking + answer, [], OPENED_IN_PROMPT) == len(thinking)
    opened = ids("<think>") + thinking
    assert reasoner.thought_tokens(opened + answer, [], OPENED_IN_ANSWER) == len(opened)
    assert reasoner.thought_tokens(answer, [], OPENED_IN_ANSWER) == 0
    assert reasoner.thought_tokens(answer, [], OPENED_IN_PROMPT) == len(answer)
    told = [output("a"), output("b")]
    for place, each in enumerate(told):
        each["details"]["reasoning_tokens"] = 4 + place
    answered = Answer(True, "m", thinking=OPENED_IN_PROMPT).whole(told, [])
    assert answered["usage"]["completion_tokens_details"] == {"reasoning_tokens": 9}
    assert "completion_tokens_details" not in usage([output("a")])
    response = ResponseAnswer("m", parse_response({"input": "hi"})[1]).whole(told[1:], [])
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}


def responded(answer: ResponseAnswer, stream: Stream) -> list[Any]:
    """A streamed Response's events, as the SDK types them."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    async def read() -> list[bytes]:
        return [e async for e in answer.events([stream], [], False)]  # type: ignore[list-item]

    typed = TypeAdapter(ResponseStreamEvent)
    return [typed.validate_json(e.split(b"data: ", 1)[1]) for e in asyncio.run(read())]


def test_a_response_puts_the_thinking_in_a_reasoning_item_before_the_message():
    _, settings = parse_response({"input": "hi"})
    answer = ResponseAnswer("m", settings, thinking=OPENED_IN_PROMPT)
    response = answer.whole([output("Let me see.\n</think>\n\nHello!")], [])
    thought, message = response["output"]
    assert thought["type"] == "reasoning" and thought["summary"] == []
    assert thought["content"] == [{"type": "reasoning_text", "text": "Let me see.\n"}]
    assert message["content"][0]["text"] == "Hello!" and response["status"] == "completed"
    # thinking cut by max_output_tokens: the reasoning alone, the Response incomplete
    cut = answer.whole([output("Let me", "length")], [])
    [thought] = cut["output"]
    assert thought["content"][0]["text"] == "Let me" and thought["status"] == "incomplete"
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("tokens", [["</think>", "Hi"], ["</think>"], []], ids=str)
def test_a_response_whose_thinking_is_empty_has_no_reasoning_item_whole_or_streamed(tokens):
    """A model that closes its thinking at once (an R1 distill's `</think>` as its first
    token) thought nothing: no reasoning item, whole or streamed. The stream announced
    none and the end said one, so every event's output_index was one short of it."""
    _, settings = parse_response({"input": "hi"})
    answer = ResponseAnswer("m", settings, thinking=OPENED_IN_PROMPT)
    whole = answer.whole([output("".join(tokens))], [])["output"]
    assert [item["type"] for item in whole] == (["message"] if "Hi" in tokens else [])
    events = responded(answer, Stream(tokens, opened=OPENED_IN_PROMPT))
    announced = [(e.output_index, e.item.type) for e in events if e.type.endswith("item.added")]
    final = events[-1].response.output
    assert announced == [(index, item.type) for index, item in enumerate(final)]
    assert [item.type for item in final] == [item["type"] for item in whole]


def test_a_response_of_a_model_that_does_not_reason_or_keeps_its_tags_is_as_before():
    _, settings = parse_response({"input": "hi"})
    text = "<think>a</think>b"
    [message] = ResponseAnswer("m", settings).whole([output(text)], [])["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == text
    events = responded(ResponseAnswer("m", settings), Stream(TOKENS))
    assert [e.type for e in events][:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert said == "".join(TOKENS) and events[-1].response.output_text == said


@pytest.mark.parametrize("opened", [None, OPENED_IN_ANSWER])  # (the worker's say, or none)
def test_a_streamed_response_sends_a_reasoning_item_then_the_message_never_a_tag(opened):
    _, settings = parse_response({"input": "hi", "stream": True})
    answer = ResponseAnswer(
        "m", settings, thinking=OPENED_IN_PROMPT if opened else OPENED_IN_ANSWER
    )
    events = responded(answer, Stream(TOKENS, opened=opened))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.item.type, e.output_index) for e in added] == [("reasoning", 0), ("message", 1)]
    finished = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.item.type, e.output_index) for e in finished] == [("reasoning", 0), ("message", 1)]
    # the thinking's item closes before the message's opens
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    items = [e.item for e in finished]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == ("\nLet me", "Hello!")
    for e in events:
        if e.type.startswith("response.reasoning_text"):
            assert e.output_index == 0 and e.item_id == items[0].id
        if e.type.startswith("response.output_text"):
            assert e.output_index == 1 and e.item_id == items[1].id
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert done == ["\nLet me"]
    last = events[-1]
    assert last.type == "response.completed"
    assert [item.type for item in last.response.output] == ["reasoning", "message"]
    assert last.response.output_text == "Hello!"


@pytest.mark.parametrize(
    ("texts", "listed"),
    [
        (TOKENS, ["\nHel", "lo!"]),  # (the first reaches into the answer: "Hel")
        (["<think>", "a", "</think>", "Hi", ""], ["Hi", ""]),  # (an end of sequence: "")
        (["<think>", "a</think>\n\nHi", " there"], ["a</think>\n\nHi", " there"]),
        (["Hi", " there", ""], ["Hi", " there", ""]),  # (no thinking: every token)
        ([""], [""]),  # (an answer of no text: its end, in a delta of none)
    ],
)
def test_a_responses_logprobs_list_the_messages_tokens_whole_and_streamed(texts, listed):
    """With `include`'s logprobs, the message's text part lists the tokens of its text,
    not those of the thinking before it (OpenAI's reasoning models list none of theirs);
    a stream's deltas list the same ones, and its text's end all of them."""
    _, settings = parse_response({"input": "hi"})
    stream = Stream(texts, opened=OPENED_IN_ANSWER)
    answer = ResponseAnswer("m", settings, thinking=OPENED_IN_ANSWER, logprobs=0)
    whole = stream.output()
    whole["details"]["tokens"] = stream.tokens
    [part] = answer.whole([whole], [])["output"][-1]["content"]
    assert [entry["token"] for entry in part["logprobs"]] == listed
    events = responded(answer, stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [entry.token for e in deltas for entry in e.logprobs] == listed
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [entry.token for entry in done.logprobs] == listed
    ended = events[-1].response.output[-1].content[0]
    assert [entry.token for entry in ended.logprobs] == listed


def test_a_streamed_response_cut_inside_its_thinking_is_a_reasoning_item_alone():
    _, settings = parse_response({"input": "hi", "stream": True})
    answer = ResponseAnswer("m", settings, thinking=OPENED_IN_ANSWER)
    events = responded(answer, Stream(TOKENS[:5], "length"))
    assert not any(e.type.startswith("response.output_text") for e in events)
    last = events[-1]
    assert last.type == "response.incomplete"
    [item] = last.response.output
    assert item.type == "reasoning" and item.content[0].text == "\nLet me</"  # (never closed)
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    assert done == item


def test_a_reasoning_item_sent_back_as_input_goes_to_the_template_with_its_answer():
    """As the SDK sends a Response's output back: its thinking is the next assistant
    message's `reasoning_content` (what chat's reasoning models' templates read)."""
    _, settings = parse_response({"input": "hi"})
    answer = ResponseAnswer("m", settings, thinking=OPENED_IN_PROMPT)
    first = answer.whole([output("Let me see.\n</think>\n\nHello!")], [])
    given = [
        {"role": "user", "content": "hi"},
        *first["output"],
        {"role": "user", "content": "and?"},
    ]
    generation, _ = parse_response({"input": given})
    [chat] = generation.items
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "Let me see.\n",
    }
    # a summary alone is the thinking too; before a message not the assistant's, dropped
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}
    generation, _ = parse_response({"input": [summary, given[2], summary, given[0]]})
    [chat] = generation.items
    assert chat["messages"][0]["reasoning_content"] == "hm"
    assert chat["messages"][1] == {"role": "user", "content": "hi"}
    for wrong in ("no parts", 0, [{"type": "output_text", "text": "x"}], [{"text": 1}]):
        with pytest.raises(BadRequest, match="reasoning"):
            parse_response({"input": [{"type": "reasoning", "content": wrong}, *given]})


def test_openais_client_reads_a_responses_thinking_and_sends_it_back():
    """The SDK's `responses.create`, whole and streamed, on rawserve's answers replayed to
    it; its second turn sends the first one's output (a reasoning item among it) back."""

    bodies: list[dict] = []

    def answer(body: dict) -> ResponseAnswer:
        bodies.append(body)
        _, settings = parse_response(body)  # (refuses what the route refuses)
        return ResponseAnswer("m", settings, thinking=OPENED_IN_ANSWER)

    client = replayed(answer)
    response = client.responses.create(model="m", input="hi")
    thought, message = response.output
    assert thought.type == "reasoning" and thought.content[0].text == "\nLet me"  # type: ignore[union-attr,index]
    assert response.output_text == "Hello!"
    with client.responses.stream(model="m", input="hi") as stream:
        thinking = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert (thinking, final.output_text) == ("\nLet me", "Hello!")
    said = [{"role": "user", "content": "hi"}, *response.output, {"role": "user", "content": "?"}]
    again = client.responses.create(model="m", input=said)  # type: ignore[arg-type]
    assert again.output_text == "Hello!"
    [chat] = parse_response(bodies[-1])[0].items
    assert chat["messages"][1]["reasoning_content"] == "\nLet me"


@pytest.mark.parametrize("kept", [False, True], ids=["split", "kept"])
async def test_the_responses_route_splits_the_thinking_but_where_the_operator_keeps_it(kept):
    """`/v1/responses` splits where the worker says the thinking opens, and leaves every
    answer whole under `--thinking-in-content`, as chat's route does."""
    from dataclasses import replace

    from rawserve.api.app import App
    from rawserve.api.served import ServedModel, ServedModels
    from rawserve.api.settings import AppSettings
    from rawserve.http.exchange import HttpRequest
    from rawserve.serving.service import ModelService
    from tests.test_streaming import FakeScheduler, StreamingWorkers

    workers = StreamingWorkers()
    workers.loaded = replace(
        StreamingWorkers.loaded, details={"chat_template": True, "thinking": OPENED_IN_PROMPT}
    )
    text = ["hm", "</th", "ink>", "Hello"]
    counts = {"prompt_tokens": 3, "generated_tokens": 4}
    output = {"generated_text": "".join(text), "details": {"finish_reason": "eos_token", **counts}}
    models = ServedModels(
        [ServedModel("m", ModelService(FakeScheduler(workers, text, output), workers))]
    )
    body = json.dumps({"input": "hi", "stream": True}).encode()
    headers = [("content-type", "application/json")]
    request = HttpRequest("POST", "/v1/responses", "", headers, body, "id")
    response = await App(models, AppSettings(thinking_in_content=kept)).handle(request)
    assert response is not None and response.stream is not None
    sent = [json.loads(chunk.split(b"data: ", 1)[1]) async for chunk in response.stream]
    items = [event["item"]["type"] for event in sent if event["type"].endswith("item.done")]
    said = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
    thought = "".join(e["delta"] for e in sent if e["type"] == "response.reasoning_text.delta")
    if kept:
        assert (items, thought, said) == (["message"], "", "hm</think>Hello")
    else:
        assert (items, thought, said) == (["reasoning", "message"], "hm", "Hello")


@pytest.mark.parametrize(
    ("texts", "thought", "text"), [(TOKENS[:4], "\nLet", None), (TOKENS, "\nLet me", "Hello!")]
)
def test_a_response_stream_that_fails_keeps_the_thinking_and_text_it_sent(texts, thought, text):
    from tests.test_api_shapes import TimedOutStream

    _, settings = parse_response({"input": "hi", "stream": True})
    answer = ResponseAnswer("m", settings, thinking=OPENED_IN_ANSWER)
    events = responded(answer, TimedOutStream(texts))  # type: ignore[arg-type]
    last = events[-1]
    assert last.type == "response.failed"
    item, *said = last.response.output
    assert item.type == "reasoning" and item.content[0].text == thought
    if text is None:  # cut inside the thinking: its item incomplete, no message
        assert item.status == "incomplete" and not said
    else:
        [message] = said
        assert item.status == "completed" and message.content[0].text == text
        assert message.status == "incomplete"


@pytest.mark.parametrize(
    ("reasoning", "taken"),
    [
        ({"effort": "none"}, True),
        ({"effort": None, "summary": None}, True),
        ({"effort": "high"}, True),  # (a template that reads one: set, else refused)
        ({"effort": "extreme"}, False),
        ({"effort": "none", "summary": "auto"}, False),
        ({"effort": "none", "budget": 10}, False),
    ],
)
def test_a_responses_reasoning_setting_is_an_effort_and_no_summary(reasoning, taken):
    """What a model thinks is said as it thinks it: a summary asked of it is refused,
    naming the field, never served without one; an effort is the template's to read."""
    from rawserve.api.openai_responses import parse_response
    from rawserve.http.errors import BadRequest

    if taken:
        parse_response({"input": "hi", "reasoning": reasoning}, reads_effort=True)
        return
    with pytest.raises(BadRequest, match="is not supported by this server") as refused:
        parse_response({"input": "hi", "reasoning": reasoning}, reads_effort=True)
    assert refused.value.param == "reasoning"


@pytest.mark.parametrize(
    ("template", "reads"),
    [
        # gpt-oss's way: a default set where the request set none
        ('{% if not reasoning_effort is defined %}{% set reasoning_effort = "medium" %}'
         "{% endif %}Reasoning: {{ reasoning_effort }}", True),
        ("{{ reasoning_effort | default('low') }}{{ messages }}", True),
        ({"default": "{{ reasoning_effort }}", "tool_use": "{{ reasoning_effort }}"}, True),
        # (a chat without tools renders with "default", which would drop it)
        ({"default": "{{ messages }}", "tool_use": "{{ reasoning_effort }}"}, False),
        ("{# this template takes no reasoning_effort #}{{ messages }}", False),  # (said)
        ("{{ default_reasoning_effort }}{{ messages }}", False),  # (a longer name)
        ("{% macro m(reasoning_effort) %}{{ reasoning_effort }}{% endmacro %}{{ m(1) }}",
         False),  # (a macro's own)
        ("{% if reasoning_effort %}", False),  # (not Jinja: no chat renders)
        (None, False),
    ],
)  # fmt: skip
def test_a_template_reads_reasoning_effort_where_it_renders_it(template, reads):
    """What the worker tells the server: a word in a comment or a longer name let an
    effort through to a template that never rendered it (a 200 that dropped it)."""
    from types import SimpleNamespace

    from rawserve.worker.chat_rendering import template_reads

    tokenizer = SimpleNamespace(chat_template=template)
    assert template_reads(tokenizer, "reasoning_effort") is reads


@pytest.mark.parametrize("reads_effort", [True, False])
def test_openais_reasoning_effort_is_the_templates_where_it_reads_one(reads_effort):
    """Chat's `reasoning_effort` and a Response's `reasoning.effort` set the template's
    `reasoning_effort` (gpt-oss's reads it), as vLLM sets it; a template that reads none
    refuses it, naming the field ("none" and null are the template's own default); a
    `chat_template_kwargs` that sets it is what the client means."""
    from rawserve.api.openai_generation import parse_chat
    from rawserve.api.openai_responses import parse_response
    from rawserve.http.errors import BadRequest

    hi = [{"role": "user", "content": "hi"}]
    for effort in ("none", None):
        chat = parse_chat({"messages": hi, "reasoning_effort": effort}, reads_effort=False)
        assert "template_kwargs" not in chat.items[0]
    asked = [
        (lambda: parse_chat({"messages": hi, "reasoning_effort": "high"}, False, reads_effort),
         "reasoning_effort"),
        (lambda: parse_response({"input": "hi", "reasoning": {"effort": "high"}}, reads_effort)[0],
         "reasoning.effort"),
    ]  # fmt: skip
    for parse, field in asked:
        if not reads_effort:
            with pytest.raises(BadRequest, match="its chat template reads no") as refused:
                parse()
            assert refused.value.param == field
            continue
        assert parse().items[0]["template_kwargs"] == {"reasoning_effort": "high"}
    if reads_effort:
        both = {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
        chat = parse_chat({"messages": hi, **both}, reads_effort=True)
        assert chat.items[0]["template_kwargs"] == {"reasoning_effort": "low"}

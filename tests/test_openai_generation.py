"""OpenAI's generation routes with the real `openai` client: `/v1/chat/completions` and
`/v1/completions` on tiny local causal LMs.

Answers are compared with greedy generation in this process (temperature 0), so the
text, the finish reason and the token counts are checked, not just the shapes. The
servers start together, once for the module: a model whose tokenizer has a chat template
and one without (plain completions; chat needs `--chat-template FILE`); then, where a test
asks for them, a long model with a template that shows tools, the plain model given a
template file, and a handler server (not a text-generation model at all).
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
from typing import Any

import pytest

from tests.server import RunningServer, module_tests, running_together
from tests.tiny_models import CHAT_TEMPLATE, PERSON, WEATHER

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "you are a good film critic"},
    {"role": "user", "content": "hello, what is a good movie"},
]
PROMPT = "the movie was"
FILE_TEMPLATE = (  # a different template, given with --chat-template
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
CANCELLED = re.compile(r"generation stopped after \d+ tokens")
# the served names: the model folders' names (tests.conftest builds each kind in its own)
CHAT_MODEL = "chat"
TOOLS_MODEL = "long-generation"
PLAIN_MODEL = "text-generation"


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(FILE_TEMPLATE)
    return path


TOOLS_TEMPLATE = (  # a template that shows the tools itself, as instruction-tuned ones do
    "{% if reasoning_effort is defined %}[effort] {{ reasoning_effort }}\n{% endif %}"
    "{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def every_server(request, tiny_model, template_file):
    """The servers of the two groups below that this run's selected tests use, started
    together (their models load side by side): a run of some of this module's tests
    (tests/test_http_processes.py's) starts only the groups they use."""
    tools_template = template_file.parent / "tools.jinja"
    tools_template.write_text(TOOLS_TEMPLATE)
    tools_chat, file_chat = (
        ["--chat-template", str(path)] for path in (tools_template, template_file)
    )
    groups = {
        "servers": {  # the two that most tests ask for
            "chat": ["--model", tiny_model("chat"), "--max-client-batch-size", "4"],
            "plain": ["--model", tiny_model("text-generation")],
        },
        "more_servers": {  # those that a few tests ask for
            # 4,096 positions: room for the tools' schemas in the prompt; its answers of
            # up to 120 grammar-held tokens took past the 30 s default on a loaded machine
            "tools": ["--model", tiny_model("long-generation"), *tools_chat, "--timeout", "120"],
            "template-file": ["--model", tiny_model("text-generation"), *file_chat],
            "handler": ["--handler", "tests.handlers:echo"],
        },
    }
    used = {name for item in module_tests(request) for name in item.fixturenames}
    started = {
        name: RunningServer(args)
        for group, members in groups.items()
        if group in used
        for name, args in members.items()
    }
    with running_together(started, OPEN_CLIENTS):
        yield started


@pytest.fixture(scope="module")
def servers(every_server):
    return {name: every_server[name] for name in ("chat", "plain")}


@pytest.fixture(scope="module")
def more_servers(every_server):
    return {name: every_server[name] for name in ("tools", "template-file", "handler")}


OPEN_CLIENTS: dict[int, object] = {}  # closed with the servers (either group, at the end)


def client(server):
    import openai

    if server.port not in OPEN_CLIENTS:
        OPEN_CLIENTS[server.port] = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
    return OPEN_CLIENTS[server.port]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy generation in this process: (text, finish_reason, prompt_tokens, tokens)."""
    import torch
    import transformers

    loaded = {}

    def generate(kind, prompt_ids, max_tokens):
        if kind not in loaded:
            folder = tiny_model(kind)
            loaded[kind] = (
                transformers.AutoTokenizer.from_pretrained(folder),
                transformers.AutoModelForCausalLM.from_pretrained(folder).eval(),
            )
        tokenizer, model = loaded[kind]
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[0, len(prompt_ids) :].tolist()
        finish = "stop" if new and new[-1] == tokenizer.eos_token_id else "length"
        text = tokenizer.decode(new, skip_special_tokens=True)
        return text, finish, len(prompt_ids), len(new)

    def tokenizer(kind):
        return transformers.AutoTokenizer.from_pretrained(tiny_model(kind))

    generate.tokenizer = tokenizer
    generate.folder = tiny_model
    return generate


def transformers_model(reference, kind):
    """The model `reference` generates with, loaded once."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(reference.folder(kind)).eval()


def chat_prompt_ids(reference, kind, messages, template=None):
    tokenizer = reference.tokenizer(kind)
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, chat_template=template
    )["input_ids"]


# --- chat -----------------------------------------------------------------------------


def test_chat_answers_the_greedy_continuation_with_real_usage(servers, reference):
    answer = client(servers["chat"]).chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    text, finish, prompt_tokens, tokens = reference(
        "chat", chat_prompt_ids(reference, "chat", MESSAGES), 12
    )
    assert answer.object == "chat.completion"
    assert answer.id.startswith("chatcmpl-") and isinstance(answer.created, int)
    [choice] = answer.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == finish
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == tokens
    assert answer.usage.total_tokens == prompt_tokens + tokens


def test_chat_model_field_answers_the_served_name(servers):
    chat = client(servers["chat"])
    [model] = chat.models.list().data
    answer = chat.chat.completions.create(
        model=model.id, messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert answer.model == model.id == CHAT_MODEL


def test_one_served_model_answers_to_any_model_name(servers):
    # as TGI and TEI do: a client's placeholder ("tgi", "gpt-4") selects the one model
    answer = client(servers["chat"]).chat.completions.create(
        model="gpt-4", messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert answer.model == CHAT_MODEL


def test_chat_streamed_matches_the_answer_and_ends_with_done(servers):
    chat = client(servers["chat"])
    whole = chat.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    chunks = list(
        chat.chat.completions.create(
            model=CHAT_MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    *content_chunks, usage_chunk = chunks
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert not any(finishes[:-1])
    # include_usage: one last chunk with no choices and the request's usage
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    # the chunks before it say "usage": null, as OpenAI's spec has them (none where no
    # usage chunk was asked for)
    asked = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    for options, usages in (({"include_usage": True}, True), (None, False)):
        document = {**asked, "stream_options": options}
        _, _, body = servers["chat"].request(
            "POST",
            "/v1/chat/completions",
            json.dumps(document),
            {"Content-Type": "application/json"},
        )
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith(b"data: {")]
        if usages:
            *before, last = events
            assert all(event["usage"] is None for event in before) and last["usage"]
        else:
            assert not any("usage" in event for event in events)


def test_chat_logprobs_list_each_tokens_text_and_its_likeliest_alternatives(servers):
    chat = client(servers["chat"])
    asked = {"max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = chat.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, **asked)
    [choice] = whole.choices
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens or choice.finish_reason == "stop"
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        logprobs = [top.logprob for top in entry.top_logprobs]
        assert logprobs == sorted(logprobs, reverse=True)
        assert entry.logprob == pytest.approx(logprobs[0], abs=1e-5)  # greedy: the likeliest
    # streamed: each chunk lists the tokens whose text it sends, the same ones
    chunks = list(
        chat.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True, **asked)
    )
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    for chunk in chunks:
        if chunk.choices[0].logprobs:
            sent = "".join(e.token for e in chunk.choices[0].logprobs.content)
            assert sent.startswith(chunk.choices[0].delta.content or "")
    # not asked: none, and no alternatives when only logprobs is asked
    plain = chat.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=4, temperature=0
    )
    assert plain.choices[0].logprobs is None
    bare = chat.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    assert all(entry.top_logprobs == [] for entry in bare.choices[0].logprobs.content)


@pytest.fixture
def hub_client_may_reach_loopback():
    """HF_HUB_OFFLINE=1 (set for the whole suite) makes huggingface_hub refuse every
    request, its InferenceClient's to our loopback server included; the client here
    talks to 127.0.0.1 only."""
    from huggingface_hub import constants

    saved, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    yield
    constants.HF_HUB_OFFLINE = saved


def test_huggingface_hubs_client_chats_streamed_and_not(servers, hub_client_may_reach_loopback):
    from huggingface_hub import InferenceClient

    whole = client(servers["chat"]).chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    with InferenceClient(base_url=f"http://127.0.0.1:{servers['chat'].port}") as hub:
        answer = hub.chat_completion(MESSAGES, model=CHAT_MODEL, max_tokens=12, temperature=0)
        chunks = list(
            hub.chat_completion(
                MESSAGES, model=CHAT_MODEL, max_tokens=12, temperature=0, stream=True
            )
        )
    assert answer.choices[0].message.content == whole.choices[0].message.content
    assert answer.choices[0].finish_reason == whole.choices[0].finish_reason
    assert answer.usage.prompt_tokens == whole.usage.prompt_tokens
    assert answer.usage.completion_tokens == whole.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_stream_on_the_wire_is_sse_closed_by_done(servers):
    server = servers["chat"]
    status, headers, body = server.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": MESSAGES, "max_tokens": 3, "stream": True}),
        {"Content-Type": "application/json"},
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data:") for e in events)
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        json.loads(event.removeprefix("data:"))


def test_chat_with_a_seed_repeats_its_sampled_answer(servers):
    chat = client(servers["chat"])

    def sampled(seed):
        return (
            chat.chat.completions.create(
                model=CHAT_MODEL,
                messages=MESSAGES,
                max_tokens=10,
                temperature=1.0,
                top_p=0.9,
                seed=seed,
            )
            .choices[0]
            .message.content
        )

    assert sampled(7) == sampled(7)


def test_chat_content_as_text_parts_is_the_same_prompt(servers):
    chat = client(servers["chat"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello, what is a good movie"}]}]
    plain = [{"role": "user", "content": "hello, what is a good movie"}]
    one = chat.chat.completions.create(
        model=CHAT_MODEL, messages=parts, max_tokens=4, temperature=0
    )
    two = chat.chat.completions.create(
        model=CHAT_MODEL, messages=plain, max_tokens=4, temperature=0
    )
    assert one.choices[0].message.content == two.choices[0].message.content
    assert one.usage.prompt_tokens == two.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 0},
        {"top_logprobs": 2},  # without "logprobs": true
        {"logprobs": True, "top_logprobs": 21},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"max_tokens": 0},
        {"max_tokens": -1},
        {"temperature": -0.5},
        {"top_p": 1.5},
        {"stop": [""]},
        {"stop": "\ufffd"},  # (what a decoder writes for bytes that make no character)
        {"extra_body": {"no_such_field": 1}},
    ],
    ids=repr,
)
def test_chat_options_it_does_not_serve_are_400_not_ignored(servers, extra):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        client(servers["chat"]).chat.completions.create(
            model=CHAT_MODEL, messages=MESSAGES, **extra
        )
    assert raised.value.status_code == 400


def test_chat_takes_openais_fields_at_their_default_values(servers):
    """What agents and proxies forward as it is: the defaults of what rawserve does not do,
    and OpenAI's bookkeeping (dropped)."""
    answer = client(servers["chat"]).chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        max_tokens=3,
        store=False,
        metadata={"run": "7"},
        service_tier="auto",
        modalities=["text"],
        user="someone",
    )
    assert answer.usage.completion_tokens <= 3


def test_reasoning_effort_is_set_in_a_template_that_reads_it(servers, more_servers):
    """OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (a Response) render in a
    template that reads `reasoning_effort` (as gpt-oss's does): the prompt grows by its
    line; a model whose template reads none refuses it, naming the field."""
    import openai

    tools = client(more_servers["tools"])
    asked = {"model": TOOLS_MODEL, "messages": MESSAGES, "max_tokens": 1}
    plain = tools.chat.completions.create(**asked)
    high = tools.chat.completions.create(**asked, reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens
    none = tools.chat.completions.create(**asked, reasoning_effort="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    said = {"model": TOOLS_MODEL, "input": MESSAGES, "max_output_tokens": 1}
    response = tools.responses.create(**said, reasoning={"effort": "high"})
    assert response.usage.input_tokens == high.usage.prompt_tokens
    assert response.reasoning.effort == "high"  # (said back, as OpenAI's)
    assert tools.responses.create(**said).reasoning.effort is None
    with pytest.raises(openai.BadRequestError) as raised:
        client(servers["chat"]).responses.create(
            model=CHAT_MODEL, input="hi", max_output_tokens=1, reasoning={"effort": "high"}
        )
    assert raised.value.body["param"] == "reasoning.effort"
    with pytest.raises(openai.BadRequestError) as raised:
        client(servers["chat"]).chat.completions.create(
            model=CHAT_MODEL, messages=MESSAGES, max_tokens=1, reasoning_effort="high"
        )
    assert raised.value.param == "reasoning_effort"
    assert "its chat template reads no reasoning_effort" in raised.value.message


@pytest.mark.parametrize(
    "extra",
    [
        {"store": True},
        {"service_tier": "flex"},
        {"modalities": ["text", "audio"]},
        {"prediction": {"type": "content", "content": "a movie"}},
    ],
    ids=repr,
)
def test_chat_fields_it_does_not_serve_are_400_naming_them(servers, extra):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        client(servers["chat"]).chat.completions.create(
            model=CHAT_MODEL, messages=MESSAGES, max_tokens=3, **extra
        )
    [name] = extra
    assert f'"{name}" is not supported by this server' in raised.value.message
    assert raised.value.param == name


# vLLM's sampling and detokenizing fields at their defaults, as its clients send them
VLLM_DEFAULTS = {
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "stop_token_ids": [],
    "bad_words": [],
    "allowed_token_ids": None,
    "prompt_logprobs": None,
    "return_tokens_as_token_ids": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "priority": 0,
    "logits_processors": None,
}


def test_vllms_fields_at_their_defaults_are_taken_and_others_named_400(servers):
    """A vLLM client sends its defaults (`skip_special_tokens: true`, `priority: 0`...):
    each was 400 "unknown field", though rawserve does what they ask. Taken at those,
    each is 400 naming it at any other value, as OpenAI's unserved fields are."""
    import openai

    chat = client(servers["chat"])
    plain = client(servers["plain"])
    asked = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    expected = chat.chat.completions.create(**asked).choices[0].message.content
    chat_only = {"add_special_tokens": False, "echo": False, "chat_template": None}
    got = chat.chat.completions.create(**asked, extra_body={**VLLM_DEFAULTS, **chat_only})
    assert got.choices[0].message.content == expected
    completed = {"model": PLAIN_MODEL, "prompt": "the movie", "max_tokens": 3}
    extra = {**VLLM_DEFAULTS, "add_special_tokens": True}
    assert plain.completions.create(**completed, extra_body=extra).choices[0].text
    for name, other in [("skip_special_tokens", False), ("stop_token_ids", [2]), ("priority", 1)]:
        with pytest.raises(openai.BadRequestError) as raised:
            plain.completions.create(**completed, extra_body={name: other})
        assert raised.value.param == name
        assert f'"{name}" is not supported by this server' in raised.value.message


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ],
    ids=repr,
)
def test_chat_malformed_messages_are_400(servers, messages):
    status, body = servers["chat"].post_json({"messages": messages}, "/v1/chat/completions")
    assert status == 400 and set(body) >= {"error"}, body


def test_chat_without_a_template_is_400_saying_how_to_give_one(servers):
    status, body = servers["plain"].post_json({"messages": MESSAGES}, "/v1/chat/completions")
    assert status == 400
    message = body["error"]["message"]
    assert "chat template" in message and "--chat-template" in message


def test_chat_template_file_renders_the_prompt(more_servers, reference):
    answer = client(more_servers["template-file"]).chat.completions.create(
        model=PLAIN_MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    ids = chat_prompt_ids(reference, "text-generation", MESSAGES, template=FILE_TEMPLATE)
    text, finish, prompt_tokens, tokens = reference("text-generation", ids, 6)
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == finish


def test_the_tiny_chat_models_template_is_the_one_tested(reference):
    assert reference.tokenizer("chat").chat_template == CHAT_TEMPLATE


def test_generation_routes_on_a_model_that_does_not_generate_are_404(more_servers):
    for path, document in [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": PROMPT}),
    ]:
        status, body = more_servers["handler"].post_json(document, path)
        assert status == 404 and "text-generation" in body["error"]["message"], body


def stream_and_leave(server, document):
    """Ask for a streamed chat, read the start of its answer, and hang up."""
    body = json.dumps({**document, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_client_that_leaves_a_stream_stops_the_generation(servers):
    server = servers["chat"]
    # greedy: the random model never ends the stream itself before the client leaves
    stream_and_leave(server, {"messages": MESSAGES, "max_tokens": 255, "temperature": 0})
    server.wait_for_log(CANCELLED, timeout=60)
    assert server.request("GET", "/health")[0] == 200


def test_a_client_that_leaves_a_stream_of_several_choices_stops_each(servers):
    import time

    server = servers["chat"]
    before = sum(bool(CANCELLED.search(line)) for line in server.read_log())
    stream_and_leave(server, {"messages": MESSAGES, "max_tokens": 255, "temperature": 0, "n": 2})
    deadline = time.monotonic() + 60
    while sum(bool(CANCELLED.search(line)) for line in server.read_log()) < before + 2:
        assert time.monotonic() < deadline, "a choice's generation went on"
        time.sleep(0.05)
    assert server.request("GET", "/health")[0] == 200


# --- scores changed: logit_bias, frequency_penalty, presence_penalty ----------------------


def test_logit_bias_makes_a_token_the_only_choice(servers, reference):
    plain = client(servers["plain"])
    tokenizer = reference.tokenizer(PLAIN_MODEL)
    answer = plain.completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"7": 100}
    )
    assert answer.choices[0].text == tokenizer.decode([7] * 5)
    banned = plain.completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0
    )
    first = banned.choices[0].logprobs.tokens[0]
    first_id = tokenizer(first, add_special_tokens=False)["input_ids"][0]
    without = plain.completions.create(
        model=PLAIN_MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=0,
        logit_bias={str(first_id): -100},
    )
    assert without.choices[0].logprobs.tokens[0] != first


def test_best_of_answers_the_likeliest_n_of_its_sampled_completions(servers):
    """Completions' `best_of`: so many sampled completions (seeded as `n` seeds them), of
    which the `n` with the highest log probability per token answer, likeliest first;
    the usage counts those answered; no log probabilities listed unless asked."""
    plain = client(servers["plain"])
    asked = {"model": PLAIN_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    asked.update(seed=7, logprobs=0)
    every = plain.completions.create(n=5, **asked)
    assert len({choice.text for choice in every.choices}) > 2  # (sampled: they differ)

    def per_token(choice: Any) -> float:
        logprobs = choice.logprobs.token_logprobs
        return sum(logprobs) / len(logprobs)

    ranked = sorted(every.choices, key=lambda choice: (-per_token(choice), choice.index))
    best = plain.completions.create(n=2, best_of=5, **asked)
    assert [choice.text for choice in best.choices] == [choice.text for choice in ranked[:2]]
    assert [choice.index for choice in best.choices] == [0, 1]
    answered = sum(len(choice.logprobs.tokens) for choice in best.choices)
    assert best.usage.completion_tokens == answered
    quiet = plain.completions.create(n=2, best_of=5, **{**asked, "logprobs": None})
    assert [choice.text for choice in quiet.choices] == [choice.text for choice in best.choices]
    assert all(choice.logprobs is None for choice in quiet.choices)
    status, one = servers["plain"].post_json({**asked, "best_of": 5}, "/v1/completions")
    assert status == 200 and [c["text"] for c in one["choices"]] == [ranked[0].text], one


def test_best_of_past_the_client_cap_is_413_naming_it(servers):
    """Each of best_of's completions is a generation queued of its own: the cap on one
    request's (--max-client-batch-size 4) counts them all."""
    document = {"prompt": [PROMPT, PROMPT], "best_of": 3, "max_tokens": 2}
    status, body = servers["chat"].post_json(document, "/v1/completions")
    assert status == 413 and body["error"]["param"] == "best_of", body
    assert "6 generations in one request (2 prompts, best_of 3)" in body["error"]["message"]


def test_penalties_take_repeated_tokens_down(servers, reference):
    from collections import Counter

    chat = client(servers["chat"])
    asked = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 0}
    free = chat.chat.completions.create(**asked, logprobs=True)
    penalized = chat.chat.completions.create(
        **asked, logprobs=True, frequency_penalty=2, presence_penalty=2
    )

    def most_repeated(answer) -> int:
        return max(Counter(t.token for t in answer.choices[0].logprobs.content).values())

    assert most_repeated(free) > 2  # a tiny random model repeats itself when greedy
    assert most_repeated(penalized) < most_repeated(free)


@pytest.mark.parametrize(
    ("document", "status", "message"),
    [
        ({"frequency_penalty": 2.5}, 400, '"frequency_penalty" must be between'),
        ({"presence_penalty": -3}, 400, '"presence_penalty" must be between'),
        ({"logit_bias": {"abc": 1}}, 400, "token ids as its keys"),
        ({"logit_bias": {"5": 101}}, 400, '"logit_bias[5]" must be between'),
        ({"logit_bias": [5]}, 400, '"logit_bias" must be an object'),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, 400, "at most 300"),
        (
            {"logit_bias": {"1000000": 1}},
            422,
            "the token id 1000000 is not in the model's vocabulary",
        ),
        # (past the 4,300 digits Python reads: a 500 with a traceback in the log)
        ({"logit_bias": {"1" + "0" * 5000: 1}}, 400, '"logit_bias" has a key past any token id'),
        ({"logit_bias": {"0" * 5000 + "5": 101}}, 400, '"logit_bias[5]" must be between'),
    ],
    ids=["frequency", "presence", "key", "bias", "list", "count", "unknown-id", "huge", "zeros"],
)
def test_scores_that_cannot_be_changed_so_are_refused(servers, document, status, message):
    answered, body = servers["plain"].post_json({"prompt": PROMPT, **document}, "/v1/completions")
    assert answered == status and message in body["error"]["message"], body


# --- responses ------------------------------------------------------------------------------


def test_a_response_answers_what_the_same_chat_answers_in_openais_response_object(servers):
    from openai.types.responses import Response

    openai_client = client(servers["chat"])
    [system, user] = MESSAGES
    asked = {"max_output_tokens": 12, "temperature": 0}
    response = openai_client.responses.create(
        model=CHAT_MODEL, instructions=system["content"], input=user["content"], **asked
    )
    chat = openai_client.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    [choice] = chat.choices
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == CHAT_MODEL
    assert response.output_text == choice.message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].annotations == []
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    # the raw answer is the SDK's type, whole (not only what its lenient reading keeps)
    status, raw = servers["chat"].post_json({"input": "hi", **asked}, "/v1/responses")
    assert status == 200
    Response.model_validate(raw)


def test_a_streamed_response_is_openais_event_sequence_ending_as_the_whole_one(servers):
    openai_client = client(servers["chat"])
    asked = {"model": CHAT_MODEL, "input": MESSAGES, "max_output_tokens": 12, "temperature": 0}
    whole = openai_client.responses.create(**asked)
    events = list(openai_client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    opening = ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[:4] == [*opening, "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done"]
    assert kinds[-4:] == [*closing, "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage == whole.usage
    # each as `event:` and `data:` lines, as OpenAI's stream sends them
    body = json.dumps({**asked, "stream": True}).encode()
    status, headers, raw = servers["chat"].request(
        "POST", "/v1/responses", body, {"Content-Type": "application/json"}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert raw.startswith(b"event: response.created\ndata: {")


def test_a_responses_logprobs_are_the_same_chats_on_its_text_and_its_deltas(servers):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the answer's
    tokens listed on its text part as chat lists them (OpenAI's Logprob entries), the
    same on the stream's deltas and its text's end; `top_logprobs` alone lists none."""
    openai_client = client(servers["chat"])
    asked = {"model": CHAT_MODEL, "input": MESSAGES, "max_output_tokens": 12, "temperature": 0}
    listed = {**asked, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = openai_client.responses.create(**listed)
    chat = openai_client.chat.completions.create(
        model=CHAT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    [part] = whole.output[0].content
    entries = [entry.model_dump() for entry in part.logprobs]
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(entries) == len(expected) == whole.usage.output_tokens > 0
    for got, chats in zip(entries, expected, strict=True):
        assert (got["token"], got["bytes"]) == (chats["token"], chats["bytes"])
        assert got["logprob"] == pytest.approx(chats["logprob"], abs=1e-4)
        assert [t["token"] for t in got["top_logprobs"]] == [
            t["token"] for t in chats["top_logprobs"]
        ]
        assert len(got["top_logprobs"]) == 2
    assert "".join(entry["token"] for entry in entries) == whole.output_text
    assert whole.top_logprobs == 2
    events = list(openai_client.responses.create(**listed, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry.model_dump() for e in deltas for entry in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [entry["token"] for entry in streamed] == [entry["token"] for entry in entries]
    assert [entry.model_dump() for entry in done.logprobs] == streamed
    ended = events[-1].response.output[0].content[0]
    assert [entry.model_dump() for entry in ended.logprobs] == streamed
    plain = openai_client.responses.create(**asked, top_logprobs=2)
    assert plain.output[0].content[0].logprobs is None and plain.output_text == whole.output_text


def test_a_responses_input_of_messages_and_text_parts_is_the_same_chat(servers):
    openai_client = client(servers["chat"])
    earlier = openai_client.responses.create(
        model=CHAT_MODEL, input="hello", max_output_tokens=3, temperature=0
    )
    parts = [{"type": "input_text", "text": "what is "}, {"type": "input_text", "text": "a film"}]
    conversation = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hello"},
        earlier.output[0].model_dump(exclude_none=True),  # an answer sent back as it came
        {"type": "message", "role": "user", "content": parts},
    ]
    response = openai_client.responses.create(
        model=CHAT_MODEL, input=conversation, max_output_tokens=6, temperature=0
    )
    chat = openai_client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": earlier.output_text},
            {"role": "user", "content": "what is a film"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content


def test_an_answer_sent_back_with_every_field_the_sdk_dumps_is_taken(servers):
    # `output[0].model_dump(mode="json")`, as an app stores a conversation: its nulls too
    answer = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "phase": None,
        "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": None}],
    }
    conversation = [{"role": "user", "content": "hello"}, answer, {"role": "user", "content": "?"}]
    document = {"input": conversation, "max_output_tokens": 2}
    status, body = servers["chat"].post_json(document, "/v1/responses")
    assert status == 200 and body["object"] == "response", body


def test_a_response_held_to_a_json_schema_is_json_it_describes(servers):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    response = client(servers["chat"]).responses.create(
        model=CHAT_MODEL, input="who?", max_output_tokens=120, temperature=0, text=text
    )
    person = json.loads(response.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # (its template reads none)
        ({"reasoning": {"effort": "none", "summary": "auto"}}, "reasoning"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]},
            "input[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "4"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # (chat's)
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),  # (needs stored ones)
        ({"include": "message.output_text.logprobs"}, "include"),  # (a list of them)
        ({"n": 2}, None),  # (not a Responses field)
    ],
)
def test_what_responses_does_not_serve_is_400_naming_its_field(servers, extra, param):
    document = {"input": "hi", "max_output_tokens": 2, **extra}
    status, body = servers["chat"].post_json(document, "/v1/responses")
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_a_response_past_the_positions_names_no_field_the_route_refuses(servers):
    """The 422 told a Response to send "truncate_prompt_tokens", which /v1/responses
    refuses (400, an unknown field)."""
    document = {"input": "hello " * 400, "max_output_tokens": 2}
    status, body = servers["chat"].post_json(document, "/v1/responses")
    assert status == 422 and body["error"]["code"] == "context_length_exceeded", body
    assert "truncate_prompt_tokens" not in body["error"]["message"]
    status, body = servers["chat"].post_json(
        {**document, "truncate_prompt_tokens": 10}, "/v1/responses"
    )
    assert status == 400 and "truncate_prompt_tokens" in body["error"]["message"], body


def test_a_verbosity_other_than_the_default_is_400_saying_which_are_taken(servers):
    document = {"input": "hi", "max_output_tokens": 2, "text": {"verbosity": "low"}}
    status, body = servers["chat"].post_json(document, "/v1/responses")
    assert status == 400, body
    assert body["error"]["message"].endswith('it takes only null or "medium"')


def test_responses_takes_what_stores_and_tags_at_their_no_op_values(servers):
    document = {
        "input": "hi",
        "max_output_tokens": 2,
        "store": True,  # OpenAI's default: nothing is stored, and the answer says so
        "metadata": {"team": "a"},
        "user": "u-1",
        "tools": [],
        "tool_choice": "auto",
        "top_logprobs": 0,
        "max_tool_calls": None,
        "stream_options": {"include_obfuscation": False},
        "text": {"verbosity": "medium"},  # OpenAI's default
        # the openai SDK's fields, at their off values or as hints to a prompt cache
        "reasoning": {"effort": "none"},
        "moderation": None,
        "context_management": None,
        "image": None,
        "access_programs": None,
        "background_options": None,
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
        "parallel_tool_calls": False,
    }
    status, body = servers["chat"].post_json(document, "/v1/responses")
    assert status == 200 and body["store"] is False, body
    assert body["tool_choice"] == "auto"  # as asked (OpenAI's default too)
    # the settings a Response says back are those asked
    assert body["metadata"] == {"team": "a"} and body["parallel_tool_calls"] is False
    for reasoning in (None, {}, {"effort": None, "summary": None}):
        status, body = servers["chat"].post_json(
            {"input": "hi", "max_output_tokens": 2, "reasoning": reasoning}, "/v1/responses"
        )
        assert status == 200, (reasoning, body)
    parts = [{"type": "input_text", "text": "hi", "prompt_cache_breakpoint": {}}]
    status, body = servers["chat"].post_json(
        {"input": [{"role": "user", "content": parts}], "max_output_tokens": 2}, "/v1/responses"
    )
    assert status == 200, body
    status, body = servers["chat"].post_json(
        {"input": "hi", "max_output_tokens": 2, "tool_choice": "none"}, "/v1/responses"
    )
    assert status == 200 and body["tool_choice"] == "none"


def test_responses_by_a_models_path_and_on_models_it_cannot_chat_with(servers, more_servers):
    status, body = servers["chat"].post_json(
        {"input": "hi", "max_output_tokens": 2}, f"/models/{CHAT_MODEL}/v1/responses"
    )
    assert status == 200 and body["object"] == "response"
    status, body = servers["plain"].post_json({"input": "hi"}, "/v1/responses")
    assert status == 400 and "chat template" in body["error"]["message"]
    status, body = more_servers["handler"].post_json({"input": "hi"}, "/v1/responses")
    assert status == 404 and "text-generation" in body["error"]["message"]


# --- structured output ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_response_format_gives_json_it_describes(servers, stream):
    chat = client(servers["chat"])
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    asked = {"model": CHAT_MODEL, "messages": MESSAGES, "n": 2, **SAMPLED, "max_tokens": 120}
    answer = chat.chat.completions.create(**asked, response_format=response_format, stream=stream)
    texts = [c.message.content for c in answer.choices] if not stream else ["", ""]
    if stream:
        for chunk in answer:
            texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert len(texts) == 2  # n=2: two answers, each held to the schema
    for text in texts:
        person = json.loads(text)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int), text
        assert len(person["name"]) <= 5 and 0 <= person["age"] <= 150


def test_pydantic_models_whose_formats_the_grammar_does_not_know_are_parsed(servers):
    """pydantic writes "password" for SecretStr, "path" for Path: each request the openai
    SDK's `.parse` sent with such a model was a 422 "Unknown format"."""
    from pathlib import Path
    from typing import Annotated

    from pydantic import BaseModel, Field, SecretStr

    class Login(BaseModel):
        token: Annotated[SecretStr, Field(max_length=4)]
        home: Annotated[Path, Field(json_schema_extra={"maxLength": 4})]  # (in the schema)
        data: Annotated[bytes, Field(json_schema_extra={"maxLength": 4})]

    chat = client(servers["chat"])
    asked = {"model": CHAT_MODEL, "messages": MESSAGES, **SAMPLED, "max_tokens": 120}
    answer = chat.chat.completions.parse(**asked, response_format=Login)
    login = answer.choices[0].message.parsed
    assert isinstance(login, Login) and len(login.token.get_secret_value()) <= 4


def test_a_json_object_response_format_gives_a_json_object(servers):
    plain = client(servers["plain"])
    answer = plain.completions.create(
        model=PLAIN_MODEL,
        prompt=PROMPT,
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},  # (vLLM's, on completions)
    )
    assert isinstance(json.loads(answer.choices[0].text), dict)
    assert answer.choices[0].finish_reason == "stop"


def test_a_schema_beside_json_object_is_held_to(servers):
    # what langchain-huggingface's ChatHuggingFace.with_structured_output(method="json_schema")
    # sends (Together's and Fireworks' form): the schema was dropped, any object answered
    status, body = servers["chat"].post_json(
        {
            "model": CHAT_MODEL,
            "messages": MESSAGES,
            **SAMPLED,
            "max_tokens": 120,
            "response_format": {"type": "json_object", "schema": PERSON},
        },
        "/v1/chat/completions",
    )
    assert status == 200, body
    person = json.loads(body["choices"][0]["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    status, body = servers["chat"].post_json(
        {
            "model": CHAT_MODEL,
            "messages": MESSAGES,
            "response_format": {"type": "json_object", "schema": 3},
        },
        "/v1/chat/completions",
    )
    assert status == 400 and "response_format" in body["error"]["message"]


def test_huggingface_hubs_client_generates_within_a_grammar(servers, hub_client_may_reach_loopback):
    import re

    from huggingface_hub import InferenceClient

    with InferenceClient(base_url=f"http://127.0.0.1:{servers['plain'].port}") as hub:
        regex = {"type": "regex", "value": "(yes|no), [0-9]{2}"}
        text = hub.text_generation(PROMPT, max_new_tokens=20, grammar=regex, return_full_text=False)
        schema = {"type": "json", "value": PERSON}
        person = hub.text_generation(
            PROMPT, max_new_tokens=120, grammar=schema, return_full_text=False
        )
    assert re.fullmatch("(yes|no), [0-9]{2}", text), text
    assert set(json.loads(person)) == {"name", "age"}, person


def test_tgis_grammars_hold_a_chat_as_they_hold_generate(servers, hub_client_may_reach_loopback):
    """TGI's chat takes its /generate grammars as "response_format", and InferenceClient
    sends them so."""
    from huggingface_hub import InferenceClient

    with InferenceClient(base_url=f"http://127.0.0.1:{servers['chat'].port}") as hub:

        def chat(grammar):
            answer = hub.chat_completion(
                MESSAGES,
                model=CHAT_MODEL,
                response_format=grammar,
                **{**SAMPLED, "max_tokens": 120},
            )
            return answer.choices[0].message.content

        text = chat({"type": "regex", "value": "(yes|no), [0-9]{2}"})
        person = chat({"type": "json", "value": PERSON})
    assert re.fullmatch("(yes|no), [0-9]{2}", text), text
    assert set(json.loads(person)) == {"name", "age"}, person


def test_huggingface_hubs_client_sends_a_json_schema_as_tgis_json_object(
    servers, hub_client_may_reach_loopback
):
    """InferenceClient sends OpenAI's json_schema as `{"type": "json_object", "value":
    schema}`, which TGI reads as its "json" grammar (an alias): it was a 400."""
    from huggingface_hub import InferenceClient

    with InferenceClient(base_url=f"http://127.0.0.1:{servers['chat'].port}") as hub:
        answer = hub.chat_completion(
            MESSAGES,
            model=CHAT_MODEL,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
            **{**SAMPLED, "max_tokens": 120},
        )
    person = json.loads(answer.choices[0].message.content)
    assert set(person) == {"name", "age"}, person
    document = {"inputs": PROMPT, "parameters": {"max_new_tokens": 120, "seed": 1}}
    document["parameters"]["grammar"] = {"type": "json_object", "value": PERSON}
    status, body = servers["plain"].post_json(document, "/generate")
    assert status == 200 and set(json.loads(body["generated_text"])) == {"name", "age"}, body


def test_tgis_tool_prompt_is_told_to_the_model_with_the_tools(
    more_servers, hub_client_may_reach_loopback
):
    from huggingface_hub import InferenceClient

    with InferenceClient(base_url=f"http://127.0.0.1:{more_servers['tools'].port}") as hub:

        def prompt_tokens(**extra):
            asked = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 120}
            answer = hub.chat_completion(ASK, model=TOOLS_MODEL, **asked, **extra)
            return answer.usage.prompt_tokens

        assert prompt_tokens(tool_prompt="Answer with a call.") > prompt_tokens()


def test_vllms_min_tokens_and_ignore_eos_give_answers_of_a_set_length(servers, reference):
    plain = client(servers["plain"])
    eos = str(reference.tokenizer(PLAIN_MODEL).eos_token_id)
    asked = {"model": PLAIN_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    ending = {"logit_bias": {eos: 100}}  # the end of sequence, at once
    assert plain.completions.create(**asked, extra_body=ending).usage.completion_tokens == 1
    waited = plain.completions.create(**asked, extra_body={**ending, "min_tokens": 5})
    assert waited.usage.completion_tokens == 6 and waited.choices[0].finish_reason == "stop"
    endless = plain.completions.create(**asked, extra_body={**ending, "ignore_eos": True})
    assert endless.usage.completion_tokens == 8
    assert endless.choices[0].finish_reason == "length"
    status, body = servers["plain"].post_json(
        {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 5}, "/v1/completions"
    )
    assert (
        status == 400 and '"min_tokens" (5) is more than "max_tokens"' in (body["error"]["message"])
    ), body
    assert body["error"]["param"] == "min_tokens"


def test_vllms_min_p_keeps_only_tokens_near_the_likeliest(servers):
    plain = client(servers["plain"])
    asked = {"model": PLAIN_MODEL, "prompt": PROMPT, "max_tokens": 8}
    greedy = plain.completions.create(**asked, temperature=0).choices[0].text
    # min_p 1: only the likeliest token is left to sample (the seeds draw alike)
    for seed in (1, 2):
        held = {"temperature": 1.0, "seed": seed, "extra_body": {"min_p": 1.0}}
        assert plain.completions.create(**asked, **held).choices[0].text == greedy
    status, body = servers["plain"].post_json({**asked, "min_p": 1.5}, "/v1/completions")
    assert status == 400 and '"min_p" must be between' in body["error"]["message"], body


def test_vllms_min_tokens_holds_stop_sequences_back_streamed_or_not(servers):
    plain = client(servers["plain"])
    asked = {"model": PLAIN_MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    free = plain.completions.create(**asked).choices[0].text
    stop = free[0]  # a stop sequence at once
    cut = plain.completions.create(**asked, stop=[stop])
    assert cut.choices[0].text == "" and cut.choices[0].finish_reason == "stop"
    held = {**asked, "stop": [stop], "extra_body": {"min_tokens": 6}}
    whole = plain.completions.create(**held)
    text, finish = whole.choices[0].text, whole.choices[0].finish_reason
    assert whole.usage.completion_tokens >= 6 and text.startswith(stop), whole
    assert free.startswith(text)  # greedy: the same tokens, cut later or not at all
    assert free[len(text) :].startswith(stop) if finish == "stop" else text == free
    chunks = list(plain.completions.create(**held, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish
    # min_tokens 1: no stop ends in the first token's text (one ending there cut it to "")
    one = {**asked, "stop": [stop], "extra_body": {"min_tokens": 1}}
    first = plain.completions.create(**one).choices[0].text
    assert first.startswith(stop), first
    chunks = list(plain.completions.create(**one, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == first


def test_vllms_guided_fields_hold_the_answer_as_response_format_does(servers):
    import re

    plain = client(servers["plain"])

    def completion(**extra):
        answer = plain.completions.create(
            model=PLAIN_MODEL, prompt=PROMPT, max_tokens=120, temperature=1.0, extra_body=extra
        )
        return answer.choices[0].text

    choices = ["yes (sure)", "no.", "a|b"]  # held as written, their regex signs escaped
    assert {completion(guided_choice=choices, seed=s) for s in range(6)} <= set(choices)
    assert re.fullmatch("[0-9]{4}", completion(guided_regex="[0-9]{4}"))
    person = json.loads(completion(guided_json=PERSON))
    assert set(person) == {"name", "age"}
    status, body = servers["plain"].post_json(
        {"prompt": PROMPT, "guided_regex": "a+", "guided_choice": ["a"]}, "/v1/completions"
    )
    assert status == 400 and "not several" in body["error"]["message"], body


def test_vllms_truncate_prompt_tokens_reads_a_prompts_last_tokens(servers):
    """vLLM's clients send it to answer a long prompt from its end: it was 400 (an unknown
    field) where /generate's `truncate` did the same."""
    server = servers["chat"]
    long_prompt = "the movie was good " * 100  # past the tiny model's 256 positions
    greedy = {"max_tokens": 3, "temperature": 0}
    status, body = server.post_json({"prompt": long_prompt, **greedy}, "/v1/completions")
    assert status == 422 and 'send "truncate_prompt_tokens"' in body["error"]["message"]
    document = {"prompt": long_prompt, **greedy, "truncate_prompt_tokens": 20}
    status, body = server.post_json(document, "/v1/completions")
    assert status == 200 and body["usage"]["prompt_tokens"] == 20, body
    tgi = {"inputs": long_prompt, "parameters": {"max_new_tokens": 3, "truncate": 20}}
    assert body["choices"][0]["text"] == server.post_json(tgi, "/generate")[1]["generated_text"]
    chat = {"messages": [{"role": "user", "content": long_prompt}], **greedy}
    status, body = server.post_json({**chat, "truncate_prompt_tokens": -1}, "/v1/chat/completions")
    assert status == 200 and body["usage"]["prompt_tokens"] == 255, body  # room for one
    for keep, said in ((0, "must be -1 or a count"), (256, "reads at most 255 tokens")):
        document = {**chat, "truncate_prompt_tokens": keep}
        status, body = server.post_json(document, "/v1/chat/completions")
        assert status == 400 and said in body["error"]["message"], body
        assert body["error"]["param"] == "truncate_prompt_tokens"
    # a prompt only scored takes no new token: every position is the prompt's (-1 read
    # 255 of a 256-token prompt that fits, dropping its first token's log probability)
    ids = [5 + index % 40 for index in range(256)]
    scored = {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0}
    for keep in (-1, 256):
        document = {**scored, "truncate_prompt_tokens": keep}
        status, body = server.post_json(document, "/v1/completions")
        assert status == 200 and body["usage"]["prompt_tokens"] == 256, body
        assert len(body["choices"][0]["logprobs"]["tokens"]) == 256


def test_vllms_structured_outputs_hold_the_answer_as_its_guided_fields_did(servers):
    """vLLM 0.12 took out the guided fields for `structured_outputs`, which its documents
    and clients now send: it was a 400 (an unknown field)."""

    def completion(structured_outputs):
        document = {"prompt": PROMPT, "max_tokens": 120, "seed": 3}
        document["structured_outputs"] = structured_outputs
        return servers["plain"].post_json(document, "/v1/completions")

    status, body = completion({"choice": ["yes (sure)", "no."]})
    assert status == 200 and body["choices"][0]["text"] in ("yes (sure)", "no."), body
    status, body = completion({"regex": "[0-9]{4}", "grammar": None})
    assert status == 200 and re.fullmatch("[0-9]{4}", body["choices"][0]["text"]), body
    status, body = completion({"json": PERSON})
    assert status == 200 and set(json.loads(body["choices"][0]["text"])) == {"name", "age"}
    status, body = completion({"json_object": True})
    assert status == 200 and isinstance(json.loads(body["choices"][0]["text"]), dict), body
    for refused in ({"grammar": 'root ::= "a"'}, {}, {"regex": "a", "choice": ["a"]}):
        status, body = completion(refused)
        assert status == 400 and body["error"]["param"] == "structured_outputs", body


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "regex", "value": "[0-9"}, "unclosed character class"),
        ({"type": "json", "value": {"type": "nonsense"}}, "Invalid type: nonsense"),
    ],
    ids=["regex", "schema"],
)
def test_a_grammar_that_cannot_be_followed_is_422_naming_the_fault(servers, grammar, message):
    document = {"inputs": PROMPT, "parameters": {"grammar": grammar, "max_new_tokens": 5}}
    status, body = servers["plain"].post_json(document, "/generate")
    assert status == 422 and message in body["error"], body
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    status, body = servers["plain"].post_json(
        {"prompt": PROMPT, "response_format": schema}, "/v1/completions"
    )
    assert status == 422 and "Invalid type: nonsense" in body["error"]["message"], body
    assert body["error"]["param"] == "response_format"  # the field that gave it
    status, body = servers["plain"].post_json(
        {"prompt": PROMPT, "guided_regex": "[0-9"}, "/v1/completions"
    )
    assert status == 422 and body["error"]["param"] == "guided_regex", body
    # a Responses body's grammar is its "text.format", as its 400s name it
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}
    document = {"input": "hi", "max_output_tokens": 4, "text": text}
    status, body = servers["chat"].post_json(document, "/v1/responses")
    assert status == 422 and body["error"]["param"] == "text.format", body


def test_a_grammar_that_fails_midway_names_the_field_that_gave_it(servers):
    """A grammar that compiles, then fails past its first step ("the grammar failed: ..."):
    its 422, and a stream's error event, name the field too."""
    import openai

    huge = {"type": "string", "pattern": "^a{900000}c$"}  # past llguidance's bound, running
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}
    asked = {"prompt": PROMPT, "response_format": schema, "max_tokens": 50}
    status, body = servers["plain"].post_json(asked, "/v1/completions")
    assert status == 422 and body["error"]["message"].startswith("the grammar failed"), body
    assert body["error"]["param"] == "response_format"
    stream = client(servers["plain"]).completions.create(
        model=PLAIN_MODEL,
        **{k: v for k, v in asked.items() if k != "response_format"},
        extra_body={"response_format": schema},
        stream=True,
    )
    with pytest.raises(openai.APIError) as failed:
        list(stream)
    assert failed.value.body["param"] == "response_format", failed.value.body


def test_a_schema_no_answer_can_complete_is_refused_before_a_stream_begins(servers):
    """An object that must always hold another of itself compiled, and failed steps later:
    a stream had answered 200 and sent `{` before its error event. It is refused first."""
    import openai

    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client(servers["plain"]).completions.create(
            model=PLAIN_MODEL,
            prompt=PROMPT,
            max_tokens=50,
            extra_body={"response_format": schema},
            stream=True,
        )
    error = refused.value.body
    assert error["param"] == "response_format", error
    assert "the schema has no value of finite length" in error["message"], error
    # a chain of 1,000 references, each to the next: it took the worker down (SIGSEGV,
    # llguidance's stack), a 500 twice then the input quarantined
    parts = {
        f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(1000)
    }
    deep = {"$defs": {**parts, "d1000": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    asked = {"prompt": PROMPT, "response_format": schema, "max_tokens": 5}
    status, body = servers["plain"].post_json(asked, "/v1/completions")
    assert status == 422 and "its subschemas nest 2,002 levels" in body["error"]["message"], body


def test_a_tools_schema_a_grammar_cannot_follow_names_the_tools(more_servers):
    parameters = {"type": "object", "properties": {"a": {"type": "wat"}}}
    broken = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    asked = {"model": TOOLS_MODEL, "messages": ASK, "tools": [broken], "tool_choice": "required"}
    status, body = more_servers["tools"].post_json(asked, "/v1/chat/completions")
    assert status == 422 and body["error"]["param"] == "tools", body
    assert body["error"]["message"] == "the grammar cannot be used: Invalid type: wat"
    # OpenAI's older form names its own field, not "tools", which the request never sent
    older = {"model": TOOLS_MODEL, "messages": ASK, "functions": [broken["function"]]}
    older["function_call"] = {"name": "f"}
    status, body = more_servers["tools"].post_json(older, "/v1/chat/completions")
    assert status == 422 and body["error"]["param"] == "functions", body


# --- tools ----------------------------------------------------------------------------------

TIME = {"type": "function", "function": {"name": "time"}}  # (no parameters: it takes none)
ASK = [{"role": "user", "content": "hi"}]


def test_a_required_tool_call_names_a_tool_and_its_arguments_fit_its_schema(more_servers):
    chat = client(more_servers["tools"])
    answer = chat.chat.completions.create(
        model=TOOLS_MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls  # required: at least one call
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("weather", "time")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "weather":
            assert arguments["city"] in ("paris", "rome")
    named = chat.chat.completions.create(
        model=TOOLS_MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        **{**SAMPLED, "max_tokens": 120},
    )
    assert named.choices[0].message.tool_calls  # the named tool is called
    for call in named.choices[0].message.tool_calls:
        assert call.function.name == "weather"
        assert json.loads(call.function.arguments)["city"] in ("paris", "rome")
    # a call forced ends as OpenAI and vLLM end it: "stop", whole or streamed
    assert named.choices[0].finish_reason == "stop"
    forced = asking_tools(tools=[WEATHER, TIME], tool_choice=named_choice("weather"))
    [call], reason = streamed_calls(chat, forced)
    assert call.function.name == "weather" and reason == "stop"


def named_choice(name):
    return {"type": "function", "function": {"name": name}}


def asking_tools(**fields):
    """A sampled chat request to the tools' model, with `fields`."""
    return {"model": TOOLS_MODEL, "messages": ASK, **SAMPLED, "max_tokens": 120, **fields}


def streamed_calls(chat, asked):
    """A streamed answer's calls (they come whole, in one chunk) and its finish reason."""
    chunks = list(chat.chat.completions.create(**asked, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(calls) == 1
    return calls[0], chunks[-1].choices[0].finish_reason


def test_stop_sequences_never_cut_a_call_or_json_held_by_a_grammar(more_servers):
    """smolagents' ToolCallingAgent sends `stop` beside required calls: a stop in the
    arguments ("paris" holds "ar") cut the call into words (finish "stop", no call);
    the grammar says where a JSON answer ends."""
    chat = client(more_servers["tools"])
    for stream in (False, True):
        asked = asking_tools(tools=[WEATHER], tool_choice="required", stop=['"', "ar", "om"])
        if stream:
            [call], reason = streamed_calls(chat, asked)
        else:
            [choice] = chat.chat.completions.create(**asked).choices
            [call], reason = choice.message.tool_calls, choice.finish_reason
        assert reason == "tool_calls" and json.loads(call.function.arguments)["city"] in (
            "paris",
            "rome",
        )
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    formatted = chat.chat.completions.create(
        **asking_tools(response_format=person, stop=["}", ","], max_tokens=200)
    )
    assert json.loads(formatted.choices[0].message.content).keys() == {"name", "age"}


def test_stop_sequences_end_words_where_the_answer_may_call_tools(more_servers):
    """With tools and "auto" (the default), an answer in words stops before a stop
    sequence, whole and streamed, as a plain answer does: ReAct agents send
    `stop: ["Observation:"]` beside their tools, and the stops were dropped."""
    chat = client(more_servers["tools"])
    asked = asking_tools(tools=[WEATHER])
    for seed in range(11, 60):  # a seed whose answer is words
        words = chat.chat.completions.create(**{**asked, "seed": seed}).choices[0].message
        if words.content and len(words.content) > 8:
            break
    stop = words.content[4:7]
    asked = {**asked, "seed": seed, "stop": [stop]}
    [choice] = chat.chat.completions.create(**asked).choices
    cut = words.content[: words.content.index(stop)]
    assert (choice.message.content, choice.finish_reason) == (cut, "stop")
    chunks = list(chat.chat.completions.create(**asked, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert (streamed, chunks[-1].choices[0].finish_reason) == (cut, "stop")


def test_a_call_cut_by_max_tokens_is_a_call_as_far_as_it_came(more_servers):
    """As OpenAI's: the call, its arguments cut, finish "length"; the grammar's
    {"name": ...} never reaches the content. Cut before its name came whole, the call
    the request named is that one's, its arguments "" (it was no call at all)."""
    chat = client(more_servers["tools"])
    named = {"tools": [WEATHER], "tool_choice": named_choice("weather"), "temperature": 0}
    whole = chat.chat.completions.create(**asking_tools(**named)).usage.completion_tokens
    for cut in (1, 4, whole - 3):  # before the call's name came whole; in its arguments
        asked = asking_tools(**named, max_tokens=cut)
        [choice] = chat.chat.completions.create(**asked).choices
        assert choice.finish_reason == "length" and not choice.message.content
        calls = choice.message.tool_calls or []
        assert [call.function.name for call in calls] == ["weather"]
        if cut > 4:
            assert calls[0].function.arguments.startswith('{"city')
        else:
            assert calls[0].function.arguments == ""
    [streamed], reason = streamed_calls(chat, asked)
    assert reason == "length" and streamed.function.name == "weather"
    assert streamed.function.arguments == calls[0].function.arguments


def test_a_streamed_tool_call_comes_whole_in_one_chunk(more_servers):
    chat = client(more_servers["tools"])
    asked = asking_tools(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    whole = chat.chat.completions.create(**asked)
    [call], reason = streamed_calls(chat, asked)
    assert call.index == 0 and call.function.name == "weather"
    assert call.function.arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert reason == "tool_calls"
    # no words: content null from the first chunk, as the whole answer's (the SDK's
    # stream helper built content "" of a first chunk's "")
    with chat.beta.chat.completions.stream(**asked) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content is None and whole.choices[0].message.content is None
    assert final.choices[0].message.tool_calls[0].function.name == "weather"


def test_an_answer_calls_several_tools_where_parallel_tool_calls_allows(more_servers):
    chat = client(more_servers["tools"])
    asked = asking_tools(tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    del asked["seed"]

    def calls(seed, **extra):
        answer = chat.chat.completions.create(**asked, **extra, seed=seed)
        assert answer.choices[0].finish_reason == "tool_calls", answer
        return answer.choices[0].message.tool_calls

    for seed in range(6):  # one call each where the client says so
        assert len(calls(seed, parallel_tool_calls=False)) == 1
    for seed in range(16):  # (a random model writes a list or a call, as it picks)
        several = calls(seed)
        if len(several) > 1:
            break
    else:
        pytest.fail("no seed of 16 answered with several calls")
    assert len({call.id for call in several}) == len(several)
    for call in several:
        assert call.function.name in ("weather", "time")
        if call.function.name == "weather":
            assert json.loads(call.function.arguments)["city"] in ("paris", "rome")
    streamed, reason = streamed_calls(chat, {**asked, "seed": seed})
    assert [call.index for call in streamed] == list(range(len(several)))
    assert [c.function.model_dump() for c in streamed] == [c.function.model_dump() for c in several]
    assert reason == "tool_calls"


def test_the_older_functions_call_one_as_the_messages_function_call(more_servers):
    chat = client(more_servers["tools"])
    functions = [WEATHER["function"], TIME["function"]]
    asked = asking_tools(functions=functions, function_call={"name": "weather"})
    answer = chat.chat.completions.create(**asked)
    [choice] = answer.choices
    # (a call forced ends with "stop", as OpenAI ends it)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "weather"
    assert json.loads(choice.message.function_call.arguments)["city"] in ("paris", "rome")
    chunks = list(chat.chat.completions.create(**asked, stream=True))
    called = [c.choices[0].delta.function_call for c in chunks if c.choices[0].delta.function_call]
    assert [c.model_dump() for c in called] == [choice.message.function_call.model_dump()]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the call and the function's answer, in the older form, and the conversation goes on
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": called[0].model_dump()},
        {"role": "function", "name": "weather", "content": "sunny, 21 degrees"},
    ]
    words = chat.chat.completions.create(
        model=TOOLS_MODEL, messages=conversation, functions=asked["functions"], max_tokens=5
    )
    assert words.choices[0].finish_reason in ("stop", "length", "function_call")


def test_auto_answers_in_words_or_with_a_call(more_servers):
    chat = client(more_servers["tools"])
    for seed in range(4):
        answer = chat.chat.completions.create(
            model=TOOLS_MODEL,
            messages=ASK,
            tools=[WEATHER],
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        [choice] = answer.choices
        if choice.message.tool_calls:
            assert choice.message.content is None
            if choice.finish_reason != "length":  # (else a call cut, as far as it came)
                assert choice.finish_reason == "tool_calls"
                assert json.loads(choice.message.tool_calls[0].function.arguments)["city"]
        else:
            assert isinstance(choice.message.content, str)
            assert choice.finish_reason in ("stop", "length")


def test_streamed_words_with_tools_come_as_they_are_written(more_servers):
    chat = client(more_servers["tools"])
    asked = {"model": TOOLS_MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 80}
    for seed in range(12):  # a seed whose answer is words (a random model picks either)
        whole = chat.chat.completions.create(**asked, temperature=1.0, seed=seed)
        content = whole.choices[0].message.content
        if content and not content.startswith(("{", "[")):  # (not a call cut short)
            break
    else:
        pytest.fail("no seed of 12 answered in words")
    chunks = list(chat.chat.completions.create(**asked, temperature=1.0, seed=seed, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == whole.choices[0].message.content
    assert len(texts) > 1  # as they came, not whole at the end
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_with_tools_and_a_response_format_an_answer_calls_or_follows_the_format(more_servers):
    """What agent SDKs send (openai-agents, pydantic-ai, LangChain's structured output on
    a tool-using agent): tools, and the final answer's format. It was a 400."""
    chat = client(more_servers["tools"])
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    asked = asking_tools(tools=[WEATHER], response_format=person, n=4, max_tokens=160)
    whole = chat.chat.completions.create(**asked)
    chunks = list(chat.chat.completions.create(**asked, stream=True))
    streamed = [
        choice.message.model_copy(update={"content": "", "tool_calls": None})
        for choice in whole.choices
    ]
    reasons = [None] * 4
    for chunk in chunks:
        [choice] = chunk.choices
        streamed[choice.index].content += choice.delta.content or ""
        streamed[choice.index].tool_calls = (
            choice.delta.tool_calls or streamed[choice.index].tool_calls
        )
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    answers = [(c.message, c.finish_reason) for c in whole.choices] + list(
        zip(streamed, reasons, strict=True)
    )
    # the format's JSON is streamed as written, the same as whole
    assert [m.content or "" for m in streamed] == [c.message.content or "" for c in whole.choices]
    for message, reason in answers:
        if message.tool_calls:
            assert reason == "tool_calls" and not message.content
            assert json.loads(message.tool_calls[0].function.arguments)["city"]
        elif reason == "stop":
            answer = json.loads(message.content)
            assert set(answer) == {"name", "age"} and isinstance(answer["age"], int), answer
    # where a call is required, the calls hold the answer (the format is for none)
    required = chat.chat.completions.create(
        **asking_tools(tools=[WEATHER], tool_choice="required", response_format=person)
    )
    assert required.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_a_call_and_its_answer_goes_on(servers):
    chat = client(servers["chat"])
    conversation = [
        {"role": "user", "content": "weather in paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    answer = chat.chat.completions.create(
        model=CHAT_MODEL, messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": "required"}, "offers no tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        (
            {"tools": [WEATHER], "response_format": {"type": "regex", "value": "a+"}},
            "a regular expression cannot hold an answer that may call tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "two tools are named weather"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "a function's name"),
        ({"tools": [{"type": "retrieval"}]}, "each tool must be"),
        # (a text is a function's name, as TGI reads it)
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, '"tool_choice" names sometimes'),
        (
            {"functions": [WEATHER["function"]], "tools": [WEATHER]},
            '"tools" and "functions" cannot be given together',
        ),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "x"}}, "names x"),
        ({"functions": [WEATHER]}, 'each function must be {"name", "description", "parameters"}'),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "g", "parameters": {"type": "string"}},
                    }
                ]
            },
            'the parameters of g must be a schema of an object ("type": "object"), not "string"',
        ),
    ],
    ids=[
        *("no-tools", "unknown", "with-regex", "twice", "name", "kind", "choice"),
        *("functions-and-tools", "function-unknown", "function-as-tool", "not-an-object"),
    ],
)
def test_tools_that_cannot_be_offered_are_400(servers, extra, message):
    document = {"messages": MESSAGES, "max_tokens": 5, **extra}
    status, body = servers["chat"].post_json(document, "/v1/chat/completions")
    assert status == 400 and message in body["error"]["message"], body
    assert body["error"]["param"] in extra  # a field of the request: agents read it


# --- several choices ----------------------------------------------------------------------


def test_several_choices_follow_each_prompt_each_seeded_one_further(servers):
    plain = client(servers["plain"])
    prompts = [PROMPT, "paris is a city"]
    answer = plain.completions.create(model=PLAIN_MODEL, prompt=prompts, n=3, **SAMPLED)
    assert [c.index for c in answer.choices] == list(range(6))
    alone = {
        (i, j): plain.completions.create(
            model=PLAIN_MODEL, prompt=prompt, **{**SAMPLED, "seed": SAMPLED["seed"] + j}
        )
        for i, prompt in enumerate(prompts)
        for j in range(3)
    }
    for (i, j), single in alone.items():
        assert answer.choices[i * 3 + j].text == single.choices[0].text
    assert len({answer.choices[j].text for j in range(3)}) > 1  # each its own sample
    # a prompt is read once, however many choices follow it
    assert answer.usage.prompt_tokens == alone[0, 0].usage.prompt_tokens + (
        alone[1, 0].usage.prompt_tokens
    )
    assert answer.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone.values())
    greedy = plain.completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, n=2, max_tokens=8, temperature=0
    )
    assert greedy.choices[0].text == greedy.choices[1].text  # one likeliest continuation


def test_several_streamed_choices_send_what_the_whole_answer_holds(servers):
    chat = client(servers["chat"])
    asked = {"model": CHAT_MODEL, "messages": MESSAGES, "n": 3, "logprobs": True, **SAMPLED}
    whole = chat.chat.completions.create(**asked)
    chunks = list(
        chat.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    roles, finishes, listed = set(), {}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.logprobs:
            listed.setdefault(choice.index, []).extend(t.token for t in choice.logprobs.content)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and set(finishes) == {0, 1, 2}
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert finishes[choice.index] == choice.finish_reason
        assert listed.get(choice.index, []) == [t.token for t in choice.logprobs.content]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.parametrize("n", [0, 129, "2", True, 1.5], ids=repr)
def test_a_choice_count_outside_1_to_128_is_400(servers, n):
    status, body = servers["plain"].post_json({"prompt": PROMPT, "n": n}, "/v1/completions")
    assert status == 400 and '"n"' in body["error"]["message"], body


def test_more_choices_than_a_request_may_carry_is_413(servers):
    document = {"messages": MESSAGES, "n": 5}  # this server takes 4 inputs a request
    status, body = servers["chat"].post_json(document, "/v1/chat/completions")
    assert status == 413 and "5 choices" in body["error"]["message"], body
    assert body["error"]["param"] == "n"
    document = {"prompt": [PROMPT, PROMPT], "n": 3}
    status, body = servers["chat"].post_json(document, "/v1/completions")
    assert status == 413 and "6 choices" in body["error"]["message"], body
    assert body["error"]["param"] == "n"


# --- completions ----------------------------------------------------------------------


def test_completion_answers_the_greedy_continuation_with_real_usage(servers, reference):
    answer = client(servers["plain"]).completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=10, temperature=0
    )
    ids = reference.tokenizer("text-generation")(PROMPT)["input_ids"]
    text, finish, prompt_tokens, tokens = reference("text-generation", ids, 10)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    [choice] = answer.choices
    assert choice.index == 0 and choice.text == text and choice.finish_reason == finish
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == tokens
    assert answer.usage.total_tokens == prompt_tokens + tokens


def test_completion_length_finish_counts_max_tokens(servers, reference):
    ids = reference.tokenizer("text-generation")(PROMPT)["input_ids"]
    _, finish, _, tokens = reference("text-generation", ids, 5)
    assert finish == "length"  # the tiny model does not stop by itself this early
    answer = client(servers["plain"]).completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=5, temperature=0
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == tokens == 5


def stop_in(text):
    """A stop sequence of 3 plain characters from the second half of `text`, and the
    text before its first occurrence."""
    for start in range(len(text) // 2, len(text) - 3):
        stop = text[start : start + 3]
        if stop.isascii() and stop.strip() and stop.isprintable():
            return stop, text[: text.index(stop)]
    raise AssertionError(f"no plain 3 characters in {text!r}")


# sampled with a seed: the same text every time, varied enough to hold a stop sequence
SAMPLED = {"max_tokens": 30, "temperature": 1.0, "seed": 11}


def test_completion_stops_before_the_stop_sequence(servers):
    plain = client(servers["plain"])
    free = plain.completions.create(model=PLAIN_MODEL, prompt=PROMPT, **SAMPLED)
    assert free.choices[0].finish_reason == "length"
    stop, before = stop_in(free.choices[0].text)
    stopped = plain.completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, stop=[stop, "zzzz"], **SAMPLED
    )
    assert stopped.choices[0].text == before
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < free.usage.completion_tokens
    # a single string is a stop sequence too
    alone = plain.completions.create(model=PLAIN_MODEL, prompt=PROMPT, stop=stop, **SAMPLED)
    assert alone.choices[0].text == before


def test_completion_streamed_with_stop_never_sends_the_stop_text(servers):
    plain = client(servers["plain"])
    free = plain.completions.create(model=PLAIN_MODEL, prompt=PROMPT, **SAMPLED)
    stop, before = stop_in(free.choices[0].text)
    chunks = list(
        plain.completions.create(
            model=PLAIN_MODEL, prompt=PROMPT, stop=stop, stream=True, **SAMPLED
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_several_prompts_streamed_are_the_choices_unstreamed_with_their_usage(servers):
    """OpenAI's completions take a list of prompts streamed too (the SDK's and vLLM's):
    each prompt's choices by index (prompt × n + choice), the texts and usage of the
    same request unstreamed. It was 400, "a streamed completion takes one prompt"."""
    plain = client(servers["plain"])
    prompts = [PROMPT, "another prompt, another answer"]
    asked = {"model": PLAIN_MODEL, "prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0}
    whole = plain.completions.create(**asked)
    options = {"include_usage": True}
    chunks = list(plain.completions.create(**asked, stream=True, stream_options=options))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {choice.index: choice.text for choice in whole.choices}
    assert len(texts) == 4 and texts[0] != texts[2]
    assert chunks[-1].usage == whole.usage


def test_completion_logprobs_are_openais_lists_with_offsets_and_the_chosen_among_the_top(servers):
    plain = client(servers["plain"])
    answer = plain.completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    [choice] = answer.choices
    listed = choice.logprobs
    assert "".join(listed.tokens) == choice.text
    assert len(listed.tokens) == len(listed.token_logprobs) == len(listed.top_logprobs)
    offsets = [sum(len(t) for t in listed.tokens[:i]) for i in range(len(listed.tokens))]
    assert listed.text_offset == offsets
    for token, logprob, top in zip(
        listed.tokens, listed.token_logprobs, listed.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 3  # the 2 likeliest, and the chosen one (greedy: among them)
        assert top[token] == pytest.approx(logprob) and max(top.values()) == pytest.approx(logprob)
    streamed = list(
        plain.completions.create(
            model=PLAIN_MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True
        )
    )
    lists = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for found in lists for t in found.tokens] == listed.tokens
    assert [o for found in lists for o in found.text_offset] == listed.text_offset


@pytest.mark.parametrize(
    "forced",
    [
        {"ignore_eos": True},  # ends of sequence that do not end it: special tokens mid-answer
        {"min_tokens": 2},  # two tokens of text, then the end of sequence
    ],
    ids=["special tokens mid-answer", "an end of sequence after text"],
)
def test_completion_logprobs_list_every_generated_token_as_usage_counts_them(
    servers, reference, forced
):
    """A client slices the list by `completion_tokens` (and sums it for a score): a
    special token is listed with the text it adds to the answer, none."""
    plain = client(servers["plain"])
    eos = str(reference.tokenizer(PLAIN_MODEL).eos_token_id)
    asked = {"model": PLAIN_MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    extra = {"logit_bias": {eos: 100}, **forced}
    answer = plain.completions.create(**asked, logprobs=1, extra_body=extra)
    [choice] = answer.choices
    listed = choice.logprobs
    assert len(listed.tokens) == len(listed.token_logprobs) == answer.usage.completion_tokens
    assert "".join(listed.tokens) == choice.text and listed.tokens[-1] == ""
    assert all(logprob <= 0 for logprob in listed.token_logprobs)
    streamed = list(plain.completions.create(**asked, logprobs=1, stream=True, extra_body=extra))
    lists = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for found in lists for t in found.tokens] == listed.tokens
    assert [p for found in lists for p in found.token_logprobs] == pytest.approx(
        listed.token_logprobs
    )
    chat_eos = str(reference.tokenizer(CHAT_MODEL).eos_token_id)
    chat = client(servers["chat"]).chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        extra_body={**extra, "logit_bias": {chat_eos: 100}},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and content[-1].bytes == []


def test_stream_events_are_written_as_openai_writes_them_and_tgis_as_tgi(servers):
    """OpenAI's and vLLM's `data: {...}`: a parser written by hand looks for "data: "
    (TGI writes `data:{...}`, and its clients read that)."""
    document = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    headers = {"Content-Type": "application/json"}
    _, _, body = servers["plain"].request("POST", "/v1/completions", json.dumps(document), headers)
    events = [event for event in body.decode().split("\n\n") if event]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])
    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    _, _, body = servers["plain"].request("POST", "/generate_stream", json.dumps(tgi), headers)
    assert all(event.startswith("data:{") for event in body.decode().split("\n\n") if event)


def test_a_stop_inside_a_token_lists_that_token_as_the_model_chose_it(servers):
    """The token a stop sequence starts in is listed with its own text (the answer's
    text stops before the stop), not one cut where the stop ends (TGI's answer's)."""
    plain = client(servers["plain"])
    asked = {"model": PLAIN_MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    free = plain.completions.create(**asked, logprobs=0).choices[0].logprobs.tokens
    at, token = next((i, t) for i, t in enumerate(free) if i and len(t.strip()) > 2)
    stop = token.strip()[:2]
    cut = plain.completions.create(**asked, logprobs=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert cut.logprobs.tokens[-1] in free[: at + 1]  # a token the model chose, whole


def test_completion_logprobs_end_where_a_stop_sequence_cuts_the_text(servers):
    plain = client(servers["plain"])
    free = plain.completions.create(model=PLAIN_MODEL, prompt=PROMPT, **SAMPLED)
    stop, before = stop_in(free.choices[0].text)
    for stream in (False, True):
        answered = plain.completions.create(
            model=PLAIN_MODEL, prompt=PROMPT, stop=stop, logprobs=0, stream=stream, **SAMPLED
        )
        chunks = answered if stream else [answered]
        lists = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for found in lists for t in found.tokens]
        offsets = [o for found in lists for o in found.text_offset]
        assert all(found.top_logprobs is None for found in lists)  # no alternatives asked
        assert "".join(tokens).startswith(before) and all(o < len(before) for o in offsets)


def test_completion_echo_scores_the_prompt_with_nothing_generated(servers, reference):
    import torch

    plain = client(servers["plain"])
    answer = plain.completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    [choice] = answer.choices
    listed = choice.logprobs
    assert choice.text == PROMPT and "".join(listed.tokens) == PROMPT
    assert answer.usage.completion_tokens == 0
    assert listed.token_logprobs[0] is None and listed.top_logprobs[0] is None
    # each token's log probability given the ones before it, as the model computes it here
    tokenizer = reference.tokenizer(PLAIN_MODEL)
    model = transformers_model(reference, PLAIN_MODEL)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        scores = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    computed = [float(scores[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert listed.token_logprobs[1:] == pytest.approx(computed, abs=1e-4)
    assert all(len(top) <= 2 for top in listed.top_logprobs[1:])


@pytest.mark.parametrize("as_ids", [True, False], ids=["token ids", "text"])
def test_a_prompt_of_all_the_positions_is_scored_when_nothing_is_generated(servers, as_ids):
    """With max_tokens 0 no token follows the prompt: the model reads a window of all its
    positions (as evaluation harnesses send them), one token more is refused."""
    text = "x" * POSITIONS  # one token a letter
    prompt = [91] * POSITIONS if as_ids else text
    asked = {"echo": True, "logprobs": 1, "max_tokens": 0}
    status, body = servers["plain"].post_json({"prompt": prompt, **asked}, "/v1/completions")
    assert status == 200, body
    assert body["usage"] == {
        "prompt_tokens": POSITIONS,
        "completion_tokens": 0,
        "total_tokens": POSITIONS,
    }
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == POSITIONS
    longer = [91] * (POSITIONS + 1) if as_ids else text + "x"
    status, body = servers["plain"].post_json({"prompt": longer, **asked}, "/v1/completions")
    assert status == 422 and f"at most {POSITIONS} " in body["error"]["message"], body


def test_completion_echo_puts_the_prompt_before_the_completion_that_stops_alone(servers):
    plain = client(servers["plain"])
    free = plain.completions.create(model=PLAIN_MODEL, prompt=PROMPT, **SAMPLED)
    stop, before = stop_in(free.choices[0].text)
    # the prompt holds the stop sequence too: the stop cuts the completion only
    prompt = f"{PROMPT}{stop}"
    alone = plain.completions.create(model=PLAIN_MODEL, prompt=prompt, stop=stop, **SAMPLED)
    echoed = plain.completions.create(
        model=PLAIN_MODEL, prompt=prompt, stop=stop, echo=True, logprobs=0, **SAMPLED
    )
    assert echoed.choices[0].text == prompt + alone.choices[0].text
    listed = echoed.choices[0].logprobs
    assert "".join(listed.tokens).startswith(echoed.choices[0].text)
    assert listed.text_offset[0] == 0 and listed.token_logprobs[0] is None


def test_a_streamed_echo_sends_the_prompt_first_then_the_completion_as_unstreamed(
    servers, reference
):
    plain = client(servers["plain"])
    asked = {"model": PLAIN_MODEL, "echo": True, "n": 2, **SAMPLED}
    whole = plain.completions.create(prompt=PROMPT, **asked)
    chunks = list(plain.completions.create(prompt=PROMPT, stream=True, **asked))
    for index, choice in enumerate(whole.choices):
        texts = [c.choices[0].text for c in chunks if c.choices[0].index == index]
        assert texts[0] == PROMPT and "".join(texts) == choice.text
    # token ids are echoed as the text they decode to; nothing generated, the prompt alone
    ids = reference.tokenizer(PLAIN_MODEL)(PROMPT)["input_ids"]
    chunks = list(plain.completions.create(prompt=ids, stream=True, **{**asked, "max_tokens": 0}))
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks if c.choices[0].text] == [
        (0, PROMPT),
        (1, PROMPT),
    ]
    status, body = servers["plain"].post_json(
        {"prompt": PROMPT, "echo": True, "logprobs": 0, "stream": True}, "/v1/completions"
    )
    assert status == 400 and '"echo" with "logprobs"' in body["error"]["message"], body
    assert body["error"]["param"] == "echo"


def test_completion_of_several_prompts_answers_a_choice_each_in_order(servers):
    plain = client(servers["plain"])
    prompts = ["the movie was", "paris is a city", "hello"]
    alone = [
        plain.completions.create(model=PLAIN_MODEL, prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    together = plain.completions.create(
        model=PLAIN_MODEL, prompt=prompts, max_tokens=6, temperature=0
    )
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_completion_takes_token_ids_as_the_text_they_encode(servers, reference):
    plain = client(servers["plain"])
    tokenizer = reference.tokenizer(PLAIN_MODEL)
    prompts = [PROMPT, "paris is a city"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    by_text = plain.completions.create(
        model=PLAIN_MODEL, prompt=prompts, max_tokens=6, temperature=0
    )
    by_ids = plain.completions.create(model=PLAIN_MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    one = plain.completions.create(
        model=PLAIN_MODEL, prompt=ids[0], max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in one) == by_text.choices[0].text


def test_completion_scores_token_ids_as_an_evaluation_harness_reads_them(servers, reference):
    """lm-evaluation-harness's `local-completions` (its default, tokenized requests) sends
    context and continuation as ids, `max_tokens` 1, `echo` and `logprobs` 1, and sums
    `token_logprobs[ctxlen:-1]`: one entry per id it sent, a special token's too."""
    import torch

    tokenizer = reference.tokenizer(PLAIN_MODEL)
    context = [tokenizer.eos_token_id, *tokenizer("the movie was")["input_ids"]]
    continuation = tokenizer(" good")["input_ids"]
    ids = context + continuation
    payload = {
        "model": PLAIN_MODEL,
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, body = servers["plain"].post_json(payload, "/v1/completions")
    assert status == 200, body
    [choice] = body["choices"]
    listed = choice["logprobs"]
    assert len(listed["token_logprobs"]) == len(ids) + 1  # the prompt's, then the new one
    assert listed["token_logprobs"][0] is None and listed["tokens"][0] == tokenizer.eos_token
    assert choice["text"].startswith(tokenizer.decode(ids))
    model = transformers_model(reference, PLAIN_MODEL)
    with torch.inference_mode():
        scores = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    computed = [float(scores[i - 1, ids[i]]) for i in range(len(context), len(ids))]
    ctxlen = len(context)
    assert listed["token_logprobs"][ctxlen:-1] == pytest.approx(computed, abs=1e-4)
    for logprob, top in zip(
        listed["token_logprobs"][ctxlen:-1], listed["top_logprobs"][ctxlen:-1], strict=True
    ):
        assert logprob in top.values() and len(top) <= 2  # the chosen, and the likeliest


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"prompt": [[]]}, "has none"),
        ({"prompt": [[5], []]}, 'token ids in "prompt" at index 1 has none'),
        ({"prompt": ["a", " "]}, 'a text of "prompt" at index 1 is empty'),
        ({"prompt": [[5], [6, 10**9]]}, 'id 1000000000 of "prompt" at index 1 is not in'),
        ({"prompt": [5, 10**9]}, "token id 1000000000 is not in the model's vocabulary"),
        ({"prompt": [5, 10**9], "echo": True, "max_tokens": 0}, "1000000000 is not in the"),
        ({"prompt": [5] * 300}, "leave room for one new token"),
        # found by the worker, before the first token: its status, not a stream of an error
        ({"prompt": [5, 10**9], "stream": True}, "token id 1000000000 is not in the"),
        (
            {"prompt": "a", "guided_json": {"$ref": "#"}, "stream": True},
            "the grammar cannot be used",
        ),
    ],
    ids=[
        *("empty", "one-empty", "one-blank", "unknown-id-of-two", "unknown-id"),
        *("unknown-id-echoed", "too-long"),
        *("unknown-id-streamed", "unusable-grammar-streamed"),
    ],
)
def test_prompts_and_grammars_that_cannot_be_used_are_422_streamed_or_not(
    servers, document, message
):
    status, body = servers["plain"].post_json(document, "/v1/completions")
    assert status == 422 and message in body["error"]["message"], body


@pytest.mark.parametrize(
    ("route", "document", "param"),
    [
        ("/v1/completions", {"prompt": [5, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [[5], [6, 10**9]], "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"1000000000": 5}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"1000000000": -5}}, "logit_bias"),
    ],
    ids=["prompt", "prompts-streamed", "logit-bias", "chat-logit-bias"],
)
def test_a_token_id_the_model_has_not_is_422_naming_its_field(servers, route, document, param):
    """Checked before the request is queued, against the loaded model's vocabulary, and
    named as vLLM names it (OpenAI's `param`)."""
    chat = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {}
    status, body = servers["chat"].post_json({**chat, **document, "max_tokens": 2}, route)
    assert status == 422 and body["error"]["param"] == param, body
    assert re.search(
        r"1000000000 (of \S+ at index \d )?is not in the model's vocabulary",
        body["error"]["message"],
    ), body


def test_completion_with_more_prompts_than_the_client_cap_is_413(servers):
    status, body = servers["chat"].post_json(
        {"prompt": ["hello"] * 5, "max_tokens": 2}, "/v1/completions"
    )
    assert status == 413 and "5" in body["error"]["message"], body


@pytest.mark.parametrize(
    "document",
    [
        {},
        {"prompt": 5},
        {"prompt": []},
        {"prompt": [1, True]},  # token ids are whole numbers
        {"prompt": [1, -2]},
        {"prompt": [1, 2.5]},
        {"prompt": ["hello", [1, 2]]},  # one form for all
        {"prompt": [[1], "hello"]},
        {"prompt": PROMPT, "best_of": 2, "stream": True},  # (the likeliest known at the end)
        {"prompt": PROMPT, "best_of": 0},
        {"prompt": PROMPT, "best_of": 21},  # (OpenAI's bound)
        {"prompt": PROMPT, "best_of": 1, "n": 3},  # (OpenAI's and vLLM's 400: best_of < n)
        {"prompt": PROMPT, "max_tokens": 0},  # 0 only with echo
        {"prompt": PROMPT, "echo": True, "logprobs": 1, "stream": True},
        {"prompt": PROMPT, "logprobs": 21},
        {"prompt": PROMPT, "suffix": "end"},
        {"prompt": PROMPT, "stream": "yes"},
        {"prompt": PROMPT, "seed": 2**63},  # past OpenAI's signed 64 bits
        {"prompt": PROMPT, "unknown": 1},
    ],
    ids=repr,
)
def test_completion_bad_requests_are_400(servers, document):
    status, body = servers["plain"].post_json(document, "/v1/completions")
    assert status == 400, body


@pytest.mark.parametrize("prompt", ["", "   ", ["hello", " \n"]], ids=repr)
def test_a_blank_prompt_is_422_as_blank_text_is_on_every_route(servers, prompt):
    status, body = servers["plain"].post_json({"prompt": prompt}, "/v1/completions")
    assert status == 422, body
    assert "empty or only whitespace" in body["error"]["message"], body


def test_a_prompt_of_a_zero_width_space_is_generated_from(servers):
    """A byte-level tokenizer reads it as tokens, as OpenAI, vLLM and TGI take it."""
    body = {"prompt": "\u200b", "max_tokens": 2}
    status, answer = servers["plain"].post_json(body, "/v1/completions")
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] >= 1, answer


def test_completion_with_no_body_type_and_bad_json_is_400(servers):
    connection = http.client.HTTPConnection("127.0.0.1", servers["plain"].port, timeout=30)
    try:
        connection.request("POST", "/v1/completions", body=b"{not json")
        response = connection.getresponse()
        assert response.status == 400
        assert json.loads(response.read())["error"]["type"] == "invalid_request_error"
    finally:
        connection.close()


# --- one rule for lengths past the model's positions ------------------------------------

POSITIONS = 256  # the tiny GPT-2's n_positions: a one-token prompt leaves room for 255


@pytest.mark.parametrize(
    ("path", "document", "field"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 256}, '"max_tokens"'),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4000, "stream": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 300}, '"max_tokens"'),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 256, "stream": True},
            '"max_completion_tokens"',
        ),
        ("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 256}}, "max_new_tokens"),
        (
            "/",
            {"inputs": PROMPT, "parameters": {"max_new_tokens": 256}, "stream": True},
            "max_new_tokens",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_more_new_tokens_than_the_positions_allow_is_refused_on_every_route(
    servers, path, document, field
):
    """OpenAI's routes: 400 (OpenAI's invalid request); a generation model's POST /,
    where TGI's clients post: 422 typed "validation", as TGI refuses it."""
    status, body = servers["chat"].post_json(document, path)
    if path.startswith("/v1/"):
        assert status == 400 and body["error"]["param"] == field.strip('"'), body
        message = body["error"]["message"]
    else:
        assert (status, body["error_type"]) == (422, "validation"), body
        message = body["error"]
    assert field in message and f"at most {POSITIONS - 1}" in message, body


def test_new_tokens_within_the_positions_stop_where_the_prompt_leaves_none(servers, reference):
    """The most that may be asked is answered; a prompt that leaves less room than was
    asked ends at the positions, and says so (finish_reason and usage)."""
    answer = client(servers["plain"]).completions.create(
        model=PLAIN_MODEL, prompt=PROMPT, max_tokens=POSITIONS - 1, temperature=0
    )
    prompt_tokens = len(reference.tokenizer("text-generation")(PROMPT)["input_ids"])
    assert answer.usage.prompt_tokens == prompt_tokens
    if answer.choices[0].finish_reason == "length":  # the tiny model may stop by itself
        assert answer.usage.total_tokens == POSITIONS
    assert answer.usage.total_tokens <= POSITIONS


# --- each field's values ------------------------------------------------------------------

# values of the wrong kind, extremes, and a few valid ones (small: each 200 generates)
FIELD_VALUES = [
    0, -1, 1, 2, 2**63, 2**64, 1e308, -0.0, 1e-30, 1.5, float("nan"), float("inf"),
    -float("inf"), True, False, "3", "", [], {}, ["x"], {"1": 1},
]  # fmt: skip
COMPLETION_FIELDS = [
    "max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "echo", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "min_tokens", "stop", "logit_bias", "ignore_eos",
]  # fmt: skip
CHAT_FIELDS = [
    *COMPLETION_FIELDS[:5],
    "top_logprobs",
    "max_completion_tokens",
    *COMPLETION_FIELDS[7:],
]


def no_constant(name: str) -> None:
    raise AssertionError(f"{name} in an answer: JSON has no such number")


ROUTE_FIELDS = [
    *[("/v1/completions", name) for name in COMPLETION_FIELDS],
    *[("/v1/chat/completions", name) for name in CHAT_FIELDS],
]
SHARES = 3  # each field of each route takes every third value (all of them: ~10 s more)


@pytest.mark.parametrize(
    ("route", "name", "values"),
    [
        (route, name, FIELD_VALUES[place % SHARES :: SHARES])
        for place, (route, name) in enumerate(ROUTE_FIELDS)
    ],
    ids=[f"{route}-{name}" for route, name in ROUTE_FIELDS],
)
def test_any_value_of_a_field_is_answered_well_or_refused_naming_that_field(
    servers, route, name, values
):
    """Every refusal of a field's value names it in the error's `param` (as OpenAI's
    clients read it), whichever check refuses it; an answer has a sane, well-typed body,
    of no more tokens than were asked for. Each field of each route is sent, each with a
    third of the values (in turn: each value goes to a third of the fields)."""
    chat = route.endswith("chat/completions")
    for value in values:
        document = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
        document = {**document, "max_tokens": 2, name: value}
        if name == "max_completion_tokens":
            del document["max_tokens"]
        status, _, raw = servers["chat"].request(
            "POST", route, json.dumps(document).encode(), {"Content-Type": "application/json"}
        )
        body = json.loads(raw, parse_constant=no_constant)
        if isinstance(value, float) and not math.isfinite(value):  # no JSON: the body's fault
            assert status == 400 and "not JSON numbers" in body["error"]["message"], body
            continue
        if status == 200:
            choices = body["choices"]
            asked = value if name == "n" else 1
            assert [choice["index"] for choice in choices] == list(range(asked)), body
            most = value if name in ("max_tokens", "max_completion_tokens") else 2
            assert body["usage"]["completion_tokens"] <= most * asked, (document, body)
            continue
        assert status in (400, 422), (document, body)
        assert body["error"]["param"] == name, (document, body)


def test_invocations_reads_tgis_three_bodies_as_tgis_sagemaker_route_does(servers):
    """SageMaker posts every request to /invocations: TGI answers a body with `inputs` as
    its POST / does (/generate's answer in a list, the prompt and its continuation unless
    the body says otherwise; streamed where it says so), one with `messages` as a chat
    completion and one with `prompt` as a completion, each in its own shape. (It was
    /generate's bare object, the continuation alone: SageMaker code reads
    `[0]["generated_text"]`.)"""
    server = servers["chat"]
    greedy = {"max_new_tokens": 4, "do_sample": False}
    generate = {"inputs": "hello", "parameters": greedy}
    status, body = server.post_json(generate, "/invocations")
    whole = {**generate, "parameters": {**greedy, "return_full_text": True}}
    expected = server.post_json(whole, "/generate")[1]
    assert status == 200 and body == [expected], body
    assert expected["generated_text"].startswith("hello")
    alone = {**generate, "parameters": {**greedy, "return_full_text": False}}
    status, body = server.post_json(alone, "/invocations")
    assert status == 200 and body == [server.post_json(alone, "/generate")[1]]
    status, headers, streamed = server.request(
        "POST",
        "/invocations",
        json.dumps({**generate, "stream": True}),
        {"Content-Type": "application/json"},
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    last = json.loads(streamed.decode().strip().split("\n\n")[-1].removeprefix("data:"))
    assert last["generated_text"] == expected["generated_text"]
    chat = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    status, body = server.post_json(chat, "/invocations")
    assert status == 200 and body["object"] == "chat.completion"
    expected = server.post_json(chat, "/v1/chat/completions")[1]
    assert body["choices"][0]["message"] == expected["choices"][0]["message"]
    status, body = server.post_json({"prompt": "hello", "max_tokens": 4}, "/invocations")
    assert status == 200 and body["object"] == "text_completion"
    # each refused in its own route's shape: TGI's, OpenAI's
    status, body = server.post_json({"inputs": "hello", "parameters": {"top_k": 0}}, "/invocations")
    assert status == 422 and body["error_type"] == "validation"
    status, body = server.post_json({"messages": []}, "/invocations")
    assert status == 400 and body["error"]["param"] == "messages"

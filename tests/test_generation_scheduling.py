"""Generation under the scheduler: what one request must never do to another.

- A prompt that cannot fit the model at all is refused (422) when it is checked, before it
  is queued: it never waits for its deadline, and while it is answered another client of
  the same model is served. So is a chat whose template's turns, or tools, make it so
  (31,000 empty messages; 128 large tools): it never reaches a worker.
- A batch-mate's prompt length never changes another sequence's output: each row gets the
  room its own prompt leaves (a real worker runner on a tiny GPT-2 of 256 positions).
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from tests.server import RunningServer

pytestmark = pytest.mark.slow

POSITIONS = 256  # the tiny GPT-2's (tests/tiny_models.py)
HUGE_PROMPT = "the movie was good " * 50_000  # ~950 KB, far past the positions
LONG_TIMEOUT = 60  # seconds: the over-long prompt's deadline, far from its answer


@pytest.fixture(scope="module")
def server(tiny_model):
    with RunningServer(
        ["--model", tiny_model("text-generation"), "--max-timeout", "120"]
    ).start() as running:
        yield running


def post(server, path, document, timeout=LONG_TIMEOUT):
    status, headers, body = server.request(
        "POST",
        path,
        json.dumps(document),
        {"Content-Type": "application/json", "X-Request-Timeout": str(timeout)},
        timeout=timeout + 30,
    )
    return status, headers, json.loads(body)


def warm(server):
    """Enough answered requests that the scheduler trusts its measured speed (before
    that it sends everything to the worker, which refuses an over-long prompt itself)."""
    for _ in range(4):
        status, _, _ = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4})
        assert status == 200


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/v1/completions", {"prompt": HUGE_PROMPT, "max_tokens": 4}),
        ("/", {"inputs": HUGE_PROMPT, "parameters": {"max_new_tokens": 4}}),
        ("/v1/completions", {"prompt": "word " * POSITIONS, "max_tokens": 4}),  # 2x over
        ("/generate", {"inputs": HUGE_PROMPT, "parameters": {"max_new_tokens": 4}}),  # TGI
        ("/generate_stream", {"inputs": "word " * POSITIONS}),
    ],
)
def test_a_prompt_past_the_positions_is_refused_before_it_queues(server, path, document):
    warm(server)
    others: list[tuple[int, dict]] = []

    def other_client():
        status, headers, _ = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        others.append((status, headers))

    started = time.monotonic()
    status, _, body = post(server, path, document)
    took = time.monotonic() - started
    assert status == 422, body
    assert "leave room for one new token" in json.dumps(body)
    assert took < LONG_TIMEOUT / 2  # answered when checked, not at its deadline
    thread = threading.Thread(target=other_client)
    thread.start()
    thread.join(LONG_TIMEOUT)
    assert others and others[0][0] == 200, others  # the queue never looked full


def test_a_prompt_that_fits_is_still_answered(server):
    status, _, body = post(server, "/v1/completions", {"prompt": "word " * 100, "max_tokens": 4})
    assert status == 200, body


# --- batch-mates ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tiny_model):
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    return CausalLMRunner(tiny_model("text-generation"), "cpu", torch.float32)


def generated(output) -> tuple[str, str, int]:
    details = output[0]["details"]
    return output[0]["generated_text"], details["finish_reason"], details["generated_tokens"]


def test_a_batch_mates_long_prompt_never_shortens_another_sequence(runner):
    short = "the movie was"
    long = "word " * ((POSITIONS - 30) // 2)  # two tokens a word: leaves about 30 positions
    room = POSITIONS - len(runner.tokenizer(long)["input_ids"])
    assert 1 < room < 40
    params = {"max_new_tokens": 40, "do_sample": False, "details": True}
    (alone,) = runner.run([short], params)
    text, finish, tokens = generated(alone)
    assert tokens > room, "the short prompt alone must use more room than the long one has"
    batched = runner.run([short, long], params)
    assert generated(batched[0]) == (text, finish, tokens)
    # the long prompt stops where its own positions end
    long_alone = runner.run([long], params)
    assert generated(batched[1]) == generated(long_alone[0])
    assert generated(batched[1])[1] == "length"


def test_a_prompt_of_all_the_positions_is_scored_on_both_paths(runner):
    """max_new_tokens 0 scores the prompt: every position may hold a prompt token, on the
    static path (`run`) and the continuous loop's (`generation`); one more is refused."""
    params = {"max_new_tokens": 0, "details": True, "decoder_input_details": True}
    params["return_full_text"] = False  # (a prompt of ids, as OpenAI's completions send it)
    full, over = [91] * POSITIONS, [91] * (POSITIONS + 1)
    (output,) = runner.run([full], params)
    assert len(output[0]["details"]["prefill"]) == POSITIONS
    scored = runner.generation("key", full, params)  # scored in the loop, with no row
    loop = batcher(runner)
    loop.add(scored)
    while loop.busy:
        loop.step()
    assert len(scored.prefill) == POSITIONS and scored.finish_reason == "length"
    with pytest.raises(ValueError, match=f"at most {POSITIONS} "):
        runner.run([over], params)
    with pytest.raises(ValueError, match=f"at most {POSITIONS} "):
        runner.generation("key", over, params)


# --- continuous batching ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_tokenizer(runner):
    return runner.model, runner.tokenizer


def batcher(runner, max_rows=64, on_token=None):
    from rawserve.worker.continuous import ContinuousBatcher

    return ContinuousBatcher(runner.model, runner.tokenizer, POSITIONS, max_rows, on_token)


def alone_greedy(runner, ids: list[int], max_new_tokens: int) -> list[int]:
    """What `generate` makes of one prompt alone, greedy, cut at its end of sequence."""
    import torch

    with torch.inference_mode():
        out = runner.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=runner.tokenizer.pad_token_id,
        )
    tokens = out[0, len(ids) :].tolist()
    eos = runner.tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def run_all(engine) -> list:
    finished = []
    while engine.busy:
        finished += engine.step()
    return finished


def prompt_ids(runner, text):
    return runner.tokenizer(text)["input_ids"]


def test_continuous_outputs_equal_one_at_a_time_greedy_generation(runner):
    from rawserve.worker.continuous import Generation

    texts = ["the movie was", "word " * 60, "a", "good film, bad film " * 5, "word " * 110]
    asks = [40, 12, 30, 25, 60]
    engine = batcher(runner, max_rows=3)  # some join only when others leave
    generations = [
        Generation(i, prompt_ids(runner, t), n)
        for i, (t, n) in enumerate(zip(texts, asks, strict=True))
    ]
    for generation in generations:
        engine.add(generation)
    finished = run_all(engine)
    assert sorted(g.key for g in finished) == list(range(len(texts)))
    for generation, text, asked in zip(generations, texts, asks, strict=True):
        ids = prompt_ids(runner, text)
        room = POSITIONS - len(ids)
        assert generation.tokens == alone_greedy(runner, ids, min(asked, room)), text[:20]


def test_outputs_stay_those_of_generate_when_the_cache_grows_and_compacts(runner, monkeypatch):
    from rawserve.worker import kv_slots
    from rawserve.worker.continuous import Generation

    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", 2)  # it starts small and moves
    texts = ["the movie was", "a", "good film", "word " * 8, "bad", "the end of it", "x y"]
    asks = [90, 5, 60, 9, 120, 3, 70]
    engine = batcher(runner, max_rows=4)  # rows leave in the middle and others join
    generations = [
        Generation(i, prompt_ids(runner, t), n)
        for i, (t, n) in enumerate(zip(texts, asks, strict=True))
    ]
    for generation in generations:
        engine.add(generation)
    run_all(engine)
    for generation, text, asked in zip(generations, texts, asks, strict=True):
        expected = alone_greedy(runner, prompt_ids(runner, text), asked)
        assert generation.tokens == expected, text


def test_a_cpu_workers_cache_goes_once_no_row_runs_and_comes_back_for_the_next(runner):
    """On a CPU the batch's KV buffers, grown by a burst of long prompts, were kept for
    good (a tester: the worker never went back below the burst's memory); they go once
    the last row leaves, and the next sequence answers as it would alone."""
    from rawserve.worker.continuous import Generation

    engine = batcher(runner, max_rows=8)
    for index in range(8):
        engine.add(Generation(index, prompt_ids(runner, f"word {index} " * 50), 20))
    engine.step()
    rows, columns = engine._slots.capacity
    assert rows == 8 and columns > 100  # grown by the burst
    run_all(engine)
    assert engine._slots.capacity == (0, 0) and not engine._slots.keys
    later = Generation("later", prompt_ids(runner, "the movie was"), 30)
    engine.add(later)
    run_all(engine)
    assert later.tokens == alone_greedy(runner, prompt_ids(runner, "the movie was"), 30)


def test_a_cpu_workers_cache_still_goes_when_idle_after_a_failed_step(runner, monkeypatch):
    """A failed step (running out of memory, most often) rebuilt the buffers without
    their release: kept at their high-water mark for the worker's life after it."""
    from rawserve.worker.continuous import Generation

    engine = batcher(runner, max_rows=8)
    for index in range(4):
        engine.add(Generation(index, prompt_ids(runner, f"word {index} " * 50), 20))
    engine.step()
    monkeypatch.setattr(runner.model, "forward", failing_forward)
    with pytest.raises(RuntimeError):
        engine.step()
    monkeypatch.undo()
    assert len(engine.drop_failed()) == 4
    for index in range(4):
        engine.add(Generation(f"after {index}", prompt_ids(runner, f"word {index} " * 50), 20))
    run_all(engine)
    assert engine._slots.capacity == (0, 0) and not engine._slots.keys


def failing_forward(*args, **kwargs):
    raise RuntimeError("a kernel failed")


def test_a_short_request_joining_a_long_one_finishes_first(runner):
    from rawserve.worker.continuous import Generation

    engine = batcher(runner)
    long = Generation("long", prompt_ids(runner, "word " * 20), 150)
    short = Generation("short", prompt_ids(runner, "the movie was"), 5)
    engine.add(long)
    for _ in range(3):
        engine.step()
    engine.add(short)
    finished = []
    while not finished:
        finished = engine.step()
    assert [g.key for g in finished] == ["short"]
    assert not long.done and len(long.tokens) < 150


def running_rows(runner, engine, count):
    """`count` long sequences joined and running (a step taken)."""
    from rawserve.worker.continuous import Generation

    for index in range(count):
        ids = prompt_ids(runner, f"word {index}")
        engine.add(Generation(f"row {index}", ids, 150, ignore_eos=True))
    engine.step()
    assert len(engine.rows) == count


def test_with_join_wait_steps_a_lone_joiner_waits_for_company_and_they_join_in_one_prefill(
    runner,
):
    """Beside running rows a joiner waits up to `join_wait_steps` steps, so that the
    joiners who come meanwhile share its prefill (one pass, not one each); their tokens
    are what they would be alone."""
    from rawserve.worker.continuous import Generation

    engine = batcher(runner)
    engine.join_wait_steps = 3
    running_rows(runner, engine, 16)  # two joiners are fewer than a quarter of them
    first = Generation("first", prompt_ids(runner, "the movie was"), 6)
    second = Generation("second", prompt_ids(runner, "a good film"), 6)
    engine.passes.taken()
    engine.add(first)
    engine.step()
    engine.add(second)  # a step later
    for _ in range(2):
        engine.step()
    assert engine.waiting == [first, second] and (first.waited_steps, second.waited_steps) == (3, 2)
    engine.step()  # the first has waited its three steps: both join
    assert first in engine.rows and second in engine.rows and not engine.waiting
    passes = engine.passes.taken()
    assert passes is not None and (passes.prefills, passes.steps) == (1, 4)
    while not (first.done and second.done):
        engine.step()
    for generation, text in ((first, "the movie was"), (second, "a good film")):
        assert generation.tokens == alone_greedy(runner, prompt_ids(runner, text), 6)


def test_without_join_wait_steps_each_joiner_joins_at_the_next_step(runner):
    from rawserve.worker.continuous import Generation

    engine = batcher(runner)
    running_rows(runner, engine, 8)
    first = Generation("first", prompt_ids(runner, "the movie was"), 6)
    engine.add(first)
    engine.step()
    assert first in engine.rows and first.waited_steps == 0


@pytest.mark.parametrize(
    ("rows", "joiners"),
    [(0, 1), (4, 1), (8, 2)],  # idle; a quarter of the rows or more (a wave)
)
def test_a_joiner_with_no_row_running_or_in_a_wave_never_waits(runner, rows, joiners):
    from rawserve.worker.continuous import Generation

    engine = batcher(runner)
    engine.join_wait_steps = 4
    if rows:
        running_rows(runner, engine, rows)
    joining = [
        Generation(f"joiner {index}", prompt_ids(runner, f"a film {index}"), 6)
        for index in range(joiners)
    ]
    for generation in joining:
        engine.add(generation)
    engine.step()
    assert all(generation in engine.rows for generation in joining)


def test_joiners_with_no_prefill_to_share_a_retry_and_a_backlog_never_wait(runner):
    """A copy of a running row's prompt (its keys and values are copied, no pass), a prompt
    prefilled in chunks (a pass of its own), a sequence put back after a failed prefill (it
    has waited), and joiners beyond the free rows (a row left empty would only idle) join
    at the next step."""
    from rawserve.worker.continuous import Generation

    engine = batcher(runner, max_rows=21)
    engine.join_wait_steps = 4
    running_rows(runner, engine, 16)
    [kept, *_] = engine._prompt_scores  # a running row's prompt whose scores are kept
    held = Generation("held", list(kept), 4)
    engine.prefill_chunk = 8  # a prompt past it is prefilled in chunks
    long = Generation("long", prompt_ids(runner, "word " * 12), 4)
    retried = Generation("retried", prompt_ids(runner, "the movie was"), 4)
    for generation in (held, long):
        engine.add(generation)
    engine.step()
    assert held in engine.rows and engine._chunked is not None and not engine.waiting
    engine.add(retried)
    engine.waiting.remove(retried)
    engine.wait_again([retried])  # as after running out of memory
    engine.step()
    assert retried in engine.rows
    backlog = [Generation(f"b{i}", prompt_ids(runner, f"a film {i}"), 4) for i in range(3)]
    for generation in backlog:  # three for two free rows (18 run, one prefills in chunks)
        engine.add(generation)
    engine.step()
    assert sum(generation in engine.rows for generation in backlog) == 2


def test_a_cancelled_sequence_frees_its_row_at_the_next_step(runner):
    from rawserve.worker.continuous import Generation

    engine = batcher(runner, max_rows=1)
    first = Generation("first", prompt_ids(runner, "the movie was"), 200)
    second = Generation("second", prompt_ids(runner, "a good film"), 5)
    engine.add(first)
    engine.add(second)
    engine.step()
    assert engine.rows == [first] and engine.waiting == [second]
    engine.cancel("first")
    finished = engine.step()
    assert finished == [first] and first.finish_reason == "cancelled"
    assert engine.rows == [second]  # it joined in the same step


def test_each_sequence_keeps_its_own_seed_whatever_its_batch_mates(runner):
    from rawserve.worker.continuous import Generation

    def sampled(mates: int) -> list[int]:
        engine = batcher(runner)
        mine = Generation("mine", prompt_ids(runner, "the movie was"), 20, True, seed=7)
        engine.add(mine)
        for n in range(mates):
            engine.add(Generation(n, prompt_ids(runner, "word " * (n + 1)), 20, True, seed=n))
        run_all(engine)
        return mine.tokens

    assert sampled(0) == sampled(3)


def test_stop_sequences_and_positions_end_a_row(runner):
    from rawserve.worker.continuous import Generation

    engine = batcher(runner)
    ids = prompt_ids(runner, "word " * 120)
    near_end = Generation("end", ids, 100)
    engine.add(near_end)
    run_all(engine)
    room = POSITIONS - len(ids)
    assert len(near_end.tokens) <= room
    if near_end.finish_reason == "length":
        assert len(near_end.tokens) == room
    greedy = alone_greedy(runner, prompt_ids(runner, "the movie was"), 30)
    text = runner.tokenizer.decode(greedy, skip_special_tokens=True)
    stop = text.strip()[:3]
    if stop:
        stopped = Generation("stop", prompt_ids(runner, "the movie was"), 30, stop=[stop])
        engine.add(stopped)
        run_all(engine)
        assert stopped.finish_reason == "stop_sequence"


# --- the prompt check, without a server --------------------------------------------------


class FakeServing:
    def __init__(
        self, tokenizer_json: str, positions: int, drops_reasoning: bool = False, **template
    ):
        from types import SimpleNamespace

        details = {"max_input_length": positions, "chat_drops_reasoning": drops_reasoning}
        self.loaded = SimpleNamespace(tokenizer=tokenizer_json, details={**details, **template})


def check(prompts, chat, positions=64, drops_reasoning=False, scored=False, **template):
    import asyncio

    from rawserve.api.prompts import check_lengths
    from rawserve.api.served import ServedModel
    from rawserve.api.tokens import ServerTokenizers
    from tests.tiny_models import bpe_tokenizer

    tokenizer = bpe_tokenizer().backend_tokenizer.to_str()
    serving = FakeServing(tokenizer, positions, drops_reasoning, **template)
    model = ServedModel("m", serving)  # type: ignore[arg-type]
    asyncio.run(check_lengths(ServerTokenizers(), model, prompts, chat, scored))


# what litellm looks for in an error's words to raise ContextWindowExceededError (which its
# Router's `context_window_fallbacks` act on), one of the phrases it knows from servers
CONTEXT_WINDOW_WORDS = "is longer than the model's context length"


def test_a_prompt_past_the_positions_is_refused_in_words_naming_the_context_length():
    """litellm read rawserve's refusal ("a prompt has more than N tokens") as an
    UnprocessableEntityError, never as the context window exceeded."""
    from rawserve.http.errors import UnprocessableInput

    for scored in (False, True):
        with pytest.raises(UnprocessableInput) as raised:
            check(["word " * 100], chat=False, scored=scored)
        assert CONTEXT_WINDOW_WORDS in str(raised.value)


def test_the_prompt_check_counts_texts_and_chats():
    from rawserve.http.errors import UnprocessableInput

    check(["word " * 10], chat=False)
    with pytest.raises(UnprocessableInput, match="leave room for one new token"):
        check(["word " * 100], chat=False)
    with pytest.raises(UnprocessableInput):
        check(["word " * 200_000], chat=False)  # counted a piece at a time, in a thread
    chat = {"messages": [{"role": "user", "content": "word " * 10}]}
    check([chat], chat=True)
    huge = {"messages": [{"role": "user", "content": "word " * 100}]}
    with pytest.raises(UnprocessableInput):
        check([huge], chat=True)


def test_a_reasoning_models_chat_is_not_counted_with_the_thinking_its_template_drops():
    from rawserve.http.errors import UnprocessableInput

    thought = {"role": "assistant", "content": "<think>" + "word " * 100 + "</think>\nyes"}
    chat = {
        "messages": [{"role": "user", "content": "hi"}, thought, {"role": "user", "content": "and"}]
    }
    check([chat], chat=True, drops_reasoning=True)  # Qwen3's template keeps only "yes"
    with pytest.raises(UnprocessableInput):  # a template that keeps it all
        check([chat], chat=True)
    said = {"role": "user", "content": "<think>" + "word " * 100 + "</think>"}
    with pytest.raises(UnprocessableInput):  # only an answer's thinking is dropped
        check([{"messages": [said]}], chat=True, drops_reasoning=True)


def test_the_prompt_check_counts_token_ids_as_they_are():
    from rawserve.http.errors import UnprocessableInput

    check([[5] * 63], chat=False)  # one position left for the new token
    with pytest.raises(UnprocessableInput, match="at most 63 tokens"):
        check([[5] * 2, [5] * 64], chat=False)


# --- a chat's template: its turns and tools ----------------------------------------------

# the tiny chat model's template (tests/tiny_models.py): `<s>user\n...</s>\n` a message
CHAT_TURN = 7
EMPTY_MESSAGE = {"role": "user", "content": ""}


def large_tools(count: int, parameters: int = 25) -> list[dict]:
    """The report's tools: `count` of them, each with `parameters` enum parameters."""
    enum = {"type": "string", "enum": [f"value_{i}" for i in range(10)]}
    properties = {f"parameter_{p}": {**enum, "description": "one of"} for p in range(parameters)}
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{t}",
                "description": "a tool of the report",
                "parameters": {"type": "object", "properties": properties},
            },
        }
        for t in range(count)
    ]


@pytest.fixture(scope="module")
def chat_runner(tiny_model):
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    return CausalLMRunner(tiny_model("chat"), "cpu", torch.float32)


def test_a_worker_reports_what_its_chat_template_adds(chat_runner):
    assert chat_runner.details["chat_message_tokens"] == CHAT_TURN
    assert chat_runner.details["chat_tools_json"]  # (described by the worker: JSON)


@pytest.mark.parametrize(
    "template",
    [
        # system messages dropped: a message may add nothing
        "{% for m in messages %}{% if m['role'] != 'system' %}<s>{{ m['content'] }}</s>"
        "{% endif %}{% endfor %}",
        # only the last message rendered
        "<s>{{ messages[-1]['content'] }}</s>",
    ],
)
def test_a_template_that_may_drop_a_message_is_counted_no_turn(tiny_model, template):
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=template)
    assert runner.details["chat_message_tokens"] == 0


# tool answers in a row written in one turn, as Qwen's templates write them
GROUPED_TOOLS = (
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<s>tool\n{% endif %}"
    "{{ m.content }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}</s>\n{% endif %}"
    "{% else %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_a_template_that_groups_a_run_of_tool_answers_is_counted_as_it_writes_them(tiny_model):
    """A second tool answer adds no turn of its own here: counted at a turn each, a chat
    of 60 empty answers (83 tokens) was refused as longer than the model's 255."""
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=GROUPED_TOOLS)
    chat = [{"role": "user", "content": ""}] + [
        {"role": "tool", "content": "", "tool_call_id": "c"} for _ in range(60)
    ]
    written = len(runner.chat.plain_ids(chat))
    counted = runner.details["chat_message_tokens"] * len(chat)
    assert counted <= written


# a template that keeps the last four messages (Phi-3's and others' windows), and one that
# writes no system message (Phi-3-mini's first): a tester's, each refused a chat it fitted
LAST_FOUR = "{% for m in messages[-4:] %}<s>{{ m['content'] }}</s>{% endfor %}"
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}<s>{{ m['content'] }}"
    "</s>{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "roles"), [(LAST_FOUR, []), (NO_SYSTEM, ["user", "assistant"])]
)
def test_the_server_counts_only_the_messages_a_template_writes(tiny_model, template, roles):
    """99 messages under a template that writes the last four were counted whole (each
    message's turn and text: 422) where the prompt was 50 tokens; a system message of 300
    words under one that writes none was counted, where the prompt was 17 tokens."""
    import torch

    from rawserve.api.prompts import chat_count
    from rawserve.worker.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=template)
    assert runner.details["chat_counted_roles"] == roles
    turns = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(99)]
    system = {"role": "system", "content": "hello there " * 150}
    fitting = 0
    for messages in (turns, [system, {"role": "user", "content": "hi"}]):
        count = chat_count({"messages": messages}, runner.details)
        ids = runner.prompt_ids({"messages": messages}, {"chat": True})
        texts = len(runner.tokenizer(count.text)["input_ids"]) if count.text else 0
        assert count.added + max(texts - count.slack, 0) <= len(ids)
        fitting += len(ids) < 256
        if len(ids) < 256:  # it fits: let by (99 turns under the last four's: 50 tokens)
            reported = {k: v for k, v in runner.details.items() if k.startswith("chat_")}
            check([{"messages": messages}], chat=True, positions=256, **reported)
    assert fitting == 1  # the chat each template was found to refuse


TRIMMED = (
    "{% for m in messages %}<s>{{ m.role }} {{ m.content | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant {% endif %}"
)
CALLS_ALONE = (
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<s>assistant "
    "{% for c in m.tool_calls %}{{ c.function.name }}{% endfor %}</s>"
    "{% else %}<s>{{ m.role }} {{ m.content }}</s>{% endif %}{% endfor %}"
)
LAST_SIXTEEN = "{% for m in messages[-16:] %}<s>{{ m['content'] }}</s>{% endfor %}"
FIRST_SYSTEM = (
    "{% set ns = namespace(done=false) %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% if not ns.done %}<s>{{ m.content }}</s>"
    "{% set ns.done = true %}{% endif %}{% else %}<s>{{ m.content }}</s>{% endif %}"
    "{% endfor %}"
)
STRINGS_ONLY = (
    "{% for m in messages %}<s>{% if m.content is string %}{{ m.content }}{% endif %}</s>"
    "{% endfor %}"
)
LONG = "hello there " * 150
CALL = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("template", "messages"),
    [
        (TRIMMED, [{"role": "user", "content": " \n" * 400 + "hi" + " \n" * 400}]),
        (
            CALLS_ALONE,
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": LONG, "tool_calls": [CALL]},
                {"role": "tool", "content": "1", "tool_call_id": "c0"},
                {"role": "user", "content": "hi"},
            ],
        ),
        (
            LAST_SIXTEEN,
            [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(99)],
        ),
        (
            FIRST_SYSTEM,
            [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": LONG},
                {"role": "user", "content": "hi"},
            ],
        ),
        (STRINGS_ONLY, [{"role": "user", "content": [{"type": "text", "text": LONG}]}]),
    ],
    ids=["trim", "tool-call-alone", "last-sixteen", "first-system", "strings-only"],
)
def test_a_chat_a_template_writes_short_is_never_counted_long(tiny_model, template, messages):
    """A tester's: each chat rendered within the 256 positions and was refused by the
    server, which counted what the template leaves out (blanks it trims, an answer's text
    beside its tool call, messages past a window of 16, a second system message, a list
    of parts)."""
    import torch

    from rawserve.api.prompts import chat_count
    from rawserve.worker.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=template)
    count = chat_count({"messages": messages}, runner.details)
    ids = runner.prompt_ids({"messages": messages}, {"chat": True})
    texts = len(runner.tokenizer(count.text)["input_ids"]) if count.text else 0
    assert count.added + max(texts - count.slack, 0) <= len(ids) < 256
    reported = {k: v for k, v in runner.details.items() if k.startswith("chat_")}
    check([{"messages": messages}], chat=True, positions=256, **reported)


def test_a_template_that_writes_tools_otherwise_has_them_not_counted(tiny_model):
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    names = (
        "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
        "{% for t in tools or [] %}{{ t['function']['name'] }}{% endfor %}"
    )
    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=names)
    assert not runner.details["chat_tools_json"]


@pytest.mark.parametrize(("template", "written"), [(None, True), (STRINGS_ONLY, False)])
def test_a_worker_reports_whether_its_template_writes_lists_of_parts(tiny_model, template, written):
    """The server counts the texts of a list of parts only where the template writes
    them: uncounted under one that does, a chat of parts past the context length was
    queued for the worker to refuse, instead of refused at once."""
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=template)
    assert runner.details["chat_parts_written"] is written


def test_a_role_a_template_writes_in_some_places_only_is_not_counted(tiny_model):
    """A system message written only where it comes first was counted wherever it
    stands: one after the first turns, which the template leaves out, got a chat that
    fitted refused as too long."""
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    first_only = (
        "{% for m in messages %}{% if m.role != 'system' or loop.first %}<s>{{ m.content }}"
        "</s>{% endif %}{% endfor %}"
    )
    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=first_only)
    assert "system" not in runner.details["chat_counted_roles"]
    assert {"user", "assistant"} <= set(runner.details["chat_counted_roles"])


def test_tools_a_template_writes_as_indented_json_are_counted_as_json(tiny_model):
    """Llama 3.1's template writes each tool with tojson(indent=4): its tools went
    uncounted, and a chat its tools made too long was queued for the worker to refuse."""
    import torch

    from rawserve.worker.causal_lm import CausalLMRunner

    indented = (
        "{% for t in tools or [] %}{{ t | tojson(indent=4) }}\n{% endfor %}"
        "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    )
    runner = CausalLMRunner(tiny_model("chat"), "cpu", torch.float32, chat_template=indented)
    assert runner.details["chat_tools_json"] is True


def test_the_server_never_counts_more_than_the_template_renders(chat_runner):
    """The server's count is a lower bound of the rendered prompt's tokens: a chat it
    lets by by a token is still one the template makes at least that long."""
    from rawserve.api.prompts import chat_count

    chats = [
        [EMPTY_MESSAGE] * 30,
        [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}] * 8,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "word " * 40}],
    ]
    for messages in chats:
        for tools in (None, large_tools(1, parameters=1)):
            count = chat_count({"messages": messages, "tools": tools}, chat_runner.details)
            ids = chat_runner.prompt_ids({"messages": messages, "tools": tools}, {"chat": True})
            texts = len(chat_runner.tokenizer(count.text)["input_ids"]) if count.text else 0
            assert count.added + max(texts - count.slack, 0) <= len(ids)


def test_a_chats_turns_and_tools_are_counted_before_it_is_queued():
    """31,000 empty messages (1 MB) were 0 tokens to the server and 217,008 to the template;
    128 tools of 25 enum parameters (584 KB) were 0 and 575,225. Both are refused in the
    server now, the turns without its tokenizer; a chat under the limit is let by."""
    from rawserve.http.errors import UnprocessableInput

    template = {"chat_message_tokens": CHAT_TURN, "chat_tools_json": True}
    many = {"messages": [EMPTY_MESSAGE] * 31_000}
    tooled = {"messages": [{"role": "user", "content": "hi"}], "tools": large_tools(128)}
    for chat in (many, tooled):
        with pytest.raises(UnprocessableInput, match="leave room for one new token"):
            check([chat], chat=True, positions=256, **template)
        check([chat], chat=True, positions=256)  # a worker that reported neither
    check([{"messages": [EMPTY_MESSAGE] * 35}], chat=True, positions=256, **template)
    # tools where no user's message has them (a template may write them into one)
    check([{**tooled, "messages": [{"role": "system", "content": "hi"}]}], True, 256, **template)


@pytest.fixture(scope="module")
def chat_server(tiny_model):
    with RunningServer(["--model", tiny_model("chat"), "--max-timeout", "120"]).start() as running:
        yield running


def batches_run(server) -> float:
    """How many batches the server's workers have run (the batch-size histogram's count)."""
    _, _, body = server.request("GET", "/metrics")
    counts = re.findall(r"^rawserve_batch_size_count\{[^}]*\} (\S+)$", body.decode(), re.M)
    return sum(float(count) for count in counts)


@pytest.mark.parametrize(
    "chat",
    [
        {"messages": [EMPTY_MESSAGE] * 31_000},
        {"messages": [{"role": "user", "content": "hi"}], "tools": large_tools(128)},
    ],
    ids=["31000-messages", "128-large-tools"],
)
def test_a_chat_its_template_makes_too_long_never_reaches_the_worker(chat_server, chat):
    warm(chat_server)
    before = batches_run(chat_server)
    status, _, body = post(chat_server, "/v1/chat/completions", {**chat, "max_tokens": 4})
    assert status == 422, body
    # the server's words ("a prompt is longer"), not the worker's ("the prompt is N tokens")
    assert body["error"]["message"].startswith("a prompt is longer than the model's context")
    assert batches_run(chat_server) == before


def test_a_chat_just_under_the_limit_is_still_answered(chat_server):
    # 35 empty messages: 253 of the 256 positions once rendered
    document = {"messages": [EMPTY_MESSAGE] * 35, "max_tokens": 1}
    status, _, body = post(chat_server, "/v1/chat/completions", document)
    assert status == 200, body

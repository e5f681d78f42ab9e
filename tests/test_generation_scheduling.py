"""Generation under the scheduler: what one request must never do to another.

- A prompt that cannot fit the model at all is refused (422) when it is checked, before it
  is queued: it never waits for its deadline, and while it is answered another client of
  the same model is served.
- A batch-mate's prompt length never changes another sequence's output: each row gets the
  room its own prompt leaves (a real worker runner on a tiny GPT-2 of 256 positions).
"""

from __future__ import annotations

import json
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

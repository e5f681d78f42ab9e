"""Continuous batching served end to end: a real server, a real worker, the tiny GPT-2.

Sequences run side by side in one worker (`--max-sequences`), each with its own cap and
its own output; a client that leaves, or a deadline that passes, frees its row at the
next step; a worker that dies with several sequences running answers every one of them.
The model has 4,096 positions and never ends a sequence by itself, so a generation of
`LONG` tokens runs for seconds: what runs when is read from /info, not guessed from time.
The worker's loop itself is tested in-process in tests/test_generating.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import pytest

from tests.server import RunningServer, started_as_used

pytestmark = pytest.mark.slow

STOPPED = re.compile(r"generation stopped after (\d+) tokens")
LONG = 4000  # new tokens: seconds of generation on the tiny model, even on a fast CPU
ASKS = [("the movie was", 3), ("a long and winding road to", 40), ("hello", 12), ("x y z", 1)]


@pytest.fixture(scope="module")
def started(request, tiny_model):
    """The module's servers its selected tests use, started together."""
    model = tiny_model("long-generation")

    def serving(*extra: str):
        return lambda: RunningServer(
            ["--model", model, *extra, "--threads", "1", "--device", "cpu"]
        )

    with started_as_used(
        request,
        {
            "rows_server": serving("--max-sequences", "8"),
            "one_row_server": serving("--max-sequences", "1"),
            "small_queue_server": serving("--max-sequences", "1", "--max-queue", "2"),
            "gathering_server": serving("--max-sequences", "16", "--join-wait-steps", "3"),
            # its own: its test stops the worker
            "watched_server": serving("--batch-timeout", "1", "--max-sequences", "2"),
        },
    ) as get:
        yield get


@pytest.fixture(scope="module")
def servers(started):
    return {"rows": started("rows_server"), "one row": started("one_row_server")}


@pytest.fixture(scope="module")
def small_queue_server(started):
    return started("small_queue_server")


@pytest.fixture(scope="module")
def watched_server(started):
    return started("watched_server")


def complete(server: RunningServer, prompt: str, tokens: int, **headers: str) -> tuple[int, dict]:
    status, _, body = server.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0}),
        {"Content-Type": "application/json", **headers},
    )
    return status, json.loads(body)


def streamed(prompt: str, tokens: int) -> str:
    """A greedy streamed completion: the model never ends it before `tokens`."""
    document = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    return json.dumps(document)


def start_stream(
    server: RunningServer, prompt: str, tokens: int, deadline: float | None = None
) -> socket.socket:
    """A stream whose first bytes have arrived (the sequence is running); `deadline`:
    its X-Request-Timeout, if any."""
    body = streamed(prompt, tokens).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    asked = f"X-Request-Timeout: {deadline:g}\r\n" if deadline else ""
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"{asked}Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    return sock


def test_info_shows_the_sequences_each_worker_runs_at_once(servers):
    for name, rows in (("rows", 8), ("one row", 1)):
        status, _, body = servers[name].request("GET", "/info")
        [worker] = json.loads(body)["workers"]
        assert status == 200 and worker["max_sequences"] == rows, worker
        assert worker["running_sequences"] == 0


def test_sequences_side_by_side_answer_as_they_do_alone(servers):
    """Each keeps its own cap and its output never depends on its batch-mates."""
    server = servers["rows"]
    alone = [complete(server, prompt, tokens) for prompt, tokens in ASKS]
    with ThreadPoolExecutor(len(ASKS) * 3) as pool:
        together = list(pool.map(lambda ask: complete(server, *ask), ASKS * 3))
    for (status, answer), (_, expected), (_, tokens) in zip(
        together, alone * 3, ASKS * 3, strict=True
    ):
        assert status == 200, answer
        [choice] = answer["choices"]
        assert choice["text"] == expected["choices"][0]["text"]
        assert choice["finish_reason"] == expected["choices"][0]["finish_reason"]
        if choice["finish_reason"] == "length":
            assert answer["usage"]["completion_tokens"] == tokens


def test_joiners_that_wait_for_company_answer_as_they_do_alone(started):
    """With --join-wait-steps, a request that comes while 8 streams run waits a few steps
    for others to join with it; its answer is what it is alone (served with no row
    running), and /info says how long a joiner may wait."""
    server = started("gathering_server")
    status, _, body = server.request("GET", "/info")
    generation = json.loads(body)["generation"]
    assert status == 200 and generation == {"requested_mode": "continuous", "join_wait_steps": 3}
    alone = [complete(server, prompt, tokens) for prompt, tokens in ASKS]
    streams = [start_stream(server, f"stream {index}", LONG) for index in range(8)]
    try:
        beside = [complete(server, prompt, tokens) for prompt, tokens in ASKS]
        with ThreadPoolExecutor(len(ASKS)) as pool:
            together = list(pool.map(lambda ask: complete(server, *ask), ASKS))
    finally:
        for sock in streams:
            sock.close()
    for answers in (beside, together):
        for (status, answer), (_, expected) in zip(answers, alone, strict=True):
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected["choices"][0]["text"]


# prompts of multi-byte characters (the byte-level tokenizer splits them across tokens)
# with stop sequences that span tokens, one a prefix of another, or come at once
MIXED = [
    ("日本 the movie 😀", {"stop": ["th", "the"]}),
    ("é paris 中文字", {"stop": ["a b"], "seed": 3, "temperature": 0.9}),
    ("😀🎉 good film", {"stop": [" "]}),
    ("hello ü", {"seed": 5, "temperature": 1.3, "top_p": 0.9}),
    ("a b 日本", {"stop": ["e"], "logprobs": 2}),
]


def sse_events(body: bytes) -> list[dict]:
    lines = [line[5:].strip() for line in body.decode().splitlines() if line.startswith("data:")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_streamed_pieces_side_by_side_make_the_whole_answer_and_the_tokenizers_counts(
    servers, tiny_model
):
    """Streamed beside each other (and beside a stream whose client leaves), each
    answer's pieces make the text that the same request answers whole: a character cut
    across tokens is sent once whole, a stop sequence never; the usage counts the
    tokenizer's tokens; nothing runs after."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model("long-generation"))
    server = servers["rows"]

    def ask(prompt: str, extra: dict, stream: bool) -> tuple[int, bytes]:
        document = {"prompt": prompt, "max_tokens": 30, "temperature": 0, **extra}
        if stream:
            document.update(stream=True, stream_options={"include_usage": True})
        status, _, body = server.request(
            "POST", "/v1/completions", json.dumps(document), {"Content-Type": "application/json"}
        )
        return status, body

    leaving = start_stream(server, "the movie was", LONG)
    with ThreadPoolExecutor(len(MIXED)) as pool:
        streams = list(pool.map(lambda mix: ask(*mix, stream=True), MIXED))
    leaving.close()
    for (prompt, extra), (status, body) in zip(MIXED, streams, strict=True):
        assert status == 200, body
        whole_status, whole_body = ask(prompt, extra, stream=False)
        whole = json.loads(whole_body)
        [choice] = whole["choices"]
        events = sse_events(body)
        pieces = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert pieces == choice["text"], (prompt, extra)
        assert [e["usage"] for e in events if e.get("usage")] == [whole["usage"]]
        assert whole["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
        assert not any(stop in choice["text"] for stop in extra.get("stop", []))
    wait_running(server, 0)


def test_a_deadline_mid_generation_is_504_on_time_and_frees_the_row(servers):
    server = servers["one row"]
    before = len(server.read_log())
    started = time.monotonic()
    status, answer = complete(server, "the movie was", LONG, **{"X-Request-Timeout": "0.5"})
    assert status in (504, 503), answer  # 503: refused at once, the deadline unreachable
    assert time.monotonic() - started < 5
    if status == 504:
        match = server.wait_for_log(STOPPED, timeout=30)
        assert int(match.group(1)) < LONG
    # the one row is free again: the next request runs
    assert complete(server, "hello", 2)[0] == 200
    assert len(server.read_log()) > before


def test_a_deadline_mid_stream_ends_it_with_an_error_event_and_frees_the_row(servers):
    server = servers["one row"]
    status, _, answer = server.request(
        "POST",
        "/v1/completions",
        streamed("the movie was", LONG),
        {"Content-Type": "application/json", "X-Request-Timeout": "1"},
    )
    assert status == 200
    lines = [line[5:].strip() for line in answer.decode().splitlines() if line]
    events = [json.loads(line) for line in lines if line != "[DONE]"]
    assert "deadline" in events[-1]["error"]["message"], events[-1]
    assert all("choices" in event for event in events[:-1]) and len(events) - 1 < LONG
    wait_running(server, 0)
    assert complete(server, "hello", 2)[0] == 200


def test_a_client_that_leaves_its_stream_frees_its_row(servers):
    server = servers["one row"]
    server.read_log()
    seen = len(server.lines)
    start_stream(server, "the movie was", LONG).close()
    deadline = time.monotonic() + 30
    stopped = None
    while stopped is None and time.monotonic() < deadline:
        stopped = next(
            (m for line in server.read_log()[seen:] if (m := STOPPED.search(line))), None
        )
        time.sleep(0.05)
    assert stopped is not None and int(stopped.group(1)) < LONG
    assert complete(server, "hello", 2)[0] == 200  # the row was given back


def running(server: RunningServer) -> int:
    status, _, body = server.request("GET", "/info")
    [worker] = json.loads(body)["workers"]
    return worker["running_sequences"]


def wait_running(server: RunningServer, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while running(server) != count:
        assert time.monotonic() < deadline, f"never {count} sequences running"
        time.sleep(0.02)


def test_a_short_request_is_answered_while_a_long_stream_runs(servers):
    """It joins the running batch instead of waiting for the long one to end; the long
    one's row is freed when its client leaves."""
    server = servers["rows"]
    with start_stream(server, "the movie was", LONG):
        wait_running(server, 1)
        status, answer = complete(server, "hello", 1)
        assert status == 200, answer
        assert running(server) == 1  # the long one still runs
    wait_running(server, 0)


def test_a_worker_killed_with_sequences_running_answers_every_one(servers):
    """Sequences that had not streamed run again alone (their answers are the greedy
    ones); every request gets exactly one answer, and the worker's death is said with
    the requests it ran."""
    server = servers["rows"]
    status, _, body = server.request("GET", "/info")
    pids = [w["pid"] for w in json.loads(body)["workers"] if w.get("pid")]
    asks = [("the movie was", 300), ("hello there", 300), ("a b c", 300)]
    alone = [complete(server, prompt, tokens) for prompt, tokens in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        sent = [pool.submit(complete, server, *ask) for ask in asks]
        wait_running(server, len(asks))
        os.kill(pids[0], signal.SIGKILL)
        answers = [future.result(timeout=120) for future in sent]
    # its death's line names the requests it ran, as a batch worker's does (a tester)
    server.wait_for_log(re.compile(rf"process {pids[0]} .* running 3 sequences \(request "))
    for (status, answer), (_, expected) in zip(answers, alone, strict=True):
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert complete(server, "hello", 2)[0] == 200


def test_the_batch_timeout_kills_a_hung_worker_not_a_long_generation(watched_server):
    """A continuous worker's sequences run as long as their deadlines allow: the batch
    timeout (1 s) tells a worker that stopped finishing passes from one that runs a long
    generation, streamed or not, and kills only the first."""
    server = watched_server
    # (deadlines far off: a busy machine took the default 30 s for the stream, a 504)
    status, answer = complete(server, "the movie was", LONG, **{"X-Request-Timeout": "300"})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == LONG
    with start_stream(server, "the movie was", LONG, deadline=300) as sock:
        sock.settimeout(60)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, received[-300:]
            received += chunk
    assert b'"error"' not in received and b'"finish_reason":"length"' in received

    status, _, body = server.request("GET", "/info")
    [pid] = [w["pid"] for w in json.loads(body)["workers"]]
    with start_stream(server, "the movie was", LONG) as sock:
        os.kill(pid, signal.SIGSTOP)  # hung: it finishes no pass any more
        # (killed as stopped from outside: its sequences run again, no strike counted)
        server.wait_for_log(re.compile(rf"its process {pid} is stopped .*; killing it"), timeout=30)


def test_more_choices_than_the_queue_holds_are_413_not_a_503_to_retry(small_queue_server):
    """A prompt with `n` 4 is four sequences, queued as four items: with `--max-queue 2`
    and one row it can never be admitted, streamed or not, on an idle server too; `n` 3
    is taken, as a list of three inputs is (the queue, and the row)."""
    for stream in (False, True):
        document = {"prompt": ["hello"], "n": 4, "max_tokens": 2, "stream": stream}
        status, headers, body = small_queue_server.request(
            "POST", "/v1/completions", json.dumps(document), {"Content-Type": "application/json"}
        )
        message = json.loads(body)["error"]["message"]
        assert status == 413 and "retry-after" not in headers, (status, body)
        assert "4 choices" in message and "at most 3" in message, message
    document = {"prompt": ["hello"], "n": 3, "max_tokens": 2}  # as many as it takes
    status, _, body = small_queue_server.request(
        "POST", "/v1/completions", json.dumps(document), {"Content-Type": "application/json"}
    )
    assert status == 200 and len(json.loads(body)["choices"]) == 3, body


def test_a_streamed_choice_refused_at_admission_refuses_the_request_at_once(small_queue_server):
    """One row, a queue of two: one stream runs, one waits in the queue; a stream of two
    choices gets its first one queued and its second refused. It is answered 503 with
    Retry-After at once, and its queued choice withdrawn, not once that choice has had
    its first token (after both long streams had their row)."""
    server = small_queue_server
    running = start_stream(server, "the movie was", LONG)
    waiting_body = streamed("a b c", LONG).encode()
    waiting = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        waiting.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            # a deadline its wait cannot miss, even on a busy machine (the default 30 s
            # may be less than the two long streams' steps at a slow pace: a 503 at once)
            + b"X-Request-Timeout: 250\r\n"
            + f"Content-Length: {len(waiting_body)}\r\n\r\n".encode()
            + waiting_body
        )
        wait_queued(server, 1, waiting)
        document = {"prompt": "hello", "n": 2, "max_tokens": 3, "stream": True}
        status, headers, body = server.request(
            "POST",
            "/v1/completions",
            json.dumps(document),
            # a deadline the work ahead cannot miss, even on a slow machine: the queue's
            # bound is what refuses it
            {"Content-Type": "application/json", "X-Request-Timeout": "250"},
            timeout=60,
        )
        assert status == 503 and "retry-after" in headers, (status, body)
        assert "queue full" in json.loads(body)["error"]["message"], body
        waiting.setblocking(False)
        with pytest.raises(BlockingIOError):  # still queued: the first stream still runs
            waiting.recv(1)
        wait_queued(server, 1)  # the refused request's first choice withdrawn
    finally:
        running.close()
        waiting.close()
    wait_running(server, 0)
    assert complete(server, "hello", 2)[0] == 200


def wait_queued(
    server: RunningServer, count: int, client: socket.socket | None = None, timeout: float = 30
) -> None:
    """Until `count` items are queued; `client`, a request's socket, is read when they
    never are, to say what it was answered."""
    deadline = time.monotonic() + timeout
    while True:
        _, _, body = server.request("GET", "/metrics")
        depths = re.findall(rb"^rawserve_queue_depth\{[^}]*\} (\S+)$", body, re.MULTILINE)
        if sum(float(depth) for depth in depths) == count:
            return
        if time.monotonic() > deadline:
            answered = b""
            if client is not None:
                client.setblocking(False)
                with suppress(BlockingIOError):
                    answered = client.recv(2000)
            raise AssertionError(f"never {count} items queued ({depths}); answered {answered!r}")
        time.sleep(0.02)

"""Continuous batching served end to end: a real server, a real worker, the tiny GPT-2.

Sequences run side by side in one worker (`--max-sequences`), each with its own cap and
its own output; a client that leaves, or a deadline that passes, frees its row at the
next step; a worker that dies with several sequences running answers every one of them.
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

import pytest

from tests.server import RunningServer, running_together

pytestmark = pytest.mark.slow

STOPPED = re.compile(r"generation stopped after (\d+) tokens")
LONGEST = 250  # new tokens: the tiny model has 256 positions
ASKS = [("the movie was", 3), ("a long and winding road to", 40), ("hello", 12), ("x y z", 1)]


@pytest.fixture(scope="module")
def servers(tiny_model):
    model = tiny_model("text-generation")
    started = {
        "rows": RunningServer(["--model", model, "--max-sequences", "8", "--threads", "1"]),
        "one row": RunningServer(["--model", model, "--max-sequences", "1", "--threads", "1"]),
    }
    with running_together(started):
        yield started


def complete(server: RunningServer, prompt: str, tokens: int, **headers: str) -> tuple[int, dict]:
    status, _, body = server.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0}),
        {"Content-Type": "application/json", **headers},
    )
    return status, json.loads(body)


def start_stream(server: RunningServer, prompt: str, tokens: int) -> socket.socket:
    """A TGI stream whose first bytes have arrived (the sequence is running)."""
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": tokens}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
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


def test_a_deadline_mid_generation_is_504_on_time_and_frees_the_row(servers):
    server = servers["one row"]
    before = len(server.read_log())
    started = time.monotonic()
    status, answer = complete(server, "the movie was", LONGEST, **{"X-Request-Timeout": "0.05"})
    assert status in (504, 503), answer  # 503: refused at once, the deadline unreachable
    assert time.monotonic() - started < 5
    if status == 504:
        match = server.wait_for_log(STOPPED, timeout=30)
        assert int(match.group(1)) < LONGEST
    # the one row is free again: the next request runs
    assert complete(server, "hello", 2)[0] == 200
    assert len(server.read_log()) > before


def test_a_client_that_leaves_its_stream_frees_its_row(servers):
    server = servers["one row"]
    server.read_log()
    seen = len(server.lines)
    start_stream(server, "the movie was", LONGEST).close()
    deadline = time.monotonic() + 30
    stopped = None
    while stopped is None and time.monotonic() < deadline:
        stopped = next(
            (m for line in server.read_log()[seen:] if (m := STOPPED.search(line))), None
        )
        time.sleep(0.05)
    assert stopped is not None and int(stopped.group(1)) < LONGEST
    assert complete(server, "hello", 2)[0] == 200  # the row was given back


def test_a_short_request_is_answered_while_a_long_stream_runs(servers):
    server = servers["rows"]
    with start_stream(server, "the movie was", LONGEST) as stream:
        status, answer = complete(server, "hello", 1)
        assert status == 200, answer
        stream.settimeout(30)
        rest = b""
        while b'"generated_text":"' not in rest and b'"generated_text": "' not in rest:
            chunk = stream.recv(65536)
            if not chunk:
                break
            rest += chunk
    assert b"generated_text" in rest


def test_a_worker_killed_with_sequences_running_answers_every_one(servers):
    """Sequences that had not streamed run again alone (their answers are the greedy
    ones); every request gets exactly one answer."""
    server = servers["rows"]
    status, _, body = server.request("GET", "/info")
    pids = [w["pid"] for w in json.loads(body)["workers"] if w.get("pid")]
    asks = [("the movie was", 200), ("hello there", 200), ("a b c", 200)]
    alone = [complete(server, prompt, tokens) for prompt, tokens in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        running = [pool.submit(complete, server, *ask) for ask in asks]
        time.sleep(0.05)
        os.kill(pids[0], signal.SIGKILL)
        answers = [future.result(timeout=120) for future in running]
    for (status, answer), (_, expected) in zip(answers, alone, strict=True):
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert complete(server, "hello", 2)[0] == 200

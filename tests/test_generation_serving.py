"""The served-generation bench measures what it says: its model never ends a sequence early,
its client reads both a JSON answer and a stream of events, and one scenario runs end to end
against the real server. (The bench's figures themselves are not tests.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from bench import generation_serving as bench
from tests.server import RunningServer


def test_the_model_makes_every_token_asked_for_and_its_tokenizer_reads_the_prompts(tmp_path):
    import torch
    import transformers

    folder = bench.save_model(tmp_path / "model", layers=2, hidden=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = bench.scenarios(seed=0)[0].prompts
    assert tokenizer(bench.text_of(prompts[0]))["input_ids"] == prompts[0]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == bench.EOS_ID
    with torch.inference_mode():
        made = model.generate(torch.tensor([prompts[0]]), max_new_tokens=200, do_sample=False)[
            0, len(prompts[0]) :
        ].tolist()
    assert len(made) == 200 and bench.EOS_ID not in made and bench.PAD_ID not in made


class Writer:
    def __init__(self) -> None:
        self.sent = b""

    def write(self, data: bytes) -> None:
        self.sent += data


def exchange(answer: bytes) -> bench.Answer:
    async def run() -> bench.Answer:
        reader = asyncio.StreamReader()
        reader.feed_data(answer)
        reader.feed_eof()
        writer: Any = Writer()
        return await bench.exchange(reader, writer, b"request")

    return asyncio.run(run())


def test_a_json_answer_counts_its_completion_tokens():
    body = json.dumps({"choices": [{"text": "w1 w2"}], "usage": {"completion_tokens": 2}})
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n"
    answer = exchange((head + body).encode())
    assert (answer.status, answer.tokens, answer.first, answer.keep_alive) == (200, 2, None, True)


def test_a_refusal_is_read_whole_and_counts_no_tokens():
    body = b'{"error": {"message": "busy"}}'
    head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Length: {len(body)}\r\n"
    answer = exchange(head.encode() + b"Connection: close\r\n\r\n" + body)
    assert (answer.status, answer.tokens, answer.keep_alive) == (503, 0, False)


@pytest.mark.parametrize("separator", [b"data:", b"data: "])
def test_a_stream_times_each_token_event_and_reads_the_usage_chunk(separator):
    def event(document: dict[str, Any] | str) -> bytes:
        data = document if isinstance(document, str) else json.dumps(document)
        payload = separator + data.encode() + b"\n\n"
        return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"

    tokens = [event({"choices": [{"text": f" w{i}"}]}) for i in range(3)]
    finish = event({"choices": [{"text": "", "finish_reason": "length"}]})
    usage = event({"choices": [], "usage": {"completion_tokens": 3}})
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = exchange(head + b"".join(tokens) + finish + usage + event("[DONE]") + b"0\r\n\r\n")
    assert answer.status == 200 and answer.tokens == 3
    assert answer.first is not None and len(answer.gaps) == 2  # 3 token events, 2 gaps


@pytest.mark.slow
def test_a_scenario_runs_against_the_real_server_and_counts_every_token(tmp_path):
    folder = bench.save_model(tmp_path / "model", layers=2, hidden=128)
    asks = [5, 3, 7, 4]
    with RunningServer(["--model", str(folder), "--task", "text-generation", "--no-warmup"]) as rs:
        assert rs.port is not None
        for stream in (False, True):
            requests = [
                bench.completion_request(str(folder), "w2 w3 w4", ask, stream) for ask in asks
            ]
            found = asyncio.run(bench.closed_loop(rs.port, requests, asks, 2, 60.0))
            assert found["statuses"] == {"200": 4} and found["short_answers"] == 0
            assert (found["ttft_p50_ms"] is not None) == stream
        # spread: the second of two clients sends its first request half the spread later
        started = time.perf_counter()
        found = asyncio.run(bench.closed_loop(rs.port, requests[:2], asks[:2], 2, 60.0, 0.4))
        assert found["statuses"] == {"200": 2} and time.perf_counter() - started >= 0.2
        # the worker's own latencies, on /metrics: every sequence's first token, each later
        # token's gap (counted to the server once a second, and once the loop is idle)
        expected = {"first token +Inf": 10, "queue +Inf": 10, "between tokens +Inf": 2 * 15 + 4 + 2}
        wait_until(lambda: counted(bench.generation_passes(rs.port)) == expected)
        passes = bench.generation_passes(rs.port)
        assert bench.bucket_quantile(bench.latency_buckets(passes, "first token"), 0.5) > 0
        between = bench.latency_buckets(passes, "between tokens")
        assert 0 < bench.bucket_quantile(between, 0.99) < 10


def counted(passes) -> dict[str, float]:
    return {name: n for name, n in passes.items() if name.endswith("+Inf")}


def wait_until(check, timeout: float = 10.0) -> None:
    until = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < until, "not within the time bound"
        time.sleep(0.05)


def test_a_quantile_is_read_from_cumulative_buckets_as_prometheus_reads_it():
    cumulative = {"0.01": 2.0, "0.02": 6.0, "0.05": 8.0, "+Inf": 10.0}
    assert bench.bucket_quantile(cumulative, 0.1) == pytest.approx(0.005)  # within (0, 0.01]
    assert bench.bucket_quantile(cumulative, 0.5) == pytest.approx(0.0175)  # 3 of 4 in (0.01, 0.02]
    assert bench.bucket_quantile(cumulative, 0.99) == 0.05  # beyond: the highest finite bound
    assert bench.bucket_quantile({"0.01": 0.0, "+Inf": 0.0}, 0.5) is None

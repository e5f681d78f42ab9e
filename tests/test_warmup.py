"""The warm start: each worker runs a batch of --max-batch-size examples before it reports
ready (/ready says "warming" meanwhile), the batch is counted in no metric, and
--no-warmup turns it off. First-request latencies with and without it are measured by
`python -m bench.first_request` (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from rawserve.api.app import App
from rawserve.api.served import ServedModel, ServedModels
from rawserve.api.settings import AppSettings
from rawserve.http.exchange import HttpRequest
from rawserve.serving.pool import WorkerPool
from rawserve.serving.service import ModelService
from rawserve.serving.status import LoadState, WorkerState
from rawserve.shared.messages import WorkerConfig, WorkerReady, WorkerWarming
from rawserve.tasks import check_input, check_params, task_rules
from rawserve.tasks.registry import TASKS
from tests.server import RunningServer, module_server, started_as_used
from tests.test_model_selection import AnsweringQueue, served
from tests.test_task_adapters import runner  # noqa: F401 - the in-process runners fixture
from tests.tiny_models import worker_config

WARMED = re.compile(r"warm-up: a batch of (\d+) took")

# (tiny model kind, task) for every task rawserve serves: each is warmed by its example
KINDS = {
    "feature-extraction": "sentence-embedding",
    "fill-mask": "fill-mask",
    "image-classification": "image-classification",
    "question-answering": "question-answering",
    "summarization": "seq2seq",
    "text-classification": "text-classification",
    "text-generation": "text-generation",
    "text2text-generation": "seq2seq",
    "token-classification": "token-classification",
    "translation": "seq2seq",
    "zero-shot-classification": "zero-shot-classification",
}


def test_every_task_has_an_example_its_own_rules_accept():
    from rawserve.worker.warmup import example

    assert set(KINDS) == set(TASKS)  # a new task needs an example here
    for task in TASKS:
        tokenizer = SimpleNamespace(mask_token="<mask>")
        found = example(SimpleNamespace(task=task, tokenizer=tokenizer))  # type: ignore[arg-type]
        assert found is not None, task
        value, params = found
        rules = task_rules(task)
        assert rules is not None
        check_input(rules, value)
        check_params(rules, params)
    assert example(SimpleNamespace(task="custom", tokenizer=None)) is None  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(KINDS))
def test_every_runner_runs_its_warm_up_batch(runner, task):  # noqa: F811
    from rawserve.worker.warmup import warm_up

    kind = KINDS[task]
    seconds = warm_up(runner(kind, task if kind == "seq2seq" else None), size=3)
    assert seconds is not None and seconds > 0


def test_a_model_of_32_positions_is_warmed_with_the_example_cut_to_what_it_reads(
    runner,  # noqa: F811
):
    """The example text is 48 tokens of the tiny GPT-2's tokenizer: its 422 made the
    warm-up fail, and the model served without it."""
    from rawserve.worker.warmup import EXAMPLE_TEXT, GENERATED_TOKENS, example_batch, warm_up

    short = runner("short-generation")
    assert short.max_positions == 32
    assert len(short.tokenizer(EXAMPLE_TEXT)["input_ids"]) > 32
    batch = example_batch(short, 2)
    assert batch is not None
    [text, _], _ = batch
    assert EXAMPLE_TEXT.startswith(text)
    assert len(short.tokenizer(text)["input_ids"]) <= 32 - GENERATED_TOKENS  # the answer's room
    assert warm_up(short, size=2) is not None


def test_fill_mask_s_example_cut_short_keeps_a_mask(tiny_model):
    import transformers

    from rawserve.shared.messages import ModelLimits
    from rawserve.worker.warmup import example_batch

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model("fill-mask"))
    fake = SimpleNamespace(
        task="fill-mask", tokenizer=tokenizer, limits=ModelLimits(max_input_tokens=6)
    )
    batch = example_batch(fake, 1)  # type: ignore[arg-type]
    assert batch is not None
    [text], _ = batch
    assert tokenizer.mask_token in text and len(tokenizer(text)["input_ids"]) <= 6


@pytest.mark.parametrize("kind", ["text-classification", "feature-extraction"])
def test_a_model_without_its_tokenizer_files_is_refused_not_served_unknown_tokens(
    tiny_model, tmp_path, kind
):
    """transformers builds such a model a tokenizer of its special tokens alone, which
    reads every word as the unknown token: every text would get the same answer. (The
    server refuses a folder with no tokenizer file at all before any worker starts; a
    worker still refuses one whose files are not its tokenizer's, here a BERT model's
    folder with a BPE vocabulary.)"""
    from rawserve.worker.loading import load_runner

    folder = tmp_path / kind
    shutil.copytree(tiny_model(kind), folder, ignore=shutil.ignore_patterns("tokenizer.json"))
    assert (folder / "tokenizer_config.json").is_file()  # what the repo kept says nothing
    (folder / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match=r"the model has no tokenizer files \(any of .*\)"):
        load_runner(worker_config(str(folder), dtype="float32"), "cpu")


def test_a_warming_worker_is_not_ready_and_says_so():
    executor = WorkerPool(WorkerConfig(model="unused", task="fill-mask"), ["cpu"])
    [worker] = executor.workers
    worker.state = WorkerState.LOADING
    executor._on_message(worker, WorkerWarming(load_seconds=1.0))
    assert worker.state is WorkerState.WARMING
    assert not executor.ready
    assert executor.load_state()[0] is LoadState.WARMING
    ready = WorkerReady(1, "fill-mask", "cpu", "float32", 1.0, warmup_seconds=0.25)
    executor._pump = lambda: None  # type: ignore[method-assign] - nothing to dispatch here
    executor._on_message(worker, ready)
    assert executor.ready and executor.status()[0].warmup_seconds == 0.25


@pytest.mark.parametrize(("warmed", "warned"), [(0.25, True), (0.05, False)])
async def test_a_first_warm_up_past_the_batch_timeout_is_warned_of(caplog, warmed, warned):
    """Ready, then each batch as large was killed as hung (500s, restarts), the log saying
    nothing of why at the start (`--batch-timeout 0.001`: a tester)."""
    executor = WorkerPool(
        WorkerConfig(model="unused", task="fill-mask"), ["cpu"], batch_timeout=0.1
    )
    executor._first_load = asyncio.get_running_loop().create_future()
    [worker] = executor.workers
    worker.state = WorkerState.WARMING
    executor._pump = lambda: None  # type: ignore[method-assign] - nothing to dispatch here
    ready = WorkerReady(1, "fill-mask", "cpu", "float32", 1.0, warmup_seconds=warmed)
    with caplog.at_level(logging.WARNING, "rawserve"):
        executor._on_message(worker, ready)
    said = [r.getMessage() for r in caplog.records if "--batch-timeout" in r.getMessage()]
    expected = "worker 0: its warm-up batch took 0.25 s, longer than --batch-timeout (0.1 s)"
    assert [line.startswith(expected) for line in said] == ([True] if warned else [])


def warming_executor() -> WorkerPool:
    """A real executor whose one worker has loaded its model and is warming up."""
    executor = WorkerPool(WorkerConfig(model="unused", task="fill-mask"), ["cpu"])
    [worker] = executor.workers
    worker.state = WorkerState.LOADING
    executor._on_message(worker, WorkerWarming(load_seconds=1.0))
    return executor


def warming_model() -> ServedModel:
    """A fill-mask model whose one worker is warming up."""
    return ServedModel(
        "mask", ModelService(AnsweringQueue("mask", "fill-mask"), warming_executor())
    )


def get(app: App, path: str) -> tuple[int, dict]:
    response = app.answer_now(HttpRequest("GET", path, "", [], b"", request_id="test"))
    assert response is not None  # probes are answered at once
    return response.status, json.loads(response.body)


def test_ready_is_503_warming_while_a_model_warms_up_and_names_it_among_several():
    alone = App(
        ServedModels(
            [
                ServedModel(
                    "mask", ModelService(AnsweringQueue("mask", "fill-mask"), warming_executor())
                )
            ]
        ),
        AppSettings(),
    )
    assert get(alone, "/ready")[0] == 503
    assert get(alone, "/ready")[1]["status"] == "warming"
    pair = App(
        ServedModels(
            [
                ServedModel(
                    "mask", ModelService(AnsweringQueue("mask", "fill-mask"), warming_executor())
                ),
                served("cls", "text-classification"),
            ]
        ),
        AppSettings(),
    )
    status, document = get(pair, "/ready")
    assert status == 503 and document["status"] == "warming"
    assert document["models"] == {"mask": "warming", "cls": "ready"}
    assert get(pair, "/ready/mask")[0] == 503 and get(pair, "/ready/cls")[0] == 200


def scrape_value(server: RunningServer, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.request("GET", "/metrics")[2].decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


@pytest.fixture(scope="module")
def servers(request, tiny_model):
    """The module's servers its selected tests use, started together."""
    model = ["--model", tiny_model("text-classification"), "--threads", "1"]
    with started_as_used(
        request,
        {
            "warmed_server": lambda: RunningServer([*model, "--max-batch-size", "16"]),
            "unwarmed_server": lambda: RunningServer([*model, "--no-warmup"]),
        },
    ) as get:
        yield get


warmed_server = module_server("warmed_server")
unwarmed_server = module_server("unwarmed_server")


@pytest.mark.slow
def test_the_server_warms_each_worker_with_a_full_batch_counted_nowhere(warmed_server):
    with warmed_server as server:
        assert int(server.wait_for_log(WARMED).group(1)) == 16
        assert any("warming up" in line for line in server.lines)
        [worker] = json.loads(server.request("GET", "/info")[2])["workers"]
        assert worker["warmup_seconds"] > 0
        assert scrape_value(server, "rawserve_batch_size_count") == 0  # not a client's batch
        assert server.post_json({"inputs": "i like it"})[0] == 200
        assert scrape_value(server, "rawserve_batch_size_count") == 1


@pytest.mark.slow
def test_no_warmup_reports_ready_without_it(unwarmed_server):
    with unwarmed_server as server:
        document = json.loads(server.request("GET", "/info")[2])
        assert document["warmup"] is False
        assert document["workers"][0]["warmup_seconds"] is None
        assert not any(WARMED.search(line) or "warming up" in line for line in server.lines)
        assert server.post_json({"inputs": "i like it"})[0] == 200


def failing(error: Exception, alone_too: bool | Exception = True):
    """A runner's `run` that raises `error` on a batch (and on one input, `alone_too`:
    that error, where it is one)."""

    def run(inputs, params, control=None):
        if len(inputs) > 1 or alone_too is True:
            raise error
        if isinstance(alone_too, Exception):
            raise alone_too
        return [{"label": "POSITIVE", "score": 1.0}]

    return run


def test_a_model_that_fails_its_tasks_example_stops_the_start(runner, monkeypatch):  # noqa: F811
    """A model whose forward cannot take the task's input (a wav2vec2 named for text)
    answered every request 500 behind a /ready of 200: it stops the start, saying why."""
    from rawserve.worker.warmup import ModelFails, warm_up

    serving = runner("text-classification")
    error = TypeError("Wav2Vec2Model.forward() missing 1 required positional argument")
    monkeypatch.setattr(serving, "run", failing(error))
    with pytest.raises(ModelFails, match=r"fails on its task's example input \(TypeError: Wav2"):
        warm_up(serving, size=4)


@pytest.mark.parametrize(
    ("error", "alone_too"),
    [
        (RuntimeError("a batch of the maximum size failed"), False),  # one input runs
        (ValueError("the example is not this model's input"), True),  # the input's fault
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),  # memory's
        # a device's or a precision's failure: no sign that every request fails
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"), True),
        (RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'"), True),
        (TypeError("a batch of the maximum size failed"), False),  # one input runs
        # one input fails otherwise: the batch's TypeError is no sign that every input fails
        (
            TypeError("a batch of the maximum size failed"),
            RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ),
    ],
)
def test_a_warm_up_that_fails_otherwise_is_logged_and_the_model_serves(
    runner,  # noqa: F811
    monkeypatch,
    caplog,
    error,
    alone_too,
):
    from rawserve.worker.warmup import warm_up

    serving = runner("text-classification")
    monkeypatch.setattr(serving, "run", failing(error, alone_too))
    assert warm_up(serving, size=4) is None
    assert "the warm-up batch failed; serving without it" in caplog.text


def test_a_server_whose_model_fails_every_input_exits_with_one_line(tiny_model, tmp_path):
    """A wav2vec2 (its own weights, a BERT's tokenizer beside them) served for embeddings:
    it loads, and its forward takes no text."""
    import transformers

    from tests.server import REPO_ROOT

    folder = tmp_path / "audio-as-text"
    shutil.copytree(tiny_model("feature-extraction"), folder)
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        conv_dim=[8],
        conv_kernel=[4],
        conv_stride=[2],
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
    )
    transformers.Wav2Vec2Model(config).save_pretrained(folder)
    done = subprocess.run(
        [sys.executable, "-m", "rawserve", "--model", f"{folder}:feature-extraction"]
        + ["--port", "0", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=170,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO_ROOT},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    [said] = [line for line in done.stderr.splitlines() if "rawserve ERROR" in line]
    assert "could not be loaded: the model fails on its task's example input (TypeError" in said
    assert said.endswith("is it a feature-extraction model?")

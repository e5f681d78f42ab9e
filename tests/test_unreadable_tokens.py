"""A model whose tokenizer has tokens its embedding table has no row for (tokens added to
the tokenizer without `model.resize_token_embeddings`, a common mistake of fine-tuned
checkpoints): an input holding one is refused (422) in words that name the token and the
table's size, before the model reads it (it failed with 500 "the model failed", and on a
GPU with a device-side assert that spoils the worker's CUDA context for every batch after),
and its batch-mates are answered; the worker warns of it as it loads; and a pad token
added so is never placed in a batch.

Each runner is loaded as a worker loads it, on tiny models (`tests/tiny_models.py`); the
continuous generation loop's case is in `tests/test_generating.py`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rawserve.shared.messages import Engine, FailureKind, ItemFailure
from rawserve.tasks import LOGITS_PARAM
from rawserve.worker.onnx_engine import ONNX_TASKS, onnxruntime_installed
from tests.server import RunningServer
from tests.test_task_adapters import _rounded
from tests.tiny_models import UNREADABLE_TOKEN, with_tokens_added, worker_config

NEEDS_ONNX = pytest.mark.skipif(
    not onnxruntime_installed(), reason="the onnx extra is not installed"
)
CONTEXT = "john lives in paris and mary lives in london"
GREEDY = {"max_new_tokens": 3, "do_sample": False}  # (a draw may differ beside a batch-mate)


@pytest.fixture(scope="module")
def unresized(tiny_model, tmp_path_factory):
    """`unresized(kind)` → a copy of that tiny model whose tokenizer holds
    UNREADABLE_TOKEN, past its embedding table (`pad`: its pad token is past it too)."""
    root = tmp_path_factory.mktemp("unresized")
    made: dict[tuple[str, bool], str] = {}

    def get(kind: str, pad: bool = False) -> str:
        if (kind, pad) not in made:
            folder = root / f"{kind}{'-pad' if pad else ''}"
            with_tokens_added(tiny_model(kind), folder, pad)
            made[kind, pad] = str(folder)
        return made[kind, pad]

    return get


@pytest.fixture(scope="module")
def runner(unresized, tmp_path_factory):
    from rawserve.worker.loading import load_runner

    loaded = {}
    with pytest.MonkeyPatch.context() as patch:
        # the ONNX exports of these models, apart from the other tests' (keyed by content)
        patch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("onnx-cache")))

        def get(kind: str, task: str, engine: Engine = Engine.TORCH):
            if (kind, task, engine) not in loaded:
                config = worker_config(unresized(kind), task, dtype="float32", engine=engine)
                loaded[kind, task, engine] = load_runner(config, "cpu")
            return loaded[kind, task, engine]

        yield get


def rows_of(folder: str) -> int:
    """The rows of the model's embedding table (the tiny models' vocab_size)."""
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


WORD = UNREADABLE_TOKEN
# (model kind, task, an input answered, one holding the unreadable token, parameters)
CASES = [
    ("feature-extraction", "feature-extraction", "hello world", f"hello {WORD}", {}),
    ("fill-mask", "fill-mask", "paris is the [MASK]", f"{WORD} is the [MASK]", {}),
    ("text-classification", "text-classification", "i like it", f"i like {WORD}", {}),
    (
        "text-classification",
        "text-classification",
        "i like it",
        f"i like {WORD}",
        {"top_k": 2},
    ),
    (  # TEI's /predict and /rerank: a (query, text) pair's logits
        "reranker",
        "text-classification",
        {"text": "who", "text_pair": "john"},
        {"text": "who", "text_pair": f"{WORD} lives"},
        {LOGITS_PARAM: True},
    ),
    ("token-classification", "token-classification", "john lives in paris", f"{WORD} lives", {}),
    (
        "zero-shot-classification",
        "zero-shot-classification",
        "i like this film",
        f"i like {WORD}",
        {"candidate_labels": ["movie", "city"]},
    ),
    (
        "question-answering",
        "question-answering",
        {"question": "who lives in paris", "context": CONTEXT},
        {"question": "who lives in paris", "context": f"{WORD} lives in paris"},
        {},
    ),
    ("text-generation", "text-generation", "the movie was", f"the {WORD}", GREEDY),
    ("seq2seq", "summarization", "the movie was good", f"the {WORD}", GREEDY),
]


def engines(cases: list[tuple]) -> list:
    """Each case on torch, and on ONNX Runtime too where that engine serves its task."""
    params = []
    for case in cases:
        name = f"{case[0]}-{case[1]}"
        params.append(pytest.param(*case, Engine.TORCH, id=f"{name}-torch"))
        if case[1] in ONNX_TASKS:
            params.append(pytest.param(*case, Engine.ONNX, marks=NEEDS_ONNX, id=f"{name}-onnx"))
    return params


@pytest.mark.parametrize(("kind", "task", "good", "bad", "params", "engine"), engines(CASES))
def test_an_input_holding_a_token_the_model_cannot_read_fails_alone_as_the_clients(
    runner, unresized, kind, task, good, bad, params, engine
):
    """Run as the worker runs a batch (bisected on failure): the input is a 422 naming
    the token and the table's rows (it was a 500, "the model failed on this input"), and
    its batch-mate answers what it answers alone."""
    from rawserve.worker.batch_runs import run_bisecting

    serving = runner(kind, task, engine)
    answered, failed = run_bisecting(serving, [good, bad], dict(params))
    assert isinstance(failed, ItemFailure) and failed.kind is FailureKind.INPUT, failed
    assert f"the token '{WORD}'" in failed.message, failed.message
    assert f"embedding table has {rows_of(unresized(kind))} rows" in failed.message
    [alone] = run_bisecting(serving, [good], dict(params))
    assert not isinstance(alone, ItemFailure), alone
    if task not in ("text-generation", "summarization"):  # (generation: its tokens)
        assert _rounded(answered) == _rounded(alone)
    else:
        assert answered == alone


@pytest.mark.parametrize("engine", [Engine.TORCH, pytest.param(Engine.ONNX, marks=NEEDS_ONNX)])
@pytest.mark.parametrize("targets", [[WORD], WORD, ["paris", WORD]])
def test_a_fill_mask_target_the_model_cannot_score_is_the_client_s_422(runner, engine, targets):
    """The pipeline scores each target's token: one past the table failed its
    postprocess with an IndexError, a 500 (a tester); a target it can score still is."""
    from rawserve.worker.batch_runs import run_bisecting

    serving = runner("fill-mask", "fill-mask", engine)
    [failed] = run_bisecting(serving, ["paris is the [MASK]"], {"targets": targets})
    assert isinstance(failed, ItemFailure) and failed.kind is FailureKind.INPUT, failed
    assert failed.message.startswith(f"`targets` names the token '{WORD}'"), failed.message
    [scored] = run_bisecting(serving, ["paris is the [MASK]"], {"targets": ["paris"]})
    assert not isinstance(scored, ItemFailure) and scored[0]["token_str"] == "paris", scored


def test_the_token_is_refused_before_the_model_reads_it(runner, monkeypatch):
    """No forward pass sees the id (on a GPU, the embedding's lookup of it is a
    device-side assert, which no later batch of the worker survives)."""
    serving = runner("feature-extraction", "feature-extraction")
    read: list[int] = []
    monkeypatch.setattr(
        serving.model,
        "forward",
        lambda **inputs: read.append(1),  # never called
    )
    with pytest.raises(ValueError, match=f"'{WORD}'"):
        serving.run([f"hello {WORD}"], {})
    assert read == []


def test_the_worker_warns_at_load_of_tokens_past_the_embedding_table(unresized, caplog):
    from rawserve.worker.loading import load_runner

    folder = unresized("text-classification")
    config = worker_config(folder, "text-classification", dtype="float32", engine=Engine.TORCH)
    with caplog.at_level(logging.WARNING, logger="rawserve.worker"):
        load_runner(config, "cpu")
    [warning] = [r.getMessage() for r in caplog.records if "embedding table" in r.getMessage()]
    assert f"embedding table {rows_of(folder)} rows" in warning
    assert f"'{WORD}'" in warning and "422" in warning


def test_a_model_whose_tokens_all_have_rows_is_not_warned_of(tiny_model, caplog):
    from rawserve.worker.loading import load_runner

    folder = tiny_model("text-classification")
    config = worker_config(folder, "text-classification", dtype="float32", engine=Engine.TORCH)
    with caplog.at_level(logging.WARNING, logger="rawserve.worker"):
        runner = load_runner(config, "cpu")
    assert not [r for r in caplog.records if "embedding table" in r.getMessage()]
    # nor are its ids read before each pass (on a GPU, a wait for the device each batch)
    assert runner.embedding_rows and not runner.makes_unreadable_ids
    assert not runner.pipe.model._forward_pre_hooks or all(
        getattr(hook, "__name__", "") != "refuse_unreadable_ids"
        for hook in runner.pipe.model._forward_pre_hooks.values()
    )


@pytest.mark.parametrize(
    ("task", "params"),
    [("text-generation", {"max_new_tokens": 4, "do_sample": False}), ("feature-extraction", {})],
)
def test_a_pad_token_past_the_embedding_table_is_never_placed(unresized, task, params):
    """A GPT-2 given a pad token without resizing (as its fine-tunes often are): a batch
    of prompts of two lengths ran into the pad's missing row (a 500 on the CPU, a
    device-side assert on a GPU); it is padded with the end-of-text token, masked out,
    and each input answers as alone."""
    from rawserve.worker.loading import load_runner

    folder = unresized("text-generation", pad=True)
    config = worker_config(folder, task, dtype="float32", engine=Engine.TORCH)
    serving = load_runner(config, "cpu")
    assert serving.tokenizer.pad_token_id < rows_of(folder)
    texts = ["the movie was very good", "paris"]
    batched = serving.run(texts, dict(params))  # whole: not bisected down to each input
    alone = [serving.run([text], dict(params))[0] for text in texts]
    assert _rounded(batched) == _rounded(alone)


@pytest.mark.slow
def test_a_served_model_refuses_such_an_input_422_and_answers_the_others(unresized):
    """End to end: the client is told 422 with the words that name the token (it was a
    500, "the model failed"), the next request is answered, and the log warned at load."""
    folder = unresized("sentence-embedding")
    with RunningServer(["--model", folder, "--threads", "1"]) as server:
        status, refused = server.post_json({"inputs": f"hello {WORD}"}, "/embed")
        assert status == 422, refused
        assert f"the token '{WORD}'" in refused["error"], refused
        assert f"embedding table has {rows_of(folder)} rows" in refused["error"]
        status, vectors = server.post_json({"inputs": "hello"}, "/embed")
        assert status == 200 and len(vectors) == 1, vectors
        log = "\n".join(server.read_log())
        assert "without resizing the model" in log and f"'{WORD}'" in log

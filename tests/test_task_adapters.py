"""Each task's runner in-process, on tiny local models: the options each task takes,
batching that answers what single calls answer, and the pipelines' list habits."""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rawserve.shared.messages import (
    EMBEDDING_ROUTE,
    BatchResult,
    Control,
    Engine,
    FailureKind,
    ItemFailure,
    TokenChunk,
)
from rawserve.tasks import LOGITS_PARAM, split_outputs
from rawserve.tasks.checks import shows
from rawserve.tasks.seq2seq import OUTPUT_KEYS
from rawserve.worker.onnx_engine import ONNX_TASKS, onnxruntime_installed
from tests.tiny_models import worker_config

NEEDS_ONNX = pytest.mark.skipif(
    not onnxruntime_installed(), reason="the onnx extra is not installed"
)


@pytest.fixture(scope="module")
def runner(tiny_model):
    from rawserve.worker.loading import load_runner

    loaded = {}
    with pytest.MonkeyPatch.context() as patch:
        # ONNX exports of the tiny models, kept between runs (keyed by content)
        patch.setenv("RAWSERVE_CACHE_DIR", str(Path(tempfile.gettempdir()) / "rawserve-test-cache"))

        def get(kind: str, task: str | None = None, engine: Engine = Engine.TORCH):
            if (kind, task, engine) not in loaded:
                config = worker_config(tiny_model(kind), task, dtype="float32", engine=engine)
                loaded[kind, task, engine] = load_runner(config, "cpu")
            return loaded[kind, task, engine]

        yield get


# --- what the installed pipelines do with a one-item list ------------------------------

PIPELINE_CASES = [
    ("fill-mask", "fill-mask", ["paris is the [MASK]", "the [MASK] movie"], {"top_k": 2}),
    ("token-classification", "token-classification", ["john lives in paris", "hello"], {}),
    (
        "token-classification",
        "token-classification",
        ["john lives in paris", "mary"],
        {"aggregation_strategy": "simple"},
    ),
    ("text-classification", "text-classification", ["i like it", "bad"], {}),
    ("text-classification", "text-classification", ["i like it", "bad"], {"top_k": 2}),
    (
        "text-classification",
        "text-classification",
        [{"text": "i like it", "text_pair": "it is good"}, {"text": "bad"}],
        {"function_to_apply": "sigmoid"},
    ),
    (
        "zero-shot-classification",
        "zero-shot-classification",
        ["i like this film", "paris"],
        {"candidate_labels": ["movie", "city"], "multi_label": True},
    ),
]


@pytest.mark.parametrize(("kind", "task", "texts", "params"), PIPELINE_CASES)
def test_batched_and_single_calls_answer_what_the_pipeline_answers_per_input(
    runner, kind, task, texts, params
):
    serving = runner(kind, task)
    expected = [
        split_outputs(task, [text], serving.pipe([text], batch_size=1, **params))[0]
        for text in texts
    ]
    alone = [serving.run([text], params)[0] for text in texts]
    batched = serving.run(texts, params)
    assert _rounded(alone) == _rounded(expected) == _rounded(batched)
    if task != "zero-shot-classification":  # its pipe(x) is the unshaped dict
        direct = serving.pipe(texts[0], **params)
        if task == "text-classification" and isinstance(direct, list) and "top_k" not in params:
            direct = direct[0]  # pipe(x) answers [top-1 dict]; pipe([x]) answers [dict]
        assert _rounded(alone[0]) == _rounded(direct)


def test_a_classifier_whose_tokenizer_has_no_pad_token_answers_each_input_as_alone(
    tiny_model, tmp_path
):
    """A GPT-2 classifier whose tokenizer has no pad token: the pipeline answers it an input
    at a time (it cannot pad them into one batch); so does the worker, whatever the batch."""
    import shutil

    from rawserve.worker.loading import load_runner

    folder = Path(shutil.copytree(tiny_model("text-generation"), tmp_path / "classifier"))
    edits = {
        "tokenizer_config.json": {"pad_token": None},
        "config.json": {
            "architectures": ["GPT2ForSequenceClassification"],
            "pad_token_id": None,
            "id2label": {"0": "NEGATIVE", "1": "POSITIVE"},
        },
    }
    for name, changes in edits.items():
        found = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**found, **changes}))
    config = worker_config(str(folder), "text-classification", dtype="float32", engine=Engine.TORCH)
    serving = load_runner(config, "cpu")
    texts = ["i like it", "the movie was very bad"]
    expected = [serving.pipe(text) for text in texts]
    assert _rounded(serving.run(texts, {})) == _rounded([found[0] for found in expected])
    assert _rounded(serving.run(texts, {"top_k": None})) == _rounded(
        [serving.pipe(text, top_k=None) for text in texts]
    )
    outputs = serving.run(texts, {LOGITS_PARAM: True})
    assert len(outputs) == 2 and not np.allclose(outputs[0]["logits"], outputs[1]["logits"])
    # each text's tokens as the model read it, its special tokens in, its padding out
    assert [output["tokens"] for output in outputs] == [
        len(serving.pipe.tokenizer(text)["input_ids"]) for text in texts
    ]


def test_token_vectors_of_a_model_whose_tokenizer_has_no_pad_token(tiny_model, tmp_path):
    """A GPT-2 without a pad token serves feature-extraction (as the pipeline does, an input
    at a time): batched, each input's vectors are those it has alone (its pads masked)."""
    import shutil

    from rawserve.worker.loading import load_runner

    folder = Path(shutil.copytree(tiny_model("text-generation"), tmp_path / "vectors"))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "pad_token": None})
    )
    config = worker_config(str(folder), "feature-extraction", dtype="float32", engine=Engine.TORCH)
    serving = load_runner(config, "cpu")
    texts = ["i like it", "the movie was very bad"]
    batched = serving.run(texts, {})
    for text, vectors in zip(texts, batched, strict=True):
        np.testing.assert_allclose(vectors, serving.run([text], {})[0], atol=1e-5)


@pytest.mark.parametrize("engine", [Engine.TORCH, pytest.param(Engine.ONNX, marks=NEEDS_ONNX)])
def test_a_t5_encoder_alone_serves_sentence_vectors_as_sentence_transformers_computes_them(
    tiny_model, engine, tmp_path, monkeypatch
):
    """A sentence-transformers folder of `T5EncoderModel` (sentence-t5, GTR) is its encoder
    alone: AutoModel made the whole T5, whose forward asks for decoder inputs, and every
    request failed (on ONNX Runtime, its export failed)."""
    import torch
    import transformers

    from rawserve.worker.loading import load_runner

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))  # exported here, not found kept
    folder = tiny_model("t5-sentence-embedding")
    serving = load_runner(worker_config(folder, dtype="float32", engine=engine), "cpu")
    texts = ["i like it", "the movie was very bad and i hate it"]
    served = serving.run(texts, {})
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = transformers.T5EncoderModel.from_pretrained(folder).eval()
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = encoder(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)
    np.testing.assert_allclose(np.array(served), expected.numpy(), atol=1e-5)


@pytest.mark.parametrize("engine", [Engine.TORCH, pytest.param(Engine.ONNX, marks=NEEDS_ONNX)])
def test_a_config_whose_labels_leave_a_gap_names_each_output(tiny_model, tmp_path, engine):
    """An `id2label` with a gap ({0: L0, 2: L2} for a head of two outputs) names the
    missing output as transformers names one a config leaves out: the pipeline failed on
    it (a 500 at `top_k`), /predict named it LABEL_1, /info listed the config's keys."""
    from rawserve.worker.loading import load_runner

    folder = tmp_path / "gap"
    shutil.copytree(tiny_model("text-classification"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "L0", "2": "L2"}, {"L0": 0, "L2": 2}
    (folder / "config.json").write_text(json.dumps(config))
    gap = load_runner(worker_config(str(folder), None, dtype="float32", engine=engine), "cpu")
    assert gap.details["id2label"] == {"0": "L0", "1": "LABEL_1"}
    [answers] = gap.run(["a good movie"], {"top_k": None})
    assert sorted(answer["label"] for answer in answers) == ["L0", "LABEL_1"]


def test_a_zero_shot_requests_labels_are_scored_together_not_one_pass_each(runner):
    """The pipeline scores each (text, label) pair; a request's pairs go through the
    model in passes of many, up to a bound, not one forward pass a label."""
    from rawserve.worker.pipeline import PIECES_PER_PASS

    serving = runner("zero-shot-classification", "zero-shot-classification")
    passes: list[int] = []
    hook = serving.pipe.model.register_forward_hook(
        lambda _, args, kwargs, out: passes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    labels = [f"label {i}" for i in range(PIECES_PER_PASS + 6)]
    try:
        answered = serving.run(["i like this film", "paris"], {"candidate_labels": labels})
    finally:
        hook.remove()
    pairs = 2 * len(labels)
    assert sum(passes) == pairs and max(passes) == PIECES_PER_PASS
    assert len(passes) == -(-pairs // PIECES_PER_PASS)
    one_pass_each = [
        split_outputs(
            "zero-shot-classification",
            [text],
            serving.pipe([text], batch_size=1, candidate_labels=labels),
        )[0]
        for text in ("i like this film", "paris")
    ]
    assert _rounded(answered) == _rounded(one_pass_each)


# a text of 362 tokens to the tiny BERT, whose windows are 128 tokens (126 of the text's)
LONG_NAMES = " ".join(["john lives in paris and mary lives in london"] * 40)


def test_token_classification_with_a_stride_reads_the_whole_text_in_windows(runner):
    """Without `stride` the pipeline cuts a text at the model's positions; with it, the
    whole text is read in overlapping windows (several a forward pass) and the entities
    are the pipeline's own, far past the first window."""
    serving = runner("token-classification", "token-classification")
    params = {"aggregation_strategy": "simple", "stride": 16}
    passes: list[int] = []
    hook = serving.pipe.model.register_forward_hook(
        lambda _, args, kwargs, out: passes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    try:
        [strided] = serving.run([LONG_NAMES], params)
    finally:
        hook.remove()
    assert passes == [4]  # 1 + ceil((362 - 128) / (126 - 16)) windows, in one pass
    [cut] = serving.run([LONG_NAMES], {"aggregation_strategy": "simple"})
    assert max(e["end"] for e in strided) > len(LONG_NAMES) - 10 > max(e["end"] for e in cut)
    assert _rounded(strided) == _rounded(serving.pipe(LONG_NAMES, **params))
    # and beside a short text, each answered as alone
    both = serving.run(["mary lives in paris", LONG_NAMES], params)
    assert _rounded(both) == _rounded([serving.run(["mary lives in paris"], params)[0], strided])


@pytest.mark.parametrize(
    ("kind", "texts", "params"),
    [
        ("token-classification", [LONG_NAMES], {"aggregation_strategy": "simple", "stride": 125}),
        (
            "zero-shot-classification",
            ["i like this film"],
            {"candidate_labels": [f"label {i}" for i in range(200)]},
        ),
    ],
)
def test_the_passes_of_a_batch_nobody_waits_for_are_skipped(runner, kind, texts, params):
    """A strided text of 235 windows (4 passes) or a text with 200 labels: once nobody
    waits for the batch, the passes left are not run (each ran on past the 504, and a
    dense stride held the worker until the batch timeout killed it). The next batch, which
    someone waits for, runs whole again: its answer is the one given before any cancel."""
    serving = runner(kind, kind)
    whole = serving.run(texts, params)
    passes: list[int] = []
    hook = serving.pipe.model.register_forward_hook(
        lambda _, args, kwargs, out: passes.append(float(out["logits"].abs().sum()) > 0),
        with_kwargs=True,
    )
    serving.bind_cancel(lambda: len(passes) >= 1)
    try:
        answered = serving.run(texts, params)
        serving.bind_cancel(lambda: False)
        skipped, passes[:] = passes[:], []
        again = serving.run(texts, params)
    finally:
        serving.bind_cancel(lambda: False)
        hook.remove()
    # (a strided text's windows not made yet are not made: its passes end sooner)
    assert len(answered) == 1 and skipped[0] and not any(skipped[1:]) and len(skipped) >= 2
    # and the next batch runs whole again: every pass, and the answer given before
    assert all(passes) and len(passes) >= 4 and again == whole


def test_the_entities_of_a_strided_text_nobody_waits_for_are_not_read(runner, monkeypatch):
    """Its passes skipped, the thousands of windows of a dense stride were still made
    ready for the model and read into entities token by token, in Python (a 100 KB text:
    41 s past its 504)."""
    from transformers.pipelines import token_classification

    serving = runner("token-classification", "token-classification")
    params = {"aggregation_strategy": "simple", "stride": 125}
    read: list[int] = []
    gather = token_classification.TokenClassificationPipeline.gather_pre_entities
    monkeypatch.setattr(
        token_classification.TokenClassificationPipeline,
        "gather_pre_entities",
        lambda *args, **kwargs: read.append(1) or gather(*args, **kwargs),
    )
    serving.bind_cancel(lambda: True)
    try:
        assert serving.run([LONG_NAMES], params) == [[]]
    finally:
        serving.bind_cancel(lambda: False)
    assert not read
    assert serving.run([LONG_NAMES], params)[0] and read  # waited for: read whole


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"stride": 16}, "stride needs an aggregation_strategy"),
        ({"stride": 16, "aggregation_strategy": "none"}, "stride needs an aggregation_strategy"),
        # no window would move: the tokenizers library panics on it
        ({"stride": 126, "aggregation_strategy": "first"}, "stride 126 leaves no new tokens"),
        ({"stride": 4000, "aggregation_strategy": "max"}, "stride 4000 leaves no new tokens"),
    ],
)
def test_a_stride_the_pipeline_cannot_honour_is_the_clients_error(runner, params, says):
    serving = runner("token-classification", "token-classification")
    with pytest.raises(ValueError, match=says) as refused:
        serving.run([LONG_NAMES], params)
    assert serving.describe_failure(refused.value).kind == FailureKind.INPUT
    assert serving.run([LONG_NAMES], {**params, "stride": 125, "aggregation_strategy": "simple"})


def test_text_is_taken_to_fit_the_window_budget_only_at_a_normalizer_s_most_tokens():
    """A character NFKC makes 18 of (U+FDFA, each a token to XLM-RoBERTa's tokenizer):
    texts of them were left uncounted as surely fitting at 4 tokens a character, and
    made 4.5 times the windows' budget (a tester)."""
    from rawserve.tasks.windows import WINDOW_TOKEN_BUDGET, surely_fit, windows_fit

    window, room, stride = 128, 126, 125  # a window a token
    characters = WINDOW_TOKEN_BUDGET // window // 5  # at 4 a character, under the budget
    text = "\ufdfa" * characters
    normalized = lambda piece, _most: 18 * len(piece)  # noqa: E731 - a tokenizer stand-in
    assert not windows_fit(normalized, [(text, room)], window, stride)
    assert not surely_fit([(text, room)], window, stride)  # so it is counted
    assert surely_fit([("\ufdfa" * 100, room)], window, stride)


def test_windows_that_hold_exactly_the_budget_fit_and_one_token_more_does_not():
    """The refusal says "more than" the budget: windows that hold it exactly were refused
    for nothing."""
    from rawserve.tasks.windows import (
        WINDOW_TOKEN_BUDGET,
        most_windows,
        window_count,
        windows_fit,
    )

    window, room, stride = 128, 126, 0
    most = most_windows(window)
    assert most * window == WINDOW_TOKEN_BUDGET
    exactly = most * room  # windows that do not overlap: `most` of them, full
    assert window_count(exactly, room, stride) == most
    assert windows_fit(lambda _text, _most: exactly, [("x", room)], window, stride)
    assert not windows_fit(lambda _text, _most: exactly + 1, [("x", room)], window, stride)


def test_a_dense_stride_on_a_long_text_is_refused_before_its_windows_are_made(runner):
    """A 100 KB text at stride 125 of 128 positions is 20,000 windows, which the pipeline's
    tokenizer made in one call before anything could stop it (the worker grew by 1.5 GB,
    and by 9 GB for 1 MB): refused at once, in words that name the bound and the remedy;
    a normal stride on a long text is still read whole."""
    serving = runner("token-classification", "token-classification")
    params = {"aggregation_strategy": "simple", "stride": 125}
    made: list[int] = []
    tokenize = serving.pipe.preprocess
    serving.pipe.preprocess = lambda *a, **k: made.append(1) or tokenize(*a, **k)
    try:
        with pytest.raises(ValueError) as refused:
            serving.run(["word " * 20_000], params)
    finally:
        serving.pipe.preprocess = tokenize
    message = str(refused.value)
    assert "windows of 128 tokens at stride 125" in message and "524,288 tokens" in message
    assert "send a smaller stride or a shorter text" in message
    assert serving.describe_failure(refused.value).kind == FailureKind.INPUT
    assert not made  # no window made
    long_text = "john lives in paris " * 1_500  # 6,000 tokens: 64 windows at stride 32
    [entities] = serving.run([long_text], {**params, "stride": 32})
    assert max(entity["end"] for entity in entities) > len(long_text) - 20


def test_a_batch_whose_windows_are_over_the_bound_together_runs_each_text_alone(
    runner, monkeypatch
):
    """The bound is on a request's windows: a batch that joins texts under it alone but
    over it together is split (each answered), and a text over it alone is refused."""
    from rawserve.tasks import windows
    from rawserve.worker.batch_runs import run_batch

    monkeypatch.setattr(windows, "WINDOW_TOKEN_BUDGET", 10 * 128)  # 10 windows of 128
    serving = runner("token-classification", "token-classification")
    params = {"aggregation_strategy": "simple", "stride": 0}
    six = "john lives in paris " * 175  # 700 tokens: 6 windows of 126
    twelve = six + " " + six
    answers = run_batch(serving, [six, six, twelve], params)
    assert answers[0] == answers[1] == serving.run([six], params)[0]
    assert isinstance(answers[2], ItemFailure) and answers[2].kind == FailureKind.INPUT
    assert "more than 1,280 tokens" in answers[2].message


def test_a_stride_without_a_fast_tokenizer_is_the_clients_error(runner, monkeypatch):
    serving = runner("token-classification", "token-classification")
    monkeypatch.setattr(serving, "tokenizer", SimpleNamespace(is_fast=False))
    with pytest.raises(ValueError, match="stride needs a fast tokenizer"):
        serving.refuse_stride({"stride": 16, "aggregation_strategy": "simple"})


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, np.ndarray):
        return _rounded(value.tolist())
    if isinstance(value, np.generic):
        return _rounded(value.item())
    return value


# --- feature-extraction -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "key", "value"),
    [
        # a context of any length is read in windows of at most its 128 positions (/info
        # said 0, where every other text model said its length)
        ("question-answering", "max_input_length", 128),
        ("fill-mask", "mask_token", "[MASK]"),  # the server counts an answer's masks by it
    ],
)
def test_a_models_details_say_what_the_server_reads_of_it(runner, kind, key, value):
    assert runner(kind).details[key] == value


@pytest.mark.parametrize("word", ["\u0301", "\u0301\u0301", "\ue000"])
@pytest.mark.parametrize(
    ("kind", "task", "name", "param"),
    [
        ("fill-mask", None, "target", "targets"),
        ("zero-shot-classification", "zero-shot-classification", "label", "candidate_labels"),
    ],
)
def test_a_target_or_label_the_tokenizer_reads_as_nothing_is_refused(
    runner, word, kind, task, name, param
):
    """A combining mark (a BERT tokenizer strips accents) or a private-use character is no
    token: beside another target transformers dropped it unsaid (a 200 with one answer),
    and a label of it was scored as one ("This example is ."). The API's check of blank
    and format characters does not see them."""
    serving = runner(kind, task)
    text = "paris is the [MASK]" if kind == "fill-mask" else "i like this film"
    with pytest.raises(ValueError) as refused:
        serving.run([text], {param: ["paris", word]})
    assert str(refused.value).startswith(f"the {name} at index 1 ({word!r}) is no text")
    [answered] = serving.run([text], {param: ["paris", "capital"]})
    assert len(answered) == 2, answered


def test_fill_mask_lists_at_most_the_whole_vocabulary(runner):
    serving = runner("fill-mask")
    vocabulary = serving.pipe.model.config.vocab_size
    [listed] = serving.run(["paris is the [MASK]"], {"top_k": vocabulary + 5})
    assert len(listed) == vocabulary  # (topk past it would be an index error)
    assert len({entry["token"] for entry in listed}) == vocabulary


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fill_mask_scores_a_half_precision_model_in_float32(tiny_model, dtype):
    """As a GPU serves it: each score is the float32 softmax of the model's own logits,
    not that softmax rounded to the model's precision (a few digits, which tie tokens
    whose logits differ and list them in any order)."""
    import torch

    from rawserve.worker.loading import load_runner

    serving = load_runner(worker_config(tiny_model("fill-mask"), dtype=dtype), "cpu")
    text = "paris is the [MASK] of france"
    [listed] = serving.run([text], {"top_k": 20})
    encoded = serving.tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        logits = serving.pipe.model(**encoded).logits
    assert logits.dtype == getattr(torch, dtype)
    masked = encoded["input_ids"][0].tolist().index(serving.tokenizer.mask_token_id)
    probabilities = logits[0, masked].float().softmax(-1)
    scores = [entry["score"] for entry in listed]
    expected = [float(probabilities[entry["token"]]) for entry in listed]
    assert scores == pytest.approx(expected, rel=1e-6, abs=0)
    assert scores == sorted(scores, reverse=True)
    unlisted = probabilities.clone()
    unlisted[[entry["token"] for entry in listed]] = -1.0
    assert min(scores) >= float(unlisted.max())  # the likeliest, all of them


def test_embedding_options(runner):
    plain = runner("feature-extraction")
    [tokens] = plain.run(["hello world"], {})
    assert tokens.shape == (1, 4, 32)  # [CLS] hello world [SEP], the pipeline's shape
    [mean] = plain.run(["hello world"], {"pooling": "mean"})
    np.testing.assert_allclose(mean, tokens[0].mean(0), atol=1e-5)
    [cls] = plain.run(["hello world"], {"pooling": "cls", "normalize": True})
    np.testing.assert_allclose(cls, tokens[0][0] / np.linalg.norm(tokens[0][0]), atol=1e-5)
    [short] = plain.run(["hello world"], {"pooling": "mean", "dimensions": 8, "normalize": True})
    np.testing.assert_allclose(short, mean[:8] / np.linalg.norm(mean[:8]), atol=1e-5)


def test_the_embedding_routes_give_unit_vectors_of_a_model_without_a_normalize_module(runner):
    """OpenAI's and TEI's embeddings are unit length (clients compare them by their dot
    product): a plain encoder's files name no Normalize module, so its mean vector is
    normalized on those routes, unless the request says not to (TEI's `normalize`)."""
    plain = runner("feature-extraction")
    [mean] = plain.run(["hello world"], {"pooling": "mean"})
    [api] = plain.run(["hello world"], {}, EMBEDDING_ROUTE)
    np.testing.assert_allclose(api["embedding"], mean / np.linalg.norm(mean), atol=1e-5)
    [kept] = plain.run(["hello world"], {"normalize": False}, EMBEDDING_ROUTE)
    np.testing.assert_allclose(kept["embedding"], mean, atol=1e-5)


def test_token_vectors_are_read_back_from_the_device_at_once(runner, monkeypatch):
    """Each text's token vectors (pooling none, TEI's /embed_all) were counted and copied
    back to the host a text at a time: on a GPU two round trips a text. A batch's reads
    no longer grow with its texts, and each text keeps its own tokens."""
    from tests.graph_recording import HostReads

    plain = runner("feature-extraction")
    reads = HostReads(monkeypatch)
    texts = ["hello world", "the movie was very good", "a", "paris"]
    alone = [plain.run([text], {"pooling": "none", "normalize": True})[0] for text in texts]
    before = reads.count
    plain.run(texts[:1], {"pooling": "none", "normalize": True})
    one = reads.count - before
    together = plain.run(texts, {"pooling": "none", "normalize": True})
    assert reads.count - before - one == one
    for mine, expected in zip(together, alone, strict=True):
        assert mine.shape == expected.shape
        np.testing.assert_allclose(mine, expected, atol=1e-5)


def test_embedding_truncation_keeps_the_side_asked_for(runner):
    plain = runner("feature-extraction")
    long_text = " ".join(["hello"] * 200 + ["world"] * 200)
    [right] = plain.run([long_text], {})
    [left] = plain.run([long_text], {"truncation_direction": "left"})
    assert right.shape == left.shape == (1, 128, 32)
    assert not np.allclose(right, left)


def test_sentence_models_pool_as_their_files_say(runner):
    [vector] = runner("sentence-embedding").run(["hello world"], {})
    assert vector.shape == (32,) and np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    [api] = runner("sentence-embedding").run(["hello world"], {}, EMBEDDING_ROUTE)
    np.testing.assert_allclose(api["embedding"], vector, atol=1e-6)
    assert api["tokens"] == 4


def test_token_ids_are_embedded_as_the_text_they_tokenize(runner):
    """OpenAI's token arrays: the model's own ids (special tokens included) read as they
    are give the text's vector, beside texts in one batch too; longer ones are cut as a
    text is, and an id past the vocabulary is the input's error, never the model's."""
    serving = runner("sentence-embedding")
    texts = ["hello world", "the movie was good"]
    ids = [serving.tokenizer(text)["input_ids"] for text in texts]
    by_text = serving.run(texts, {}, EMBEDDING_ROUTE)
    mixed = serving.run([ids[0], texts[1], ids[1]], {}, EMBEDDING_ROUTE)
    for got, expected in zip(mixed, [by_text[0], by_text[1], by_text[1]], strict=True):
        np.testing.assert_allclose(got["embedding"], expected["embedding"], atol=1e-5)
        assert got["tokens"] == expected["tokens"]
    most = serving.details["max_input_length"]
    [long] = serving.run([ids[0] * most], {}, EMBEDDING_ROUTE)
    assert long["tokens"] == most
    with pytest.raises(ValueError, match="not in the model.s vocabulary"):
        serving.run([[2, serving.details["vocabulary"]]], {}, EMBEDDING_ROUTE)


# sentence-transformers' Pooling modes, on one text's token vectors (its formulas)
ST_POOLING = {
    "cls": lambda tokens: tokens[0],
    "lasttoken": lambda tokens: tokens[-1],
    "max": lambda tokens: tokens.max(0),
    "mean": lambda tokens: tokens.mean(0),
    "weightedmean": lambda tokens: weighted(tokens, np.arange(1, len(tokens) + 1)),
    "mean_sqrt_len_tokens": lambda tokens: tokens.sum(0) / np.sqrt(len(tokens)),
}


def weighted(tokens, weights):
    return (tokens * weights[:, None]).sum(0) / weights.sum()


def sentence_folder(tiny_model, tmp_path, pooling=None, **bert_config):
    """A copy of the tiny sentence-transformers model, its Pooling config replaced by
    `pooling`, with a sentence_bert_config.json of `bert_config`."""
    import json
    import shutil

    folder = tmp_path / "sentence"
    shutil.copytree(tiny_model("sentence-embedding"), folder)
    if pooling is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return folder


def sentence_runner(folder):
    from rawserve.worker.loading import load_runner

    return load_runner(worker_config(str(folder), dtype="float32"), "cpu")


@pytest.mark.parametrize("mode", sorted(ST_POOLING))
def test_sentence_models_pool_in_each_of_sentence_transformers_modes(tiny_model, tmp_path, mode):
    """Texts of different lengths share a padded batch; each is pooled as its mode says
    over its own tokens, then normalized (the folder has a Normalize module)."""
    folder = sentence_folder(
        tiny_model, tmp_path, {"embedding_dimension": 32, "pooling_mode": mode}
    )
    serving = sentence_runner(folder)
    texts = ["hello world", "the movie was very good in paris"]
    vectors = serving.run(texts, {})
    for text, vector in zip(texts, vectors, strict=True):
        [tokens] = serving.run([text], {"pooling": "none", "normalize": False})
        expected = ST_POOLING[mode](tokens[0])
        np.testing.assert_allclose(vector, expected / np.linalg.norm(expected), atol=1e-5)


def test_a_normalizing_sentence_models_token_vectors_are_not_normalized(tiny_model, tmp_path):
    """The folder's Normalize module normalizes its sentence vector: token vectors asked
    for with pooling "none" were each of unit length, where sentence-transformers'
    token_embeddings and TEI's /embed_all are the model's own. Asked, they are."""
    serving = sentence_runner(sentence_folder(tiny_model, tmp_path))
    [tokens] = serving.run(["hello world"], {"pooling": "none"})
    [plain] = serving.run(["hello world"], {"pooling": "none", "normalize": False})
    np.testing.assert_allclose(tokens, plain)
    assert not np.allclose(np.linalg.norm(tokens[0], axis=-1), 1.0, atol=1e-3)
    [unit] = serving.run(["hello world"], {"pooling": "none", "normalize": True})
    np.testing.assert_allclose(np.linalg.norm(unit[0], axis=-1), 1.0, atol=1e-5)


def test_sentence_models_cut_and_lowercase_texts_as_sentence_bert_config_says(tiny_model, tmp_path):
    import json

    folder = sentence_folder(tiny_model, tmp_path, max_seq_length=5, do_lower_case=True)
    tokenizer_file = folder / "tokenizer.json"  # a cased tokenizer: the lowercasing shows
    tokenizer = json.loads(tokenizer_file.read_text())
    tokenizer["normalizer"]["lowercase"] = False
    tokenizer_file.write_text(json.dumps(tokenizer))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["do_lower_case"] = False  # (else transformers lowercases in the tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    serving = sentence_runner(folder)
    assert serving.details["max_input_length"] == 5
    [long] = serving.run(["hello world is good and bad"], {}, EMBEDDING_ROUTE)
    assert long["tokens"] == 5
    [upper, lower] = serving.run(["HELLO World", "hello world"], {})
    np.testing.assert_allclose(upper, lower, atol=1e-6)
    # the server's tokenizer (/tokenize, its counts) lowercases too: it listed a cased
    # text's own ids ([UNK]s), not those the model read
    import tokenizers

    served = tokenizers.Tokenizer.from_str(serving.tokenizer_json())
    assert served.encode("HELLO World").ids == served.encode("hello world").ids
    assert served.encode("HELLO World").offsets == served.encode("hello world").offsets


def left_padded(tiny_model, tmp_path, kind="text-generation"):
    """A tiny model, its tokenizer saved to pad on the left (as many decoders' are)."""
    folder = tmp_path / "left-padded"
    shutil.copytree(tiny_model(kind), folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))
    return str(folder)


@pytest.mark.parametrize(
    ("task", "params"),
    [("feature-extraction", {"pooling": "lasttoken"}), ("text-classification", {})],
)
def test_a_left_padding_decoder_answers_each_input_as_alone(tiny_model, tmp_path, task, params):
    """A decoder's positions count from its first token: padded on its tokenizer's left,
    a short input beside a long one would be read at shifted positions (its vector 0.25
    cosine from its own alone). Encoders and classifiers pad on the right, pads unseen."""
    from rawserve.worker.loading import load_runner

    config = worker_config(left_padded(tiny_model, tmp_path), task, dtype="float32")
    serving = load_runner(config, "cpu")
    texts = ["good movie", "the city of paris " * 10]
    together = serving.run(texts, params)
    for text, got in zip(texts, together, strict=True):
        [alone] = serving.run([text], params)
        if task == "text-classification":
            assert got["label"] == alone["label"]
            got, alone = got["score"], alone["score"]
        np.testing.assert_allclose(got, alone, atol=1e-5)


def test_a_left_padding_seq2seq_encoder_reads_each_input_as_alone(tiny_model, tmp_path):
    """BART's positions are absolute too: what its encoder makes of a text beside a longer
    one is what it makes of it alone (the tiny model's answers are one text for every
    input, so its encoder's states are compared)."""
    from rawserve.worker.loading import load_runner

    folder = left_padded(tiny_model, tmp_path, "seq2seq")
    serving = load_runner(worker_config(folder, "summarization", dtype="float32"), "cpu")
    read = []
    serving.model.get_encoder().register_forward_hook(
        lambda module, args, kwargs, out: read.append((kwargs["attention_mask"], out[0])),
        with_kwargs=True,
    )
    serving.run(["good movie", "the city of paris " * 10], {"max_new_tokens": 2})
    serving.run(["good movie"], {"max_new_tokens": 2})
    (mask, together), (_, alone) = read
    np.testing.assert_allclose(together[0][mask[0].bool()], alone[0], atol=1e-5)


# --- question-answering -------------------------------------------------------------------

CONTEXT = "john lives in paris and mary lives in london"


def test_question_answering_answers_a_span_of_the_context(runner):
    qa = runner("question-answering")
    [best] = qa.run([{"question": "who lives in paris", "context": CONTEXT}], {})
    assert set(best) == {"score", "start", "end", "answer"}
    assert best["answer"] == CONTEXT[best["start"] : best["end"]] and best["answer"]
    [three] = qa.run([{"question": "who lives in paris", "context": CONTEXT}], {"top_k": 3})
    assert len(three) == 3 and three[0] == best
    assert len({(a["start"], a["end"]) for a in three}) == 3
    assert [a["score"] for a in three] == sorted((a["score"] for a in three), reverse=True)


def test_question_answering_options(runner):
    qa = runner("question-answering")
    item = {"question": "who lives in paris", "context": CONTEXT}
    [short] = qa.run([item], {"top_k": 5, "max_answer_len": 1})
    assert all(len(a["answer"].split()) == 1 for a in short)
    [with_null] = qa.run([item], {"top_k": 50, "handle_impossible_answer": True})
    [without] = qa.run([item], {"top_k": 50})
    # "no answer" once (a tester saw it twice: beside the empty span the pipeline lets
    # through at score 0), at the score of the no-answer pair
    [empty] = [a for a in with_null if a["answer"] == ""]
    assert [a for a in without if a["answer"] == ""] == [
        {"score": 0.0, "start": 0, "end": 0, "answer": ""}
    ]
    assert empty["start"] == empty["end"] == 0 and 0 < empty["score"] <= 1
    assert [a for a in with_null if a["answer"]] == [a for a in without if a["answer"]][
        : len(with_null) - 1
    ]


def test_question_answering_takes_the_old_name_topk(runner):
    """transformers 4's pipeline took `topk` for `top_k`, and clients written for it
    send it (the README lists it)."""
    qa = runner("question-answering")
    item = {"question": "who lives in paris", "context": CONTEXT}
    [old] = qa.run([item], {"topk": 3})
    assert len(old) == 3 and _rounded(old) == _rounded(qa.run([item], {"top_k": 3})[0])


def test_question_answering_adds_up_answers_that_differ_only_in_case(runner):
    """ "Paris" and "paris" are one answer, their scores added, as the pipeline gave them:
    never the same answer twice in a client's top_k, nor one at its first span's score."""
    qa = runner("question-answering")
    item = {"question": "where", "context": "Paris is big and paris is old"}
    [answers] = qa.run([item], {"top_k": 50})
    texts = [answer["answer"].lower() for answer in answers]
    assert "paris" in texts and len(texts) == len(set(texts))
    [paris] = [answer for answer in answers if answer["answer"].lower() == "paris"]
    # each span's score: its start's and its end's probability over the context and [CLS]
    encoded = qa.windows([item], qa.options({"top_k": 50}))
    [encoding] = encoded.encodings
    starts, ends = qa.logits(encoded)
    ids = np.array(encoding.ids)
    wanted = np.array([s == 1 for s in encoding.sequence_ids]) | (ids == qa.tokenizer.cls_token_id)

    def probabilities(logits):
        logits = np.where(wanted, logits[: len(ids)], -10000.0)
        exp = np.exp(logits - logits.max())
        return exp / exp.sum()

    start, end = probabilities(starts[0]), probabilities(ends[0])
    both = [
        i for i, s in enumerate(encoding.sequence_ids) if s == 1 and encoding.tokens[i] == "paris"
    ]
    assert len(both) == 2
    assert paris["score"] == pytest.approx(sum(start[i] * end[i] for i in both), rel=1e-4)


def test_question_answering_s_no_answer_score_is_its_lowest_window_s(runner):
    """With handle_impossible_answer, "no answer" is offered at the lowest score any
    window gives it (the pipeline's), a probability as every score is: each window's is
    what that window's text gives alone."""
    qa = runner("question-answering")
    question, context = "where", " ".join(["the city of paris is in france"] * 4)
    options = {"max_seq_len": 16, "handle_impossible_answer": True, "top_k": 100}

    def no_answer(context: str) -> float:
        [answers] = qa.run([{"question": question, "context": context}], options)
        return max(answer["score"] for answer in answers if answer["answer"] == "")

    encoded = qa.windows([{"question": question, "context": context}], qa.options(options))
    windows = []
    for encoding in encoded.encodings:
        own = [i for i, sequence in enumerate(encoding.sequence_ids) if sequence == 1]
        windows.append(context[encoding.offsets[own[0]][0] : encoding.offsets[own[-1]][1]])
    assert len(windows) > 1
    each = [no_answer(window) for window in windows]
    assert 0 < min(each) < max(each) <= 1  # a probability, as every answer's score
    assert no_answer(context) == pytest.approx(min(each))


def test_question_answering_long_contexts_are_read_in_windows(runner):
    qa = runner("question-answering")
    context = " ".join(["the city of paris is in france"] * 30)
    [best] = qa.run([{"question": "where", "context": context}], {"max_seq_len": 32})
    assert best["answer"] == context[best["start"] : best["end"]]


def test_question_answering_a_stride_past_the_room_the_question_leaves_is_the_client_s(runner):
    # max_seq_len 16 leaves a 3-token question 10 tokens of context a window, and the
    # default doc_stride is 8: fine. A 5-token question leaves 8: the tokenizer panicked
    # on a context that needs windows, and the panic killed the worker.
    qa = runner("question-answering")
    context = " ".join(["the city of paris is in france"] * 5)
    options = {"max_seq_len": 16}
    [fits] = qa.run([{"question": "who lives here", "context": context}], options)
    assert fits["answer"] == context[fits["start"] : fits["end"]]
    question = "who lives in paris now"
    with pytest.raises(ValueError, match="doc_stride 8 must be less than that"):
        qa.run([{"question": question, "context": context}], options)
    [short] = qa.run([{"question": question, "context": "paris"}], options)  # one window
    assert short["answer"] == "paris"


def test_question_answering_a_dense_doc_stride_is_refused_before_its_windows_are_made(
    runner, monkeypatch
):
    """A 1 MB context at doc_stride 120 of 128 makes 200,000 windows, which the tokenizer
    made in one call (the worker grew by 4 GB): refused at once; the pipeline's own
    stride on a long context is still read."""
    qa = runner("question-answering")
    calls: list[int] = []
    tokenize = qa.windows
    monkeypatch.setattr(qa, "windows", lambda *a: calls.append(1) or tokenize(*a))
    item = {"question": "what?", "context": "word " * 200_000}
    with pytest.raises(ValueError) as refused:
        qa.run([item], {"doc_stride": 120, "max_answer_len": 1000})
    message = str(refused.value)
    assert "windows of 128 tokens at doc_stride 120" in message, message
    assert "send a smaller doc_stride or a shorter context" in message
    assert not calls
    context = "the city of paris is in france " * 500  # 3,500 tokens: ~60 windows
    [best] = qa.run([{"question": "where", "context": context}], {})
    assert best["answer"] == context[best["start"] : best["end"]]


@pytest.mark.parametrize("stride", [15, 16])
def test_question_answering_a_stride_that_leaves_no_new_tokens_is_said_in_its_own_words(
    runner, stride
):
    """A doc_stride just under max_seq_len, or equal to it (transformers counts its
    special tokens its own way and refuses before rawserve's check of the room): the
    client got transformers' words about a "tokenizer stride" it never sent."""
    qa = runner("question-answering")
    item = {"question": "who", "context": "john lives in paris"}
    with pytest.raises(ValueError) as refused:
        qa.run([item], {"max_seq_len": 16, "doc_stride": stride})
    message = str(refused.value)
    assert f"doc_stride {stride}" in message and "tokenizer stride" not in message, message


def test_question_answering_runs_many_windows_in_bounded_passes(runner, monkeypatch):
    """A doc_stride just under max_seq_len makes a window every token or two: the
    windows go through the model a bounded number at a time, with the same answers."""
    from rawserve.worker import span_extraction
    from rawserve.worker.span_extraction import WINDOWS_PER_PASS

    qa = runner("question-answering")
    item = {"question": "where", "context": CONTEXT * 18}
    options = {"max_seq_len": 16, "doc_stride": 10}
    passes: list[int] = []
    hook = qa.model.register_forward_hook(
        lambda _, args, kwargs, out: passes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    try:
        [answer] = qa.run([item], {**options, "top_k": 3})
    finally:
        hook.remove()
    assert len(passes) > 1 and max(passes) == WINDOWS_PER_PASS
    monkeypatch.setattr(span_extraction, "WINDOWS_PER_PASS", len(passes) * WINDOWS_PER_PASS)
    [whole] = qa.run([item], {**options, "top_k": 3})  # every window in one pass
    assert [a["answer"] for a in answer] == [a["answer"] for a in whole]
    np.testing.assert_allclose([a["score"] for a in answer], [a["score"] for a in whole])


def test_question_answering_runs_no_more_windows_once_nobody_waits(runner):
    """Once nobody waits for the batch (its clients gone, its deadlines passed), the
    windows left are not run: a 34 KB context went on for 4 s past its 504, the next
    request waiting behind it. The batch still ends with answers, which nobody reads."""
    qa = runner("question-answering")
    item = {"question": "where", "context": CONTEXT * 18}
    passes: list[int] = []
    hook = qa.model.register_forward_hook(
        lambda _, args, kwargs, out: passes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    qa.bind_cancel(lambda: bool(passes))  # gone once the first pass ran
    try:
        [answer] = qa.run([item], {"max_seq_len": 16, "doc_stride": 10})
    finally:
        hook.remove()
        qa.bind_cancel(lambda: False)
    assert len(passes) == 1 and answer["answer"] == ""  # nor read out of the windows


def test_question_answering_reads_no_more_windows_once_nobody_waits(runner, monkeypatch):
    """Nor are the windows read for their answers once nobody waits: reading them was
    most of a long context's time (900 KB: 70 s, past its 504 and a worker's kill for
    hanging), after every pass had run. Their answers add up by text as before."""
    from rawserve.worker import span_extraction

    monkeypatch.setattr(span_extraction, "WINDOWS_PER_PASS", 10_000)  # one pass
    qa = runner("question-answering")
    item = {"question": "where", "context": CONTEXT * 18}
    options = {"max_seq_len": 16, "doc_stride": 10, "top_k": 3}
    [whole] = qa.run([item], options)
    assert len({a["answer"].lower() for a in whole}) == 3  # one answer a text, in any case
    qa.bind_cancel(cancelled := GivesUp(after=1))  # waited for through the pass alone
    try:
        [answer] = qa.run([item], options)
    finally:
        qa.bind_cancel(lambda: False)
    assert cancelled.asked == 2 and answer == {"score": 0.0, "start": 0, "end": 0, "answer": ""}


@pytest.mark.parametrize("context", ["\u200b", "\x00\x01", "\ufeff\ufeff"])
def test_a_context_that_reads_as_no_tokens_is_refused_as_a_blank_one(runner, context):
    """Zero-width spaces or control characters only: the tokenizer reads no token, and
    the only answer was the empty span at [CLS], 200 with score 0 (made up)."""
    qa = runner("question-answering")
    with pytest.raises(ValueError, match="the context reads as no tokens"):
        qa.run([{"question": "who", "context": context}], {})


@pytest.mark.parametrize("blank", ["\u200b", "\x00\x01"])
def test_a_context_that_reads_as_no_tokens_fails_alone_in_a_batch(runner, blank):
    """Batched with a good context (the server batches concurrent requests), a blank one
    is still refused, and alone: it got the made-up empty answer at [CLS]."""
    from rawserve.worker.batch_runs import run_batch

    qa = runner("question-answering")
    good = {"question": "who lives in paris", "context": "john lives in paris"}
    answered, failed = run_batch(qa, [good, {"question": "who", "context": blank}], {})
    assert answered == qa.run([good], {})[0]
    assert isinstance(failed, ItemFailure) and failed.kind == FailureKind.INPUT
    assert "the context reads as no tokens" in failed.message


def test_a_doc_stride_larger_than_max_seq_len_is_refused_in_its_own_words(runner):
    """A window cannot overlap the one before it by more than its length: said in the
    two numbers the client sent, not in words about a room it never asked for."""
    qa = runner("question-answering")
    item = {"question": "who", "context": "john lives in paris " * 40}
    with pytest.raises(ValueError) as refused:
        qa.run([item], {"max_seq_len": 100, "doc_stride": 200})
    assert str(refused.value) == "doc_stride (200) is larger than max_seq_len (100)"
    assert qa.describe_failure(refused.value).kind == FailureKind.INPUT


@pytest.mark.parametrize("question", ["\u200b", "\x00", "\ufeff"])
def test_a_question_that_reads_as_no_tokens_is_refused(runner, question):
    """The same of the question: a span was picked (200 "lives in paris") for no question."""
    qa = runner("question-answering")
    with pytest.raises(ValueError, match="the question reads as no tokens"):
        qa.run([{"question": question, "context": CONTEXT}], {})


def test_question_answering_batches_answer_what_single_calls_answer(runner):
    qa = runner("question-answering")
    items = [
        {"question": "who lives in paris", "context": CONTEXT},
        {"question": "where", "context": "mary works in berlin"},
    ]
    alone = [qa.run([item], {"top_k": 2})[0] for item in items]
    assert _rounded(qa.run(items, {"top_k": 2})) == _rounded(alone)


def test_question_answering_with_a_tokenizer_that_pads_on_the_left(tiny_model, tmp_path):
    """A tokenizer that pads on the left (XLNet's) reads the context first; a batch's
    shorter windows are still padded after their tokens, so that each is read at the
    positions it has alone, answering what it answers alone (padded before, a model of
    absolute positions, as the tiny BERT is, read them shifted)."""
    from rawserve.worker.loading import load_runner

    folder = tmp_path / "left"
    shutil.copytree(tiny_model("question-answering"), folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))
    qa = load_runner(worker_config(str(folder), "question-answering", dtype="float32"), "cpu")
    assert qa.tokenizer.padding_side == "left"
    items = [
        {"question": "who lives in paris", "context": CONTEXT},
        {"question": "where", "context": "mary works in berlin"},
    ]
    alone = [qa.run([item], {"top_k": 2})[0] for item in items]
    assert _rounded(qa.run(items, {"top_k": 2})) == _rounded(alone)


# --- summarization, translation, text2text-generation -----------------------------------


@pytest.fixture(scope="module")
def t5_summarizer(tmp_path_factory):
    """A tiny T5 whose tokenizer (BERT's) skips control and format characters."""
    from rawserve.worker.loading import load_runner
    from tests import fidelity_models

    folder = fidelity_models.build("t5", tmp_path_factory.mktemp("t5"))
    return load_runner(worker_config(str(folder), "summarization", dtype="float32"), "cpu")


@pytest.mark.parametrize(
    "text", ["\x00", "\u200b\ufeff", "\u0301", "\ue000", "\ufffd", "\ufffd" * 65, "\u0301" * 80]
)
def test_a_text_the_seq2seq_tokenizer_reads_as_nothing_is_refused(t5_summarizer, runner, text):
    """A T5's tokenizer here skips control and format characters: the model saw its task's
    prefix alone and made up an answer (200), where a blank text is refused. A text with
    something visible beside them is answered; a byte-level BART reads them as tokens."""
    with pytest.raises(ValueError, match="reads as no tokens"):
        t5_summarizer.run(["fine", text], {"max_new_tokens": 3})
    [answer] = t5_summarizer.run([text + "fine"], {"max_new_tokens": 3})
    assert set(answer) == {"summary_text"}
    if not shows(text):  # (control and format characters: BART's bytes read them)
        [answer] = runner("seq2seq", "summarization").run([text], {"max_new_tokens": 3})
        assert set(answer) == {"summary_text"}


def test_a_most_asked_below_the_task_s_least_is_answered_without_a_warning(t5_summarizer, caplog):
    """T5's summarization settings say min_length 10 and max_length 40: a request asking
    at most 3 new tokens got them (the most asked wins), and generate() warned, at every
    such request, that the lengths could not both be met (a UserWarning) and that both
    max_new_tokens and max_length were set (the worker's log)."""
    import transformers

    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            [answer] = t5_summarizer.run(["a fine day"], {"max_new_tokens": 3})
            t5_summarizer.run(["a fine day"], {"max_new_tokens": 30})
    finally:
        transformers.logging.disable_propagation()
    ids = t5_summarizer.tokenizer(answer["summary_text"], add_special_tokens=False)["input_ids"]
    assert len(ids) <= 3
    assert "seem to have been set" not in caplog.text and "length" not in caplog.text


def test_a_length_asked_of_a_model_whose_config_names_one_is_answered_without_a_warning(
    tmp_path, caplog
):
    """A generation config naming max_length (bart-large-cnn's 142) and min_length: each
    request naming max_new_tokens or min_new_tokens was answered with generate()'s "Both
    ... seem to have been set" in the worker's log, though the lengths are settled here."""
    import transformers

    from rawserve.worker.loading import load_runner
    from tests import fidelity_models

    folder = fidelity_models.build("t5", tmp_path / "t5")
    config = transformers.GenerationConfig.from_pretrained(folder)
    config.update(max_length=24, min_length=2)
    config.save_pretrained(folder)
    summarize = load_runner(worker_config(str(folder), "summarization", dtype="float32"), "cpu")
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            summarize.run(["a fine day"], {"max_new_tokens": 3, "min_new_tokens": 2})
    finally:
        transformers.logging.disable_propagation()
    assert "seem to have been set" not in caplog.text


def test_seq2seq_batches_answer_what_single_calls_answer(runner):
    summarize = runner("seq2seq", "summarization")
    texts = ["the movie was very good and i like it", "hello"]
    params = {"max_new_tokens": 6}
    assert summarize.run(texts, params) == [summarize.run([t], params)[0] for t in texts]
    assert set(summarize.run(texts, params)[0]) == {"summary_text"}


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"num_return_sequences": 3, "num_beams": 2}, "more answers than num_beams 2 keeps"),
        # beam sampling keeps num_beams too: the advice was do_sample, refused again in
        # generate()'s own words
        (
            {"num_return_sequences": 3, "num_beams": 2, "do_sample": True},
            "set do_sample true and num_beams 1",
        ),
        ({"max_length": 1}, "max_length 1 holds only the decoder's start token"),
        # generate() ignored the least, and a 200 answered what was not asked for
        ({"min_new_tokens": 50, "max_new_tokens": 3}, "min_new_tokens 50 asks for more new"),
        ({"generate_parameters": {"min_length": 5, "max_length": 3}}, "min_length 5 .*length 3"),
        # a least and a most of the other names, as generate() reads them (a tester)
        ({"min_length": 20, "max_new_tokens": 5}, r"min_length 20 \(the decoder's start token"),
        ({"min_new_tokens": 10, "max_length": 6}, "than max_length 6"),
    ],
)
def test_seq2seq_settings_generate_refuses_are_said_in_rawserves_words(runner, params, says):
    """generate()'s own words named `decoder_input_ids` and its checks' internals."""
    summarize = runner("seq2seq", "summarization")
    with pytest.raises(ValueError, match=says):
        summarize.run(["hello"], params)


def test_seq2seq_clean_up_of_spaces_is_done_for_a_bpe_tokenizer_too(tiny_model):
    """`clean_up_tokenization_spaces: true` asks for transformers 4.57's answer, which
    cleaned up for any tokenizer: 5 skips it for a BPE one (BART's, with a warning in the
    worker's log), and the client got "hello world ." as asked for without it."""
    import transformers

    from rawserve.worker.seq2seq_lm import decoded

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model("seq2seq"))
    assert type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    ids = [tokenizer("hello world . is it ?")["input_ids"]]
    assert decoded(tokenizer, ids, True) == ["hello world. is it?"]
    assert decoded(tokenizer, ids, False) == decoded(tokenizer, ids, None)
    assert decoded(tokenizer, ids, False) == ["hello world . is it ?"]


@pytest.mark.parametrize(
    ("caller", "most"),
    [
        # generate() reads max_new_tokens over max_length, min_new_tokens over min_length:
        # a pair of which one is not read is not refused (a tester)
        ({"min_length": 20, "max_length": 6, "max_new_tokens": 50}, 50),
        ({"min_length": 20, "min_new_tokens": 2, "max_length": 6}, 127),
        # a least past the model's own most, no most asked: the most is raised to it
        ({"min_new_tokens": 128}, 128),
        ({"min_length": 129}, 128),
        ({"min_new_tokens": 5}, 127),
    ],
)
def test_seq2seq_least_and_most_are_judged_as_generate_reads_them(caller, most):
    from rawserve.worker.seq2seq_lm import settled

    options = settled({"max_new_tokens": 127, **caller}, caller)  # (127: the model's own)
    assert options["max_new_tokens"] == caller.get("max_new_tokens", most)


def test_a_least_past_the_max_length_of_the_models_generation_config_raises_it(runner, monkeypatch):
    """A model whose generation config sets its own max_length (10): a least asked past it,
    no most asked, was left unmet with a 200 (9 new tokens); it raises the most, as where
    the pipeline's default is the most."""
    from rawserve.worker.seq2seq_lm import settled

    own = {"max_new_tokens": None, "max_length": 10}
    assert settled({}, {"min_new_tokens": 15}, own)["max_new_tokens"] == 15
    assert settled({}, {"min_length": 16}, own)["max_new_tokens"] == 15
    assert "max_new_tokens" not in settled({}, {"min_new_tokens": 5}, own)
    summarize = runner("seq2seq", "summarization")
    monkeypatch.setattr(summarize.model.generation_config, "max_length", 10)
    monkeypatch.setattr(summarize.model.generation_config, "max_new_tokens", None)
    monkeypatch.setattr(summarize, "defaults", summarize.pipeline_defaults())
    assert "max_new_tokens" not in summarize.defaults  # (the model's own is read)
    text = ["the movie was very good and i like it"]
    raised = summarize.run(text, {"min_new_tokens": 15})
    assert raised == summarize.run(text, {"min_new_tokens": 15, "max_new_tokens": 15})
    assert raised != summarize.run(text, {"max_new_tokens": 9})


def test_a_seq2seq_max_new_tokens_beside_a_max_length_is_the_length(runner):
    """generate() runs to max_new_tokens when both are given; the max_length alone is the
    length wanted (a default max_new_tokens does not override it)."""
    summarize = runner("seq2seq", "summarization")
    text = ["the movie was very good and i like it"]
    both = summarize.run(text, {"max_length": 3, "max_new_tokens": 8})
    assert both == summarize.run(text, {"max_new_tokens": 8})
    assert both != summarize.run(text, {"max_length": 3})
    # ... and a max_length past the positions beside it is not read either (a tester)
    past = summarize.model.config.max_position_embeddings + 50
    assert summarize.run(text, {"max_length": past, "max_new_tokens": 8}) == both


def test_a_seq2seq_model_makes_as_many_new_tokens_as_its_positions(runner):
    """The decoder reads its start token and each new token but the last: 128 positions
    make 128 tokens, as transformers 4's pipeline made them; 127 was the most allowed
    (a tester)."""
    summarize = runner("seq2seq", "summarization")
    positions = summarize.model.config.max_position_embeddings
    assert summarize.limits.max_new_tokens == positions
    made = {"max_new_tokens": positions, "min_new_tokens": positions, "num_beams": 1}
    [answer] = summarize.run(["the movie was good"], made)
    ids = summarize.tokenizer(answer["summary_text"], add_special_tokens=False)["input_ids"]
    assert len(ids) >= positions // 2  # (what decodes to fewer pieces, at most the 128)


def test_a_seq2seq_temperature_of_zero_is_greedy(runner):
    """As the causal LM's is (TGI's and OpenAI's reading); generate() refused it."""
    summarize = runner("seq2seq", "summarization")
    greedy = {"max_new_tokens": 5, "num_beams": 1}
    text = ["the movie was good"]
    zero = summarize.run(text, {**greedy, "do_sample": True, "temperature": 0.0})
    assert zero == summarize.run(text, greedy)


def test_a_tiny_seq2seq_temperature_draws_at_the_least_one_not_an_empty_answer(runner):
    """Below it the scores overflowed and every draw was the end: 200 with ""."""
    import torch

    from rawserve.worker.scores import MIN_TEMPERATURE

    summarize = runner("seq2seq", "summarization")
    text, drawn = ["the movie was good"], {"do_sample": True, "num_beams": 2}
    answers = []
    for temperature in (1e-12, MIN_TEMPERATURE):
        with torch.random.fork_rng():  # (the seed stays this test's)
            torch.manual_seed(0)
            answers.append(summarize.run(text, {**drawn, "temperature": temperature}))
    assert answers[0] == answers[1]
    assert answers[0][0]["summary_text"]


@pytest.mark.parametrize("task", ["summarization", "translation"])
def test_a_seq2seq_model_says_how_it_generates(runner, task):
    """/info's `generation` was null for summarization and translation, which generate
    one batch at a time (null reads as "not generating")."""
    generation = runner("seq2seq", task).generation_mode
    assert generation == "static (one generate call per batch): an encoder-decoder model"


def test_a_seq2seq_model_says_what_it_cuts_an_input_to(runner):
    """/info's max_input_length was 0 (unknown) for an encoder-decoder, and /tokenize's
    "truncate" cut nothing."""
    summarize = runner("seq2seq", "summarization")
    assert summarize.details["max_input_length"] == summarize.input_limit > 0


def test_seq2seq_prefixes_and_output_keys(runner, tiny_model):
    import torch
    import transformers

    folder = tiny_model("seq2seq")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()

    def generate(text):
        # the pipelines' num_beams=4, as the model's generation config names none
        with torch.inference_mode():
            ids = model.generate(
                **tokenizer([text], return_tensors="pt"), max_new_tokens=5, num_beams=4
            )
        return tokenizer.batch_decode(ids, skip_special_tokens=True)[0]

    text = "the movie was good"
    summary = runner("seq2seq", "summarization").run([text], {"max_new_tokens": 5})
    assert summary == [{"summary_text": generate("summarize: " + text)}]
    translate = runner("seq2seq", "translation")
    french = translate.run(
        [text], {"src_lang": "en", "tgt_lang": "fr", "generate_parameters": {"max_new_tokens": 5}}
    )
    assert french == [{"translation_text": generate("translate English to French: " + text)}]
    with pytest.raises(ValueError, match="does not translate"):
        translate.run([text], {"src_lang": "en", "tgt_lang": "de"})
    # one language named: the one direction that has it (its error named None for the other)
    for one in ({"tgt_lang": "fr"}, {"src_lang": "en"}):
        asked = {**one, "generate_parameters": {"max_new_tokens": 5}}
        assert translate.run([text], asked) == french
    with pytest.raises(ValueError, match=r"does not translate to 'de' \(it names") as refused:
        translate.run([text], {"tgt_lang": "de"})
    assert "None" not in str(refused.value)
    # a language two directions name: the other one is asked for
    translate.directions.append("translation_en_to_de")
    try:
        with pytest.raises(
            ValueError, match="translation_en_to_fr, translation_en_to_de: name tgt_lang too"
        ):
            translate.run([text], {"src_lang": "en"})
    finally:
        translate.directions.remove("translation_en_to_de")
    generated = runner("seq2seq", "text2text-generation").run([text], {"max_new_tokens": 5})
    assert generated == [{"generated_text": generate(text)}]


class GivesUp:
    """What says whether anybody waits for the batch: asked once a token, the server gives
    up after `after` of them."""

    def __init__(self, after: int):
        self.after, self.asked = after, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.asked > self.after


@pytest.mark.parametrize(
    "params",
    [
        {"max_new_tokens": 4},
        {"max_new_tokens": 4, "num_beams": 3},
        {"max_new_tokens": 4, "do_sample": True},
    ],
)
def test_a_seq2seq_input_whose_model_scores_are_not_numbers_fails_alone(runner, params):
    """A model that overflows (float16, as a GPU serves it) on one input: greedy and beam
    search took token 0 from its NaN scores and answered an empty text, and sampling
    blamed a temperature never set (422); the input now fails alone, the model's fault."""
    import torch

    from rawserve.worker.batch_runs import run_bisecting
    from rawserve.worker.runner import MODEL_SCORES_FAILED_MESSAGE

    generating = runner("seq2seq", "text2text-generation")
    poisoned = generating.tokenizer("paris", add_special_tokens=False)["input_ids"][0]

    def overflow(_module, _args, kwargs, output):  # an input holding "paris" overflows
        rows = (kwargs["input_ids"] == poisoned).any(-1)
        output.last_hidden_state[rows] = float("nan")
        return output

    texts = ["the movie was good", "paris is a city"]
    hook = generating.model.get_encoder().register_forward_hook(overflow, with_kwargs=True)
    try:
        with torch.random.fork_rng():  # a draw of the tiny model may end at once: seeded
            torch.manual_seed(0)
            good, failed = run_bisecting(generating, texts, params)
    finally:
        hook.remove()
    assert failed == ItemFailure(FailureKind.INTERNAL, MODEL_SCORES_FAILED_MESSAGE)
    assert isinstance(good, dict) and good["generated_text"]


@pytest.mark.parametrize("beams", [1, 4])
def test_a_seq2seq_batch_nobody_waits_for_stops_generating_at_its_next_token(runner, beams):
    """As a causal model's: `generate` ran a summary or translation to its length whatever
    happened to its requests, so one past its deadline (504) held the worker while every
    request queued behind it met its own 504. Beam search stops as greedy search does."""
    summarize = runner("seq2seq", "summarization")
    summarize.bind_cancel(cancelled := GivesUp(after=3))
    try:
        params = {"max_new_tokens": 40, "min_new_tokens": 40, "num_beams": beams}
        [output] = summarize.run(["the movie was very good and i like it"], params)
    finally:
        summarize.bind_cancel(lambda: False)
    assert cancelled.asked == 4  # (not asked again: it stopped there)
    assert len(summarize.tokenizer(output["summary_text"])["input_ids"]) < 40


@pytest.mark.parametrize("task", ["summarization", "translation", "text2text-generation"])
def test_a_seq2seq_model_without_task_settings_is_served(tiny_model, tmp_path, task):
    """Most seq2seq configs (Marian's, mBART's, NLLB's) name no task_specific_params, and
    transformers 5's configs have no such attribute unless the file names it."""
    import json
    import shutil

    from rawserve.worker.loading import load_runner

    folder = tmp_path / "plain-seq2seq"
    shutil.copytree(tiny_model("seq2seq"), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["task_specific_params"]
    (folder / "config.json").write_text(json.dumps(config))
    serving = load_runner(worker_config(str(folder), task, dtype="float32"), "cpu")
    [answer] = serving.run(["the movie was good"], {"max_new_tokens": 3})
    assert set(answer) == {OUTPUT_KEYS[task]}


@pytest.mark.parametrize("configured", [{"max_length": 300}, {"max_new_tokens": 200}])
def test_a_generation_config_length_past_the_positions_stops_there(
    tiny_model, tmp_path, configured
):
    """A model's own generation config may name more decoder tokens than its positions
    (128 here): its default output stops at the positions, where generate() would fail."""
    import shutil

    from rawserve.worker.loading import load_runner

    folder = tmp_path / "long-config"
    shutil.copytree(tiny_model("seq2seq"), folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, **configured}))
    serving = load_runner(worker_config(str(folder), "summarization"), "cpu")
    [answer] = serving.run(["the movie was good"], {"num_beams": 1, "min_new_tokens": 127})
    assert set(answer) == {"summary_text"}
    assert serving.limits.default_new_tokens == 127  # what the server counts it to cost


@pytest.mark.parametrize(
    ("kind", "task", "configured", "new_tokens", "beams"),
    [
        ("text-generation", "text-generation", {}, 255, 1),  # 256, within 256 positions
        ("text-generation", "text-generation", {"max_new_tokens": 40, "num_beams": 3}, 40, 3),
        ("seq2seq", "summarization", {}, 127, 4),  # the pipeline's beams, within positions
        ("seq2seq", "summarization", {"max_length": 21, "num_beams": 2}, 20, 2),
    ],
)
def test_a_generation_models_default_length_and_beams_are_told_to_the_server(
    tiny_model, tmp_path, kind, task, configured, new_tokens, beams
):
    """A request naming no length or beams gets the model's generation config's (else the
    pipeline's): the server counts its cost by them (rawserve.serving.core.decoding)."""
    import shutil

    from rawserve.worker.loading import load_runner

    folder = tmp_path / "configured"
    shutil.copytree(tiny_model(kind), folder)
    path = folder / "generation_config.json"
    settings = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**settings, **configured}))
    limits = load_runner(worker_config(str(folder), task), "cpu").limits
    assert (limits.default_new_tokens, limits.default_beams) == (new_tokens, beams)


@pytest.mark.parametrize("declared", [16, None])
def test_a_t5_encoder_reads_what_its_tokenizer_declares_or_else_512(tiny_model, tmp_path, declared):
    """A T5 sentence encoder (sentence-t5, GTR) as T5 itself: it read up to a million
    tokens where its tokenizer declared none (6,000 words: 2 GB; 400,000: out of memory,
    a 500), and was never cut, nor refused with truncate false."""
    import shutil

    from rawserve.worker.loading import load_runner
    from rawserve.worker.runner import UNDECLARED_INPUT_TOKENS

    folder = Path(shutil.copytree(tiny_model("t5-sentence-embedding"), tmp_path / "t5"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("model_max_length", None)
    if declared is not None:
        config["model_max_length"] = declared
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    serving = load_runner(worker_config(str(folder), "feature-extraction"), "cpu")
    limit = UNDECLARED_INPUT_TOKENS if declared is None else declared
    assert serving.limits.max_input_tokens == limit
    long_text = "the movie was good " * limit
    alone = serving.run([long_text], {})
    cut = serving.tokenizer.decode(
        serving.tokenizer(long_text, truncation=True, max_length=limit)["input_ids"],
        skip_special_tokens=True,
    )
    np.testing.assert_allclose(alone[0], serving.run([cut], {})[0], atol=1e-5)
    with pytest.raises(ValueError, match=f"at most {limit}"):
        serving.run([long_text], {"truncate": False})


@pytest.mark.parametrize("declared", [16, None])
def test_a_t5_reads_what_its_tokenizer_declares_or_else_512(tmp_path, declared):
    """T5 has relative positions, no bound of its own: an input is cut at the length its
    tokenizer declares (t5-*'s 512), and refused past it when cutting is refused; a
    tokenizer that declares none is read as T5's own 512 (whole, a 36 KB body's 30,000
    tokens took the worker's attention 18 GB)."""
    from rawserve.worker.loading import load_runner
    from rawserve.worker.runner import UNDECLARED_INPUT_TOKENS
    from tests import fidelity_models

    folder = fidelity_models.build("t5", tmp_path / "t5")
    if declared is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["model_max_length"] = declared
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    serving = load_runner(worker_config(str(folder), "text2text-generation"), "cpu")
    limit = UNDECLARED_INPUT_TOKENS if declared is None else declared
    assert serving.limits.max_input_tokens == limit
    long_text = "the movie was good " * (limit // 3)  # 4/3 of the limit's words: past it
    assert len(serving.tokenizer(long_text)["input_ids"]) > limit
    options = {"max_new_tokens": 3}
    cut = serving.tokenizer.decode(
        serving.tokenizer(long_text, truncation=True, max_length=limit)["input_ids"],
        skip_special_tokens=True,
    )
    assert serving.run([long_text], options) == serving.run([cut], options)
    with pytest.raises(ValueError, match=f"reads at most {limit}"):
        serving.run([long_text], {**options, "truncation": False})


def test_a_longt5_whose_tokenizer_declares_no_length_reads_what_it_was_trained_for(tmp_path):
    """LongT5's attention is local, its cost linear in the input: not cut at T5's 512."""
    import transformers

    from rawserve.worker.loading import load_runner
    from tests import fidelity_models

    tokenizer = fidelity_models._tokenizer()
    config = transformers.LongT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    folder = tmp_path / "longt5"
    transformers.LongT5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    saved.pop("model_max_length", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(saved))
    serving = load_runner(worker_config(str(folder), "text2text-generation"), "cpu")
    assert serving.limits.max_input_tokens == 16384
    long_text = "the movie was good " * 200  # past T5's 512, read whole
    assert serving.run([long_text], {"max_new_tokens": 2, "truncation": False})


def test_a_request_s_source_language_is_its_own(runner, monkeypatch):
    """NLLB's, mBART's and M2M100's tokenizers keep src_lang as their state: a request
    that names none reads its text in the model's own source language, whatever the
    request before it named."""
    serving = runner("multilingual-translation", "translation")
    read: list[list[int]] = []
    generate = serving.model.generate

    def reading(**inputs):
        read.append(inputs["input_ids"][0].tolist())
        return generate(**inputs)

    monkeypatch.setattr(serving.model, "generate", reading)
    params = {"max_new_tokens": 2, "num_beams": 1}
    serving.run(["hello world"], params)
    serving.run(["hello world"], {**params, "src_lang": "fra_Latn", "tgt_lang": "deu_Latn"})
    serving.run(["hello world"], params)
    first, french, after = read
    assert first != french and after == first


@pytest.mark.parametrize(
    ("source", "target", "unknown"),
    [
        ("xx_Zzzz", "fra_Latn", "xx_Zzzz"),
        ("eng_Latn", "xx_Zzzz", "xx_Zzzz"),
        # the tokenizer's own special tokens: in its vocabulary, but no language (generation
        # was forced to start on "</s>", 200)
        ("eng_Latn", "</s>", "</s>"),
        ("eng_Latn", "<mask>", "<mask>"),
        ("<pad>", "fra_Latn", "<pad>"),
    ],
)
def test_a_language_the_model_does_not_know_is_refused_either_way(runner, source, target, unknown):
    # an unknown source language was read as the unknown token: a translation of the
    # text as if from no language, answered 200, where an unknown target was refused
    serving = runner("multilingual-translation", "translation")
    params = {"max_new_tokens": 2, "num_beams": 1, "src_lang": source, "tgt_lang": target}
    with pytest.raises(ValueError, match=f"does not know the language '{unknown}'"):
        serving.run(["hello world"], params)


def test_a_target_language_alone_is_translated_into_from_the_models_own(runner, monkeypatch):
    # tgt_lang without src_lang was dropped: the answer came in the model's default
    # language, 200, where transformers 4's pipeline refused it; the text is read in the
    # tokenizer's own source language, as a request that names none is
    serving = runner("multilingual-translation", "translation")
    forced: list[object] = []
    generate = serving.model.generate

    def recording(**options):
        forced.append(options.get("forced_bos_token_id"))
        return generate(**options)

    monkeypatch.setattr(serving.model, "generate", recording)
    params = {"max_new_tokens": 2, "num_beams": 1}
    serving.run(["hello world"], {**params, "tgt_lang": "fra_Latn"})
    both = {"src_lang": serving.source_language, "tgt_lang": "fra_Latn"}
    serving.run(["hello world"], {**params, **both})
    assert forced[0] == forced[1] == serving.tokenizer.convert_tokens_to_ids("fra_Latn")
    with pytest.raises(ValueError, match="tgt_lang"):  # a source alone says into what?
        serving.run(["hello world"], {**params, "src_lang": "fra_Latn"})


# --- text-generation ----------------------------------------------------------------------


def test_generation_batches_with_left_padding_answer_what_single_calls_answer(runner):
    generate = runner("text-generation")
    prompts = ["hello", "the capital of france is", "i like this very good movie"]
    params = {"max_new_tokens": 6, "do_sample": False}
    assert generate.run(prompts, params) == [generate.run([p], params)[0] for p in prompts]
    [[output]] = generate.run(prompts[:1], {**params, "return_full_text": False})
    assert (
        prompts[0] + output["generated_text"]
        == generate.run(prompts[:1], params)[0][0]["generated_text"]
    )


def test_generation_stops_at_a_stop_sequence(runner):
    generate = runner("text-generation")
    params = {"max_new_tokens": 8, "do_sample": False, "return_full_text": False}
    [[free]] = generate.run(["hello"], params)
    stop = free["generated_text"][2:4]
    [[stopped]] = generate.run(["hello"], {**params, "stop": [stop], "details": True})
    # as in TGI, the text runs to the end of the token that completed the stop sequence
    assert stop in stopped["generated_text"]
    assert len(stopped["generated_text"]) < len(free["generated_text"])
    assert stopped["details"]["finish_reason"] == "stop_sequence"


def test_a_seeded_generation_leaves_torch_s_generators_as_they_were(runner):
    """Run whole (`--generation static`, or a beam search's config), a seeded sample
    seeded torch for good: every unseeded one after it, another client's, drew the same
    text."""
    import torch

    generate = runner("text-generation")
    params = {"max_new_tokens": 4, "do_sample": True, "return_full_text": False}
    before = torch.random.get_rng_state()
    [[seeded]] = generate.run(["hello"], {**params, "seed": 7})
    assert torch.equal(torch.random.get_rng_state(), before)
    assert generate.run(["hello"], {**params, "seed": 7}) == [[seeded]]  # (seeded still)


class FakeFlag:
    def __init__(self):
        self.value = 0


def test_streamed_tokens_go_to_the_pipe_and_a_cancel_stops_generation(runner):
    generate = runner("text-generation")
    flag = FakeFlag()
    sent: list[TokenChunk] = []

    def send(chunk):
        sent.append(chunk)
        if len(sent) == 3:  # the client leaves after the third token
            flag.value = 7

    generate.bind_stream(send, flag)
    try:
        # greedy: sampled tokens would depend on what ran before in this process
        [output] = generate.run(
            ["hello"], {"max_new_tokens": 50, "do_sample": False}, Control(stream_id=7)
        )
    finally:
        generate.bind_stream(None, None)
    assert len(sent) == 3 and all(c.stream_id == 7 and c.index == 0 for c in sent)
    assert output["details"]["finish_reason"] == "cancelled"
    # return_full_text's default (POST /'s, streamed or not): the prompt, then the tokens
    assert output["generated_text"] == "hello" + "".join(c.token["text"] for c in sent)


def test_a_batch_nobody_waits_for_stops_generating_at_its_next_token(runner):
    """Not streamed, `generate` ran a batch to its max_tokens whatever happened to its
    requests: past their deadline (504), a worker of `--generation static` went on for
    as long again while every request queued behind it met its own 504."""
    generate = runner("text-generation")
    generate.bind_cancel(GivesUp(after=3))
    try:
        params = {"max_new_tokens": 50, "do_sample": False, "ignore_eos": True}
        [[output]] = generate.run(["hello"], {**params, "details": True})
    finally:
        generate.bind_cancel(lambda: False)
    assert output["details"]["finish_reason"] == "cancelled"
    assert output["details"]["generated_tokens"] < 50


# --- image-classification -----------------------------------------------------------------


def png(color, size=(40, 30)):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def test_image_classification_decodes_base64_images_in_the_worker(runner, tiny_model):
    import base64
    import io

    from PIL import Image
    from transformers import pipeline

    images = [png((255, 0, 0)), png((0, 0, 255), (16, 64))]
    classify = runner("image-classification")
    encoded = [base64.b64encode(image).decode() for image in images]
    batched = classify.run(encoded, {"top_k": 2})
    reference = pipeline("image-classification", model=tiny_model("image-classification"))
    expected = [
        reference(Image.open(io.BytesIO(image)).convert("RGB"), top_k=2) for image in images
    ]
    assert _rounded(batched) == _rounded(expected)
    assert _rounded(classify.run(encoded[:1], {"top_k": 2})) == _rounded(expected[:1])
    with pytest.raises(ValueError, match="not an image"):
        classify.run([base64.b64encode(b"not an image").decode()], {})


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP"])
def test_an_image_cut_short_is_the_clients_error(runner, fmt):
    """Half of an ordinary image (an upload cut short): opened lazily, its pixels were
    first read inside the pipeline, and the OSError there was a 500."""
    import io

    from PIL import Image

    written = io.BytesIO()
    Image.effect_noise((400, 300), 60).convert("RGB").save(written, fmt)
    half = written.getvalue()[: len(written.getvalue()) // 2]
    classify = runner("image-classification")
    with pytest.raises(ValueError, match="not an image Pillow can read") as refused:
        classify.run([base64.b64encode(half).decode()], {})
    assert classify.describe_failure(refused.value).kind == FailureKind.INPUT


def test_a_broken_png_chunk_is_the_clients_error(runner):
    """Pillow raises SyntaxError ("broken PNG file") for a chunk of a type no PNG has
    past the image data's first: neither OSError nor ValueError, it was a 500."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    pixels = zlib.compress(b"".join(b"\0" + bytes(120) for _ in range(30)))
    half = len(pixels) // 2
    broken = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 40, 30, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", pixels[:half])
        + chunk(b"ID-T", pixels[half:])
        + chunk(b"IEND", b"")
    )
    classify = runner("image-classification")
    with pytest.raises(ValueError, match="not an image Pillow can read") as refused:
        classify.run([base64.b64encode(broken).decode()], {})
    assert classify.describe_failure(refused.value).kind == FailureKind.INPUT


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "JPEG"])
def test_an_exif_block_that_cannot_be_read_leaves_the_picture_as_stored(runner, fmt):
    """The pipeline turns an image as its EXIF says: a PNG's or WebP's EXIF that is no TIFF
    data made it raise SyntaxError, a 500. The picture is read as stored (as a viewer
    shows it), and an orientation that can be read still turns it."""
    import io

    from PIL import Image

    def saved(exif: bytes) -> str:
        written = io.BytesIO()
        Image.new("RGB", (40, 30), (200, 10, 10)).save(written, fmt, exif=exif)
        return base64.b64encode(written.getvalue()).decode()

    classify = runner("image-classification")
    [garbled] = classify.run([saved(b"garbage!garbage!")], {"top_k": 1})
    [plain] = classify.run([base64.b64encode(png((200, 10, 10))).decode()], {"top_k": 1})
    assert garbled[0]["label"] == plain[0]["label"]
    turned = Image.new("RGB", (1, 1)).getexif()
    turned[0x0112] = 6  # rotated 90 degrees
    from rawserve.worker.images import decode_image

    assert decode_image(saved(turned.tobytes())).size == (30, 40)


@pytest.mark.parametrize(("grey", "read"), [(0, 0), (200, 1), (32768, 128), (65535, 255)])
@pytest.mark.parametrize("order", ["I;16", "I;16B"])  # (a big-endian TIFF's, "MM")
def test_a_16_bit_grey_image_is_read_at_8_bits_not_clipped(grey, read, order):
    """A 16-bit grey PNG was clipped at 255 on its way to RGB: mid grey read as white,
    and 200 of 65535 (nearly black) as nearly white (the pipeline does so too)."""
    import io

    import numpy as np
    from PIL import Image

    from rawserve.worker.images import decode_image

    written = io.BytesIO()
    if order == "I;16":
        Image.fromarray(np.full((8, 8), grey, dtype=np.uint16)).save(written, "PNG")
    else:
        levels = np.full((8, 8), grey, dtype=">u2").tobytes()
        Image.frombytes(order, (8, 8), levels).save(written, "TIFF")
    assert Image.open(io.BytesIO(written.getvalue())).mode == order  # (what is tested)
    image = decode_image(base64.b64encode(written.getvalue()).decode())
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (read, read, read)


def test_a_jpeg_of_a_great_many_scans_is_refused_before_it_is_decoded():
    """Each scan of a progressive JPEG is a pass over the whole image: a 421 KB file of
    20,000 (its smallest scan repeated) took 6 s to decode at 4000x4000."""
    import io

    from PIL import Image

    from rawserve.worker.images import MAX_JPEG_SCANS, ImageRefused, decode_image

    written = io.BytesIO()
    Image.effect_noise((400, 300), 60).convert("RGB").save(written, "JPEG", progressive=True)
    jpeg = written.getvalue()
    assert decode_image(base64.b64encode(jpeg).decode()).size == (400, 300)
    last = jpeg.rfind(b"\xff\xda")
    repeated = jpeg[:-2] + jpeg[last:-2] * MAX_JPEG_SCANS + b"\xff\xd9"
    with pytest.raises(ImageRefused, match=rf"scans; at most {MAX_JPEG_SCANS} are read"):
        decode_image(base64.b64encode(repeated).decode())


def test_a_batch_of_images_holds_one_decoded_image_at_a_time(runner, monkeypatch):
    """A decoded image may take hundreds of megabytes (up to Pillow's 89 million pixels):
    each is decoded as the pipeline preprocesses it, never a whole batch of them at once
    (eight of 6000x6000 at once: 1.6 GB at the peak; one at a time: 0.76 GB, as for one)."""
    import weakref

    from rawserve.worker import pipeline

    decode, alive, counts = pipeline.decode_image, [0], []

    def counted(encoded, squashed):
        image = decode(encoded, squashed)
        alive[0] += 1
        weakref.finalize(image, lambda: alive.__setitem__(0, alive[0] - 1))
        counts.append(alive[0])
        return image

    monkeypatch.setattr(pipeline, "decode_image", counted)
    classify = runner("image-classification")
    encoded = [base64.b64encode(png((40 * i, 0, 0))).decode() for i in range(6)]
    answers = classify.run(encoded, {})
    assert _rounded(answers) == _rounded([classify.run([item], {})[0] for item in encoded])
    assert max(counts) <= 2, counts  # the one just preprocessed, at most, and the next


def test_an_image_input_never_reaches_ghostscript(monkeypatch):
    """An EPS "image" is PostScript, which Pillow renders by running Ghostscript wherever
    it is installed: a client's program run on the server. Only raster formats are read."""
    from PIL import EpsImagePlugin

    from rawserve.worker import images

    ran = []

    def ghostscript(*args, **kwargs):
        ran.append(args)
        raise OSError("Ghostscript ran")

    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: True)  # as if installed
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n%%EOF\n"
    with pytest.raises(ValueError, match="not an image Pillow can read .PNG, JPEG"):
        images.decode_image(base64.b64encode(eps).decode())
    assert not ran
    assert images.decode_image(base64.b64encode(png((9, 9, 9))).decode()).size == (40, 30)


def encoded_image(size: tuple[int, int], fmt: str = "PNG", mode: str = "RGB") -> str:
    """A plain image of `size` in `fmt` and `mode`, base64-encoded."""
    import io

    from PIL import Image

    written = io.BytesIO()
    color = (200, 40, 40, 255)[: len(mode)] if mode in ("RGB", "RGBA") else 1
    Image.new(mode, size, color).save(written, fmt)
    return base64.b64encode(written.getvalue()).decode()


@pytest.mark.parametrize(
    ("size", "fmt", "squashed", "kept"),
    [
        ((4100, 4100), "JPEG", True, (2050, 2050)),  # libjpeg decodes it at half its size
        ((9000, 4500), "JPEG", False, (4500, 2250)),
        ((4200, 4300), "PNG", False, (2100, 2150)),  # decoded whole, then shrunk
        ((8000, 4095), "JPEG", False, (4000, 2048)),  # to 4096x4096's pixels, or fewer
        ((4095, 21850), "PNG", False, (1365, 7284)),  # (an 11 KB one-bit PNG: 3.8 s, 2 GB)
        ((2047, 21850), "PNG", False, (2047, 21850)),  # its shorter side already small
        ((8000, 4095), "JPEG", True, (2667, 4095)),  # each side on its own: the processor
        ((4095, 21850), "PNG", True, (4095, 2185)),  # squashes it to its shape anyway
        ((3000, 4000), "PNG", True, (3000, 4000)),  # a phone's photo: as it is
    ],
)
def test_a_huge_image_is_shrunk_to_several_times_any_models_input_before_it_is_processed(
    size, fmt, squashed, kept
):
    """A 9000x9000 JPEG took the image processor 5 s and 2 GB, an 11 KB PNG of 4095x21850
    pixels 6 s and 1.5 GB; shrunk by whole factors (to no less than 2048 pixels a side,
    or where the processor keeps the aspect ratio, to no more pixels than 4096x4096 while
    the shorter side stays 1024 or more) before it, under a second. Images under 4096
    pixels a side are decoded as they are."""
    from rawserve.worker.images import decode_image

    decoded = decode_image(encoded_image(size, fmt), squashed)
    assert (decoded.size, decoded.mode) == (kept, "RGB")
    assert decoded.getpixel((0, 0)) == pytest.approx((200, 40, 40), abs=3)


@pytest.mark.parametrize("mode", ["1", "L", "I;16"])
def test_a_huge_grey_image_is_shrunk_before_it_is_made_rgb_to_the_same_pixels(mode, monkeypatch):
    """A grey image was made RGB at full size, then shrunk: a 170 KB 16-bit PNG of
    4095x21850 took the worker 0.86 GB (0.43 GB now). Shrunk first, each pixel is the
    same (within a level: Pillow's means round)."""
    import io

    import numpy as np
    from PIL import Image

    from rawserve.worker.images import decode_image

    size = (4200, 4300)
    gradient = np.add.outer(np.arange(size[1]), np.arange(size[0])) % 509
    if mode == "I;16":
        source = Image.fromarray((gradient * 128).astype(np.uint16))
        expected = Image.fromarray(np.round(gradient * 128 / 257).astype(np.uint8))
    else:
        source = Image.fromarray((gradient % 256).astype(np.uint8)).convert(mode)
        expected = source
    written = io.BytesIO()
    source.save(written, "PNG")
    assert Image.open(io.BytesIO(written.getvalue())).mode == mode  # (what is tested)
    read_so_far = np.asarray(expected.convert("RGB").reduce((2, 2)), dtype=int)
    made, convert = [], Image.Image.convert
    monkeypatch.setattr(
        Image.Image,
        "convert",
        lambda i, m=None, *a, **k: made.append((m, i.size)) or convert(i, m, *a, **k),
    )
    decoded = decode_image(base64.b64encode(written.getvalue()).decode())
    assert ("RGB", size) not in made, made  # (three bytes a pixel, at full size)
    assert decoded.size == (2100, 2150) and decoded.mode == "RGB"
    assert np.abs(np.asarray(decoded, dtype=int) - read_so_far).max() <= 1


def test_a_long_image_is_read_the_same_shrunk_where_the_processor_keeps_its_shape(
    runner, tiny_model, tmp_path
):
    """A processor that keeps the aspect ratio (ConvNeXt's) scales the shorter side to its
    few hundred pixels and the long side with it: an image shrunk alike on both sides, its
    shorter side still 1024 or more, reads the same as at full size, at a fraction of the
    pixels (its shorter side alone, under 4096, left 4095x21850 whole: 3.8 s and 2 GB)."""
    import io

    from PIL import Image

    from rawserve.worker.images import decode_image
    from rawserve.worker.loading import load_runner

    folder = shutil.copytree(tiny_model("image-classification"), tmp_path / "convnext")
    (folder / "preprocessor_config.json").write_text(json.dumps(CONVNEXT_PROCESSOR))
    classify = load_runner(worker_config(str(folder), dtype="float32"), "cpu")
    size = (2100, 9000)
    bands = [Image.linear_gradient("L"), Image.linear_gradient("L").rotate(90)]
    image = Image.merge("RGB", [*bands, Image.radial_gradient("L")]).resize(size)
    written = io.BytesIO()
    image.save(written, "PNG", compress_level=1)
    encoded = base64.b64encode(written.getvalue()).decode()
    assert decode_image(encoded, squashed=False).size == (1050, 4500)
    answers = classify.run([encoded], {"top_k": 3})[0]
    whole = classify.pipe(image, top_k=3)
    assert [a["label"] for a in answers] == [w["label"] for w in whole]
    assert [a["score"] for a in answers] == pytest.approx([w["score"] for w in whole], abs=1e-3)


# ConvNeXt's image processor, its shorter side scaled to 32 pixels (the tiny model's)
CONVNEXT_PROCESSOR = {
    "image_processor_type": "ConvNextImageProcessor",
    "crop_pct": 0.875,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 32},
}


@pytest.mark.parametrize("fmt", ["JPEG", "MPO"])
def test_a_huge_jpeg_is_decoded_by_libjpeg_at_a_fraction_of_its_size(fmt, monkeypatch):
    """A JPEG of several pictures, as phones and cameras write them, opens as "MPO": it
    was decoded at full size, then shrunk (9000x9000: 243 MB and 0.5 s, not 0.07 s)."""
    import io

    from PIL import Image, JpegImagePlugin

    from rawserve.worker.images import decode_image

    drafted = []
    draft = JpegImagePlugin.JpegImageFile.draft

    def recorded(image, mode, size):
        drafted.append(draft(image, mode, size))
        return drafted[-1]

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", recorded)
    written = io.BytesIO()
    pictures = {"save_all": True, "append_images": [Image.new("RGB", (10, 10))]}
    Image.new("RGB", (4100, 4100), (200, 40, 40)).save(
        written, fmt, **(pictures if fmt == "MPO" else {})
    )
    assert Image.open(written).format == fmt
    decoded = decode_image(base64.b64encode(written.getvalue()).decode())
    assert decoded.size == (2050, 2050) and decoded.getpixel((0, 0)) == pytest.approx(
        (200, 40, 40), abs=3
    )
    assert drafted and drafted[0][1] == (0, 0, 2050, 2050)  # libjpeg decoded it at 1/2


@pytest.mark.parametrize("mode", ["1", "P", "I;16", "L", "RGBA"])
def test_a_huge_image_in_any_mode_is_shrunk(mode):
    """Pillow shrinks no palette, one-bit or 16-bit image ("image has wrong mode", which
    read as "not an image"): each is made RGB first."""
    from rawserve.worker.images import decode_image

    decoded = decode_image(encoded_image((4096, 8192), "PNG", mode), squashed=False)
    assert (decoded.size, decoded.mode) == ((2048, 4096), "RGB")


def test_an_image_far_longer_than_wide_is_refused_where_the_processor_keeps_its_shape():
    """A processor that scales the shorter side to its 224 pixels (ConvNeXt's, ResNet's)
    builds an image as many times longer: 1x100000 pixels took a worker down. One that
    resizes to a fixed shape reads it at no cost."""
    from rawserve.worker.images import MAX_ASPECT, ImageRefused, decode_image

    assert decode_image(encoded_image((3, 3 * MAX_ASPECT)), squashed=False).size == (3, 300)
    with pytest.raises(ImageRefused, match=r"3x301 pixels; this model reads an image at most"):
        decode_image(encoded_image((3, 3 * MAX_ASPECT + 1)), squashed=False)
    assert decode_image(encoded_image((1, 100_000)), squashed=True).size == (1, 2084)


def test_a_model_whose_processor_keeps_the_shape_refuses_a_stretched_image(runner, monkeypatch):
    classify = runner("image-classification")
    assert classify.run([encoded_image((1, 1000))], {})  # its processor squashes
    processor = classify.pipe.image_processor
    monkeypatch.setattr(processor, "size", {"shortest_edge": 32})  # as ConvNeXt's
    with pytest.raises(ValueError, match="1x1000 pixels") as refused:
        classify.run([encoded_image((1, 1000))], {})
    assert classify.describe_failure(refused.value).kind == FailureKind.INPUT


def test_the_images_of_a_batch_nobody_waits_for_are_not_decoded(runner, monkeypatch):
    """Once nobody waits for a batch, its images left are read as a blank pixel each
    (31 images of seconds each held a worker until the batch timeout killed it)."""
    from rawserve.worker import pipeline

    decoded: list[str] = []
    decode = pipeline.decode_image

    def counted(encoded, squashed):
        decoded.append(encoded)
        return decode(encoded, squashed)

    monkeypatch.setattr(pipeline, "decode_image", counted)
    classify = runner("image-classification")
    images = [encoded_image((40 + i, 30)) for i in range(5)]
    classify.bind_cancel(lambda: len(decoded) >= 2)
    try:
        answers = classify.run(images, {})
    finally:
        classify.bind_cancel(lambda: False)
    assert len(answers) == 5 and decoded == images[:2]
    assert len(classify.run(images, {})) == 5 and decoded[2:] == images


def png_head(width: int, height: int) -> str:
    """A PNG's signature and header alone, base64-encoded: the size of a decompression bomb
    (a few hundred kilobytes of zeros decode to gigabytes) without its data."""
    import base64
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        checksum = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + checksum

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    image = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    return base64.b64encode(image).decode()


# --- each task's input errors, on every engine that serves the task -----------------------

LONG = " ".join(["hello"] * 200)  # 200 words: past the tiny models' 128 positions
LONG_LIST = [LONG, " ".join(["world"] * 150)]
QUESTION = {"question": "who lives in paris", "context": CONTEXT}
# an input each task answers, sent in the same batch as the failing one
GOOD = {
    "fill-mask": "paris is the [MASK]",
    "text-classification": "i like it",
    "token-classification": "john lives in paris",
    "zero-shot-classification": "i like this film",
    "question-answering": QUESTION,
    "feature-extraction": "hello world",
    "text-generation": "hello",
    "summarization": "the movie was good",
    "translation": "the movie was good",
    "text2text-generation": "the movie was good",
    "image-classification": base64.b64encode(png((255, 0, 0))).decode(),
}

# (model kind, task, failing input, parameters, what the client is told)
INPUT_ERRORS = [
    ("fill-mask", "fill-mask", "no mask token here", {"top_k": 2}, "No mask_token ([MASK])"),
    ("fill-mask", "fill-mask", LONG + " [MASK]", {}, "reads at most 128"),
    ("text-classification", "text-classification", LONG, {}, "reads at most 128"),
    ("text-classification", "text-classification", LONG, {"top_k": 2}, "reads at most 128"),
    ("text-classification", "text-classification", LONG, {LOGITS_PARAM: True}, "at most 128"),
    (
        "zero-shot-classification",
        "zero-shot-classification",
        "hello",
        {"candidate_labels": ["city", LONG]},
        "reads at most 128",
    ),
    (
        "question-answering",
        "question-answering",
        {"question": LONG, "context": CONTEXT},
        {},
        "no room for the context",
    ),
    ("question-answering", "question-answering", QUESTION, {"max_seq_len": 200}, "limit of 128"),
    ("feature-extraction", "feature-extraction", LONG, {"truncate": False}, "at most 128"),
    ("feature-extraction", "feature-extraction", "hello", {"dimensions": 64}, "at most 32"),
    ("text-generation", "text-generation", " world" * 300, {"max_new_tokens": 2}, "room"),
    # more new tokens than the positions allow: the server refuses it first (400)
    ("text-generation", "text-generation", "hello", {"max_new_tokens": 300}, "at most 255"),
    ("seq2seq", "translation", "hello", {"src_lang": "en", "tgt_lang": "de"}, "not translate"),
    ("seq2seq", "summarization", "hello", {"max_new_tokens": 200}, "limit of 128"),
    ("seq2seq", "text2text-generation", LONG, {"truncation": False}, "reads at most 128"),
    ("seq2seq", "text2text-generation", LONG, {"truncation": "do_not_truncate"}, "at most 128"),
    # a single text has no second sequence to cut: the strategy cuts nothing of it
    ("seq2seq", "summarization", LONG, {"truncation": "only_second"}, "reads at most 128"),
    # Pillow refuses 30000x30000 itself; 10000x10000 it only warns of, then decodes 300 MB
    ("image-classification", "image-classification", png_head(30000, 30000), {}, "pixels"),
    ("image-classification", "image-classification", png_head(10000, 10000), {}, "pixels"),
]


def engines(cases: list[tuple]) -> list:
    """Each case on torch, and on ONNX Runtime too where that engine serves its task."""
    params = []
    for index, case in enumerate(cases):
        name = f"{case[1]}-{index}"
        params.append(pytest.param(*case, Engine.TORCH, id=f"{name}-torch"))
        if case[1] in ONNX_TASKS:
            params.append(pytest.param(*case, Engine.ONNX, marks=NEEDS_ONNX, id=f"{name}-onnx"))
    return params


@pytest.mark.parametrize(
    ("kind", "task", "bad", "params", "message", "engine"), engines(INPUT_ERRORS)
)
def test_an_input_error_is_the_client_s_on_every_engine(
    runner, kind, task, bad, params, message, engine
):
    """Run as the worker runs a batch (bisected on failure): the failing input is a 422
    that says what to fix, and its batch-mate is answered where the parameters allow."""
    from rawserve.worker.batch_runs import run_bisecting

    serving = runner(kind, task, engine)
    good, failed = run_bisecting(serving, [GOOD[task], bad], dict(params))
    assert isinstance(failed, ItemFailure) and failed.kind is FailureKind.INPUT, failed
    assert message in failed.message, failed.message
    # the batch-mate is answered as it is alone (a refused parameter fails both)
    [alone] = run_bisecting(serving, [GOOD[task]], dict(params))
    assert isinstance(good, ItemFailure) == isinstance(alone, ItemFailure), (good, alone)


# (task, an input whose scores the model breaks, parameters, the route's control): each
# runs beside GOOD[task], the model kind being the task's
NOT_NUMBERS = [
    ("text-classification", "paris", {}, Control()),
    ("text-classification", "paris", {"top_k": 2}, Control()),
    ("text-classification", "paris", {LOGITS_PARAM: True}, Control()),
    ("token-classification", "mary", {}, Control()),
    ("fill-mask", "the [MASK] movie", {"top_k": 2}, Control()),
    ("zero-shot-classification", "paris", {"candidate_labels": ["movie", "city"]}, Control()),
    ("question-answering", {"question": "where", "context": "berlin"}, {}, Control()),
    ("feature-extraction", "paris", {}, Control()),
    ("feature-extraction", "paris", {"normalize": False}, Control(embedding_route=True)),
    ("feature-extraction", "paris", {"normalize": True}, Control(embedding_route=True)),
]


@pytest.mark.parametrize(("task", "bad", "params", "control"), NOT_NUMBERS)
def test_an_input_whose_model_output_is_not_numbers_fails_alone_as_the_models_fault(
    runner, task, bad, params, control
):
    """A model that overflows (float16 on a long input, a broken checkpoint) on one input:
    its NaN scores or vectors were answered 200 as nulls (a null score, a null vector, no
    entities at all); that input now fails alone with 500 saying why, as in generation."""
    from rawserve.worker.batch_runs import run_bisecting

    serving = runner(task, task)
    model = serving.pipe.model if hasattr(serving, "pipe") else serving.model
    text = bad["context"] if isinstance(bad, dict) else bad
    marker = serving.tokenizer(text, add_special_tokens=False)["input_ids"][-1]

    def overflow(_module, args, output):  # the input holding the marker's token overflows
        return output.masked_fill((args[0] == marker).unsqueeze(-1), float("nan"))

    hook = model.get_input_embeddings().register_forward_hook(overflow)
    try:
        good, failed = run_bisecting(serving, [GOOD[task], bad], dict(params), control=control)
    finally:
        hook.remove()
    assert failed == ItemFailure(
        FailureKind.INTERNAL,
        f"the model's {'vectors' if task == 'feature-extraction' else 'scores'} for this "
        "input are not numbers (NaN or infinite: the model overflowed (in float16, --dtype "
        "bfloat16 or float32 has the range), or its weights are broken)",
    )
    [alone] = run_bisecting(serving, [GOOD[task]], dict(params), control=control)
    assert _rounded(good) == _rounded(alone)


@pytest.mark.parametrize("kind", ["token-classification", "seq2seq", "text-generation"])
def test_the_tiny_models_tokenizers_declare_no_length_limit(tiny_model, kind):
    """The premise of the length cases: like tokenizers saved without a limit, these
    declare ~1e30, so only the model's positions bound what the model reads."""
    import transformers

    assert transformers.AutoTokenizer.from_pretrained(tiny_model(kind)).model_max_length > 10**20


# (model kind, task, inputs past the positions, parameters): the route truncates them
CUT_TO_FIT = [
    ("token-classification", "token-classification", LONG_LIST, {}),
    ("token-classification", "token-classification", LONG_LIST, {"aggregation_strategy": "simple"}),
    (
        "zero-shot-classification",
        "zero-shot-classification",
        LONG_LIST,
        {"candidate_labels": ["a", "b"]},
    ),
    (
        "text-classification",
        "text-classification",
        LONG_LIST,
        {LOGITS_PARAM: True, "truncate": True},
    ),
    ("feature-extraction", "feature-extraction", LONG_LIST, {"pooling": "mean"}),
    ("question-answering", "question-answering", [{"question": "who", "context": LONG}], {}),
    (
        "seq2seq",
        "text2text-generation",
        LONG_LIST,
        {"truncation": "longest_first", "max_new_tokens": 4},
    ),
    ("seq2seq", "text2text-generation", LONG_LIST, {"truncation": True, "max_new_tokens": 4}),
    ("seq2seq", "summarization", LONG_LIST, {"truncation": "only_first", "max_new_tokens": 4}),
    ("seq2seq", "summarization", LONG_LIST, {"max_new_tokens": 4}),
]


@pytest.mark.parametrize(("kind", "task", "inputs", "params", "engine"), engines(CUT_TO_FIT))
def test_an_input_past_the_positions_is_cut_where_the_route_truncates(
    runner, kind, task, inputs, params, engine
):
    """Whatever the tokenizer declares (the tiny models' declare no limit, ~1e30), a
    truncating route cuts at the model's positions: answered, in a list as alone."""
    from rawserve.worker.batch_runs import run_bisecting

    serving = runner(kind, task, engine)
    outputs = run_bisecting(serving, list(inputs), dict(params))
    assert not any(isinstance(output, ItemFailure) for output in outputs), outputs
    [alone] = run_bisecting(serving, list(inputs[:1]), dict(params))
    assert _rounded(alone) == _rounded(outputs[0])


def roberta_folder(folder: Path, task: str) -> Path:
    """A tiny RoBERTa (64 positions, padding id 1) with the tiny models' tokenizer, which
    declares no length: its tokens sit at positions 2 to 63, so it reads 62 of them."""
    import torch
    import transformers

    from tests.tiny_models import VOCAB

    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        pad_token_id=1,
    )
    if task == "text-classification":  # a cross-encoder
        config.num_labels = 1
        model: Any = transformers.RobertaForSequenceClassification(config)
    else:
        model = transformers.RobertaModel(config)
    model.save_pretrained(folder)
    transformers.BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)}).save_pretrained(
        folder
    )
    return folder


@pytest.mark.parametrize(
    ("task", "params"),
    [("feature-extraction", {"pooling": "mean"}), ("text-classification", {LOGITS_PARAM: True})],
)
def test_a_roberta_s_length_leaves_out_the_positions_before_its_first_token(tmp_path, task, params):
    """RoBERTa-like models number tokens from the padding id + 1: the input length is the
    positions less those, so an input cut to it runs, and one just over it is refused in
    words rather than failing the model with an index out of range."""
    from rawserve.worker.batch_runs import run_bisecting
    from rawserve.worker.loading import load_runner

    folder = roberta_folder(tmp_path, task)
    serving = load_runner(worker_config(str(folder), task, dtype="float32"), "cpu")
    assert serving.details["max_input_length"] == 62
    cut = run_bisecting(serving, [LONG], {**params, "truncate": True})
    assert not isinstance(cut[0], ItemFailure), cut
    [over] = run_bisecting(serving, [" ".join(["hello"] * 61)], {**params, "truncate": False})
    assert isinstance(over, ItemFailure) and over.kind is FailureKind.INPUT, over
    assert "at most 62" in over.message, over.message


def test_a_library_panic_on_one_input_fails_that_input_alone(runner, monkeypatch):
    """The tokenizers library panics on some inputs, raised as a BaseException past every
    `except Exception`: it ended the worker, and every batch-mate with it. Now it is that
    input's failure (500, logged), found by bisection; the others are answered."""
    from rawserve.worker.batch_runs import run_bisecting
    from tests.test_prepare_ahead import tokenizer_panic

    serving = runner("text-classification", "text-classification")
    run = serving.run

    def run_or_panic(inputs, params, control):
        if "panic" in inputs:
            tokenizer_panic(serving.tokenizer)
        return run(inputs, params, control)

    monkeypatch.setattr(serving, "run", run_or_panic)
    good, failed, also_good = run_bisecting(serving, ["fine", "panic", "fine too"], {})
    assert isinstance(failed, ItemFailure) and failed.kind is FailureKind.INTERNAL, failed
    assert failed.message == "the model failed on this input"  # nothing of the library's
    assert not isinstance(good, ItemFailure) and not isinstance(also_good, ItemFailure)
    assert run_bisecting(serving, ["fine"], {}) == [good]  # the tokenizer still works


def test_an_item_that_fails_alone_is_logged_with_its_request_id(caplog):
    """The worker's traceback of an item's failure names the request the access log names,
    found through the bisection (its batch-mates' ids named nowhere)."""
    from rawserve.worker.batch_runs import run_batch

    def run(inputs, params, control):
        if "bad" in inputs:
            raise IndexError("index out of range in self")
        return [len(text) for text in inputs]

    failed = ItemFailure(FailureKind.INTERNAL, "the model failed on this input")
    runner = SimpleNamespace(run=run, describe_failure=lambda exc: failed)
    with caplog.at_level(logging.ERROR, "rawserve.worker"):
        outputs = run_batch(runner, ["ok", "bad", "fine"], {}, request_ids=["r-1", "r-2", "r-3"])
    assert outputs == [2, failed, 4]
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == "an item failed (request r-2)"
    assert record.request_id == "r-2"  # a JSON line's field, as the access log's


def test_an_input_failing_outside_a_pipeline_does_not_load_the_pipelines(monkeypatch):
    """Every runner asked whether a failure was a pipeline's, and reading the name loaded
    transformers.pipelines: the first input to fail in an embedding, generation or handler
    worker (a 422 as much as a 500) held its batch, and the worker, for seconds."""
    import transformers

    from rawserve.worker.pipeline import PipelineRunner
    from rawserve.worker.runner import Runner

    refused = transformers.pipelines.PipelineException("fill-mask", "tiny", "no mask token")
    pipeline_runner = object.__new__(PipelineRunner)  # what it says needs no model loaded
    assert pipeline_runner.describe_failure(refused) == ItemFailure(
        FailureKind.INPUT, "no mask token"
    )
    # as in a worker that has not loaded them: the name read loads the module anew
    monkeypatch.delitem(sys.modules, "transformers.pipelines")
    monkeypatch.delattr(transformers, "pipelines")
    runner = Runner("feature-extraction", "cpu")
    assert runner.describe_failure(ValueError("too long")).kind is FailureKind.INPUT
    assert runner.describe_failure(RuntimeError("a bug")).kind is FailureKind.INTERNAL
    assert "transformers.pipelines" not in sys.modules


@pytest.mark.parametrize(
    ("built_for", "visible", "says"),
    [
        (None, None, "is a build without CUDA: install a CUDA build of torch"),
        (
            "13.0",
            None,
            "sees no CUDA GPU here: check the driver \\(this torch is built for CUDA 13.0\\)",
        ),
        (  # a ROCm build: told to install a CUDA build, which it is in torch's eyes
            "rocm 6.4",
            None,
            "sees no CUDA GPU here: check the driver \\(this torch is built for ROCm 6.4\\)",
        ),
        (  # --device cuda:3 on a machine of one GPU
            "12.8",
            "3",
            "sees no CUDA GPU among CUDA_VISIBLE_DEVICES=3, the GPUs this worker was given: "
            "check that they exist \\(nvidia-smi lists them\\)",
        ),
    ],
)
def test_a_gpu_torch_cannot_use_is_refused_in_words(monkeypatch, caplog, built_for, visible, says):
    """`--device cuda` with a CPU build of torch failed late, on an AssertionError; a GPU
    named that the machine does not have was blamed on the driver. Without `--device` on
    a machine that shows a GPU (`auto`), the worker went to the CPU without a word, under
    a GPU's defaults: PyPI's CUDA build on an older driver is served so."""
    import torch

    from rawserve.worker import runner
    from rawserve.worker.runner import resolve_device

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rocm = built_for and built_for.startswith("rocm ")
    monkeypatch.setattr(torch.version, "cuda", None if rocm else built_for)
    monkeypatch.setattr(torch.version, "hip", built_for.removeprefix("rocm ") if rocm else None)
    with pytest.raises(RuntimeError, match=f"{says}, or serve with --device cpu"):
        resolve_device("cuda:0")
    monkeypatch.setattr(runner, "gpu_present", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert not caplog.records  # a machine without a GPU: the CPU is what auto means
    monkeypatch.setattr(runner, "gpu_present", lambda: True)
    assert resolve_device("auto") == "cpu"
    assert re.search(f"the machine shows one, and torch .* {says}; serving on the CPU", caplog.text)


def cut_short(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a download interrupted


def as_bin(folder: Path, cut: int = 0) -> None:
    """The weights as torch.save'd pytorch_model.bin (its last `cut` bytes lost)."""
    import safetensors.torch
    import torch

    weights = folder / "model.safetensors"
    torch.save(safetensors.torch.load_file(weights), folder / "pytorch_model.bin")
    weights.unlink()
    if cut:
        written = (folder / "pytorch_model.bin").read_bytes()
        (folder / "pytorch_model.bin").write_bytes(written[:-cut])


def with_config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return change


OWN_CODE = {"AutoConfig": "configuration_my.MyConfig", "AutoModel": "modeling_my.MyModel"}


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (cut_short, "model.safetensors is not a whole safetensors file (Error while "),
        (
            with_config(model_type="mybert", auto_map=OWN_CODE),
            "config.json's model_type 'mybert' is not one transformers knows: it names the "
            "model's own Python code (auto_map), which rawserve does not run",
        ),
        (with_config(model_type="frobnicator"), "config.json's model_type 'frobnicator' is not"),
        (
            with_config(id2label={"neg": "NEGATIVE", "pos": "POSITIVE"}),
            "config.json's id2label keys are the head's outputs, numbered from 0, not 'neg'",
        ),
        (
            functools.partial(as_bin, cut=300),
            "pytorch_model.bin is not a whole PyTorch checkpoint (its zip archive is cut short",
        ),
    ],
)
def test_a_model_transformers_would_fail_to_load_is_refused_naming_the_file(
    tiny_model, tmp_path, capfd, damage, says
):
    """Refused in one line that names the file, before transformers fails on it: its
    safetensors error named no file, and for a model's own code it printed a question
    ("Do you wish to run the custom code? [y/N]") to the worker's output."""
    from rawserve.worker.loading import load_runner

    folder = tmp_path / "model"
    folder.mkdir()
    for path in Path(tiny_model("text-classification")).iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    damage(folder)
    with pytest.raises(ValueError) as caught:
        load_runner(worker_config(str(folder), engine=Engine.TORCH), "cpu")
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)
    assert "[y/N]" not in capfd.readouterr().out


def test_a_whole_pytorch_checkpoint_loads(tiny_model, tmp_path):
    from rawserve.worker.loading import load_runner

    folder = tmp_path / "model"
    shutil.copytree(tiny_model("text-classification"), folder)
    as_bin(folder)
    loaded = load_runner(worker_config(str(folder), engine=Engine.TORCH), "cpu")
    assert loaded.run(["a good movie"], {})[0]["label"] in ("NEGATIVE", "POSITIVE")
    # a cut .bin left beside whole safetensors weights is not read (transformers loads
    # those first): the folder serves
    beside = tmp_path / "beside"
    shutil.copytree(tiny_model("text-classification"), beside)
    (beside / "pytorch_model.bin").write_bytes((folder / "pytorch_model.bin").read_bytes()[:-300])
    loaded = load_runner(worker_config(str(beside), engine=Engine.TORCH), "cpu")
    assert loaded.run(["a good movie"], {})[0]["label"] in ("NEGATIVE", "POSITIVE")


def test_a_known_model_type_whose_architecture_is_its_own_code_needs_its_task_named(
    tiny_model, tmp_path
):
    """A bert whose `architectures` names its own class (auto_map) had its task guessed
    from that class's name ("...Model": feature-extraction), its trained head dropped
    unsaid; named, the task serves the folder as transformers' own class."""
    from rawserve.models.folder import read_facts

    folder = tmp_path / "model"
    shutil.copytree(tiny_model("text-classification"), folder)
    own = {"AutoModelForSequenceClassification": "org/repo--modeling_my.BertWithMyHeadModel"}
    with_config(architectures=["BertWithMyHeadModel"], auto_map=own)(folder)
    with pytest.raises(ValueError) as caught:
        read_facts(folder, None, None)
    assert str(caught.value).startswith(
        "config.json's architecture 'BertWithMyHeadModel' is the model's own Python code "
        "(auto_map), which rawserve does not run (no trust_remote_code): where transformers "
        "knows its model_type 'bert', name the task"
    )
    assert read_facts(folder, "text-classification", None).task == "text-classification"


@pytest.mark.parametrize(
    ("kind", "task", "says"),
    [
        (
            "sentence-embedding",
            "summarization",
            "summarization needs an encoder-decoder model (such as BART or T5); this model is "
            "a bert: serve it without --task, for what it was trained as (Bert",
        ),
        (
            "text-generation",
            "fill-mask",
            "fill-mask needs a masked language model (such as BERT or RoBERTa); this model is "
            "a gpt2: serve it without --task, for what it was trained as (GPT2LMHeadModel: ",
        ),
    ],
)
def test_a_task_the_models_architecture_cannot_run_is_one_line_saying_why(
    tiny_model, kind, task, says
):
    """transformers' own refusal was ~600 characters listing every config class its Auto
    class knows (AutoModelForSeq2SeqLM for a BERT), or for a pipeline's task, a model
    loaded by its architecture that then failed on something else (a GPT-2's tokenizer
    has no mask token)."""
    from rawserve.worker.loading import load_runner
    from rawserve.worker.process import load_failed

    config = worker_config(tiny_model(kind), task=task, engine=Engine.TORCH)
    with pytest.raises(ValueError) as caught:
        load_runner(config, "cpu")
    line = load_failed(caught.value).message
    assert line.startswith(f"ValueError: {says}"), line
    assert line.endswith(f"or serve a model made for {task}") and "Config" not in line
    # (not every task whose class loads it: most would serve a head the model lacks)
    assert "text-classification" not in line


@pytest.mark.parametrize(
    ("kind", "task", "model_class", "layers"),
    [
        ("text-classification", "fill-mask", "BertForMaskedLM", "cls.predictions"),
        ("seq2seq", "text-generation", "BartForCausalLM", "lm_head"),
    ],
)
def test_a_task_head_the_checkpoint_has_no_weights_for_is_served_and_said_random(
    tiny_model, kind, task, model_class, layers
):
    """A classifier served as fill-mask, BART as a causal LM ("hellohellohello"): the
    head transformers made at random was said only in its LOAD REPORT table, squeezed
    into one escaped log line. Served all the same (a base model may be wanted so), with
    one plain line the worker logs."""
    from rawserve.worker.loading import load_runner

    runner = load_runner(worker_config(tiny_model(kind), task=task, engine=Engine.TORCH), "cpu")
    assert runner.untrained is not None
    said = runner.untrained.warning(task)
    assert said.startswith(f"{len(runner.untrained.tensors)} weight tensors of {model_class} (")
    assert f"numbers, in {layers}" in said and "\n" not in said
    assert said.endswith(
        f"are not in the checkpoint, so they are random: its {task} answers will mean "
        f"nothing until a model trained for {task} is served"
    )
    # the numbers of distinct tensors: tied weights (a decoder's bias, its head's) once
    model = runner.pipe.model if hasattr(runner, "pipe") else runner.model
    weights = model.state_dict()
    distinct = {weights[name].data_ptr(): weights[name] for name in runner.untrained.tensors}
    assert runner.untrained.numbers == sum(tensor.numel() for tensor in distinct.values())


def test_info_names_the_weights_made_at_random(tiny_model):
    """A classifier served as text-generation answered 200s of random text, which only the
    log's warning explained (a tester): /info's worker says it too, as the log does."""
    from tests.server import RunningServer

    args = ["--model", tiny_model("text-classification"), "--task", "fill-mask"]
    with RunningServer([*args, "--engine", "torch", "--device", "cpu"]) as server:
        status, _, body = server.request("GET", "/info")
    assert status == 200
    [worker] = json.loads(body)["workers"]
    assert worker["untrained"].startswith("6 weight tensors of BertForMaskedLM (")
    assert worker["untrained"].endswith(
        "its fill-mask answers will mean nothing until a model trained for fill-mask is served"
    )
    [warning] = [line for line in server.lines if "untrained weights: " in line]
    assert worker["untrained"] in warning


def test_a_head_left_random_is_said_in_rawserves_one_line_not_transformers_table(
    tiny_model, caplog
):
    """transformers logs its LOAD REPORT table at every load (three times at a first
    start's engine trial), in terminal escape codes, where the README promises one
    warning: a load that succeeds holds it back."""
    from rawserve.worker.loading import load_runner
    from rawserve.worker.model_classes import LOAD_REPORT, LOADING_LOGGER

    caplog.set_level(logging.WARNING)
    config = worker_config(tiny_model("text-classification"), task="fill-mask", engine=Engine.TORCH)
    runner = load_runner(config, "cpu")
    assert runner.untrained is not None
    assert [r.name for r in caplog.records if LOAD_REPORT in r.getMessage()] == []
    assert not [r for r in caplog.records if "seem corrupted" in r.getMessage()]
    # held back only while loading
    assert not any(
        type(f).__name__ == "_HeldReports" for f in logging.getLogger(LOADING_LOGGER).filters
    )


def test_a_checkpoint_that_is_another_models_weights_is_refused_not_served_random(
    tiny_model, tmp_path
):
    """A GPT-2's weights in a BERT classifier's folder left every tensor random: it was
    served, with a warning, answering noise. Refused in one line."""
    from rawserve.worker.loading import load_runner
    from rawserve.worker.process import load_failed

    folder = tmp_path / "classifier"
    shutil.copytree(tiny_model("text-classification"), folder)
    weights = Path(tiny_model("text-generation")) / "model.safetensors"
    shutil.copy(weights, folder / "model.safetensors")
    with pytest.raises(ValueError) as caught:
        load_runner(worker_config(str(folder), engine=Engine.TORCH), "cpu")
    assert load_failed(caught.value).message == (
        "ValueError: none of the checkpoint's weights are BertForSequenceClassification's: "
        "they are another model's, or named otherwise, and every answer would be noise"
    )


def test_a_model_type_whose_config_class_is_shared_is_not_refused():
    """transformers' mapping's own `in` reads a reverse map of names, wrong for a model
    type sharing its config class: evolla as feature-extraction was refused though
    from_pretrained loads it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from rawserve.worker.model_classes import loads_as

    if "evolla" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no evolla model")
    assert loads_as("evolla", "AutoModel")
    assert not loads_as("bert", "AutoModelForSeq2SeqLM")


def test_whether_a_class_loads_a_model_type_is_what_from_pretrained_finds():
    """Read by names, without importing every config's module (1.3-2.5 s of each
    worker's start): for every model type and every task's class, the answer of the
    mapping's keys(), which from_pretrained looks in."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from rawserve.worker.model_classes import TASK_CLASSES, loads_as

    differ = []
    for class_name in sorted(set(TASK_CLASSES.values())):
        config_classes = set(getattr(transformers, class_name)._model_mapping.keys())
        for model_type in CONFIG_MAPPING:
            if loads_as(model_type, class_name) != (CONFIG_MAPPING[model_type] in config_classes):
                differ.append((class_name, model_type))
    assert not differ


@pytest.mark.parametrize(
    ("kind", "task"),
    [
        ("text-classification", "text-classification"),
        ("fill-mask", "fill-mask"),
        ("sentence-embedding", "feature-extraction"),
        ("text-generation", "text-generation"),
        ("seq2seq", "summarization"),
    ],
)
def test_a_model_trained_for_its_task_is_not_said_untrained(tiny_model, kind, task):
    from rawserve.worker.loading import load_runner

    runner = load_runner(worker_config(tiny_model(kind), task=task, engine=Engine.TORCH), "cpu")
    assert runner.untrained is None


def test_weights_that_do_not_match_the_config_are_one_line_that_says_so(
    tiny_model, tmp_path, caplog
):
    """The pipeline nests each class's traceback after 'Could not load model ... with
    any of the following classes: (...)', which was all the line said."""
    from rawserve.worker.loading import load_runner
    from rawserve.worker.model_classes import LOAD_REPORT
    from rawserve.worker.process import load_failed

    folder = tmp_path / "model"
    folder.mkdir()
    for path in Path(tiny_model("text-classification")).iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    with_config(intermediate_size=74)(folder)  # the weights' layers are 37 wide
    caplog.set_level(logging.WARNING)
    with pytest.raises(Exception) as caught:
        load_runner(worker_config(str(folder), engine=Engine.TORCH), "cpu")
    assert load_failed(caught.value).message.startswith(
        "the weights' shapes do not match config.json ("
    )
    # the line points to the table, which a failed load does log
    (report,) = [r.getMessage() for r in caplog.records if LOAD_REPORT in r.getMessage()]
    assert "MISMATCH" in report


def test_bin_weights_pickling_an_object_are_one_line_that_says_what_to_serve(tiny_model, tmp_path):
    """torch.load's weights_only refusal told the operator to re-run torch.load with
    weights_only=False or to allowlist the class in Python, in ANSI bold, cut at 500
    characters before it named the object."""
    import argparse

    import torch
    from safetensors.torch import load_file

    from rawserve.worker.loading import load_runner
    from rawserve.worker.process import load_failed

    folder = tmp_path / "model"
    folder.mkdir()
    for path in Path(tiny_model("text-classification")).iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**weights, "args": argparse.Namespace(lr=0.1)}, folder / "pytorch_model.bin")
    with pytest.raises(Exception) as caught:
        load_runner(worker_config(str(folder), engine=Engine.TORCH), "cpu")
    assert load_failed(caught.value).message == (
        "the model's .bin weights are pickled with argparse.Namespace, which torch.load "
        "runs as code only when told to (weights_only=False): rawserve loads weights "
        "alone; serve the model's safetensors, or convert its .bin to safetensors"
    )


def test_a_handler_whose_import_fails_deep_down_is_told_where(monkeypatch, tmp_path):
    """Its one line said "No module named 'helper_missing_dep'", with no file or line: the
    import that failed was three modules down (a tester)."""
    from rawserve.worker.process import load_failed

    (tmp_path / "deep_pkg").mkdir()
    (tmp_path / "deep_pkg" / "__init__.py").write_text("")
    (tmp_path / "deep_pkg" / "inner.py").write_text("x = 1\nimport helper_missing_dep\n")
    with pytest.raises(ModuleNotFoundError) as caught:
        handler_runner(monkeypatch, tmp_path, "import deep_pkg.inner\ndef make(): pass\n")
    inner = tmp_path / "deep_pkg" / "inner.py"
    assert load_failed(caught.value).message == (
        f"ModuleNotFoundError: No module named 'helper_missing_dep' ({inner}, line 2)"
    )


@pytest.mark.parametrize(
    ("handler", "missing"),
    [
        ("nosuchmod_of_this_test:handler", "nosuchmod_of_this_test"),
        ("nosuchpkg_of_this_test.handlers:make", "nosuchpkg_of_this_test"),  # its package
    ],
)
def test_a_handler_module_not_found_says_where_it_was_looked_for(
    monkeypatch, tmp_path, handler, missing
):
    """Its line said only "No module named 'nosuchmod'", once a worker and once more for
    the server: a new user could not tell that the server's folder was the one looked in."""
    from rawserve.worker.handler import HandlerRunner
    from rawserve.worker.process import load_failed

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError) as caught:
        HandlerRunner(handler, "cpu")
    message = load_failed(caught.value).message
    assert f"no module named '{missing}' in {tmp_path}" in message, message
    assert "PYTHONPATH" in message


def test_a_handler_named_as_a_module_imported_already_says_so(monkeypatch, tmp_path):
    """A `types.py` in the server's folder was never imported (Python's own `types` was,
    long before): the start said only "module 'types' has no attribute 'handler'"."""
    from rawserve.worker.handler import HandlerRunner
    from rawserve.worker.process import load_failed

    (tmp_path / "types.py").write_text("def handler():\n    return lambda inputs: inputs\n")
    monkeypatch.chdir(tmp_path)
    # (the worker puts its folder first on sys.path: left there, this `types.py` took
    # the place of Python's own in the processes later tests start)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ImportError) as caught:
        HandlerRunner("types:handler", "cpu")
    message = load_failed(caught.value).message
    assert f"is {tmp_path / 'types.py'}, but that name is taken by a module" in message
    assert "name the file another way" in message


def handler_runner(monkeypatch, tmp_path, source: str, factory: str = "make"):
    """A HandlerRunner of a module written now, `source` its code."""
    from rawserve.worker.handler import HandlerRunner

    name = f"handler_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return HandlerRunner(f"{name}:{factory}", "cpu")


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def make():\n    return 42\n", "the factory returned int, not a callable"),
        (
            "def make():\n    async def f(inputs, **params):\n        return inputs\n"
            "    return f\n",
            "the factory returned an async function",
        ),
        (
            "def make():\n    async def f(inputs, **params):\n        yield inputs\n    return f\n",
            "the factory returned an async function",
        ),
        (
            "class Make:\n    async def __call__(self, inputs):\n        yield inputs\n"
            "def make():\n    return Make()\n",
            "the factory returned an async function",
        ),
        (
            "def make():\n    return lambda: []\n",
            "the factory returned a callable that takes no positional argument",
        ),
    ],
)
def test_a_handler_that_cannot_be_called_as_one_is_refused_at_load(
    monkeypatch, tmp_path, source, says
):
    """It was served as ready, and every request failed with 500."""
    with pytest.raises(TypeError) as refused:
        handler_runner(monkeypatch, tmp_path, source)
    assert f":make: {says}" in str(refused.value)


def test_a_handler_using_torch_has_its_threads_set_before_its_factory_runs(monkeypatch, tmp_path):
    """A handler's worker no longer imports torch itself; one whose module does gets its
    threads set as a model's worker does, before the factory loads its own model."""
    import torch

    from rawserve.shared.messages import WorkerConfig
    from rawserve.worker.handler import load_handler

    name = f"handler_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def make():\n"
        "    threads = torch.get_num_threads()\n"
        "    return lambda inputs, **params: [threads for _ in inputs]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    before = torch.get_num_threads()
    try:
        runner = load_handler(WorkerConfig(model="", handler=f"{name}:make", threads=1), "auto")
        assert runner.run(["x"], {}) == [1]
        assert runner.device == ("cuda:0" if torch.cuda.is_available() else "cpu")  # torch's
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "source",
    [
        "import argparse\nargparse.ArgumentParser().parse_args(['--served'])\n",
        "import sys\ndef make():\n    sys.exit('no model here')\n",
    ],
)
def test_a_handler_that_exits_as_it_loads_is_a_load_failure(monkeypatch, tmp_path, source):
    """SystemExit from the module's import (a script's argparse reading the server's
    argv) or from the factory ended the worker as it loaded: restarted with backoff, it
    died again, for ever, where a load error stops the server with its reason."""
    from rawserve.worker.handler import HandlerStopped
    from rawserve.worker.process import load_failed

    with pytest.raises(HandlerStopped) as stopped:
        handler_runner(monkeypatch, tmp_path, source)
    assert load_failed(stopped.value).message.startswith(
        "HandlerStopped: the handler raised SystemExit: "
    )


@pytest.mark.parametrize(("inherited", "raised"), [(0, 500), (700, 1000), (-1000, -500)])
def test_a_worker_raises_its_oom_score_adj_so_the_kernel_kills_it_first(
    tmp_path, inherited, raised
):
    """When memory runs out, a worker killed is restarted; the server killed is gone."""
    from rawserve.worker.process import prefer_for_oom_kill

    adj = tmp_path / "oom_score_adj"
    adj.write_text(f"{inherited}\n")
    assert prefer_for_oom_kill(str(adj)) == raised and int(adj.read_text()) == raised


@pytest.mark.parametrize("found", [None, "", "not a number\n"])
def test_a_worker_that_cannot_raise_its_oom_score_adj_runs_as_it_is(tmp_path, found):
    from rawserve.worker.process import prefer_for_oom_kill

    adj = tmp_path / "oom_score_adj"  # none there: not Linux
    if found is not None:
        adj.write_text(found)
    assert prefer_for_oom_kill(str(adj)) is None
    assert not adj.exists() if found is None else adj.read_text() == found


def test_a_handler_raising_systemexit_on_one_input_fails_that_input_alone(monkeypatch, tmp_path):
    """SystemExit, KeyboardInterrupt or a BaseException of the handler's own passed every
    `except Exception` and ended the worker: its batch-mates were run again, and a server of
    one worker per core was unready for a restart's imports."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "import sys\n"
        "class Stop(BaseException):\n    pass\n"
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        if 'exit' in inputs: sys.exit(3)\n"
        "        if 'interrupt' in inputs: raise KeyboardInterrupt\n"
        "        if 'stop' in inputs: raise Stop('stop')\n"
        "        return [x.upper() for x in inputs]\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    answers = run_bisecting(serving, ["a", "exit", "b", "interrupt", "c", "stop"], {})
    assert answers[0::2] == ["A", "B", "C"]
    for failed in answers[1::2]:
        assert failed == ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


@pytest.mark.parametrize("answers", ["map(answer, inputs)", "(answer(x) for x in inputs)"])
def test_a_handler_s_lazy_answers_raising_systemexit_fail_that_input_alone(
    monkeypatch, tmp_path, answers
):
    """A handler returning a generator (or `map`) runs its code as its answers are read,
    which was outside the guard: sys.exit on one input ended the worker, three times over,
    and the input was quarantined as one that crashes it. So did an exception of the
    handler's own whose `str()` raised SystemExit as its failure was told."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "import sys\n"
        "class Odd(ValueError):\n"
        "    def __str__(self):\n        raise SystemExit(1)\n"
        "def answer(x):\n"
        "    if x == 'exit': sys.exit('a library gave up')\n"
        "    if x == 'interrupt': raise KeyboardInterrupt\n"
        "    if x == 'odd': raise Odd()\n"
        "    if x == 'odd-base': raise OddBase()\n"
        "    return x.upper()\n"
        "class OddBase(BaseException):\n"
        "    def __str__(self):\n        raise SystemExit(1)\n"
        "def make():\n"
        f"    return lambda inputs, **params: {answers}\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    sent = ["a", "exit", "b", "interrupt", "c", "odd", "d", "odd-base"]
    answers_got = run_bisecting(serving, sent, {})
    assert answers_got[0::2] == ["A", "B", "C", "D"]
    for failed in answers_got[1::2]:
        assert failed == ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"inputs": 1}, "multiple values for argument 'inputs'"),
        ({"top_k": 2, "colour": "red"}, "unexpected keyword argument 'colour'"),
    ],
)
def test_parameters_a_handler_cannot_take_are_the_client_s_to_fix(
    monkeypatch, tmp_path, params, says
):
    """They raised TypeError in the call: 500, "the model failed on this input", and an
    error with its traceback in the log for each such request."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "def make():\n"
        "    def f(inputs, top_k=1):\n"
        "        return [[x] * top_k for x in inputs]\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    assert run_bisecting(serving, ["a", "b"], {"top_k": 2}) == [["a", "a"], ["b", "b"]]
    refused = run_bisecting(serving, ["a", "b"], params)
    assert [failure.kind for failure in refused] == [FailureKind.INPUT] * 2
    assert refused[0].message.startswith("invalid parameters for the handler: ")
    assert says in refused[0].message


def test_a_handler_that_changes_its_parameters_in_place_answers_each_input_as_alone(
    monkeypatch, tmp_path
):
    """Its parameters were the request's own objects: a failing batch's halves were called
    with what the first call had left in them ("added" once a call: "a" answered with it
    three times, "d" seven; a tester)."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "def make():\n"
        "    def f(inputs, labels):\n"
        "        labels.append('added')\n"
        "        if 'bad' in inputs: raise ValueError('bad input')\n"
        "        return [[x, labels] for x in inputs]\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    params = {"labels": ["x"]}
    answers = run_bisecting(serving, ["a", "b", "bad", "c", "d"], params)
    assert answers[2] == ItemFailure(FailureKind.INPUT, "bad input")
    good = [answer for place, answer in enumerate(answers) if place != 2]
    assert good == [[value, ["x", "added"]] for value in "abcd"]
    assert params == {"labels": ["x"]}


def test_a_parameter_named_as_a_handler_method_s_self_is_the_client_s_to_fix(monkeypatch, tmp_path):
    """A class's `__call__(self, inputs, **params)` took `self` into `**params` by its
    signature, and the call failed: 500, and a traceback in the log."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "class Make:\n"
        "    def __call__(self, inputs, **params):\n"
        "        if params.get('fail'): raise TypeError('its own')\n"
        "        return inputs\n"
        "def make():\n    return Make()\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    [refused] = run_bisecting(serving, ["a"], {"self": 1})
    assert refused.kind is FailureKind.INPUT
    assert refused.message.startswith("invalid parameters for the handler: ")
    [failed] = run_bisecting(serving, ["a"], {"fail": True})  # its own TypeError: its fault
    assert failed == ItemFailure(FailureKind.INTERNAL, "the model failed on this input")
    # a wrapper written in C raises in no frame of the handler's either (a reviewer: 422)
    source = (
        "import functools\ndef make():\n    return functools.lru_cache(lambda inputs: inputs)\n"
    )
    cached = handler_runner(monkeypatch, tmp_path, source)
    [failed] = run_bisecting(cached, ["a"], {})  # (a list is no cache key)
    assert failed == ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


@pytest.mark.parametrize("answer", ["{'label': 'yes'}", "'yes'", "None"])
def test_a_handler_answering_one_value_for_its_batch_fails_it(
    monkeypatch, tmp_path, caplog, answer
):
    """A dict or a text was read as the list of answers: `{"label": "yes"}` for one input
    answered "label", and "ab" for two answered "a" and "b", all 200."""
    from rawserve.worker.batch_runs import run_bisecting

    source = f"def make():\n    return lambda inputs, **params: {answer}\n"
    serving = handler_runner(monkeypatch, tmp_path, source)
    failed = ItemFailure(FailureKind.INTERNAL, "the model failed on this input")
    assert run_bisecting(serving, ["a", "b", "c"], {}) == [failed] * 3
    assert "not a list of one answer per input" in caplog.text


def test_a_handler_that_consumes_its_list_still_has_its_failing_batch_split(monkeypatch, tmp_path):
    """The handler was given the batch's own list: one that popped its inputs as it went
    and then failed left the bisection an empty list to split, and a batch of four was
    answered with one failure (its good items never answered)."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        answers = []\n"
        "        while inputs:\n"
        "            text = inputs.pop(0)\n"
        "            if text == 'bad': raise RuntimeError('bad')\n"
        "            answers.append(text.upper())\n"
        "        return answers\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    answers = run_bisecting(serving, ["a", "b", "bad", "c"], {})
    assert answers[:2] == ["A", "B"] and answers[3] == "C"
    assert answers[2] == ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


def test_a_handler_that_changes_its_inputs_in_place_still_has_its_batch_split(
    monkeypatch, tmp_path
):
    """The handler was given the request's own objects: one that popped a field of each
    and then failed left the halves without it, and every input of the batch failed
    with a KeyError (a tester), the one at fault 500 instead of its 422."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        texts = [value.pop('text') for value in inputs]\n"
        "        if '' in texts: raise ValueError('empty text')\n"
        "        return [t.upper() for t in texts]\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    inputs = [{"text": "hello"}, {"text": "world"}, {"text": ""}]
    answers = run_bisecting(serving, inputs, {})
    assert answers[:2] == ["HELLO", "WORLD"]
    assert answers[2] == ItemFailure(FailureKind.INPUT, "empty text")


def test_an_error_that_cannot_be_told_fails_its_input_not_the_worker(monkeypatch, tmp_path):
    """A handler's exception whose `__str__` raises escaped the bisection from its
    description (the worker died, and twice more on the input alone)."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "class Untold(Exception):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no words')\n"
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        if 'bad' in inputs: raise Untold()\n"
        "        return inputs\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    a, failed, c = run_bisecting(serving, ["a", "bad", "c"], {})
    assert (a, c) == ("a", "c")
    assert failed == ItemFailure(FailureKind.INTERNAL, "the model failed on this input")


@pytest.mark.parametrize(
    "answers",
    [
        "[x.upper() for x in inputs if x != 'odd']",  # none for it
        "[y for x in inputs for y in ([x.upper(), 'EXTRA'] if x == 'odd' else [x.upper()])]",
    ],
    ids=["none", "two"],
)
def test_an_input_a_handler_answers_with_no_answer_or_two_fails_alone(
    monkeypatch, tmp_path, answers
):
    """A handler that skipped an input (one answer fewer) failed its whole batch: every
    batch-mate got 500 "the model answered the wrong number of outputs". One that answered
    an input twice is as wrong: which answer is whose is not known (of six answers to five
    inputs, the first five give each input after it its neighbour's), so the batch is
    split until the input answered twice is alone."""
    from rawserve.worker.batch_runs import run_bisecting

    source = f"def make():\n    return lambda inputs, **params: {answers}\n"
    serving = handler_runner(monkeypatch, tmp_path, source)
    answered = run_bisecting(serving, ["a", "b", "odd", "c", "d"], {})
    assert answered[:2] == ["A", "B"] and answered[3:] == ["C", "D"]
    assert answered[2] == ItemFailure(
        FailureKind.INTERNAL, "the model answered the wrong number of outputs"
    )


def test_the_failing_item_s_error_is_logged_alone_not_chained_to_its_batch_s(
    monkeypatch, tmp_path, caplog
):
    """The halves ran inside the batch's `except`: the item's logged traceback carried each
    larger batch's, the same error over again, "During handling of the above exception,
    another exception occurred" (five times over in a batch of 32)."""
    from rawserve.worker.batch_runs import run_bisecting

    source = (
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        if 'bad' in inputs: raise RuntimeError('bad')\n"
        "        return inputs\n"
        "    return f\n"
    )
    serving = handler_runner(monkeypatch, tmp_path, source)
    assert run_bisecting(serving, ["a", "b", "bad", "c"], {})[3] == "c"
    [record] = [record for record in caplog.records if record.msg.startswith("an item failed")]
    assert record.exc_info is not None and record.exc_info[1].__context__ is None


def sent(result: BatchResult, pickler: Any = pickle.Pickler) -> BatchResult:
    """`result` as the server reads it, sent as a worker sends it."""
    from rawserve.shared.pipes import MessageReader, MessageWriter
    from rawserve.worker.process import send_result

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # as the server reads it
    try:
        writer = MessageWriter(write_end)
        writer.pickler = pickler
        assert send_result(writer, result)
        [message] = MessageReader().read(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    return message


def answered(monkeypatch, tmp_path, source: str, count: int) -> tuple:
    """A handler's answers to `count` inputs, as the server reads them from its worker."""
    serving = handler_runner(monkeypatch, tmp_path, source)
    outputs = serving.run(["one"] * count, {})
    return sent(BatchResult(1, tuple(outputs), 0.01), serving.answer_pickler).outputs


def test_a_handler_s_answers_reach_the_server_as_plain_data(monkeypatch, tmp_path):
    """Pickled as they were, a torch tensor loaded torch into the server's process (then
    500: its JSON encoder refused it), and an object of the handler's own class imported
    the handler's module into the server, or killed the worker where the server could not
    import it (its message unreadable), three times over, and quarantined the input."""
    import torch

    from rawserve.http.encoding import dumps

    source = (
        "import dataclasses, datetime, torch\n"
        "@dataclasses.dataclass\n"
        "class Scored:\n    label: str\n    score: object\n"
        "class Opaque:\n    pass\n"
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        return [{'v': torch.tensor([1.0, 2.0], requires_grad=True),\n"
        "                 's': torch.tensor(0.5, dtype=torch.bfloat16)},\n"
        "                Scored('a', torch.tensor(0.25)), Opaque(),\n"
        "                datetime.date(2024, 1, 2), 'plain']\n"
        "    return f\n"
    )
    tensors, scored, opaque, date, plain = answered(monkeypatch, tmp_path, source, 5)
    assert isinstance(tensors["v"], np.ndarray) and not isinstance(scored["score"], torch.Tensor)
    assert json.loads(dumps(tensors)) == {"v": [1.0, 2.0], "s": 0.5}
    assert json.loads(dumps(scored)) == {"label": "a", "score": 0.25}
    assert opaque == ItemFailure(
        FailureKind.INTERNAL, "the model's answer to this input cannot be sent"
    )
    assert (json.loads(dumps(date)), plain) == ("2024-01-02", "plain")


def test_a_handler_s_namedtuples_enums_paths_and_addresses_reach_the_server_as_plain_data(
    monkeypatch, tmp_path
):
    """A namedtuple (which the README says is written as a list), an Enum member, a path,
    an IP address or a dict of the handler's own class was refused as an object of its
    own class: 500, "the model's answer to this input cannot be sent" (a tester). Each is
    sent as FastAPI writes it; an Enum member whose value is an object of its own is not."""
    from rawserve.http.encoding import dumps

    source = (
        "import collections, enum, ipaddress, pathlib, typing\n"
        "Point = collections.namedtuple('Point', 'x y')\n"
        "class Pair(typing.NamedTuple):\n    a: int\n    b: str\n"
        "class Color(enum.Enum):\n    RED = 'red'\n    ODD = object()\n"
        "class Level(enum.IntEnum):\n    HIGH = 3\n"
        "class Labels(dict):\n    pass\n"
        "class Said(str):\n    def __str__(self): return 'its own'\n"
        "class Count(int):\n    def __int__(self): return 99\n"
        "def make():\n"
        "    def f(inputs, **params):\n"
        "        return [Point(1, 2), Pair(3, 'c'), Color.RED, Level.HIGH,\n"
        "                pathlib.Path('/tmp/x'), ipaddress.ip_address('::1'),\n"
        "                ipaddress.ip_network('10.0.0.0/8'), Labels(a=Point(4, 5)),\n"
        "                [Said('x'), Count(5)], Color.ODD]\n"
        "    return f\n"
    )
    answers = answered(monkeypatch, tmp_path, source, 10)
    assert [json.loads(dumps(answer)) for answer in answers[:9]] == [
        [1, 2],
        [3, "c"],
        "red",
        3,
        "/tmp/x",
        "::1",
        "10.0.0.0/8",
        {"a": [4, 5]},
        ["x", 5],  # (as JSON writes them: not their own __str__ and __int__)
    ]
    assert answers[9] == ItemFailure(
        FailureKind.INTERNAL, "the model's answer to this input cannot be sent"
    )


def test_an_output_pickle_cannot_write_fails_its_item_and_not_the_worker():
    """A handler's answer holding a lock or a lambda ended the worker as it sent the batch's
    result: its batch-mates were run again, and the input alone killed it twice more."""
    result = BatchResult(7, ("a", threading.Lock(), np.arange(3), lambda: 1), 0.01)
    answers = sent(result)
    cannot = ItemFailure(FailureKind.INTERNAL, "the model's answer to this input cannot be sent")
    assert answers.batch_id == 7 and answers.outputs[0] == "a"
    assert answers.outputs[1::2] == (cannot,) * 2 and answers.outputs[2].tolist() == [0, 1, 2]


def test_a_handler_module_in_the_current_directory_is_found_by_the_rawserve_command(
    tmp_path, monkeypatch
):
    from rawserve.worker.handler import HandlerRunner

    (tmp_path / "doubling_handler.py").write_text(
        "def make():\n    return lambda inputs, **params: [x * 2 for x in inputs]\n"
    )
    monkeypatch.chdir(tmp_path)
    # the `rawserve` command's sys.path starts at its script's folder, not the current one
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert HandlerRunner("doubling_handler:make", "cpu").run([1, 2], {}) == [2, 4]
    finally:
        sys.modules.pop("doubling_handler", None)


@pytest.mark.parametrize(
    ("said", "told"),
    [
        (
            "No connection adapters were found for 'svc:Sup3rS3cret@10.1.2.3/v1/score'",
            "No connection adapters were found for '<credentials>@10.1.2.3/v1/score'",
        ),
        # a file:// address's path is a file's; a fragment may hold a token
        ("file://localhost/etc/shadow is missing", "file://<path> is missing"),
        ("https://h/p#access_token=SECRET ok", "https://h/p?<query> ok"),
        (
            "url https://h/a?x=1, then (https://h/b?k=S)",
            "url https://h/a?<query>, then (https://h/b?<query>)",
        ),
        # words and numbers between slashes are no file's path
        ("label POSITIVE/NEGATIVE/NEUTRAL expected", "label POSITIVE/NEGATIVE/NEUTRAL expected"),
        ("in km/h and m/s/s", "in km/h and m/s/s"),
        # an address's query may hold a key; its path is no file's
        (
            "url https://api.example.com/v1/x?api_key=SECRET123&x=1 refused",
            "url https://api.example.com/v1/x?<query> refused",
        ),
        ("s3://bucket/a/key not found", "s3://bucket/a/key not found"),
        (  # an @ in the query is no userinfo: the query goes whole
            "failed: https://api.example/v1/users?email=bob@corp.example&api_key=SECRET1 403",
            "failed: https://api.example/v1/users?<query> 403",
        ),
        ("cannot open /home/me/.cache/w.bin", "cannot open <path>"),
        ("cannot open models/me/w.bin", "cannot open <path>"),
        ("cannot open ./models/me", "cannot open <path>"),
        ("C:\\Users\\me\\w.bin is missing", "<path> is missing"),
        ("date 2024/01/02 is past", "date 2024/01/02 is past"),
        (
            "cannot reach https://user:pass@host.example/x",
            "cannot reach https://<credentials>@host.example/x",
        ),
        ("redis://:s3cret@cache:6379/0", "redis://<credentials>@cache:6379/0"),  # no user
        ("https://ghp_abcd1234@github.com", "https://<credentials>@github.com"),
        ("https://user:pa/ss@host/x", "https://<credentials>@host/x"),  # a / in it
        ("postgres://user:p@ss@db", "postgres://<credentials>@db"),  # an @ in it
        # no address: as said
        ("at 10:30 the queue @ noon", "at 10:30 the queue @ noon"),
        ("write to user@example.com", "write to user@example.com"),
        ("mailto:bob@example.com", "mailto:bob@example.com"),
        ("expected 12:00:01@UTC", "expected 12:00:01@UTC"),
        ("key a:b@c", "key a:b@c"),
        ('{"a": "b@c", "ip": "[::1]:8080"}', '{"a": "b@c", "ip": "[::1]:8080"}'),
    ],
)
def test_an_address_s_credentials_in_a_failure_are_never_told_to_clients(said, told):
    """A handler's library error (a ValueError, told as the client's 422) showed the
    password of the address it could not use."""
    from rawserve.worker.runner import client_message

    assert client_message(ValueError(said)) == told


def test_a_failure_of_no_words_is_told_without_its_class_name():
    """`raise MyError()` (a ValueError) told the client the server's class name."""
    from rawserve.worker.runner import client_message

    class MyRefusal(ValueError):
        pass

    assert client_message(MyRefusal()) == "the input was refused (no reason given)"


def test_every_worker_makes_the_same_random_head_and_leaves_the_generator_as_it_was(
    tiny_model,
):
    """Two torch workers serving a classifier as fill-mask made their random heads each
    from its own generator, so one text's answer changed with the worker it met (a
    tester): the head is made from one seed, and the load does not move the generator a
    client's seeded sampling draws from."""
    import torch

    from rawserve.worker.loading import load_runner

    config = worker_config(tiny_model("text-classification"), task="fill-mask", engine=Engine.TORCH)
    heads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        runner = load_runner(config, "cpu")
        assert runner.untrained is not None
        assert torch.equal(torch.get_rng_state(), before)
        model = runner.pipe.model if hasattr(runner, "pipe") else runner.model
        weights = model.state_dict()
        heads.append({name: weights[name].clone() for name in runner.untrained.tensors})
    assert heads[0].keys() == heads[1].keys()
    assert all(torch.equal(heads[0][name], heads[1][name]) for name in heads[0])


def test_a_classifiers_logits_cut_a_long_text_on_the_side_asked(runner):
    """TEI's truncation_direction reaches /predict's and /rerank's logits (the
    classification pipeline), not only the embedding runner's: left keeps the end, right
    the start (dropped, left kept the start too)."""
    serving = runner("text-classification")
    text = "paris is lovely " * 60 + "the movie was terrible and boring " * 20
    cut = {LOGITS_PARAM: True, "truncate": True}
    [left] = serving.run([text], {**cut, "truncation_direction": "left"})
    [right] = serving.run([text], {**cut, "truncation_direction": "right"})
    [start] = serving.run(["paris is lovely " * 60], {**cut, "truncation_direction": "right"})
    assert not np.allclose(left["logits"], right["logits"])
    np.testing.assert_allclose(right["logits"], start["logits"], atol=1e-5)  # the start kept


def test_a_seq2seq_max_length_of_its_positions_plus_one_is_taken(runner):
    """A seq2seq max_length counts the decoder's start token: positions + 1 is the most
    it takes (as max_new_tokens takes the positions)."""
    summarize = runner("seq2seq", "summarization")
    positions = summarize.model.config.max_position_embeddings
    [answer] = summarize.run(["the movie was good"], {"max_length": positions + 1, "num_beams": 1})
    assert "summary_text" in answer
    refused = f"max_length {positions + 2} is over this model's limit of {positions + 1}"
    with pytest.raises(ValueError, match=refused):
        summarize.run(["the movie was good"], {"max_length": positions + 2})

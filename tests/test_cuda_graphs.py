"""An encoder's forward pass replayed from a graph per padded batch shape
(rawserve.worker.cuda_graphs, `--cuda-graphs`).

Recording a CUDA graph needs a GPU; everything around it runs here: the buckets, the
padding of a batch into a bucket's tensors (the same outputs as the batch alone, on a
real tiny model), the refill of those tensors on every replay (nothing of one batch
leaks into the next), the way back to the plain forward pass, and the runners' answers
through it. The recording itself is replaced by one that runs the forward pass at
replay, on the same tensors, as a graph would; and, where a test says so, by the CUDA
part of it alone, refusing host reads as a GPU does (tests/graph_recording.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from rawserve.tasks import LOGITS_PARAM
from rawserve.worker import cuda_graphs
from rawserve.worker.cuda_graphs import GraphedForward, bucket, padded, unpadded
from tests import graph_recording
from tests.tiny_models import worker_config

TEXTS = ["hello world", "the movie was good and long", "a", "my day " * 30]


class Replayed:
    """A stand-in for a recorded graph: replay runs the forward pass on the bucket's
    tensors, into the tensor the graph would write."""

    def __init__(self, forward, tensors):
        self.forward, self.tensors = forward, tensors
        self.output = forward(tensors).clone()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.forward(self.tensors))


@pytest.fixture
def recorded(monkeypatch):
    """Every graph recorded in the test, replayed by running the forward pass."""
    graphs: list[Replayed] = []

    def record(self, tensors):
        graphs.append(Replayed(self.forward, tensors))
        return graphs[-1], graphs[-1].output

    monkeypatch.setattr(GraphedForward, "_record", record)
    return graphs


@pytest.fixture(scope="module")
def runners(tiny_model):
    from rawserve.worker.loading import load_runner

    return {
        kind: load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
        for kind in ("text-classification", "feature-extraction")
    }


def test_a_batch_runs_at_the_next_bucket_of_rows_and_tokens_within_the_model():
    assert bucket(1, 5, 512) == (1, 8)
    assert bucket(3, 9, 512) == (4, 16)
    assert bucket(33, 70, 512) == (48, 80)  # multiples of 16 past 64 tokens
    assert bucket(2, 129, 512) == (2, 160)  # of 32 past 128
    assert bucket(1, 97, 100) == (1, 100)  # never more tokens than the model reads
    assert bucket(1, 101, 100) is None  # too long: runs as it is, and fails as it would
    assert bucket(513, 8, 512) is None  # more rows than any bucket
    assert bucket(256, 64, 512) is None  # 16,384 padded tokens: past MAX_GRAPH_TOKENS
    assert bucket(128, 64, 512) == (128, 64)


@pytest.mark.parametrize("kind, per_token", [("text-classification", False),
                                             ("feature-extraction", True)])  # fmt: skip
def test_a_batch_padded_into_its_bucket_gives_the_outputs_it_gives_alone(runners, kind, per_token):
    runner = runners[kind]
    model = runner.pipe.model if kind == "text-classification" else runner.model
    encoded = runner.tokenizer(TEXTS[:3], padding=True, return_tensors="pt")
    rows, length = encoded["input_ids"].shape
    shape = bucket(rows, length, runner.max_length)
    assert shape is not None and shape != (rows, length)  # padded in both directions
    into = {name: torch.full(shape, 7, dtype=encoded[name].dtype) for name in encoded}
    padded(encoded, into)
    with torch.inference_mode():
        alone = model(**encoded)[0]
        in_bucket = unpadded(model(**into)[0], rows, length, per_token)
    assert torch.isfinite(model(**into)[0]).all()  # padded rows attend to one token: no NaN
    torch.testing.assert_close(in_bucket, alone, rtol=1e-4, atol=1e-5)


def test_each_replay_refills_the_buckets_tensors_so_no_batch_leaks_into_the_next(runners, recorded):
    model = runners["text-classification"].pipe.model
    tokenizer = runners["text-classification"].tokenizer
    graphed = GraphedForward(lambda inputs: model(**inputs).logits, "cpu", False, 512)
    with torch.inference_mode():
        # 3 rows then 2 in a bucket of 4; a longer text then a shorter one in a bucket of 8
        for texts in (TEXTS[:3], TEXTS[1:3], [TEXTS[1]], ["a"], TEXTS[:3]):
            encoded = tokenizer(texts, padding=True, return_tensors="pt")
            torch.testing.assert_close(
                graphed(encoded), model(**encoded).logits, rtol=1e-4, atol=1e-5
            )
    # one recording a shape, replayed once to check it, then for each batch of its shape
    assert len(recorded) == len(graphed.graphs) < 5
    assert sum(graph.replays for graph in recorded) == len(recorded) + 5


def test_what_no_graph_fits_runs_as_it_is(runners, recorded):
    model = runners["text-classification"].pipe.model
    tokenizer = runners["text-classification"].tokenizer
    graphed = GraphedForward(lambda inputs: model(**inputs).logits, "cpu", False, 16)
    with torch.inference_mode():
        long = tokenizer([TEXTS[3]], return_tensors="pt")  # past the 16 tokens it reads
        torch.testing.assert_close(graphed(long), model(**long).logits)
        assert not recorded  # its own shape, as it is (a model that refuses it, refuses it)
        no_types = dict(tokenizer(["a"], return_tensors="pt"))
        graphed(no_types)  # the first batch's inputs are the graphs'
        no_types.pop("token_type_ids")
        graphed(no_types)  # other inputs: no graph
    assert len(recorded) == 1 and not graphed.failed


def test_a_failed_recording_leaves_the_model_running_without_graphs(runners, monkeypatch, caplog):
    def broken(self, tensors):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedForward, "_record", broken)
    model = runners["text-classification"].pipe.model
    encoded = runners["text-classification"].tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    graphed = GraphedForward(lambda inputs: model(**inputs).logits, "cpu", False, 512)
    with caplog.at_level(logging.WARNING, "rawserve.worker"), torch.inference_mode():
        first, second = graphed(encoded), graphed(encoded)
        torch.testing.assert_close(first, model(**encoded).logits)
    torch.testing.assert_close(second, first)
    assert graphed.failed and not graphed.graphs
    assert sum("recording the forward pass failed" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("kind", ["text-classification", "feature-extraction"])
def test_a_runner_with_graphs_answers_as_it_does_without(tiny_model, recorded, kind):
    from rawserve.worker.loading import load_runner

    plain = load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
    graphed = load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
    assert graphed.use_cuda_graphs().startswith("on")
    asked: list[tuple[list, dict]] = [(texts, {}) for texts in (TEXTS, TEXTS[:1], TEXTS[1:3])]
    if kind == "text-classification":  # TEI's /predict and /rerank: logits, text pairs too
        pairs = [{"text": "a question", "text_pair": text} for text in TEXTS[:3]]
        asked += [(TEXTS[:3], {LOGITS_PARAM: True}), (pairs, {LOGITS_PARAM: True})]
    for texts, params in asked:
        for one, two in zip(plain.run(texts, params), graphed.run(texts, params), strict=True):
            if isinstance(one, dict) and "logits" in one:
                assert one["tokens"] == two["tokens"]
                np.testing.assert_allclose(two["logits"], one["logits"], rtol=1e-4, atol=1e-5)
            elif isinstance(one, dict):
                assert one["label"] == two["label"]
                assert two["score"] == pytest.approx(one["score"], abs=1e-5)
            else:
                np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    assert recorded  # the graphs' way was taken


def test_the_warm_up_records_every_smaller_bucket_of_rows(tiny_model, recorded):
    from rawserve.worker.loading import load_runner
    from rawserve.worker.warmup import warm_up

    runner = load_runner(worker_config(tiny_model("text-classification"), threads=1), "cpu")
    runner.cuda_graphs = runner.use_cuda_graphs()
    assert warm_up(runner, 32) is not None
    rows = sorted(shape[0] for shape in runner.graphed.graphs)
    assert rows == [r for r in cuda_graphs.ROW_BUCKETS if r <= 32]  # one token bucket each
    assert runner.cuda_graphs.startswith("on: ")  # what /info says


def test_graphs_the_warm_up_failed_to_record_are_off_in_what_the_worker_says(
    tiny_model, recorded_as_a_gpu_records
):
    """On the H200 every recording of the classifier failed (a hook read its scores back
    to the host) and the classifier ran as it is, while /info said its graphs were on:
    the log's warning was the only sign. What the worker says after its warm-up (its
    `cuda_graphs`, which /info shows) now says they are off."""
    from rawserve.worker.loading import load_runner
    from rawserve.worker.warmup import warm_up

    runner = load_runner(worker_config(tiny_model("text-classification"), threads=1), "cpu")
    runner.cuda_graphs = runner.use_cuda_graphs()

    def read_back(_module, _args, output) -> None:
        assert bool(output.logits.isfinite().all())

    runner.pipe.model.register_forward_hook(read_back)
    assert warm_up(runner, 4) is not None
    assert runner.graphed.failed and not recorded_as_a_gpu_records
    said = "off: recording the forward pass failed at the warm-up (the log says why)"
    assert runner.cuda_graphs.startswith(said)


def test_graphs_are_on_unless_the_flag_or_its_variable_says_no(monkeypatch):
    from rawserve.options import parse_config

    assert parse_config([]).model.cuda_graphs  # a CPU worker ignores it (below)
    assert not parse_config(["--no-cuda-graphs"]).model.cuda_graphs
    monkeypatch.setenv("RAWSERVE_NO_CUDA_GRAPHS", "1")
    assert not parse_config([]).model.cuda_graphs


def test_a_cpu_worker_asked_for_graphs_runs_without_and_says_nothing_of_them(tiny_model):
    from rawserve.worker.loading import load_runner

    config = worker_config(tiny_model("text-classification"), threads=1, cuda_graphs=True)
    runner = load_runner(config, "cpu")
    assert runner.cuda_graphs == "" and runner.graphed is None


def test_a_graph_whose_replay_differs_from_the_pass_leaves_the_model_without_graphs(
    runners, monkeypatch, caplog
):
    """A pass that does not record faithfully (a branch on a tensor's value, state kept
    between calls) is caught by the first replay, on the batch that asked for it."""

    class Unfaithful(Replayed):
        def replay(self) -> None:
            super().replay()
            self.output.mul_(-1)

    def record(self, tensors):
        graph = Unfaithful(self.forward, tensors)
        return graph, graph.output

    monkeypatch.setattr(GraphedForward, "_record", record)
    model = runners["text-classification"].pipe.model
    encoded = runners["text-classification"].tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    graphed = GraphedForward(lambda inputs: model(**inputs).logits, "cpu", False, 512)
    with caplog.at_level(logging.WARNING, "rawserve.worker"), torch.inference_mode():
        torch.testing.assert_close(graphed(encoded), model(**encoded).logits)
    assert graphed.failed and not graphed.graphs
    assert any("differs" in (r.exc_text or "") for r in caplog.records)


def test_tasks_without_a_replayed_forward_pass_say_so(tiny_model):
    from rawserve.worker.loading import load_runner

    runner = load_runner(worker_config(tiny_model("fill-mask"), threads=1), "cpu")
    assert runner.use_cuda_graphs().startswith("off")
    assert cuda_graphs.MAX_GRAPHS > 0


def test_what_became_of_the_graphs_reaches_the_workers_status_for_info():
    from rawserve.api.operations import _worker_info
    from rawserve.serving.pool import WorkerPool
    from rawserve.serving.status import WorkerState
    from rawserve.shared.messages import WorkerConfig, WorkerReady

    executor = WorkerPool(WorkerConfig(model="unused", task="text-classification"), ["cpu"])
    [worker] = executor.workers
    worker.state = WorkerState.LOADING
    said = "on: text classification's scores and logits, a graph per padded batch shape"
    ready = WorkerReady(1, "text-classification", "cuda:0", "float16", 1.0, cuda_graphs=said)
    executor._pump = lambda: None  # type: ignore[method-assign] - nothing to dispatch here
    executor._on_message(worker, ready)
    assert _worker_info(executor.status()[0])["cuda_graphs"] == said


def test_past_the_most_shapes_new_ones_run_as_they_are_and_the_log_says_so_once(
    runners, recorded, monkeypatch, caplog
):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 1)
    model = runners["text-classification"].pipe.model
    tokenizer = runners["text-classification"].tokenizer
    graphed = GraphedForward(lambda inputs: model(**inputs).logits, "cpu", False, 512)
    with caplog.at_level(logging.INFO, "rawserve.worker"), torch.inference_mode():
        for texts in (["a"], TEXTS[:3], TEXTS[:3], ["a"]):
            encoded = tokenizer(texts, padding=True, return_tensors="pt")
            torch.testing.assert_close(graphed(encoded), model(**encoded).logits)
    assert len(recorded) == 1 and recorded[0].replays == 1 + 2  # checked, then twice
    assert sum("shapes recorded" in r.message for r in caplog.records) == 1


@pytest.fixture
def recorded_as_a_gpu_records(monkeypatch):
    """The CUDA part of a recording as a GPU enforces it (tests/graph_recording.py): no
    host reads while it records."""
    return graph_recording.recorded_as_a_gpu_records(monkeypatch)


@pytest.mark.parametrize("kind", ["text-classification", "feature-extraction"])
def test_a_recording_reads_nothing_back_to_the_host(tiny_model, recorded_as_a_gpu_records, kind):
    """The check for scores that are not numbers, a forward hook on the model, read them
    while the pass was recorded: on the H200 every recording failed and the classifier
    ran without graphs (5 ms a text where a replay takes 1). A recording now checks
    nothing; each replay's scores are checked."""
    from rawserve.worker.loading import load_runner

    plain = load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
    graphed = load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
    assert graphed.use_cuda_graphs().startswith("on")
    for texts in (TEXTS, TEXTS[:1], TEXTS[1:3]):
        for one, two in zip(plain.run(texts, {}), graphed.run(texts, {}), strict=True):
            if isinstance(one, dict):
                assert (one["label"], one["score"]) == (two["label"], pytest.approx(two["score"]))
            else:
                np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    assert recorded_as_a_gpu_records and not graphed.graphed.failed
    assert len(graphed.graphed.graphs) == len(recorded_as_a_gpu_records)


@pytest.mark.parametrize("kind", ["text-classification", "feature-extraction"])
def test_scores_that_are_not_numbers_fail_their_input_alone_and_leave_the_graphs_on(
    tiny_model, recorded_as_a_gpu_records, kind
):
    """An input whose scores overflow in the batch a shape is recorded on: its first
    replay is NaN where the pass as it is was NaN too, which is faithful (NaN is no
    number, but equal to itself here); the input fails alone, checked on the replay."""
    from rawserve.shared.messages import FailureKind, ItemFailure
    from rawserve.worker.batch_runs import run_bisecting
    from rawserve.worker.loading import load_runner

    runner = load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
    runner.use_cuda_graphs()
    model = runner.pipe.model if kind == "text-classification" else runner.model
    marker = runner.tokenizer("paris", add_special_tokens=False)["input_ids"][-1]

    def overflow(_module, args, output):  # the input holding the marker's token overflows
        return output.masked_fill((args[0] == marker).unsqueeze(-1), float("nan"))

    model.get_input_embeddings().register_forward_hook(overflow)
    good, bad = run_bisecting(runner, ["hello world", "paris"], {})
    assert isinstance(bad, ItemFailure) and bad.kind == FailureKind.INTERNAL
    assert "not numbers" in bad.message and not isinstance(good, ItemFailure)
    assert recorded_as_a_gpu_records and not runner.graphed.failed

"""A batch tokenized ahead, on a thread of its own, while the one before it runs
(rawserve.worker.feeder's preparing thread, a runner's `prepare` and `run_prepared`).

What it must keep: the same answers as tokenizing in the model's thread, the messages'
order, and a batch whose preparation fails still run whole by the model thread, which
then says what failed (one bad input never fails its batch-mates)."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing import Pipe

import numpy as np
import pytest

from rawserve.serving.pool import WorkerPool
from rawserve.shared.messages import (
    EMBEDDING_ROUTE,
    NO_CONTROL,
    Batch,
    Cancel,
    FailureKind,
    ItemFailure,
    Shutdown,
    WorkerConfig,
)
from rawserve.worker.feeder import Feeder
from tests.tiny_models import WORDS, worker_config

TEXTS = ["hello world", "the movie was good and long", "a", "my day " * 30]


@pytest.fixture(scope="module")
def runners(tiny_model):
    from rawserve.worker.loading import load_runner

    return {
        kind: load_runner(worker_config(tiny_model(kind), threads=1), "cpu")
        for kind in ("text-classification", "sentence-embedding", "feature-extraction")
    }


def same(one, two, atol: float = 0.0) -> bool:
    """Equal answers; `atol` for vectors computed in batches of other sizes (padding)."""
    if isinstance(one, dict):
        return one.keys() == two.keys() and all(same(one[k], two[k], atol) for k in one)
    if isinstance(one, (list, tuple)):
        pairs = zip(one, two, strict=True)
        return len(one) == len(two) and all(same(a, b, atol) for a, b in pairs)
    if isinstance(one, np.ndarray):
        return np.allclose(one, two, rtol=0, atol=atol) if atol else np.array_equal(one, two)
    return one == two


@pytest.mark.parametrize(
    "kind, params, control",
    [
        ("text-classification", {}, NO_CONTROL),
        ("sentence-embedding", {}, NO_CONTROL),
        ("sentence-embedding", {}, EMBEDDING_ROUTE),
        ("sentence-embedding", {"truncation_direction": "left", "normalize": False}, NO_CONTROL),
        ("sentence-embedding", {"dimensions": 8}, EMBEDDING_ROUTE),
        ("feature-extraction", {}, NO_CONTROL),
    ],
)
def test_a_prepared_batch_answers_what_the_model_thread_would(runners, kind, params, control):
    runner = runners[kind]
    assert runner.prepares_ahead and runner.ahead_tokenizer() is not runner.tokenizer
    expected = runner.run(TEXTS, dict(params), control)
    prepared = runner.prepare(TEXTS, dict(params), control)
    assert prepared is not None
    assert same(runner.run_prepared(TEXTS, dict(params), control, prepared), expected)


def test_what_cannot_be_prepared_is_left_to_the_model_thread(runners):
    classifier = runners["text-classification"]
    # parameters the plain path does not take: the pipeline runs it, untokenized ahead
    assert classifier.prepare(TEXTS, {"top_k": 2}) is None
    assert len(classifier.run_prepared(TEXTS, {"top_k": 2}, NO_CONTROL, None)) == len(TEXTS)
    # an input past the model's positions, with truncation off: preparing fails, and the
    # model thread's run says why (the message a client is answered with)
    embedder = runners["sentence-embedding"]
    too_long = ["word " * 5000]
    with pytest.raises(ValueError, match="tokens and the model takes at most"):
        embedder.prepare(too_long, {"truncate": False})
    with pytest.raises(ValueError, match="tokens and the model takes at most"):
        embedder.run(too_long, {"truncate": False})


def test_counting_a_long_texts_tokens_warns_of_no_indexing_error(runners):
    """The worker counts a text's tokens whole (for the server's estimate) and the model
    reads it cut: transformers' warning of "indexing errors" for a sequence past the
    model's length reached the operator's log, of something that never happens."""
    import copy

    runner = runners["sentence-embedding"]
    tokenizer = copy.deepcopy(runner.tokenizer)  # (its warnings once each: none given yet)
    tokenizer.deprecation_warnings.clear()
    tokenizer.model_max_length = 512  # (as the packaged MiniLM's says)
    (counted,) = runner.count_tokens(["word " * 2000], tokenizer)
    assert counted > 2000
    # (transformers' loggers do not propagate to the root: what it warned, it notes here)
    assert not [key for key in tokenizer.deprecation_warnings if "sequence-length" in key]


def test_two_threads_tokenizing_at_once_each_get_their_own_answer(runners):
    """The model thread and the preparing thread tokenize at the same time, with different
    truncation sides: each must see its own settings (they are a tokenizer's state)."""
    runner = runners["sentence-embedding"]
    left, right = {"truncation_direction": "left"}, {"truncation_direction": "right"}
    long_text = [" ".join(WORDS * 20)]  # known words, past the positions: cut at one end
    expected_left = runner.run(long_text, dict(left))
    expected_right = runner.run(long_text, dict(right))
    assert not np.array_equal(expected_left[0], expected_right[0])
    failures: list[str] = []

    def model_thread() -> None:
        for _ in range(30):
            if not same(runner.run(long_text, dict(right)), expected_right):
                failures.append("model thread")

    def preparing_thread() -> None:
        for _ in range(30):
            prepared = runner.prepare(long_text, dict(left))
            if not same(
                runner.run_prepared(long_text, dict(left), NO_CONTROL, prepared), expected_left
            ):
                failures.append("preparing thread")

    threads = [threading.Thread(target=model_thread), threading.Thread(target=preparing_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []


def test_the_feeder_prepares_the_next_batch_before_the_model_thread_asks():
    receiving, sending = Pipe(duplex=False)
    second_prepared = threading.Event()

    def prepare(batch: Batch):
        if batch.inputs == ("bad",):
            raise ValueError("cannot tokenize")
        if batch.batch_id == 2:
            second_prepared.set()
        return f"tokens of {batch.inputs}"

    feeder = Feeder(receiving, prepare).start()
    sent = time.perf_counter()
    for batch_id, inputs in ((1, ("a",)), (2, ("b", "c")), (3, ("bad",))):
        sending.send(Batch(batch_id, inputs))
    sending.send(Shutdown())
    first = feeder.next()
    received = feeder.received(1)
    assert first.batch_id == 1 and received.prepared == "tokens of ('a',)"
    assert sent <= received.at <= time.perf_counter() and received.prepare_seconds > 0
    # batch 1 is "running": batch 2 is tokenized meanwhile, not when it is asked for
    assert second_prepared.wait(10)
    second = feeder.next()
    assert second.batch_id == 2 and feeder.received(2).prepared == "tokens of ('b', 'c')"
    assert feeder.received(2).prepared is None  # taken once
    third = feeder.next()
    assert third.batch_id == 3 and feeder.received(3).prepared is None  # left to the model
    assert isinstance(feeder.next(), Shutdown)


def test_without_preparing_the_feeder_still_tells_when_each_batch_arrived():
    receiving, sending = Pipe(duplex=False)
    feeder = Feeder(receiving, timed=True).start()
    sent = time.perf_counter()
    sending.send(Batch(7, ("a",)))
    assert feeder.next().batch_id == 7
    received = feeder.received(7)
    assert received.at >= sent and received.prepared is None and received.prepare_seconds == 0
    assert feeder._received == {}  # taken: nothing kept


def test_the_feeder_tells_whether_the_next_batch_is_already_here():
    """A worker trims its heap only when no batch waits (a GPU's second batch would wait
    through the trim): the feeder says, whether the batch is queued or being prepared."""
    receiving, sending = Pipe(duplex=False)
    preparing = threading.Event()
    go_on = threading.Event()

    def prepare(batch: Batch):
        preparing.set()
        assert go_on.wait(10)

    feeder = Feeder(receiving, prepare).start()
    assert not feeder.waiting()
    sending.send(Batch(1, ("a",)))
    assert preparing.wait(10)
    assert feeder.waiting()  # being prepared
    go_on.set()
    assert feeder.next().batch_id == 1
    assert not feeder.waiting()


def test_the_feeder_says_when_the_server_no_longer_wants_the_batch_running():
    """A batch run whole reads no message until it is done: the feeder's thread does, so
    a generation nobody waits for (its clients left, or their deadlines passed) stops at
    its next token instead of running to its max_tokens long after its 504. A cancel of
    a batch queued behind it holds for that one; those of batches gone before are let go."""
    receiving, sending = Pipe(duplex=False)
    feeder = Feeder(receiving, timed=True).start()
    for message in [Batch(1, ("a",)), Batch(2, ("b",)), Cancel(2), Cancel(0)]:
        sending.send(message)
    assert feeder.next().batch_id == 1 and not feeder.running_cancelled()
    assert feeder.next().batch_id == 2
    assert feeder.next() == Cancel(2)  # (passed on too: the continuous loop reads them)
    assert feeder.running_cancelled()
    assert feeder.next() == Cancel(0)
    sending.send(Batch(3, ("c",)))
    assert feeder.next().batch_id == 3 and not feeder.running_cancelled()
    assert feeder._cancelled == set()


def test_a_feeder_that_times_nothing_keeps_nothing():
    """The continuous generation loop takes batches and cancels and never asks when a
    batch arrived, nor whether one is cancelled: a record per batch, or per cancel (a
    busy loop drains, and nothing trimmed them), would pile up for the worker's life."""
    receiving, sending = Pipe(duplex=False)
    feeder = Feeder(receiving).start()
    for batch_id in range(50):
        sending.send(Batch(batch_id, ("a",)))
        sending.send(Cancel(batch_id))
    taken: list[object] = []
    given_up = time.monotonic() + 10
    while len(taken) < 100 and time.monotonic() < given_up:  # as a busy continuous loop
        taken += feeder.drain()
        time.sleep(0.001)
    assert taken[-1] == Cancel(49)
    assert feeder._received == {} and feeder._cancelled == set()


def _run_out_of_memory() -> None:
    raise MemoryError


class OutOfMemoryOnArrival:
    """A message whose unpickling runs out of memory, as a large batch's may in a worker
    at its memory limit."""

    def __reduce__(self):
        return (_run_out_of_memory, ())


def test_a_message_that_cannot_be_read_stops_the_worker_instead_of_hanging_it(caplog):
    """The reading thread once died of it, leaving the model thread waiting for a batch
    that never came until --batch-timeout killed the worker (its clients' deadlines long
    past); the worker now stops at once, and the server restarts it and retries."""
    receiving, sending = Pipe(duplex=False)
    feeder = Feeder(receiving, timed=True).start()
    sending.send(OutOfMemoryOnArrival())
    taken: list[object] = []
    model_thread = threading.Thread(target=lambda: taken.append(feeder.next()), daemon=True)
    model_thread.start()
    model_thread.join(10)
    assert taken and isinstance(taken[0], Shutdown)
    assert "cannot be read" in caplog.text and "MemoryError" in caplog.text


class RecordingLoop:
    """Stands in for the event loop where the pool sets its timers: records each delay."""

    def __init__(self):
        self.delays: list[float] = []

    def call_later(self, delay, callback, *args):
        self.delays.append(delay)


def test_a_workers_second_batch_is_sent_in_time_to_be_prepared_before_it_runs():
    loop = RecordingLoop()
    pool = WorkerPool(WorkerConfig(model="m", task="feature-extraction"), ["cuda:0"], loop=loop)
    worker = pool.workers[0]
    worker.overlap, worker.run_seconds = True, 0.100
    pool._hold_second(worker, None)
    assert loop.delays == [pytest.approx(0.075)]  # the run less a quarter of it
    worker.prepare_seconds = 0.030  # the worker takes 30 ms to tokenize a batch ahead
    pool._hold_second(worker, None)
    assert loop.delays[-1] == pytest.approx(0.045) and not worker.second_open
    worker.prepare_seconds = 0.080  # about the whole run: the second batch goes at once
    pool._hold_second(worker, None)
    assert len(loop.delays) == 2 and worker.second_open


@pytest.mark.slow
@pytest.mark.parametrize("prepare_ahead", [True, False, None])  # None: by device (a CPU: no)
async def test_a_worker_with_two_batches_in_flight_answers_each_with_its_own(
    tiny_model, runners, prepare_ahead
):
    """A real worker process, two batches sent at once (a GPU worker's way): the second
    is tokenized while the first runs; answers as in-process; an input that cannot run
    fails alone."""
    config = worker_config(tiny_model("sentence-embedding"), threads=1, prepare_ahead=prepare_ahead)
    pool = WorkerPool(config, ["cpu"], overlap=True)
    pool.start()
    try:
        await asyncio.wait_for(pool.wait_ready(), 120)
        runner = runners["sentence-embedding"]
        strict = {"truncate": False}
        too_long = "word " * 5000
        first = pool.submit(TEXTS, {}, EMBEDDING_ROUTE)
        second = pool.submit(["good", too_long, "also good"], strict, EMBEDDING_ROUTE)
        assert pool.workers[0].queued is not None  # both in the worker at once
        one, two = await asyncio.wait_for(asyncio.gather(first, second), 60)
        # the worker says how long tokenizing ahead took; the pool keeps a lead for it
        assert (one.prepare_seconds > 0) is bool(prepare_ahead)
        assert (pool.workers[0].prepare_seconds > 0) is bool(prepare_ahead)
        # the first batch's real token counts (sampled), counted ahead or by the model thread
        assert one.token_counts == tuple(runner.count_tokens(TEXTS))
        assert same(list(one.outputs), runner.run(TEXTS, {}, EMBEDDING_ROUTE), 1e-6)
        good, failed, also_good = two.outputs
        assert isinstance(failed, ItemFailure) and failed.kind is FailureKind.INPUT
        assert "tokens and the model takes at most" in failed.message
        assert same(
            [good, also_good], runner.run(["good", "also good"], strict, EMBEDDING_ROUTE), 1e-6
        )
    finally:
        await pool.shutdown()


def test_a_tokenizer_that_cannot_be_copied_leaves_the_tokenizing_to_the_model_thread(runners):
    from rawserve.worker.process import prepare_batch

    class Uncopyable:
        def __deepcopy__(self, memo):
            raise TypeError("this tokenizer holds a handle that cannot be copied")

    runner = runners["sentence-embedding"]
    saved, runner.tokenizer, runner._ahead_tokenizer = runner.tokenizer, Uncopyable(), None
    try:
        assert prepare_batch(runner) is None  # the worker serves, tokenizing in turn
    finally:
        runner.tokenizer = saved
    assert prepare_batch(runner) is not None


def tokenizer_panic(tokenizer) -> None:
    """A real panic of the tokenizers library: an overlap (stride) as long as the room a
    question leaves its context (transformers checks the stride against the length less
    the special tokens, not less the question)."""
    tokenizer(
        "Where does Zoe live?",
        "Zoe lives in Zurich. " * 40,
        truncation="only_second",
        max_length=16,
        stride=8,
        return_overflowing_tokens=True,
    )


def test_a_library_panic_while_preparing_leaves_the_batch_to_the_model_thread(runners):
    """pyo3 raises a panic as a BaseException: uncaught, it ended the preparing thread and
    the worker waited for its batch forever."""
    tokenizer = runners["text-classification"].tokenizer
    with pytest.raises(BaseException) as raised:  # the premise: a panic, not an Exception
        tokenizer_panic(tokenizer)
    assert not isinstance(raised.value, Exception), raised.value
    receiving, sending = Pipe(duplex=False)

    def prepare(batch: Batch):
        tokenizer_panic(tokenizer)

    feeder = Feeder(receiving, prepare).start()
    sending.send(Batch(1, ("a",)))
    sending.send(Batch(2, ("b",)))
    sending.send(Shutdown())
    for batch_id in (1, 2):
        assert feeder.next().batch_id == batch_id
        assert feeder.received(batch_id).prepared is None  # left to the model thread
    assert isinstance(feeder.next(), Shutdown)

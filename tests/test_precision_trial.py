"""bfloat16 on a CPU that computes it in hardware: measured against the float32 that
serves, its answers set beside float32's, offered in the log and /info and never chosen
by itself; kept per model and machine. No such CPU here: its flags are faked where the
worker reads them, and the bfloat16 copy is a real one of a tiny model."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from rawserve.shared.messages import Engine
from rawserve.worker import engine_trial, precision_trial
from rawserve.worker.precision_trial import Drift, Offer, bf16_units, compare, measure
from tests.test_engine_trial import FakeClock, with_raw


@pytest.fixture(autouse=True)
def trials_keep_verdicts_beside_other_tests(monkeypatch):
    """These trials run beside other tests (or are stubbed): kept as on a quiet machine."""
    monkeypatch.setattr(engine_trial, "FULL_SHARE", 0.0)


AMX_FLAGS = "fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(
    ("flags", "units"),
    [
        (AMX_FLAGS, "amx_bf16"),  # the matrix units first
        ("fpu avx2 avx512f avx512_bf16", "avx512_bf16"),
        ("fpu sse2 avx2 fma", None),  # bfloat16 emulated: nothing to offer
        ("", None),  # no /proc/cpuinfo
    ],
)
def test_the_units_are_read_from_the_cpus_flags(flags, units):
    assert bf16_units(flags) == units


def test_answers_side_by_side_give_the_largest_difference_and_the_lowest_cosine():
    vectors = [np.array([[1.0, 0.0, 0.0]], dtype=np.float32), np.array([[0.0, 2.0]])]
    moved = [np.array([[0.99, 0.01, 0.0]], dtype=np.float32), np.array([[0.0, 2.0]])]
    drift = compare(vectors, moved)
    assert drift.largest == pytest.approx(0.01, abs=1e-6)
    assert drift.cosine == pytest.approx(0.99 / np.hypot(0.99, 0.01))
    assert drift.same_labels
    assert compare(vectors, vectors) == Drift(0.0, 1.0, same_labels=True)


def test_a_label_that_changes_is_told_apart_from_scores_that_move():
    float32 = [[{"label": "POSITIVE", "score": 0.51}, {"label": "NEGATIVE", "score": 0.49}]]
    nearby = [[{"label": "POSITIVE", "score": 0.52}, {"label": "NEGATIVE", "score": 0.48}]]
    swapped = [[{"label": "NEGATIVE", "score": 0.5}, {"label": "POSITIVE", "score": 0.5}]]
    assert compare(float32, nearby).same_labels
    assert compare(float32, nearby).largest == pytest.approx(0.01)
    assert not compare(float32, swapped).same_labels
    spans = [{"answer": "river bank", "start": 53, "end": 63, "score": 0.3}]
    assert not compare(spans, [{**spans[0], "end": 62}]).same_labels


def test_answers_of_another_shape_have_no_difference_to_give():
    drift = compare([[0.1, 0.2, 0.3]], [[0.1, 0.2]])
    assert drift == Drift(None, None, same_labels=False)
    assert compare([[1.0]], []).same_labels is False
    line = Offer("amx_bf16", 8, 0.04, 0.01, drift).describe()
    assert "differ from float32's in shape" in line


@pytest.mark.parametrize(
    ("float32_ms", "bfloat16_ms", "verdict"),
    [
        (40, 10, "faster: --dtype bfloat16 serves it"),
        (10, 40, "not faster: float32 serves"),
        # a tie (1.00x) was "faster": two timings on one machine differ by more than that
        (
            20.4,
            20.3,
            "not clearly faster (under the 1.1x that advises it: two timings on "
            "one machine differ by as much): float32 serves",
        ),
        (21, 20, "not clearly faster (under the 1.1x"),
    ],
)
def test_the_copy_is_timed_against_what_serves(float32_ms, bfloat16_ms, verdict):
    clock = FakeClock()
    answers = [np.array([0.6, 0.8])]

    def timed(name: str, ms: float):
        step = clock.candidate(name, ms / 1000)
        return lambda: step() or answers

    offer = measure(
        timed("float32", float32_ms), timed("bfloat16", bfloat16_ms), 8, "amx_bf16", clock
    )
    assert offer.float32_seconds == pytest.approx(float32_ms / 1000)
    assert offer.bfloat16_seconds == pytest.approx(bfloat16_ms / 1000)
    assert clock.calls[2:6] == ["float32", "bfloat16", "float32", "bfloat16"]  # in turn
    line = offer.describe()
    assert line.startswith("bfloat16 on this CPU's amx_bf16, measured now: a batch of 8")
    assert f"{float32_ms:.1f} ms" in line and f"{bfloat16_ms:.1f} ms" in line
    assert line.split("; ")[-1].startswith(verdict)
    assert offer.advised is verdict.startswith("faster")


def test_a_kept_finding_reads_back_the_same(tmp_path):
    offer = Offer("amx_bf16", 8, 0.04, 0.01, Drift(0.002, 0.99994, same_labels=True))
    key = {"model": "m", "machine": {"cpu": "x"}}
    precision_trial.remember(tmp_path, key, offer)
    again = precision_trial.recalled(tmp_path, key)
    assert again == Offer(**{**offer.__dict__, "cached": True})
    assert ", found in the cache: " in again.describe()
    assert precision_trial.recalled(tmp_path, {**key, "model": "other"}) is None
    precision_trial.remember(tmp_path, key, offer, start="s1")  # this very start's trial
    again = precision_trial.recalled(tmp_path, key, start="s1")
    assert again is not None and "measured at this start (cached)" in again.describe()
    again = precision_trial.recalled(tmp_path, key, start="s2")
    assert again is not None and ", found in the cache: " in again.describe()


@pytest.mark.parametrize(
    "damaged",
    [
        {"drift": {"largest": "x", "cosine": 0.9, "same_labels": True}},
        {"drift": {"largest": 0.002, "cosine": None, "same_labels": True}},
        {"drift": [1, 2]},
        {"float32_seconds": None},
        {"bfloat16_seconds": float("nan")},
    ],
)
def test_a_kept_finding_with_damaged_figures_is_measured_again(tmp_path, damaged):
    """A file edited or damaged by hand is not the start's failure (describe() formats its
    numbers): the finding is measured again."""
    offer = Offer("amx_bf16", 8, 0.04, 0.01, Drift(0.002, 0.99994, same_labels=True))
    key = {"model": "m"}
    precision_trial.remember(tmp_path, key, offer)
    (file,) = tmp_path.glob("bfloat16-trial-*.json")
    file.write_text(json.dumps({**json.loads(file.read_text()), **damaged}))
    assert precision_trial.recalled(tmp_path, key) is None


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("batch", "1e999"),  # infinity: int() raised OverflowError, and the start failed
        ("batch", "8.5"),
        ("float32_seconds", "1" + "0" * 400),  # too large for a float
        ("drift", '{"largest": 1' + "0" * 400 + ', "cosine": 0.9, "same_labels": true}'),
    ],
)
def test_a_kept_finding_with_a_number_past_any_range_is_measured_again(tmp_path, field, text):
    offer = Offer("amx_bf16", 8, 0.04, 0.01, Drift(0.002, 0.99994, same_labels=True))
    key = {"model": "m"}
    precision_trial.remember(tmp_path, key, offer)
    (file,) = tmp_path.glob("bfloat16-trial-*.json")
    file.write_text(with_raw(json.loads(file.read_text()), field, text))
    assert precision_trial.recalled(tmp_path, key) is None


def test_a_kept_finding_of_answers_of_another_shape_reads_back(tmp_path):
    offer = Offer("amx_bf16", 8, 0.04, 0.01, Drift(None, None, same_labels=False))
    precision_trial.remember(tmp_path, {"model": "m"}, offer)
    again = precision_trial.recalled(tmp_path, {"model": "m"})
    assert again is not None and "differ from float32's in shape" in again.describe()


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """A CPU with AMX, as the worker reads it; its finding kept in a fresh cache."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine_trial, "cpu_facts", lambda: {"flags": AMX_FLAGS})
    offers: list[Offer] = []
    real_measure = precision_trial.measure

    def counted(*args, **kwargs):
        offers.append(real_measure(*args, **kwargs))
        return offers[-1]

    monkeypatch.setattr(precision_trial, "measure", counted)
    return offers


def test_a_float32_encoder_on_such_a_cpu_measures_a_real_bfloat16_copy_once(
    tiny_model, bf16_cpu, caplog
):
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    config = worker_config(
        tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4, threads=1
    )
    with caplog.at_level(logging.INFO, logger="rawserve.worker"):
        first = loading.load_runner(config, "cpu")
        second = loading.load_runner(config, "cpu")
    assert len(bf16_cpu) == 1  # the second start read what the first found
    offer = bf16_cpu[0]
    assert first.dtype == "float32"  # offered, never chosen
    assert 0 < offer.drift.largest < 0.05 and offer.drift.cosine > 0.999  # a real copy
    assert offer.drift.same_labels
    assert first.bfloat16_trial == offer.describe()
    assert "measured now" in first.bfloat16_trial
    assert "found in the cache" in second.bfloat16_trial
    assert any(r.getMessage().startswith("bfloat16 trial: ") for r in caplog.records)


def test_a_bfloat16_finding_timed_beside_other_work_is_not_kept(
    tiny_model, bf16_cpu, monkeypatch, tmp_path, caplog
):
    """A tester's start kept "1.72x faster" from a trial whose layout timer, in the same
    start, had 28 % of its cores; every later start said it, found in the cache."""
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setattr(engine_trial, "FULL_SHARE", 2.0)  # no share is enough
    config = worker_config(
        tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4, threads=1
    )
    with caplog.at_level(logging.WARNING, logger="rawserve.worker"):
        first = loading.load_runner(config, "cpu")
        second = loading.load_runner(config, "cpu")
    assert len(bf16_cpu) == 2  # measured at each start: nothing was kept
    assert "measured now" in first.bfloat16_trial and "measured now" in second.bfloat16_trial
    assert not list(tmp_path.rglob("bfloat16-trial-*.json"))
    assert "the bfloat16 trial ran while other work shared the machine" in caplog.text


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("text-classification", "float32"),  # a precision given is the one wanted
        ("text-classification", "bfloat16"),
        ("text-generation", "auto"),  # encoders only
    ],
)
def test_nothing_is_tried_where_nothing_would_be_offered(tiny_model, bf16_cpu, kind, dtype):
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    runner = loading.load_runner(worker_config(tiny_model(kind), dtype=dtype, threads=1), "cpu")
    assert runner.bfloat16_trial == "" and bf16_cpu == []


def test_nothing_is_offered_to_a_server_started_with_the_onnx_engine(tiny_model, bf16_cpu):
    """Its advice, --dtype bfloat16, is refused beside --engine onnx (a loading review)."""
    from rawserve.worker import loading

    config = SimpleNamespace(
        dtype="auto", engine=Engine.ONNX, model=tiny_model("text-classification")
    )
    runner = SimpleNamespace(dtype="float32")
    assert loading.bfloat16_trial(config, "text-classification", "cpu", runner) == ""
    assert bf16_cpu == []


def test_a_cpu_without_bfloat16_units_tries_nothing(tiny_model, monkeypatch, tmp_path):
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine_trial, "cpu_facts", lambda: {"flags": "fpu sse2 avx2"})
    config = worker_config(tiny_model("text-classification"), threads=1)
    assert loading.load_runner(config, "cpu").bfloat16_trial == ""
    assert not list(tmp_path.rglob("bfloat16-trial-*"))


def test_the_workers_of_one_start_measure_once_and_say_one_verdict(
    tiny_model, tmp_path, monkeypatch
):
    """A first start's layout timers load the model at once: two measured bfloat16 side by
    side, one logged "1.07x ... faster", the other "0.89x ... not faster", and the last
    written was kept. One measures now; the other waits for it and reads its finding."""
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine_trial, "cpu_facts", lambda: {"flags": AMX_FLAGS})
    measured: list[float] = []
    both_measuring = threading.Barrier(2)
    speedups = iter([1.5, 0.5])

    def measure(config, task, device, runner, size, units) -> Offer:
        speedup = next(speedups)
        measured.append(speedup)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_measuring.wait(timeout=0.5)  # the other meets it here, unless it waits
        return Offer(units, size, 0.01 * speedup, 0.01, Drift(0.002, 0.9999, same_labels=True))

    monkeypatch.setattr(loading, "measured_bfloat16", measure)
    config = worker_config(tiny_model("text-classification"), threads=1, start="s1")
    serving = SimpleNamespace(dtype="float32", engine=Engine.TORCH)
    said: list[str] = []

    def load() -> None:
        said.append(loading.bfloat16_trial(config, "text-classification", "cpu", serving))

    workers = [threading.Thread(target=load) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert measured == [1.5]
    assert [line.split("; ")[-1] for line in said] == ["faster: --dtype bfloat16 serves it"] * 2
    sources = sorted(line.split(": a batch")[0].split(", ")[-1] for line in said)
    assert sources == ["measured at this start (cached)", "measured now"]

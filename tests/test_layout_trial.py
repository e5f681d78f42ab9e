"""The CPU worker layout settled by a timed trial at a first start, not by a rule: one
single-threaded worker a core against one worker with every core, each timed on the
warm-up batch in real processes, the faster kept per model and machine and given in the
log and /info; the rule stands wherever the trial cannot tell."""

from __future__ import annotations

import json
import multiprocessing
import os
import re

import pytest

from rawserve.config import WorkerPlan, plan_workers
from rawserve.models.plan import plan_models
from rawserve.ops import layout_trial
from rawserve.ops.layout_trial import LayoutTrial, applies, measured, settle
from rawserve.options import parse_config
from rawserve.shared.messages import Engine
from tests.server import RunningServer
from tests.tiny_models import worker_config


@pytest.mark.parametrize(
    ("per_core", "one_worker", "chosen"),
    [
        (188.2, 150.8, "2 worker(s) x 1 thread on 2 core(s)"),
        (120.0, 150.0, "1 worker x 2 threads on 2 core(s)"),
        (150.0, 150.0, "2 worker(s) x 1 thread on 2 core(s)"),  # a tie: one a core
    ],
)
def test_the_faster_candidate_is_chosen_and_both_figures_given(per_core, one_worker, chosen):
    trial = LayoutTrial(cores=2, workers=2, batch=32, per_core=per_core, one_worker=one_worker)
    line = trial.describe()
    assert line.startswith(f"{chosen}, the faster here, measured now: batches of 32")
    assert f"{per_core:.1f} items/s together" in line and f"{one_worker:.1f} items/s" in line


def test_the_measured_tasks_are_the_encoder_tasks():
    from rawserve.worker.onnx_engine import ONNX_TASKS

    assert layout_trial.MEASURED_TASKS == ONNX_TASKS


@pytest.fixture
def four_cores(monkeypatch):
    """A CPU machine of four cores, no GPU, and no --device given."""
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)


def planned(argv: list[str]) -> tuple[WorkerPlan, bool]:
    config = parse_config(argv)
    plans = plan_models(config.models, task=config.task, handler=config.handler)
    workers = plan_workers(config.model, plans)
    return workers, applies(workers, plans, config.model)


def test_the_trial_settles_only_what_the_per_core_rule_chose(four_cores, tiny_model):
    classifier = ["--model", tiny_model("text-classification")]
    assert planned(classifier)[1]
    assert not planned([*classifier, "--device", "cpu"])[1]  # the layout given
    assert not planned([*classifier, "--threads", "2"])[1]  # the threads given
    assert not planned(["--handler", "tests.handlers:echo"])[1]  # nothing to time
    assert not planned(["--model", tiny_model("text-generation")])[1]  # not an encoder
    several = ["--model", tiny_model("text-classification"), "--model", tiny_model("fill-mask")]
    assert not planned(several)[1]


def test_a_single_core_has_nothing_to_compare(monkeypatch, tiny_model):
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert not planned(["--model", tiny_model("text-classification")])[1]


PER_CORE = WorkerPlan(("cpu",) * 4, 1, True, "4 worker(s) x 1 thread ... one per core", True)


@pytest.mark.parametrize(("one_worker", "devices", "threads"), [(90.0, 4, 1), (110.0, 1, 4)])
def test_the_verdict_becomes_the_plan(monkeypatch, one_worker, devices, threads):
    trial = LayoutTrial(cores=4, workers=4, batch=8, per_core=100.0, one_worker=one_worker)
    monkeypatch.setattr(layout_trial, "measured", lambda config, cores, workers: trial)
    plan = settle(PER_CORE, worker_config_stub(), cores=4)
    assert (plan.devices, plan.threads) == (("cpu",) * devices, threads)
    assert plan.layout == trial.describe() and plan.chosen and plan.share_cores


def test_a_trial_that_cannot_tell_keeps_the_rule(monkeypatch):
    monkeypatch.setattr(layout_trial, "measured", lambda config, cores, workers: None)
    assert settle(PER_CORE, worker_config_stub(), cores=4) == PER_CORE


def worker_config_stub():
    from rawserve.shared.messages import WorkerConfig

    return WorkerConfig(model="unused", task="text-classification")


def test_real_timers_measure_both_candidates_once(tiny_model, tmp_path, monkeypatch):
    """Two single-threaded timers together, then one of two threads, each a process that
    loads the model as a worker does; the second start reads the kept verdict."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    trial = measured(config, cores=2, workers=2)
    assert trial is not None and not trial.cached
    assert (trial.cores, trial.workers, trial.batch) == (2, 2, 4)
    assert trial.per_core > 0 and trial.one_worker > 0

    def no_more_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(layout_trial, "items_per_second", no_more_timing)
    again = measured(config, cores=2, workers=2)
    assert again == LayoutTrial(**{**trial.__dict__, "cached": True})
    assert list(tmp_path.rglob("layout-trial-*.json"))


def test_timers_that_cannot_load_the_model_end_the_trial_at_once(tmp_path, monkeypatch):
    """Every timer fails (no model in the folder): none waits for the others, and the
    trial says it cannot tell."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    config = worker_config_stub().__class__(model=str(tmp_path / "empty"), task="fill-mask")
    assert measured(config, cores=2, workers=2) is None
    assert not list(tmp_path.rglob("layout-trial-*.json"))  # nothing kept


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: no layout to choose")
def test_a_first_start_with_no_device_times_the_layout_then_keeps_it(tiny_model, tmp_path):
    env = {"RAWSERVE_DEVICE": "", "RAWSERVE_CACHE_DIR": str(tmp_path)}  # no --device
    args = ["--model", tiny_model("text-classification"), "--max-batch-size", "4"]
    with RunningServer(args, env=env).start(timeout=300) as server:
        log = "\n".join(server.read_log())
        assert "layout trial (first start only)" in log
        info = json.loads(server.request("GET", "/info")[2])
        assert "the faster here, measured now" in info["layout"]
        cores = os.cpu_count() or 1
        if info["layout"].startswith("1 worker x"):
            assert (info["devices"], info["threads_per_worker"]) == (["cpu"], cores)
        else:
            assert len(info["devices"]) > 1 and info["threads_per_worker"] == 1
        assert server.post_json({"inputs": "a fine day"})[0] == 200
    with RunningServer(args, env=env).start(timeout=300) as server:
        log = "\n".join(server.read_log())
        assert "layout trial (first start only)" not in log
        assert re.search(r"layout: .*measured at an earlier start \(cached\)", log)


def test_a_timer_that_dies_breaks_the_others_wait_at_once():
    """A timer killed from outside (say, out of memory) is an EOF on its pipe: the ones
    waiting for it at the start are released, and the trial cannot tell."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    timed, died = context.Pipe(duplex=False), context.Pipe(duplex=False)
    timed[1].send(0.25)
    died[1].close()
    assert layout_trial.gathered([timed[0], died[0]], start) == [0.25, None]
    assert start.broken


def test_timers_that_never_answer_are_given_up(monkeypatch):
    monkeypatch.setattr(layout_trial, "START_TIMEOUT", -60.0)  # the deadline is now
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    silent = context.Pipe(duplex=False)
    assert layout_trial.gathered([silent[0]], start) == [None]
    assert start.broken

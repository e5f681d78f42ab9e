"""The CPU worker layout settled by a timed trial at a first start, not by a rule: one
single-threaded worker a core against one worker with every core, each timed on the
warm-up batch in real processes, the faster kept per model and machine and given in the
log and /info; the rule stands wherever the trial cannot tell."""

from __future__ import annotations

import asyncio
import errno
import json
import multiprocessing
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from rawserve.config import WorkerPlan, plan_workers
from rawserve.models.plan import plan_models
from rawserve.ops import layout_trial
from rawserve.ops.layout_trial import LayoutTrial, applies, kept, measured, settle
from rawserve.options import parse_config
from rawserve.shared import cgroups
from rawserve.shared.devices import cpu_cores
from rawserve.shared.messages import Engine
from rawserve.worker import engine_trial
from rawserve.worker.layout_timer import Timing
from tests.server import READY, RunningServer
from tests.test_devices import v2_tree
from tests.tiny_models import worker_config


@pytest.mark.parametrize(
    ("per_core", "one_worker", "chosen"),
    [
        (188.2, 150.8, "2 worker(s) x 1 thread on 2 core(s)"),
        (120.0, 150.0, "1 worker x 2 threads on 2 core(s)"),
        (150.0, 150.0, "2 worker(s) x 1 thread on 2 core(s)"),  # a tie: one a core
        (150.0, 160.0, "2 worker(s) x 1 thread on 2 core(s)"),  # within the margin
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
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))


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
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(1)))
    assert not planned(["--model", tiny_model("text-classification")])[1]


PER_CORE = WorkerPlan(("cpu",) * 4, 1, True, "4 worker(s) x 1 thread ... one per core", True)


@pytest.mark.parametrize(("one_worker", "devices", "threads"), [(90.0, 4, 1), (120.0, 1, 4)])
def test_the_verdict_becomes_the_plan(monkeypatch, one_worker, devices, threads):
    trial = LayoutTrial(cores=4, workers=4, batch=8, per_core=100.0, one_worker=one_worker)
    monkeypatch.setattr(layout_trial, "recalled", lambda config, cores, workers: None)
    monkeypatch.setattr(layout_trial, "measured", lambda config, cores, workers, stop: trial)
    plan = settle(PER_CORE, worker_config_stub(), cores=4)
    assert (plan.devices, plan.threads) == (("cpu",) * devices, threads)
    assert plan.layout == trial.describe() and plan.chosen and plan.share_cores


def test_a_trial_that_cannot_tell_keeps_the_rule(monkeypatch):
    monkeypatch.setattr(layout_trial, "recalled", lambda config, cores, workers: None)
    monkeypatch.setattr(layout_trial, "measured", lambda config, cores, workers, stop: None)
    assert settle(PER_CORE, worker_config_stub(), cores=4) == PER_CORE


def test_a_model_built_on_the_rule_takes_the_settled_layout_before_its_workers_start(
    four_cores, tiny_model
):
    """The server listens with the rule's plan while the trial runs; the verdict then
    becomes the model's workers and what /info says, before any worker starts."""
    from rawserve.main import build_model, relayout
    from rawserve.ops.metrics import Metrics
    from rawserve.serving import CoreShare

    config = parse_config(["--model", tiny_model("text-classification")])
    plans = plan_models(config.models, task=config.task, handler=config.handler)
    rule = plan_workers(config.model, plans)
    assert len(rule.devices) == 4 and rule.threads == 1
    share = CoreShare(cores=4)
    loop = asyncio.new_event_loop()
    try:
        model = build_model(plans[0], config, rule, Metrics(), share, loop)
        trial = LayoutTrial(cores=4, workers=4, batch=8, per_core=100.0, one_worker=150.0)
        relayout(model, config, layout_trial.planned(rule, trial))
    finally:
        loop.close()
    workers = model.executor.workers
    assert [(w.config.device, w.config.threads) for w in workers] == [("cpu", 4)]
    assert share.workers == workers and len(model.executor.supervisor.records) == 1
    assert model.served.facts is model.facts
    assert (model.facts["devices"], model.facts["threads_per_worker"]) == (["cpu"], 4)
    assert model.facts["layout"] == trial.describe()


def worker_config_stub():
    from rawserve.shared.messages import WorkerConfig

    return WorkerConfig(model="unused", task="text-classification")


def test_real_timers_measure_both_candidates_once(tiny_model, tmp_path, monkeypatch):
    """Two single-threaded timers together, then one of two threads, each a process that
    loads the model as a worker does; the second start reads the kept verdict."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(layout_trial, "FULL_SHARE", 0.0)  # kept on a busy machine too
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    assert kept(PER_CORE_2, config, cores=2) is None  # nothing kept yet: the trial runs
    timed = []
    timer = layout_trial.items_per_second

    def noted(*args):
        timed.append(timer(*args))
        return timed[-1]

    monkeypatch.setattr(layout_trial, "items_per_second", noted)
    trial = measured(config, cores=2, workers=2, stop=threading.Event())
    assert trial is not None and not trial.cached
    assert (trial.cores, trial.workers, trial.batch) == (2, 2, 4)
    assert trial.per_core > 0 and trial.one_worker > 0
    # each candidate's share of its cores: CPU time over wall time and threads (timed
    # twice where one worker was the faster the first time)
    assert len(timed) in (2, 4) and all(0 < share <= 1.05 for _, share in timed), timed

    def no_more_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(layout_trial, "items_per_second", no_more_timing)
    again = LayoutTrial(**{**trial.__dict__, "cached": True})
    assert kept(PER_CORE_2, config, cores=2) == layout_trial.planned(PER_CORE_2, again)
    assert settle(PER_CORE_2, config, cores=2).layout == again.describe()
    [kept_file] = tmp_path.rglob("layout-trial-*.json")
    # it names its model, outside its key, for a person to find it by (grep -l)
    stored = json.loads(kept_file.read_text())
    assert stored["folder"] == config.model and "folder" not in stored["key"]


@pytest.mark.parametrize(
    ("timings", "kept_figures", "timed_twice"),
    [
        # one a core the faster: timed once
        ([(100.0, 90.0)], (100.0, 90.0), False),
        # one worker the faster, and again: both timings' figures, kept as timed twice
        ([(100.0, 150.0), (110.0, 130.0)], (105.0, 140.0), True),
        # one worker the faster, then not: the second timing's verdict, the rule's layout
        ([(100.0, 150.0), (120.0, 110.0)], (120.0, 110.0), False),
    ],
)
def test_a_switch_to_one_worker_is_kept_only_when_timed_twice(
    tiny_model, tmp_path, monkeypatch, timings, kept_figures, timed_twice
):
    """A kept verdict decides every later start: a burst of other work during the
    per-core stretch once kept one worker at 542.6 against 426.9 items/s, where later
    trials found it at most 1.06 of one a core. Leaving the rule takes two timings."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    figures = iter(items for pair in timings for items in pair)
    asked = []

    def timed(config, processes, size, stop):
        asked.append(config.threads)
        return layout_trial.Candidate(next(figures), 0.99)

    monkeypatch.setattr(layout_trial, "items_per_second", timed)
    trial = measured(config, cores=2, workers=2, stop=threading.Event())
    assert asked == [1, 2] * len(timings)
    assert trial is not None and (trial.per_core, trial.one_worker) == kept_figures
    assert trial.one_worker_wins is timed_twice
    again = kept(PER_CORE_2, config, cores=2)
    assert again is not None and ("1 worker x 2 threads on" in again.layout) is timed_twice
    [stored] = tmp_path.rglob("layout-trial-*.json")
    assert json.loads(stored.read_text())["timed_twice"] is timed_twice


def test_a_switch_kept_before_it_was_timed_twice_is_timed_again(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    key = layout_trial.trial_key(config, cores=2, workers=2, size=4)
    switch = {"cores": 2, "workers": 2, "batch": 4, "per_core": 426.9, "one_worker": 542.6}
    cache = engine_trial.default_cache_dir()
    engine_trial.remember(cache, layout_trial.CACHE_PREFIX, key, switch)
    assert kept(PER_CORE_2, config, cores=2) is None  # timed again at this start
    engine_trial.remember(cache, layout_trial.CACHE_PREFIX, key, {**switch, "timed_twice": True})
    assert "1 worker x 2 threads on" in kept(PER_CORE_2, config, cores=2).layout
    rule = {**switch, "per_core": 600.0}  # one a core: the rule needs no second timing
    engine_trial.remember(cache, layout_trial.CACHE_PREFIX, key, rule)
    assert kept(PER_CORE_2, config, cores=2) is not None


@pytest.mark.parametrize(
    ("one_worker_share", "quota", "kept_one"),
    [
        (0.99, None, True),
        (0.5, None, False),
        (0.82, 1.67, True),  # 1.67 CPUs count as 2 cores: 0.83 of them at most
        (0.5, 1.67, False),
        (0.99, 3.0, True),  # a quota above the cores timed on: all of them, no more
    ],
)
def test_a_verdict_timed_amid_other_work_is_not_kept(
    tiny_model, tmp_path, monkeypatch, caplog, one_worker_share, quota, kept_one
):
    """On a shared machine the per-core figure swung from 2,944 to 20,962 items/s, and the
    verdict of the worse moment was kept for every later start. A timer that had less than
    FULL_SHARE of its cores ran beside other work: its verdict is not kept, and the rule's
    layout serves."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    figures = {  # by threads
        1: layout_trial.Candidate(100.0, 0.99),
        2: layout_trial.Candidate(150.0, one_worker_share),
    }

    def timed(config, processes, size, stop):
        return figures[config.threads]

    monkeypatch.setattr(layout_trial, "items_per_second", timed)
    limit = None if quota is None else cgroups.Limit(quota, Path("cpu.max"))
    monkeypatch.setattr(cgroups, "cpu_limit", lambda root=None: limit)
    trial = measured(config, cores=2, workers=2, stop=threading.Event())
    assert (trial is not None) is kept_one
    assert (kept(PER_CORE_2, config, cores=2) is not None) is kept_one
    assert ("other work shared the machine (a timer had 50%" in caplog.text) is not kept_one


@pytest.mark.parametrize(
    "figures",
    [
        {"per_core": None, "one_worker": 150.0},
        {"per_core": 150.0, "one_worker": "fast"},
        {"per_core": 0, "one_worker": 150.0},
        {"per_core": 150.0},
        {"per_core": 10**400, "one_worker": 150.0},  # too large for a float: OverflowError
    ],
)
def test_a_kept_verdict_with_damaged_figures_is_measured_again(
    tiny_model, tmp_path, monkeypatch, figures
):
    """A layout file edited or damaged by hand: the trial runs again, where reading it
    failed the start with a traceback (a null multiplied)."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    key = layout_trial.trial_key(config, cores=2, workers=2, size=4)
    stored = {"cores": 2, "workers": 2, "batch": 4, **figures}
    engine_trial.remember(engine_trial.default_cache_dir(), layout_trial.CACHE_PREFIX, key, stored)
    assert kept(PER_CORE_2, config, cores=2) is None
    figures = {"per_core": 150.0, "one_worker": 120.0}
    engine_trial.remember(engine_trial.default_cache_dir(), layout_trial.CACHE_PREFIX, key, figures)
    assert kept(PER_CORE_2, config, cores=2) == layout_trial.planned(
        PER_CORE_2, LayoutTrial(2, 2, 4, 150.0, 120.0, cached=True)
    )


def bare_model(tmp_path: Path, monkeypatch):
    """A worker config of a model folder holding only its config (a key needs no more),
    and a cache of the test's own."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    config = worker_config_stub().__class__(
        model=str(tmp_path / "model"), task="text-classification", warmup_batch=4
    )
    return config


def test_a_verdict_is_read_only_for_the_per_core_workers_it_timed(tmp_path, monkeypatch):
    """Memory held 2 workers on 4 cores when it was timed: a later start with the memory
    for 4 times its own per-core candidate, not 2 workers' figures."""
    config = bare_model(tmp_path, monkeypatch)
    key = layout_trial.trial_key(config, cores=4, workers=2, size=4)
    figures = {"per_core": 150.0, "one_worker": 120.0}
    engine_trial.remember(engine_trial.default_cache_dir(), layout_trial.CACHE_PREFIX, key, figures)
    two, four = (WorkerPlan(("cpu",) * n, 1, True, "one per core", True) for n in (2, 4))
    assert kept(two, config, cores=4) is not None
    assert kept(four, config, cores=4) is None


def test_a_verdict_timed_with_the_engine_an_earlier_rule_chose_is_measured_again(
    tmp_path, monkeypatch
):
    """`--engine auto` once picked by the warm-up batch alone; the verdicts it kept are
    measured again, and may now serve the other engine: a layout timed with the engine
    the old rule served (its threads scale otherwise) is measured again too."""
    config = bare_model(tmp_path, monkeypatch)
    key = layout_trial.trial_key(config, cores=2, workers=2, size=4)
    assert key["engine_rule"] == engine_trial.RULE
    figures = {"per_core": 150.0, "one_worker": 120.0}
    earlier = {name: value for name, value in key.items() if name != "engine_rule"}
    engine_trial.remember(
        engine_trial.default_cache_dir(), layout_trial.CACHE_PREFIX, earlier, figures
    )
    assert kept(PER_CORE_2, config, cores=2) is None
    engine_trial.remember(engine_trial.default_cache_dir(), layout_trial.CACHE_PREFIX, key, figures)
    assert kept(PER_CORE_2, config, cores=2) is not None


def test_weights_the_server_cannot_read_are_reported_by_the_trial_not_a_traceback(
    tiny_model, tmp_path, monkeypatch
):
    """A model folder saved by root (`save_pretrained` writes its weights 0600) served by
    an image's non-root user: reading the kept verdict's key failed the start with a
    traceback from main; now nothing is kept, and the timers, which load the model as a
    worker does, end the start with the one line a worker would report."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)

    def unreadable(path: Path, *args: object) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(engine_trial, "fingerprint", unreadable)
    assert kept(PER_CORE_2, config, cores=2) is None


def test_a_verdict_s_layout_still_names_the_container_s_limits(tmp_path, monkeypatch):
    """The trial's line replaces the rule's in the log and /info: the limits that set
    the cores it timed on stay in it."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr("rawserve.shared.cgroups.ROOT", v2_tree(tmp_path, "200000 100000"))
    settled = layout_trial.planned(PER_CORE_2, LayoutTrial(2, 2, 4, 150.0, 120.0))
    assert settled.layout.endswith(
        "a cgroup CPU limit of 2 (/sys/fs/cgroup/cpu.max), of 64 allowed]"
    )


PER_CORE_2 = WorkerPlan(("cpu",) * 2, 1, True, "2 worker(s) x 1 thread ... one per core", True)


def test_a_stop_ends_a_trial_at_once_and_keeps_nothing(tiny_model, tmp_path, monkeypatch):
    """The server is stopped while its timers load: they are stopped within a moment,
    and no verdict is kept (the next start times again)."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(tiny_model("text-classification"), engine=Engine.TORCH, warmup_batch=4)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()  # the timers are still importing torch then
    began = time.monotonic()
    assert settle(PER_CORE_2, config, cores=2, stop=stop) == PER_CORE_2
    assert time.monotonic() - began < 30  # the loads cut short, not waited for
    assert not multiprocessing.active_children()  # no timer left behind
    assert not list(tmp_path.rglob("layout-trial-*.json"))


def test_timers_that_cannot_load_the_model_end_the_trial_with_the_reason(tmp_path, monkeypatch):
    """The timers cannot load the model (no model in the folder): the first to fail ends
    the trial with the one line a worker would report (the workers, which load it the
    same way, would fail alike), none waits for the others, and nothing is kept."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    config = worker_config_stub().__class__(model=str(tmp_path / "empty"), task="fill-mask")
    with pytest.raises(layout_trial.ModelLoadFailed) as caught:
        measured(config, cores=2, workers=2, stop=threading.Event())
    assert "\n" not in str(caught.value) and str(tmp_path / "empty") in str(caught.value)
    assert not multiprocessing.active_children()  # no timer left behind
    assert not list(tmp_path.rglob("layout-trial-*.json"))  # nothing kept


@pytest.mark.skipif(cpu_cores() < 2, reason="one core: no layout to choose")
def test_a_first_start_with_a_model_that_cannot_load_stops_before_any_worker(tiny_model, tmp_path):
    """A load the layout timers fail is the server's load failure: one line naming the
    model, exit 1, no worker started to fail the same load again."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for path in Path(tiny_model("text-classification")).iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)  # not a safetensors file
    env = {"RAWSERVE_DEVICE": "", "RAWSERVE_CACHE_DIR": str(tmp_path / "cache")}
    server = RunningServer(["--model", str(folder)], env=env).start(wait_ready=False)
    try:
        assert server.process is not None and server.process.wait(timeout=120) == 1
    finally:
        server.stop()
    log = "\n".join(server.read_log())
    assert "layout trial (first start only)" in log and "worker 0: started" not in log, log
    said = "ERROR model broken could not be loaded: ValueError: model.safetensors is not a whole"
    assert said in log, log


@pytest.mark.slow
@pytest.mark.timeout(600)  # two starts, the first timing two layouts: its waits allow 300 s
@pytest.mark.skipif(cpu_cores() < 2, reason="one core: no layout to choose")
def test_a_first_start_with_no_device_times_the_layout_then_keeps_it(tiny_model, tmp_path):
    env = {"RAWSERVE_DEVICE": "", "RAWSERVE_CACHE_DIR": str(tmp_path)}  # no --device
    args = ["--model", tiny_model("text-classification"), "--max-batch-size", "4"]
    with RunningServer(args, env=env).start(wait_ready=False) as server:
        # the trial runs while the server listens: /health answers, /ready says loading
        server.wait_for_log(re.compile(r"layout trial \(first start only\)"))
        assert server.request("GET", "/health")[0] == 200
        status, _, body = server.request("GET", "/ready")
        assert status == 503 and json.loads(body)["status"] == "loading", body
        assert json.loads(body)["elapsed_seconds"] >= 0, body  # the trial is the load's part
        server.wait_for_log(READY, timeout=300)
        log = "\n".join(server.read_log())
        info = json.loads(server.request("GET", "/info")[2])
        # (a machine busy with other work keeps no verdict: the rule's layout serves; the
        # engine's or precision's trial, busy while this one was not, says so in its own line)
        busy = "the layout trial ran while other work shared the machine" in log
        if busy:
            assert log.index("the layout trial ran while") < log.index("rawserve INFO layout: ")
            assert "one per core" in info["layout"] and info["threads_per_worker"] == 1
        else:
            assert log.index("layout trial took") < log.index("rawserve INFO layout: ")
            assert "the faster here, measured now" in info["layout"]
        cores = cpu_cores()
        if info["layout"].startswith("1 worker x"):
            assert (info["devices"], info["threads_per_worker"]) == (["cpu"], cores)
        else:
            assert len(info["devices"]) > 1 and info["threads_per_worker"] == 1
        assert server.post_json({"inputs": "a fine day"})[0] == 200
    with RunningServer(args, env=env).start(timeout=300) as server:
        log = "\n".join(server.read_log())
        assert ("layout trial (first start only)" in log) is busy  # nothing kept: again
        if not busy:
            kept_line = engine_trial.verdict_source(cached=True, this_start=False)
            assert re.search(f"layout: .*{re.escape(kept_line)}", log)


@pytest.mark.skipif(cpu_cores() < 2, reason="one core: no layout to choose")
def test_a_stop_during_the_first_starts_trial_ends_it_and_the_server_at_once(tiny_model, tmp_path):
    """SIGTERM while the timers load: the trial stops (nothing kept), no worker starts,
    and the server exits 0 with none of its processes left running."""
    server = first_start(tiny_model, tmp_path)
    try:
        children = trial_children(server, at_least=1)
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()
    log = "\n".join(server.read_log())
    assert "layout trial stopped" in log and "worker 0: started" not in log, log
    assert log.rstrip().endswith("rawserve INFO stopped")
    assert not list(tmp_path.rglob("layout-trial-*.json"))
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, [p for p in children if os.path.exists(f"/proc/{p}")]
        time.sleep(0.1)


@pytest.mark.skipif(cpu_cores() < 2, reason="one core: no layout to choose")
def test_the_trials_timers_exit_with_a_server_that_is_killed(tiny_model, tmp_path):
    """SIGKILL of the server while its timers load the model: they went on loading,
    exporting and timing it (14 s of a tiny model's first start, a large one's whole
    load with its memory), then died of a broken pipe, its traceback in the log."""
    server = first_start(tiny_model, tmp_path)
    try:
        children = trial_children(server, at_least=2)
        assert server.process is not None
        server.process.kill()
        server.process.wait(10)
        deadline = time.monotonic() + 4
        while left := [pid for pid in children if os.path.exists(f"/proc/{pid}")]:
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
    finally:
        server.stop()


def first_start(tiny_model, tmp_path: Path) -> RunningServer:
    """A server started on a classifier with no device and an empty cache: it runs the
    layout trial (not waited for)."""
    env = {"RAWSERVE_DEVICE": "", "RAWSERVE_CACHE_DIR": str(tmp_path)}
    server = RunningServer(["--model", tiny_model("text-classification")], env=env)
    return server.start(wait_ready=False)


def trial_children(server: RunningServer, at_least: int) -> list[int]:
    """The server's child processes once its trial began and `at_least` of them run: the
    timers (and the resource tracker)."""
    server.wait_for_log(re.compile(r"layout trial \(first start only\)"))
    assert server.process is not None
    children: list[int] = []
    deadline = time.monotonic() + 30
    while len(children) < at_least:
        assert time.monotonic() < deadline, "no timer started"
        time.sleep(0.05)
        children = child_pids(server.process.pid)
    return children


def child_pids(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    listed = (task / "children" for task in tasks.iterdir())
    return [int(child) for children in listed for child in children.read_text().split()]


def test_a_timer_that_dies_breaks_the_others_wait_at_once():
    """A timer killed from outside (say, out of memory) is an EOF on its pipe: the ones
    waiting for it at the start are released, and the trial cannot tell."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    timed, died = context.Pipe(duplex=False), context.Pipe(duplex=False)
    timed[1].send(Timing(0.25, 1.0))
    died[1].close()
    gathered = layout_trial.gathered([timed[0], died[0]], start, threading.Event())
    assert gathered == [Timing(0.25, 1.0), None]
    assert start.broken


class Unstarted:
    """A timer process, never started (what it sent is `gathered`'s, faked)."""

    exitcode = 0

    def __init__(self, **kwargs: object) -> None:
        pass

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_candidate_whose_timer_failed_has_no_figure(monkeypatch):
    """One of two per-core timers died after the other had timed its batch: the items a
    second of one worker are not the candidate's (one a core would be judged at half its
    figure, and that verdict kept); the trial cannot tell."""
    monkeypatch.setattr(multiprocessing.get_context("spawn"), "Process", Unstarted)
    monkeypatch.setattr(
        layout_trial, "gathered", lambda readers, start, stop: [Timing(0.25, 1.0), None]
    )
    assert layout_trial.items_per_second(worker_config_stub(), 2, 8, threading.Event()) is None


def test_a_candidates_figure_is_the_items_a_second_of_all_its_timers_together(monkeypatch):
    """The per-core timers run side by side, each a worker: the candidate serves what
    they all do. One timer's rate standing for all, one worker with every core won, and
    that verdict was kept for every later start."""
    monkeypatch.setattr(multiprocessing.get_context("spawn"), "Process", Unstarted)
    timings = [Timing(0.25, 1.0), Timing(0.5, 0.75), Timing(0.5, 0.9)]
    monkeypatch.setattr(layout_trial, "gathered", lambda readers, start, stop: timings)
    found = layout_trial.items_per_second(worker_config_stub(), 3, 8, threading.Event())
    assert found is not None
    assert (found.items, found.cpu_share) == (8 / 0.25 + 8 / 0.5 + 8 / 0.5, 0.75)


def test_timers_that_never_answer_are_given_up(monkeypatch):
    monkeypatch.setattr(layout_trial, "START_TIMEOUT", -60.0)  # the deadline is now
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    silent = context.Pipe(duplex=False)
    assert layout_trial.gathered([silent[0]], start, threading.Event()) == [None]
    assert start.broken


def test_a_stop_breaks_the_wait_for_timers():
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    silent = context.Pipe(duplex=False)
    stop = threading.Event()
    stop.set()
    assert layout_trial.gathered([silent[0]], start, stop) == [None]
    assert start.broken


def test_a_timer_is_the_kernels_first_choice_when_memory_runs_out(monkeypatch):
    """A timer loads the model beside the server (one a core): out of memory, the kernel
    should kill a timer (the trial cannot tell, the rule's layout stands) rather than the
    server, as it would a worker. The server keeps its own value: only the timer's process
    raises its own, before it loads the model."""
    from rawserve.worker import layout_timer

    steps: list[str] = []
    monkeypatch.setattr(layout_timer.signal, "signal", lambda signum, handler: None)
    monkeypatch.setattr(layout_timer, "no_progress_bars", lambda: None)
    monkeypatch.setattr(layout_timer, "setup_worker_logging", lambda label: None)
    monkeypatch.setattr(layout_timer, "prefer_for_oom_kill", lambda: steps.append("raised"))
    monkeypatch.setattr(
        layout_timer,
        "timed_batch",
        lambda config, size, start: steps.append("timed") or Timing(0.25, 1.0),
    )
    reader, writer = multiprocessing.Pipe(duplex=False)
    layout_timer.timer_main(worker_config_stub(), 4, multiprocessing.Barrier(1), writer)
    assert reader.recv() == Timing(0.25, 1.0) and steps == ["raised", "timed"]


def test_timers_the_system_refuses_a_process_leave_the_rule(monkeypatch, caplog):
    """Out of processes (ulimit -u): the trial cannot tell, and says why. A timer that
    never started was joined all the same, and the server's first start ended on
    "can only join a started process"."""

    def refused(process) -> None:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refused)
    stop = threading.Event()
    assert layout_trial.items_per_second(worker_config_stub(), 2, 8, stop) is None
    assert "could not start a timer ([Errno 11] Resource temporarily unavailable)" in caplog.text

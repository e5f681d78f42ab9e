"""`--engine auto` settled by a short timed trial on the machine itself, not by a rule
about CPUs: the faster candidate wins, the verdict is cached per model and machine, and
the log and /info show the figures."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import shutil
from pathlib import Path

import pytest

from rawserve.shared.messages import Engine
from rawserve.worker import engine_trial, precision_trial
from rawserve.worker.engine_trial import Trial, cached, run_trial, store
from tests.server import RunningServer


@pytest.fixture(autouse=True)
def trials_keep_verdicts_beside_other_tests(monkeypatch):
    """These trials run beside other tests, which take from their cores: kept as on a
    quiet machine (`test_a_trial_timed_beside_other_work_keeps_no_verdict` the other way)."""
    monkeypatch.setattr(engine_trial, "FULL_SHARE", 0.0)


# a verdict as a trial keeps it: a batch's figures and one item's
KEPT = Trial(
    {Engine.TORCH: 0.004, Engine.ONNX: 0.003}, 8, lone={Engine.TORCH: 0.002, Engine.ONNX: 0.001}
)


class FakeClock:
    """perf_counter's stand-in: each candidate moves it by its own fixed cost."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def candidate(self, name: str, seconds: float):
        def call() -> None:
            self.calls.append(name)
            self.now += seconds

        return call


@pytest.mark.parametrize(("torch_ms", "onnx_ms", "winner"), [(3, 2, "onnx"), (2, 3, "torch")])
def test_the_trial_picks_the_faster_of_two_fake_timed_candidates(torch_ms, onnx_ms, winner):
    clock = FakeClock()
    candidates = {
        Engine.TORCH: clock.candidate("torch", torch_ms / 1000),
        Engine.ONNX: clock.candidate("onnx", onnx_ms / 1000),
    }
    trial = run_trial(candidates, batch=8, budget=0.01, clock=clock)
    assert trial.winner is Engine(winner)
    assert trial.seconds == {
        Engine.TORCH: pytest.approx(torch_ms / 1000),
        Engine.ONNX: pytest.approx(onnx_ms / 1000),
    }
    # one untimed call each, then the candidates in turn, so noise falls on both alike
    assert clock.calls[:2] == ["torch", "onnx"]
    assert clock.calls[2:6] == ["torch", "onnx", "torch", "onnx"]
    assert clock.calls.count("torch") == clock.calls.count("onnx")


@pytest.mark.parametrize(
    ("batch_ms", "lone_ms", "winner"),
    [
        # tied at the batch (one Xeon's 104.3 and 104.5 ms): one item alone decides
        ({"torch": 104.3, "onnx": 104.5}, {"torch": 14.7, "onnx": 5.5}, "onnx"),
        # a little slower at the batch, far faster alone: 0.95 x 2.5
        ({"torch": 100, "onnx": 105}, {"torch": 10, "onnx": 4}, "onnx"),
        # far faster at the batch outweighs a little slower alone
        ({"torch": 60, "onnx": 100}, {"torch": 5.5, "onnx": 5}, "torch"),
    ],
)
def test_the_trial_weighs_one_item_alone_as_much_as_the_batch(batch_ms, lone_ms, winner):
    """A server spends its quiet hours on lone requests: where the engines tie at the
    warm-up batch, the batch's figure alone was a toss (torch won one on a Xeon where
    ONNX Runtime then served a lone client in half the time)."""
    clock = FakeClock()

    def candidates(figures: dict[str, float], label: str):
        return {
            Engine(name): clock.candidate(f"{name} {label}", ms / 1000)
            for name, ms in figures.items()
        }

    trial = run_trial(
        candidates(batch_ms, "batch"), 32, 0.01, clock, lone=candidates(lone_ms, "alone")
    )
    assert trial.winner is Engine(winner)
    assert trial.lone == {Engine(name): pytest.approx(ms / 1000) for name, ms in lone_ms.items()}
    # the batches first, then one item each, in turn as well
    firsts = [call.split()[1] for call in clock.calls]
    assert firsts == sorted(firsts, key=["batch", "alone"].index) and "alone" in firsts
    line = trial.describe()
    loser = next(engine for engine in ("torch", "onnx") if engine != winner)
    assert "over a batch and one item" in line and "a batch of 32 took" in line
    alone = line.split("one item alone ")[1]
    assert alone.index(f"{winner} {lone_ms[winner]:.1f} ms") < alone.index(f"{loser} ")
    # what decided, where the winner was the slower at the batch
    share = (batch_ms[winner] * lone_ms[winner]) / (batch_ms[loser] * lone_ms[loser])
    assert line.endswith(f"; both times multiplied, {winner} {share:.2g} of {loser}'s")


def test_a_trial_of_one_item_times_it_once():
    """A warm-up batch of one item is the lone item: timed once, its figures both."""
    clock = FakeClock()
    batch = {
        Engine.TORCH: clock.candidate("torch", 0.002),
        Engine.ONNX: clock.candidate("onnx", 0.001),
    }
    again = {Engine.TORCH: clock.candidate("again", 0.002)}
    trial = run_trial(batch, 1, 0.01, clock, lone=again)
    assert "again" not in clock.calls and trial.lone == trial.seconds
    assert trial.winner is Engine.ONNX
    assert "one item alone" not in trial.describe()  # (the same figures twice)


def test_a_verdict_of_a_batch_of_one_kept_without_its_lone_figures_is_used(tmp_path):
    """Its batch was the one item: an earlier version's verdict stands."""
    key = {"files": {"config.json": "ab"}, "batch": 1}
    seconds = {"onnx": 0.001, "torch": 0.002}
    engine_trial.remember(
        tmp_path, engine_trial.CACHE_PREFIX, key, {"batch": 1, "seconds": seconds}
    )
    kept = cached(tmp_path, key)
    assert kept is not None and kept.winner is Engine.ONNX and kept.lone == kept.seconds


def test_the_trial_runs_at_least_a_few_rounds_and_stops_within_bounds():
    slow = FakeClock()
    run_trial({Engine.TORCH: slow.candidate("torch", 5.0)}, batch=1, budget=1.0, clock=slow)
    assert len(slow.calls) == 1 + engine_trial.MIN_ROUNDS  # over budget: the minimum
    fast = FakeClock()
    run_trial({Engine.TORCH: fast.candidate("torch", 1e-6)}, batch=1, budget=1.0, clock=fast)
    assert len(fast.calls) == 1 + engine_trial.MAX_ROUNDS  # a tiny model: the maximum


def test_the_median_ignores_one_stall():
    clock = FakeClock()
    laps = iter([0.001, 0.001, 0.001, 0.5] + [0.001] * 40)  # untimed, then a stall in the 3rd

    def stalling() -> None:
        clock.now += next(laps)

    trial = run_trial(
        {Engine.TORCH: stalling, Engine.ONNX: clock.candidate("onnx", 0.002)},
        batch=4,
        budget=0.005,
        clock=clock,
    )
    assert trial.winner is Engine.TORCH


def test_the_verdict_is_kept_per_key(tmp_path):
    key = {"files": {"config.json": "ab"}, "machine": {"cpu": "X", "cores": 2}, "batch": 8}
    assert cached(tmp_path, key) is None
    store(tmp_path, key, KEPT)
    again = cached(tmp_path, key)
    assert again == Trial(KEPT.seconds, 8, cached=True, lone=KEPT.lone)
    assert again.winner is Engine.ONNX and "found in the cache" in again.describe()
    assert cached(tmp_path, {**key, "machine": {"cpu": "Y", "cores": 2}}) is None
    (file,) = tmp_path.glob("engine-trial-*.json")
    assert json.loads(file.read_text())["winner"] == "onnx"  # readable by a person
    file.write_text("{not json")
    assert cached(tmp_path, key) is None  # a damaged file: the trial runs again


def test_a_verdict_kept_by_this_very_start_says_so_not_an_earlier_one(tmp_path):
    """A first start's layout trial loads the model in its timers, which measure the
    engines and keep the verdict: its workers then said "measured at an earlier start".
    Another start's verdict is found in the cache: "an earlier start" was not true of one
    that another server sharing the folder kept seconds before."""
    key = {"files": {"config.json": "ab"}, "batch": 8}
    store(tmp_path, key, KEPT, start="s1")
    kept = cached(tmp_path, key, start="s1")
    assert kept is not None and "measured at this start (cached)" in kept.describe()
    for other in ("s2", ""):  # another start (an earlier one, or another server's), or none
        kept = cached(tmp_path, key, start=other)
        assert kept is not None and ", found in the cache: " in kept.describe()
        assert "earlier" not in kept.describe()


@pytest.mark.parametrize(
    "seconds",
    [
        {"onnx": None, "torch": 0.004},
        {"onnx": "fast", "torch": 0.004},
        {"onnx": float("nan"), "torch": 0.004},
        {"onnx": -1.0, "torch": 0.004},
        {"auto": 0.001, "torch": 0.004},  # no engine that runs
        {"tensorrt": 0.001, "torch": 0.004},
    ],
)
def test_a_verdict_with_damaged_figures_is_measured_again(tmp_path, seconds):
    key = {"files": {"config.json": "ab"}, "batch": 8}
    sound = {"onnx": 0.001, "torch": 0.002}
    for damaged in ({"seconds": seconds, "lone": sound}, {"seconds": sound, "lone": seconds}):
        engine_trial.remember(tmp_path, engine_trial.CACHE_PREFIX, key, {"batch": 8, **damaged})
        assert cached(tmp_path, key) is None
    engine_trial.remember(
        tmp_path, engine_trial.CACHE_PREFIX, key, {"batch": 8, "seconds": sound, "lone": sound}
    )
    assert cached(tmp_path, key) is not None  # (what made the others fail: their damage)


def test_a_verdict_timed_at_the_batch_alone_is_measured_again(tmp_path):
    """A verdict kept before one item was timed beside the batch (no `lone` figures, or
    not for every engine) was a toss where the engines tied at the batch: measured
    again, and the new verdict kept in its place."""
    key = {"files": {"config.json": "ab"}, "batch": 8}
    seconds = {"onnx": 0.0031, "torch": 0.003}
    for lone in ({}, {"onnx": 0.001}, None):
        document = {"batch": 8, "seconds": seconds, "winner": "torch"}
        if lone is not None:
            document["lone"] = lone
        engine_trial.remember(tmp_path, engine_trial.CACHE_PREFIX, key, document)
        assert cached(tmp_path, key) is None
    store(tmp_path, key, KEPT)
    assert cached(tmp_path, key) == Trial(KEPT.seconds, 8, cached=True, lone=KEPT.lone)


def with_raw(document: dict, field: str, text: str) -> str:
    """`document` as JSON with `field`'s value written as `text`, which JSON reads back
    as no Python value could be written (1e999: infinity; 400 digits)."""
    return json.dumps({**document, field: "RAW"}).replace('"RAW"', text)


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("batch", "1e999"),  # infinity: int() raised OverflowError, and the start failed
        ("batch", "-1e999"),
        ("batch", "8.5"),
        ("batch", "0"),
        ("seconds", '{"torch": 1' + "0" * 400 + "}"),  # too large for a float
        ("lone", '{"torch": 1' + "0" * 400 + "}"),
    ],
)
def test_a_verdict_with_a_number_past_any_range_is_measured_again(tmp_path, field, text):
    key = {"files": {"config.json": "ab"}}
    store(tmp_path, key, KEPT)
    (file,) = tmp_path.glob("engine-trial-*.json")
    file.write_text(with_raw(json.loads(file.read_text()), field, text))
    assert cached(tmp_path, key) is None


def test_a_cache_file_nested_past_the_parser_s_depth_is_measured_again(tmp_path):
    key = {"batch": 8}
    store(tmp_path, key, Trial({Engine.TORCH: 0.004}, 8))
    (file,) = tmp_path.glob("engine-trial-*.json")
    file.write_text("[" * 100_000 + "]" * 100_000)
    assert cached(tmp_path, key) is None


def test_a_full_disk_keeps_no_verdict_and_leaves_no_scratch_file(tmp_path, monkeypatch, caplog):
    """Each start that cannot keep its trial says so in one line; the half-written file
    goes, else a full cache folder gained one more at every start."""

    def disk_full(document, handle, **options):
        handle.write('{"key": ')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", disk_full)
    with caplog.at_level(logging.WARNING, logger="rawserve.worker"):
        store(tmp_path, {"batch": 8}, Trial({Engine.TORCH: 0.004}, 8))
    assert "could not keep the trial" in caplog.text and "No space left" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_the_description_gives_the_figures_fastest_first():
    line = Trial({Engine.TORCH: 0.0123, Engine.ONNX: 0.0101}, 32).describe()
    assert line.startswith("auto: ") and "measured now" in line
    assert line.index("onnx 10.1 ms") < line.index("torch 12.3 ms")
    assert "a batch of 32" in line


def test_a_user_without_a_home_still_gets_a_cache_folder(monkeypatch):
    """HOME unset and a uid the password database does not know (a container's arbitrary
    uid): the cache folder is under /, as Docker's home for such a user, not a crash."""
    monkeypatch.delenv("RAWSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)

    def unknown_uid(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr("pwd.getpwuid", unknown_uid)
    assert engine_trial.default_cache_dir() == Path("/.cache/rawserve/onnx")


@pytest.mark.parametrize("blank", ["", " ", "\t "])
def test_a_blank_cache_dir_variable_is_read_as_unset(monkeypatch, tmp_path, blank):
    """As every RAWSERVE_* variable: blank, it named a folder " " in the working
    directory, the graph exported anew in each."""
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", blank)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert engine_trial.default_cache_dir() == tmp_path / "rawserve" / "onnx"
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", f" {tmp_path / 'mine'} ")
    assert engine_trial.default_cache_dir() == tmp_path / "mine" / "onnx"
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", blank)
    monkeypatch.setenv("XDG_CACHE_HOME", blank)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert engine_trial.default_cache_dir() == tmp_path / ".cache" / "rawserve" / "onnx"


def test_a_large_file_saved_again_in_place_changes_its_fingerprint(tmp_path):
    """A large file is read at its head and tail only: weights saved again in place,
    changed only in their middle (a merged LoRA's layers), kept their fingerprint, and
    the graph exported or copied from them before was served (a tester)."""
    import os

    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(3000))
    os.utime(path, ns=(10**18, 10**18))
    before = engine_trial.fingerprint(path, whole_below=1000, edge=100)
    assert engine_trial.fingerprint(path, whole_below=1000, edge=100) == before  # stable
    path.write_bytes(bytes(1500) + b"x" + bytes(1499))  # same size, head and tail
    assert engine_trial.fingerprint(path, whole_below=1000, edge=100) != before


def test_the_machine_fingerprint_names_the_cpu():
    facts = engine_trial.machine()
    assert set(facts) == {"cpu", "flags", "cores", "machine"} and facts["cores"]


def test_one_process_at_a_time_looks_for_a_verdict_and_measures(tmp_path):
    """The processes of one start (a layout trial's timers, workers loading together)
    each measured amid the others' work and could disagree, the last written winning:
    a log said ONNX Runtime, and the workers then read torch's verdict (a tester). Now
    the second waits for the first, then reads its verdict; another key does not wait;
    a cache that cannot be written holds nobody back."""
    import threading

    order: list[str] = []

    def second(key: dict, cache=tmp_path, waits: bool = False) -> threading.Thread:
        def look() -> None:
            with engine_trial.one_trial_at_a_time(cache, key):
                order.append(key["model"])

        thread = threading.Thread(target=look)
        thread.start()
        thread.join(timeout=0.3 if waits else 10)  # (on a busy machine: ample time)
        return thread

    with engine_trial.one_trial_at_a_time(tmp_path, {"model": "a"}):
        waiting = second({"model": "a"}, waits=True)
        assert waiting.is_alive()  # it waits for this one's verdict
        assert not second({"model": "b"}).is_alive()  # another model's: no wait
        order.append("first")
    waiting.join(timeout=5)
    assert order == ["b", "first", "a"]
    unwritable = tmp_path / "a file" / "cache"  # (under a file: no folder can be made)
    unwritable.parent.write_text("")
    with engine_trial.one_trial_at_a_time(unwritable, {"model": "c"}):
        assert not second({"model": "c"}, unwritable).is_alive()
    assert order[-1] == "c"


def test_a_second_load_uses_the_cached_verdict(tiny_model, tmp_path, monkeypatch, caplog):
    """In process: the first load measures both engines, the second (a later start's)
    loads only the winner the first one found, and says it found it in the cache; one of
    the same start (a worker after its layout trial's timer) says so."""
    pytest.importorskip("onnxruntime")
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(
        tiny_model("text-classification"), engine=Engine.AUTO, warmup_batch=4, threads=1
    )
    trials: list[Trial] = []
    real_trial = engine_trial.run_trial

    def counted(*args, **kwargs):
        trials.append(real_trial(*args, **kwargs))
        return trials[-1]

    monkeypatch.setattr(engine_trial, "run_trial", counted)
    with caplog.at_level(logging.INFO, logger="rawserve.worker"):
        first = loading.load_runner(dataclasses.replace(config, start="first"), "cpu")
        second = loading.load_runner(dataclasses.replace(config, start="second"), "cpu")
        again = loading.load_runner(dataclasses.replace(config, start="first"), "cpu")
    assert len(trials) == 1  # the second start measured nothing
    assert first.engine is second.engine is again.engine is trials[0].winner
    assert "measured now" in first.engine_reason and " ms" in first.engine_reason
    assert "found in the cache" in second.engine_reason
    assert "measured at this start (cached)" in again.engine_reason
    assert any("measured now" in record.getMessage() for record in caplog.records)
    assert list((tmp_path / "onnx").glob("engine-trial-*.json"))


def test_a_trial_timed_beside_other_work_keeps_no_verdict(
    tiny_model, tmp_path, monkeypatch, caplog
):
    """A tester's trial timed torch at 366 ms a batch beside other work (186 ms alone) and
    kept it for every later start, where the layout trial keeps none timed so: the
    verdict serves this start, and the next measures again."""
    pytest.importorskip("onnxruntime")
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engine_trial, "FULL_SHARE", 2.0)  # no share is enough
    config = worker_config(
        tiny_model("text-classification"), engine=Engine.AUTO, warmup_batch=4, threads=1
    )
    with caplog.at_level(logging.WARNING, logger="rawserve.worker"):
        first = loading.load_runner(config, "cpu")
    assert "measured now" in first.engine_reason
    assert not list((tmp_path / "onnx").glob("engine-trial-*.json"))
    assert "the engine trial ran while other work shared the machine (it had " in caplog.text
    assert "its verdict serves this start and is not kept" in caplog.text
    monkeypatch.setattr(engine_trial, "FULL_SHARE", 0.0)
    again = loading.load_runner(dataclasses.replace(config, start="later"), "cpu")
    assert "measured now" in again.engine_reason  # measured again, and now kept
    assert list((tmp_path / "onnx").glob("engine-trial-*.json"))


def test_a_winner_far_ahead_is_said_with_its_figure_not_as_none(tmp_path):
    """On a loaded machine: "onnx 0.00 of torch's", where it was 0.0014."""
    trial = Trial(
        {Engine.ONNX: 0.052, Engine.TORCH: 0.26}, 32, lone={Engine.ONNX: 0.0014, Engine.TORCH: 0.2}
    )
    assert trial.describe().endswith("; both times multiplied, onnx 0.0014 of torch's")


def test_the_share_of_the_cores_is_the_cpu_time_over_the_wall_time_and_threads(monkeypatch):
    monkeypatch.setattr(engine_trial, "FULL_SHARE", 0.9)
    clock, cpu = iter([0.0, 2.0, 2.0]), iter([10.0, 13.0, 13.0])
    share = engine_trial.CoreShare(2, clock=lambda: next(clock), cpu=lambda: next(cpu))
    assert share.share() == pytest.approx(0.75)  # 3 s of CPU in 2 s on 2 threads
    assert not engine_trial.quiet(0.75, 2) and engine_trial.quiet(0.95, 2)


@pytest.mark.parametrize(("failure", "kept"), [(RuntimeError, True), (MemoryError, False)])
def test_a_model_onnx_runtime_cannot_load_is_not_exported_again_at_each_start(
    tiny_model, tmp_path, monkeypatch, failure, kept
):
    """GPT-2's export fails to load ([ShapeInferenceError] at a Gemm): each start exported
    the model again to fail again (5-16 s on a tiny one). A failure of the machine's
    (memory, the disk) may not recur: that one is tried again."""
    from rawserve.worker import loading, onnx_engine
    from tests.tiny_models import worker_config

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path))
    config = worker_config(
        tiny_model("text-classification"), engine=Engine.AUTO, warmup_batch=4, threads=1
    )
    tried: list[str] = []

    def unloadable(model: str, *args):
        tried.append(model)
        raise failure("[ONNXRuntimeError] : 1 : FAIL : Node (node_Gemm_295)")

    monkeypatch.setattr(onnx_engine, "load_network", unloadable)
    first = loading.load_runner(dataclasses.replace(config, start="first"), "cpu")
    second = loading.load_runner(dataclasses.replace(config, start="second"), "cpu")
    assert first.engine is second.engine is Engine.TORCH
    assert f"could not load the model ({failure.__name__})" in first.engine_reason
    assert len(tried) == (1 if kept else 2)
    assert ("at an earlier start" in second.engine_reason) is kept


def test_a_model_s_trial_files_name_it_and_deleting_them_measures_again(
    tiny_model, tmp_path, monkeypatch
):
    """Each trial file was named by a hash and its key lists file hashes: nothing told
    which model a file was of, nor how to have one measured again. Each names the model
    (as the command line named it, and its folder) outside its key, so a model moved
    keeps its verdicts, and the files a grep for it finds, deleted, are measured again."""
    pytest.importorskip("onnxruntime")
    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(engine_trial, "cpu_facts", lambda: {"flags": "avx2 amx_bf16"})
    measured: list[str] = []
    real_trial, real_measure = engine_trial.run_trial, precision_trial.measure

    def trial(*args, **kwargs):
        measured.append("engine")
        return real_trial(*args, **kwargs)

    def measure(*args, **kwargs):
        measured.append("bfloat16")
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(engine_trial, "run_trial", trial)
    monkeypatch.setattr(precision_trial, "measure", measure)

    def load(folder: Path, source: str) -> None:
        config = worker_config(
            str(folder), engine=Engine.AUTO, warmup_batch=4, threads=1, source=source
        )
        loading.load_runner(config, "cpu")

    folder = tmp_path / "models" / "mini"
    shutil.copytree(tiny_model("text-classification"), folder)
    load(folder, "models/mini")
    assert measured == ["engine", "bfloat16"]
    cache = tmp_path / "cache" / "onnx"
    files = sorted(cache.glob("*-trial-*.json"))
    assert [file.name.split("-trial-")[0] for file in files] == ["bfloat16", "engine"]
    for file in files:
        document = json.loads(file.read_text())
        assert (document["model"], document["folder"]) == ("models/mini", str(folder))
        assert str(tmp_path) not in json.dumps(document["key"])  # moved, the same key
    moved = tmp_path / "elsewhere" / "mini"
    shutil.move(folder, moved)
    load(moved, str(moved))
    assert measured == ["engine", "bfloat16"]  # moved, it keeps its verdicts
    for file in cache.glob("*-trial-*.json"):  # grep -l models/mini | xargs rm
        if "models/mini" in file.read_text():
            file.unlink()
    load(moved, str(moved))
    assert measured == ["engine", "bfloat16"] * 2


def test_a_half_precision_checkpoint_served_by_onnx_runtime_says_float32(
    tiny_model, tmp_path, monkeypatch
):
    """A checkpoint saved in float16 runs in it on torch and in float32 on ONNX Runtime:
    where the trial picks ONNX Runtime, the reason says float32 (it said the
    checkpoint's own float16 while float32 served)."""
    pytest.importorskip("onnxruntime")
    import shutil

    import torch
    import transformers

    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    folder = tmp_path / "half"
    shutil.copytree(tiny_model("text-classification"), folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    model.to(torch.float16).save_pretrained(folder)
    assert loading.saved_dtype(folder) == "float16"
    monkeypatch.setenv("RAWSERVE_CACHE_DIR", str(tmp_path / "cache"))
    onnx_faster = {Engine.ONNX: 0.001, Engine.TORCH: 0.01}
    monkeypatch.setattr(engine_trial, "timed", lambda candidates, *args: onnx_faster)
    config = worker_config(str(folder), engine=Engine.AUTO, warmup_batch=4, threads=1)
    runner = loading.load_runner(config, "cpu")
    assert runner.engine is Engine.ONNX and runner.dtype == "float32"
    assert runner.dtype_reason.startswith("float32: ONNX Runtime computes in it"), (
        runner.dtype_reason
    )
    assert "float16" in runner.dtype_reason


@pytest.mark.slow
def test_the_server_shows_the_trial_in_its_log_and_info(tiny_model, tmp_path):
    pytest.importorskip("onnxruntime")
    env = {"RAWSERVE_CACHE_DIR": str(tmp_path), "RAWSERVE_ENGINE": "auto"}
    args = ["--model", tiny_model("text-classification"), "--device", "cpu"]
    with RunningServer(args, env=env).start() as server:
        measured = "(auto: the faster here over a batch and one item, measured now: a batch of"
        assert any(measured in line for line in server.read_log())
        status, _, body = server.request("GET", "/info")
        assert status == 200
        info = json.loads(body)
        assert info["workers"][0]["dtype_reason"].startswith("auto on cpu: the checkpoint's")
        assert info["workers"][0]["attention"] is None  # a CPU keeps torch's own choice
        assert info["workers"][0]["cuda_graphs"] is None  # nor are graphs tried there
        # bfloat16 is tried where the CPU computes it in hardware (tests/test_precision_trial.py)
        tried = info["workers"][0]["bfloat16_trial"]
        if precision_trial.bf16_units(engine_trial.cpu_facts().get("flags", "")) is None:
            assert tried is None
        else:
            assert tried.startswith("bfloat16 on this CPU's") and " ms against float32's " in tried
        reason = info["workers"][0]["engine_reason"]
        assert "torch" in reason and "onnx" in reason and " ms" in reason
        # the winner first, in both lists
        assert info["engine"] == reason.split("took ")[1].split(" ")[0]
        assert info["engine"] == reason.split("one item alone ")[1].split(" ")[0]
        assert info["requested_engine"] == "auto"
    with RunningServer(args, env=env).start() as server:
        # (timed beside other tests, the first start's verdict may not have been kept)
        found = "the faster here over a batch and one item, found in the cache"
        assert any(found in line or measured in line for line in server.read_log())


def test_a_verdict_is_kept_apart_for_the_folder_s_own_graph(tiny_model, tmp_path):
    """A verdict timed on the export was reused once the folder had its own graph (one
    fetched from the Hub since), though ONNX Runtime then ran another graph; a folder
    without one keeps the key, and the verdicts, it had."""
    from rawserve.worker.loading import trial_key
    from tests.tiny_models import worker_config

    folder = tmp_path / "model"
    shutil.copytree(tiny_model("text-classification"), folder)
    config = worker_config(str(folder), engine=Engine.AUTO)
    exported = trial_key(config, "text-classification", 8)
    assert "shipped" not in exported
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"a graph")
    shipped = trial_key(config, "text-classification", 8)
    assert shipped != exported and shipped == {**exported, "shipped": shipped["shipped"]}

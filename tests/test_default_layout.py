"""The default worker layout: one single-threaded worker per core, as memory allows."""

from __future__ import annotations

import json

import pytest

from rawserve.config import WorkerPlan, plan_workers
from rawserve.models.plan import plan_models
from rawserve.ops.layout import WORKER_OVERHEAD, cpu_layout, model_bytes, ram_bytes
from rawserve.options import parse_config
from tests.server import RunningServer
from tests.test_devices import v1_tree, v2_tree

GIB = 2**30


@pytest.mark.parametrize(
    ("cores", "ram", "model", "workers"),
    [
        (2, 24 * GIB, 90 * 2**20, 2),  # this machine, MiniLM: one per core
        (16, 24 * GIB, 90 * 2**20, 16),
        (16, 8 * GIB, 1300 * 2**20, 1),  # a large model: memory bounds the copies
        (16, 16 * GIB, 1300 * 2**20, 2),
        (4, 1 * GIB, 5 * GIB, 1),  # never fewer than one
        (1, None, 90 * 2**20, 1),
        (8, None, 90 * 2**20, 8),  # RAM unknown: cores only
    ],
)
def test_workers_per_core_bounded_by_memory(cores, ram, model, workers):
    layout = cpu_layout(cores, ram, model)
    assert layout.workers == workers and layout.threads == 1
    assert f"{workers} worker(s)" in layout.reason or "RAM unknown" in layout.reason


def test_the_memory_bound_counts_two_copies_and_the_runtime():
    model = 1 * GIB
    per_worker = 2 * model + WORKER_OVERHEAD
    ram = 4 * per_worker  # half of it holds two workers
    assert cpu_layout(64, ram, model).workers == 2


def test_model_size_is_one_copy_of_the_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 3000)  # the same weights again
    (tmp_path / "config.json").write_text("{}")
    assert model_bytes(tmp_path) == 1000
    assert model_bytes(tmp_path / "missing") == 0


def test_a_sharded_model_s_size_is_all_its_shards(tmp_path):
    """A large checkpoint comes in shards: one copy is their sum (its largest shard alone
    would make a model of three shards a third of its size to the memory bound)."""
    for shard, size in ((1, 5000), (2, 5000), (3, 4000)):
        (tmp_path / f"model-0000{shard}-of-00003.safetensors").write_bytes(b"x" * size)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert model_bytes(tmp_path) == 14000


def test_an_onnx_only_folder_s_size_is_its_graph_and_the_graph_s_weights(tmp_path):
    """Its weights are under onnx/ alone: counted as none, the memory bound let a CPU
    machine start a worker per core whatever the model's size."""
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "model.onnx").write_bytes(b"x" * 100)
    (tmp_path / "onnx" / "model.onnx_data").write_bytes(b"x" * 3000)
    (tmp_path / "onnx" / "model_quantized.onnx").write_bytes(b"x" * 900)  # not served
    (tmp_path / "config.json").write_text("{}")
    assert model_bytes(tmp_path) == 3100


def test_ram_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\n")
    assert ram_bytes(meminfo) == 24576000 * 1024
    assert ram_bytes(tmp_path / "missing") is None


def test_a_container_s_memory_limit_bounds_the_ram(tmp_path):
    """`docker run --memory 4g` on a 64 GiB host: MemTotal is the host's, and copies
    planned for 64 GiB were killed by the kernel past 4."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {64 * GIB // 1024} kB\n")
    root = v2_tree(tmp_path / "root", "max 100000", str(4 * GIB))
    assert ram_bytes(meminfo, root) == 4 * GIB
    assert ram_bytes(tmp_path / "missing", root) == 4 * GIB
    unlimited = v1_tree(tmp_path / "unlimited", "-1")
    assert ram_bytes(meminfo, unlimited) == 64 * GIB


def settled(argv: list[str]) -> WorkerPlan:
    config = parse_config(argv)
    plans = plan_models(config.models, task=config.task, handler=config.handler)
    return plan_workers(config.model, plans)


def test_no_device_on_a_cpu_machine_is_the_per_core_layout(monkeypatch):
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    workers = settled(["--handler", "tests.handlers:echo"])
    assert workers.devices == ("cpu",) * 4 and workers.threads == 1 and workers.share_cores
    assert "one per core" in workers.layout and workers.chosen
    explicit = settled(["--handler", "tests.handlers:echo", "--device", "cpu"])
    assert explicit.devices == ("cpu",) and explicit.threads == 4 and explicit.share_cores
    assert explicit.layout == "--device cpu" and not explicit.chosen


def test_the_layout_counts_the_cores_this_process_may_run_on(monkeypatch):
    """Started with `taskset -c 0,1` (or a container's --cpuset-cpus) on a machine of 64
    cores, the server may run on 2: one worker per core is 2 workers, and
    --http-processes is bounded by the same 2."""
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    workers = settled(["--handler", "tests.handlers:echo"])
    assert workers.devices == ("cpu", "cpu") and workers.threads == 1
    with pytest.raises(SystemExit):
        parse_config(["--handler", "tests.handlers:echo", "--http-processes", "3"])


def test_the_layout_counts_a_container_s_limits_and_says_so(monkeypatch, tmp_path, capsys):
    """`docker run --cpus 2 --memory 4g` on a 64-core host: 2 workers, and the log line
    and /info's layout say which limits made them 2."""
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    root = v2_tree(tmp_path, "200000 100000", str(4 * GIB))
    monkeypatch.setattr("rawserve.shared.cgroups.ROOT", root)
    workers = settled(["--handler", "tests.handlers:echo"])
    assert workers.devices == ("cpu", "cpu") and workers.threads == 1
    assert "a cgroup CPU limit of 2 (/sys/fs/cgroup/cpu.max), of 64 allowed" in workers.layout
    assert "RAM at most 4.0 GiB (/sys/fs/cgroup/memory.max)" in workers.layout
    explicit = settled(["--handler", "tests.handlers:echo", "--device", "cpu"])
    assert explicit.threads == 2 and "cgroup CPU limit" in explicit.layout
    for option in ("--threads", "--http-processes"):  # at most 2 too, and why
        with pytest.raises(SystemExit):
            parse_config(["--handler", "tests.handlers:echo", option, "3"])
        refusal = capsys.readouterr().err
        assert f"{option} must be from 1 to 2, the cores this process may use (a cgroup" in refusal


def test_a_handler_s_workers_are_counted_at_what_they_load_not_at_a_model_s(monkeypatch):
    """A handler's worker imports neither torch nor a tokenizer (33 MiB before its own
    code): counted at a model worker's 400 MiB, 8 cores with 4 GiB of RAM got 5."""
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("rawserve.ops.layout.ram_bytes", lambda: 4 * GIB)
    workers = settled(["--handler", "tests.handlers:echo"])
    assert workers.devices == ("cpu",) * 8
    assert "at 40 MiB each" in workers.layout


def test_several_models_count_every_copy_and_runtime():
    mib = 2**20
    assert cpu_layout(16, 8 * GIB, 100 * mib).workers == 6  # 4 GiB / (2 x 100 + 400) MiB
    assert cpu_layout(16, 8 * GIB, 2 * 100 * mib, models=2).workers == 3  # / 1200 MiB


def test_a_gpu_machine_keeps_one_worker_per_device(monkeypatch):
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: True)
    workers = settled(["--handler", "tests.handlers:echo"])
    assert workers.devices == ("auto",) and workers.layout == "--device auto"
    assert not workers.chosen


# --- the tokenizer: in the thread that calls it ------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"TOKENIZERS_PARALLELISM": "false"}),
        ({"TOKENIZERS_PARALLELISM": "true"}, {"TOKENIZERS_PARALLELISM": "true"}),
        ({"RAYON_NUM_THREADS": "8"}, {"RAYON_NUM_THREADS": "8"}),  # a pool of the user's size
    ],
)
def test_a_worker_tokenizes_in_the_calling_thread_unless_the_environment_says(given, expected):
    from rawserve.worker.libraries import tokenize_in_the_calling_thread

    environ = dict(given)
    tokenize_in_the_calling_thread(environ)
    assert environ == expected


@pytest.mark.parametrize("given", [None, "true"])
def test_a_served_worker_s_tokenizer_parallelism(monkeypatch, given):
    """Asked of a running worker's own environment, through a handler."""
    for name in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    if given is not None:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", given)
    with RunningServer(["--handler", "tests.handlers:environment"]) as server:
        status, answer = server.post_json({"inputs": "TOKENIZERS_PARALLELISM"})
        assert (status, answer) == (200, given or "false")


def test_the_api_key_is_not_in_a_workers_environment():
    """The workers inherited RAWSERVE_API_KEY: a model's own code (trust_remote_code)
    could read it. It is read once, and the HTTP processes are given it."""
    key = "k-secret-1"
    argv = ["--handler", "tests.handlers:environment", "--http-processes", "2"]
    with RunningServer(argv, env={"RAWSERVE_API_KEY": key}) as server:
        body = json.dumps({"inputs": "RAWSERVE_API_KEY"})
        headers = {"Content-Type": "application/json"}
        status, _, _ = server.request("POST", "/", body, headers)
        assert status == 401
        for _ in range(4):  # (through each HTTP process, likely)
            headers["Authorization"] = f"Bearer {key}"
            status, _, answer = server.request("POST", "/", body, headers)
            assert (status, json.loads(answer)) == (200, None)


def test_threads_without_a_device_makes_fewer_workers_not_more_threads_than_cores(monkeypatch):
    """`--threads 2` on 4 cores: two workers of two threads, not four of two (eight
    threads on four cores stall each other: 0.1-0.25 of the throughput, measured), and the
    log line says so."""
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    for threads, workers in (("1", 4), ("2", 2), ("3", 1), ("4", 1)):
        plan = settled(["--handler", "tests.handlers:echo", "--threads", threads])
        assert plan.devices == ("cpu",) * workers and plan.threads == int(threads)
        assert not plan.share_cores and plan.chosen
        assert f"{workers} worker(s) x {threads} thread" in plan.layout
        assert len(plan.devices) * plan.threads <= 4
    two = settled(["--handler", "tests.handlers:echo", "--threads", "2"])
    assert "one per 2 cores (--threads 2)" in two.layout
    assert cpu_layout(4, None, 0, threads=2).workers == 2
    assert cpu_layout(8, 100 * GIB, 100 * 2**20, threads=3).workers == 2  # 8 // 3


def test_threads_for_several_models_keep_all_their_threads_within_the_cores():
    """`--threads 2` for two models on 8 cores: two workers of two threads for each model
    (8 threads in all), not four each (16 threads on 8 cores: the stalls above)."""
    layout = cpu_layout(8, 100 * GIB, 2 * 100 * 2**20, models=2, threads=2)
    assert (layout.workers, layout.threads) == (2, 2)
    assert "one per 4 cores (--threads 2, 2 models)" in layout.reason


@pytest.mark.parametrize(
    ("argv", "models", "workers", "crowded"),
    [
        (["--threads", "2"], 1, ("cpu",), False),
        (["--threads", "2"], 2, ("cpu",), True),  # a worker of 2 for each: 4 threads
        (["--threads", "1"], 2, ("cpu", "cpu"), False),  # single threads only take turns
        (["--device", "cpu", "--threads", "2"], 1, ("cpu",), False),
        (["--device", "cpu", "--threads", "2"], 2, ("cpu",), True),
        (["--device", "cpu,cpu", "--threads", "2"], 1, ("cpu", "cpu"), True),
        ([], 2, ("cpu", "cpu"), False),  # no --threads: the busy workers share the cores
    ],
)
def test_threads_whose_teams_outnumber_the_cores_are_warned_of(
    monkeypatch, argv, models, workers, crowded
):
    """Two models with `--threads 2` on 2 cores run a 2-thread worker each, and busy at
    once they ran 5-25 x slower than without --threads: the start says so, and what to
    give instead."""
    monkeypatch.delenv("RAWSERVE_DEVICE", raising=False)
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    config = parse_config(["--handler", "tests.handlers:echo", *argv])
    plans = plan_models(config.models, task=config.task, handler=config.handler)
    plan = plan_workers(config.model, plans * models)
    assert plan.devices == workers
    assert bool(plan.crowded) is crowded, plan.crowded
    if crowded:
        assert f"{len(workers) * models} CPU worker(s) x 2 threads" in plan.crowded
        assert "give --threads 1" in plan.crowded

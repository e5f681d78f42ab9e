"""The benchmark harness runs end to end: its load generator against rawserve's echo handler.

Only a smoke test (about two seconds of load): the benchmarks themselves are not tests.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import random
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench import gpu_round, load, refusal_cost, report, sampling_cost, scheduler_cost, spread
from bench.workloads import RAW_TEXT, BodyFormat, texts
from tests.server import REPO_ROOT, RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def echo_server():
    with RunningServer(["--handler", "tests.handlers:echo"]) as server:
        yield server


def test_closed_and_open_loop_runs_answer_200_and_summarise(echo_server):
    requests = load.build_requests(texts("short")[:16], RAW_TEXT)
    json_requests = load.build_requests(texts("mixed")[:16], BodyFormat({}), timeout_header=5)

    async def run():
        closed = await load.closed_loop(echo_server.port, requests, 8, 0.8, health_interval=0.05)
        counted = await load.closed_loop(echo_server.port, json_requests, 4, 10.0, max_requests=40)
        opened = await load.open_loop(echo_server.port, json_requests, 200, 0.8, deadline=5.0)
        return closed.summary(), counted.summary(), opened.summary()

    closed, counted, opened = asyncio.run(run())
    assert closed["requests"] > 0 and closed["statuses"] == {"200": closed["requests"]}
    assert closed["p50_ms"] is not None and closed["health"]["ok"] == closed["health"]["requests"]
    assert counted["requests"] == 40 and counted["statuses"] == {"200": 40}
    assert opened["statuses"].get("200", 0) > 50 and opened["late_200"] == 0


def test_load_from_several_processes_is_one_run(echo_server):
    """bench.spread: the clients (or the arrival rate) split between processes, their
    samples merged as if one process had sent them all."""
    requests = load.build_requests(texts("short")[:16], RAW_TEXT)

    async def run():
        closed = await spread.closed_loop(
            echo_server.port, requests, 5, 0.8, processes=2, health_interval=0.05
        )
        opened = await spread.open_loop(echo_server.port, requests, 200, 0.8, processes=2)
        return closed, opened

    closed, opened = asyncio.run(run())
    assert closed.clients == 5 and closed.health is not None and closed.health.status
    summary = closed.summary()
    assert summary["requests"] > 0 and summary["statuses"] == {"200": summary["requests"]}
    assert opened.rate == 200 and opened.summary()["statuses"].get("200", 0) > 50
    assert spread.shares(10, 4) == [3, 3, 2, 2] and spread.shares(2, 4) == [1, 1]


def test_report_checks_targets_from_figures():
    point = {"clients": 64, "throughput": 300.0, "p50_ms": 100.0, "p99_ms": 150.0}
    results = {
        "scenarios": [
            {
                "model": "classification",
                "ceiling": {"short": {"forward/arrival": {"best": 320.0, "curve": {}}}},
                "servers": {"rawserve": {"text_sets": {"short": {"points": [point]}}}},
            }
        ]
    }
    table = report.ratio_table(results)
    assert "0.94" in table and "| yes |" in table


def test_refusal_cost_harness_times_real_refusals():
    """The harness asserts that every request it times was answered 503 from the head, on
    a connection that stays open: an error page or a closed connection would be timed as
    a (very cheap) refusal otherwise."""
    loop = asyncio.new_event_loop()
    try:
        seconds = refusal_cost.per_refusal(200, loop, queue=8)
    finally:
        loop.close()
    assert 0 < seconds < 0.05


def test_scheduler_cost_runs_requests_through_batches():
    """Its closed loop keeps asking: requests are answered in batches of several."""
    figures = asyncio.run(scheduler_cost.one_round(32, 0.3, 0.001, 16))
    assert figures["requests_per_s"] > 0 and figures["cpu_us_per_request"] > 0
    assert 1 < figures["mean_batch"] <= 16


def test_the_gpu_round_runs_each_stage_bounded_and_skips_what_the_budget_cannot_fit(tmp_path):
    quick = gpu_round.Stage("quick", 30, ("json.tool", "--help"))
    stuck = gpu_round.Stage("stuck", 1, ("http.server", "0", "--bind", "127.0.0.1"))
    large = gpu_round.Stage("large", 10_000, ("json.tool", "--help"))

    found = gpu_round.run([quick, stuck, large], tmp_path, budget=60)

    assert [f["stage"] for f in found] == ["quick", "stuck", "large"]
    assert found[0]["exit"] == 0 and not found[0]["timed_out"]
    assert "usage" in (tmp_path / "quick.log").read_text()  # its output kept
    assert found[1]["timed_out"] and found[1]["seconds"] < 10  # killed at its limit
    assert "skipped" in found[2]  # more than the budget left
    assert json.loads((tmp_path / "summary.json").read_text()) == found


def test_a_gpu_round_stage_past_its_limit_takes_its_servers_with_it(tmp_path, monkeypatch):
    """A benchmark killed at its limit leaves no server of its own behind, on the GPU and
    the cores, for the stages after it."""
    (tmp_path / "starts_a_server.py").write_text(
        "import subprocess, sys, time\n"
        "server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(server.pid))\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    stuck = gpu_round.Stage("stuck", 3, ("starts_a_server",))

    found = gpu_round.run_stage(stuck, tmp_path)

    assert found["timed_out"]
    server = int((tmp_path / "pid").read_text())
    ends = time.monotonic() + 10
    while time.monotonic() < ends and running(server):
        time.sleep(0.05)
    assert not running(server)


@pytest.mark.parametrize("given", [["--budget", "0"], ["--budget", "-5"], ["--limit", "nan"]])
def test_a_gpu_round_budget_that_is_no_time_is_refused(tmp_path, capsys, given):
    """`--budget 0` ran the default 500 s, as though no budget had been named."""
    with pytest.raises(SystemExit) as stopped:
        gpu_round.main(["--out", str(tmp_path), "--dry-run", *given])
    assert stopped.value.code == 2
    assert f"{given[0]} must be a positive number of seconds" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no stage ran


def test_the_gpu_rounds_archive_leaves_out_what_a_lent_machine_cannot_send_back(tmp_path):
    """A lent machine sends back files of 16 MiB at most: a profile's raw stacks made the
    whole archive too large, and every log of its round was lost with them."""
    out = tmp_path / "round"
    (out / "profile").mkdir(parents=True)
    (out / "http.log").write_text("20,032 requests/s\n")
    (out / "profile" / "stacks.txt").write_bytes(b"x" * 2_000)

    gpu_round.pack(out, tmp_path / "round.tar.gz", limit=1_000)

    with tarfile.open(tmp_path / "round.tar.gz") as tar:
        names = set(tar.getnames())
        said = tar.extractfile("round/left-out.txt").read().decode()
        assert tar.extractfile("round/http.log").read() == b"20,032 requests/s\n"
    assert "round/profile/stacks.txt" not in names and "round/profile" in names
    assert said == "round/profile/stacks.txt: 2000 bytes\n"


def running(pid: int) -> bool:
    """Whether `pid` runs (a child ended but not yet reaped by anyone counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("dry_run", [False, True])
def test_every_gpu_round_stage_names_a_benchmark_that_takes_its_options(
    tmp_path, monkeypatch, dry_run
):
    """On the GPU and in the CPU's dry run alike: a wrong option or value fails here, not
    minutes into a lent machine's time."""
    from bench import generation_serving, models, servers

    parsed_args = []

    def parse_only(parser, args=None, namespace=None):
        parsed, unknown = parser.parse_known_args(args, namespace)  # checks types and choices
        assert not unknown, unknown
        parsed_args.append(parsed)
        raise SystemExit(0)  # parsed: the benchmark itself does not run

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    generation_scenarios = {s.name for s in generation_serving.scenarios(0)}
    for stage in gpu_round.stages(tmp_path, dry_run):
        module = importlib.import_module(stage.argv[0])
        with pytest.raises(SystemExit) as parsed:
            module.main(list(stage.argv[1:]))
        assert parsed.value.code == 0, stage.name
        args = vars(parsed_args[-1])
        # the values each benchmark looks up only once it runs
        if stage.argv[0] == "bench.compare":
            assert set(args["scenarios"].split(",")) <= set(models.BUILDERS), stage.name
            assert set(args["servers"].split(",")) <= set(servers.SERVERS), stage.name
        if stage.argv[0] in ("bench.lone_request", "bench.profile"):
            assert args["scenario"] in models.BUILDERS, stage.name
        if stage.argv[0] == "bench.generation_serving" and args["scenarios"]:
            assert set(args["scenarios"]) <= generation_scenarios, stage.name
        if "--device" in stage.argv:
            assert args["device"].startswith("cpu" if dry_run else "cuda"), stage.name


def test_the_gpu_round_s_open_targets_come_first_and_fit_its_default_budget(tmp_path):
    """One command on a lent GPU runs at most 600 s: the stages that measure the issues'
    open targets run first and fit the default budget together, the wheels' install
    beside it; what the rest of the budget cannot fit (the summary names it skipped) fits
    a second command."""
    every = gpu_round.stages(tmp_path)
    targets = gpu_round.chosen_stages(["targets"], tmp_path, dry_run=False)
    assert targets == every[: len(targets)] and len(targets) < len(every)
    assert sum(stage.seconds for stage in targets) <= gpu_round.BUDGET <= 540
    others = gpu_round.chosen_stages(["others"], tmp_path, dry_run=False)
    assert others == every[len(targets) :]
    assert sum(stage.seconds for stage in every) <= 2 * gpu_round.BUDGET  # two commands
    some = gpu_round.chosen_stages(["others", "http"], tmp_path, dry_run=False)
    assert some == [every[0], *others]  # in the round's order


def test_the_gpu_round_packs_what_it_wrote_into_one_archive(tmp_path):
    out = tmp_path / "round"
    found = gpu_round.run([gpu_round.Stage("quick", 30, ("json.tool", "--help"))], out, 60)
    gpu_round.pack(out, tmp_path / "back" / "round.tar.gz")

    with tarfile.open(tmp_path / "back" / "round.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"round/summary.json", "round/quick.log"} <= names and found[0]["exit"] == 0


def fake_round(monkeypatch, *found: gpu_round.Stage) -> None:
    """`python -m bench.gpu_round` with these stages in place of the benchmarks, and a
    GPU said to be there."""
    monkeypatch.setattr(gpu_round, "stages", lambda out, dry_run=False: list(found))
    monkeypatch.setattr(gpu_round, "missing_cuda", lambda device="cuda": None)


def test_a_gpu_round_that_skips_what_its_budget_cannot_hold_succeeds_and_names_it(
    tmp_path, monkeypatch
):
    """A first command on a lent GPU skips what its budget cannot hold, as planned: it
    exited 1 all the same, as if a stage had failed."""
    quick = gpu_round.Stage("quick", 30, ("json.tool", "--help"))
    large = gpu_round.Stage("large", 10_000, ("json.tool", "--help"))
    fake_round(monkeypatch, quick, large)

    code = gpu_round.main(["--out", str(tmp_path), "--budget", "60"])

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0
    assert [f["stage"] for f in summary] == ["quick", "large"] and "skipped" in summary[1]


def test_a_gpu_round_s_second_command_runs_what_the_first_skipped(tmp_path, monkeypatch):
    """Which stages a first command skips depends on the time each took: the second reads
    them from the first's summary rather than from a list written beforehand."""
    every = [
        gpu_round.Stage(name, seconds, ("json.tool", "--help"))
        for name, seconds in [("first", 30), ("large", 10_000), ("small", 30), ("other", 9_000)]
    ]
    fake_round(monkeypatch, *every)
    first, second = tmp_path / "first", tmp_path / "second"
    assert gpu_round.main(["--out", str(first), "--budget", "100"]) == 0

    code = gpu_round.main(
        ["--out", str(second), "--budget", "20000", "--skipped-from", str(first / "summary.json")]
    )

    ran = json.loads((second / "summary.json").read_text())
    assert code == 0 and [(f["stage"], f["exit"]) for f in ran] == [("large", 0), ("other", 0)]
    with pytest.raises(SystemExit):  # no summary there: said, not an empty round
        gpu_round.main(["--out", str(second), "--skipped-from", str(tmp_path / "none.json")])


def test_a_gpu_round_with_a_stage_that_failed_or_ran_out_of_time_fails(tmp_path, monkeypatch):
    failing = gpu_round.Stage("failing", 30, ("json.tool", str(tmp_path / "absent.json")))
    fake_round(monkeypatch, failing)
    assert gpu_round.main(["--out", str(tmp_path / "failed")]) == 1
    stuck = gpu_round.Stage("stuck", 1, ("http.server", "0", "--bind", "127.0.0.1"))
    fake_round(monkeypatch, stuck)
    assert gpu_round.main(["--out", str(tmp_path / "stuck")]) == 1


def test_a_gpu_round_s_limit_cuts_its_budget(tmp_path, monkeypatch):
    """A command run under a smaller limit than 600 s (a second one, or the device time
    left) starts no stage that would outlast it."""
    fake_round(monkeypatch, gpu_round.Stage("quick", 30, ("json.tool", "--help")))

    code = gpu_round.main(["--out", str(tmp_path), "--limit", str(gpu_round.LIMIT_MARGIN + 20)])

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0 and summary == [{"stage": "quick", "skipped": "20 s left"}]


def test_a_gpu_round_sends_back_every_stage_as_it_ends(tmp_path, monkeypatch):
    """A command killed at the tool's limit returns only what is already in its $OUT: the
    summary and the archive there are rewritten as each stage ends, not at the round's."""
    back = tmp_path / "back"
    (tmp_path / "peek.py").write_text(
        "import json, sys, tarfile\n"
        f"back = {str(back)!r}\n"
        "with tarfile.open(back + '/round.tar.gz') as tar:\n"
        "    names = tar.getnames()\n"
        "summary = json.load(open(back + '/summary.json'))\n"
        f"peeked = open({str(tmp_path / 'peeked.json')!r}, 'w')\n"
        "json.dump({'names': names, 'summary': summary}, peeked)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    quick = gpu_round.Stage("quick", 30, ("json.tool", "--help"))
    fake_round(monkeypatch, quick, gpu_round.Stage("peek", 30, ("peek",)))

    code = gpu_round.main(["--out", str(tmp_path / "round"), "--back", str(back)])

    peeked = json.loads((tmp_path / "peeked.json").read_text())
    assert code == 0, (tmp_path / "round" / "peek.log").read_text()
    assert [(f["stage"], f["exit"]) for f in peeked["summary"]] == [("quick", 0)]
    assert {"round/quick.log", "round/summary.json"} <= set(peeked["names"])
    assert [f["stage"] for f in json.loads((back / "summary.json").read_text())] == [
        "quick",
        "peek",
    ]
    assert sorted(path.name for path in back.iterdir()) == ["round.tar.gz", "summary.json"]


def test_a_gpu_round_stopped_from_outside_names_what_it_did_not_reach(tmp_path, monkeypatch):
    """Stopped (SIGINT, as round.sh's timeout stops it): the stage running is marked
    interrupted, the round fails, and the stages it never reached are named, for
    `--skipped-from`."""
    (tmp_path / "stops_the_round.py").write_text(
        "import os, signal, time\nos.kill(os.getppid(), signal.SIGINT)\ntime.sleep(30)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    quick = gpu_round.Stage("quick", 30, ("json.tool", "--help"))
    stopper = gpu_round.Stage("stopper", 30, ("stops_the_round",))
    after = gpu_round.Stage("after", 30, ("json.tool", "--help"))
    # as `main` hears it, whatever this process inherited (a suite run in the background
    # ignores SIGINT: the stage ran out its limit)
    heard = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        found = gpu_round.run([quick, stopper, after], tmp_path, budget=100)
    finally:
        signal.signal(signal.SIGINT, heard)

    assert found[1:] == [
        {"stage": "stopper", "interrupted": True},
        {"stage": "after", "skipped": "the round was stopped"},
    ]
    assert not gpu_round.succeeded(found)
    assert gpu_round.skipped_stages(tmp_path / "summary.json") == ["stopper", "after"]


def test_bench_compare_keeps_a_failed_server_s_last_words_and_exits_1(
    tmp_path, monkeypatch, capsys
):
    """A server that measured nothing (the seed's, timed out on the GPU) left its stage
    at exit 0: the round called it a success."""
    from bench import compare

    stopped = []

    class DeafServer:
        def log_tail(self) -> str:
            return "the server's own last words"

        def stop(self) -> None:
            stopped.append(True)

    async def times_out(*args):
        raise TimeoutError("no answer in 180 s")

    monkeypatch.setattr(compare, "start_server", lambda *args: DeafServer())
    monkeypatch.setattr(compare, "measure_server", times_out)
    figures = compare.measured_or_error("seed-batching", None, None, tmp_path)
    assert figures == {"error": "TimeoutError('no answer in 180 s')"} and stopped
    assert "the server's own last words" in capsys.readouterr().err

    results = json.loads((Path(REPO_ROOT) / "bench" / "results.json").read_text())
    results["scenarios"][0]["servers"]["seed-batching"] = figures
    (tmp_path / "figures.json").write_text(json.dumps(results))
    tracked_picture = (Path(REPO_ROOT) / "bench" / "throughput_vs_p99.png").read_bytes()

    code = compare.main(
        ["--from-json", str(tmp_path / "figures.json"), "--json", str(tmp_path / "encoders.json")]
    )

    assert code == 1 and "measured nothing: seed-batching" in capsys.readouterr().err
    # the picture goes beside the figures: the tracked one stays as it was
    assert (Path(REPO_ROOT) / "bench" / "throughput_vs_p99.png").read_bytes() == tracked_picture
    assert (tmp_path / "encoders.png").exists() or importlib.util.find_spec("matplotlib") is None


def test_the_gpu_round_s_in_process_benchmarks_leave_no_model_in_tmp(tmp_path, monkeypatch):
    """bench.cuda_graphs left 419 MB of BERT-base in /tmp, bench.overlap its random
    encoders: on a lent machine nothing removes them."""
    import tempfile

    from bench import cuda_graphs, models, overlap

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def build_then_fail(folder: Path) -> Path:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        raise RuntimeError("built")

    async def no_pool(*args, **kwargs):
        raise RuntimeError("built")

    monkeypatch.setattr(models, "build_bert_base_classifier", build_then_fail)
    monkeypatch.setattr(overlap, "ready_pool", no_pool)
    for module, argv in [
        (cuda_graphs, ["--device", "cpu"]),
        (overlap, ["--prepare", "--device", "cpu", "--layers", "1", "--hidden", "32"]),
    ]:
        with pytest.raises(RuntimeError, match="built"):
            module.main(argv)
        # (torch may keep a compile cache there: not the benchmark's)
        left = [path.name for path in tmp_path.iterdir() if path.name.startswith("rawserve")]
        assert left == [], module.__name__


def test_the_machine_s_idle_time_is_read_from_proc_stat():
    """What `bench.compare` reports as the cores nobody used during a point."""
    from bench import servers

    before = servers.idle_seconds()
    time.sleep(0.2)
    assert 0 < before <= servers.idle_seconds()


def test_make_bench_quick_is_a_short_try_of_every_step():
    """`make bench ARGS=--quick` shortened bench.compare alone, then ran the HTTP and the
    generation benchmarks in full (about 19 minutes more)."""
    planned = subprocess.run(
        ["make", "-n", "bench", "ARGS=--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()

    def arguments(module: str) -> list[str]:
        [line] = [line for line in planned if f"-m {module}" in line]
        return shlex.split(line.split(f"-m {module}", 1)[1])

    assert arguments("bench.compare") == ["--quick"]
    assert arguments("bench.http_processes") == ["--rounds", "1", "--duration", "2"]
    assert arguments("bench.generation_serving") == ["--rounds", "1", "--scenarios", "16 x 64"]


def test_the_sampling_cost_benchmark_times_a_step_of_every_setting_with_every_row_running():
    pytest.importorskip("torch")
    figures = sampling_cost.measure(vocabulary=300, rows=3, steps=1, rounds=1)
    assert list(figures) == list(sampling_cost.SETTINGS)
    assert all(ms > 0 for ms in figures.values())


def test_the_generation_benchmark_s_stand_in_tokenizer_serves_the_loop_s_text():
    """The decoding benchmark drives the continuous loop with a tokenizer of no text;
    the loop's text reader must take it (it failed the GPU round's decode stage when
    the reader came to ask a tokenizer for its byte tokens)."""
    from bench.generation import NoTokenizer
    from rawserve.worker.text_pieces import TextPieces

    pieces = TextPieces(NoTokenizer())
    assert pieces.next_piece([5, 6], last=False) == ""
    assert pieces.next_piece([5, 6, 7], last=True) == ""


def test_the_decoding_benchmark_s_requests_joining_one_a_step_each_have_a_prefill():
    """The scenario that says what joins cost: one request joins a step (a prefill of its
    own beside the step), where requests added at once share one prefill."""
    pytest.importorskip("torch")
    from bench import generation

    model = generation.build_model(1, 16)
    prompts = generation.prompts(6, random.Random(0))
    engine = generation.loop(model)
    joining = generation.continuous(model, prompts, [4] * 6, engine, one_a_step=True)
    at_once = generation.continuous(model, prompts, [4] * 6, engine)
    for run in (joining, at_once):
        assert run["useful"] == 24 and len(run["first"]) == 6 and len(run["gaps"]) == 6 * 3
    # a joiner's first token is its prefill's, the next three its step's and two more:
    # six prefills over the last one's join (the sixth step) and its two steps after,
    # against one prefill for three steps
    assert joining["prefills_per_step"] == pytest.approx(6 / 8)
    assert at_once["prefills_per_step"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", ["encode_outputs", "tokenize_cost", "model_memory"])
def test_a_benchmark_without_options_says_what_it_measures_on_help(name, capsys):
    """`--help` printed usage; before, these three started their measurement (servers, a
    minute of timing) whatever they were given."""
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and module.__doc__.split("\n")[0] in out


@pytest.mark.parametrize(("floor_ms", "hooks"), [("2", "1"), ("", "0")])
def test_the_emulated_gpu_floors_every_gpt2_a_process_builds_only_when_asked(floor_ms, hooks):
    """bench/emulated_gpu's sitecustomize, first on PYTHONPATH, hooks each GPT-2 model a
    process builds (a server's spawned workers run it too), and nothing without its
    variable."""
    build = (
        "import time, torch, transformers\n"
        "config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,"
        " bos_token_id=1, eos_token_id=1)\n"
        "model = transformers.GPT2LMHeadModel(config)\n"
        "started = time.perf_counter(); model(torch.tensor([[1, 2]]))\n"
        "print(len(model._forward_pre_hooks), time.perf_counter() - started)\n"
    )
    env = {
        "PYTHONPATH": str(Path(REPO_ROOT) / "bench" / "emulated_gpu"),
        "RAWSERVE_BENCH_PASS_FLOOR_MS": floor_ms,
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, "-c", build], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    count, seconds = done.stdout.split()
    assert count == hooks
    if floor_ms:
        assert float(seconds) >= 0.002  # the pass waited its floor


def test_the_benchmarks_wait_for_every_worker_not_only_the_first_answer():
    """A server answers once its first worker is ready while the others still load on
    the same cores: `wait_until_serving` waits until /info says every worker serves (of
    every model), and does not wait on a server without rawserve's /info."""
    import http.server
    import threading

    states = iter(["loading", "loading", "warming", "idle"])
    seen: list[str] = []

    class Stand_in(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            if self.server.server_port == plain.server_port:
                self.send_error(404)
                return
            seen.append(next(states, "busy"))
            workers = [{"state": "idle"}]
            body = json.dumps({"workers": workers, "models": [{"workers": [{"state": seen[-1]}]}]})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    rawserve_like = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stand_in)
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stand_in)
    for server in (rawserve_like, plain):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        request = load.build_request(b"x")
        asyncio.run(load.wait_until_serving(rawserve_like.server_port, request, 30))
        assert seen == ["loading", "loading", "warming", "idle"]
        asyncio.run(load.wait_until_serving(plain.server_port, request, 30))
        assert load.workers_starting(plain.server_port) == 0
    finally:
        for server in (rawserve_like, plain):
            server.shutdown()
            server.server_close()

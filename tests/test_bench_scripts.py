"""The bench/ scripts' own pieces, checked without a server or a model (each well under a
second): what they read from a server's log, how they judge an answer, what --help says."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import servers
from tests.test_bench_smoke import running

# how rawserve.serving.pool says a worker's process ended (`exit_words`, `server_kill`)
WORKER_ENDS = [
    "worker 0: process 16032 exited with code 1; restarting in 0.5 s",
    "worker 0: process 16032 was killed by SIGKILL (out of memory, or a kill -9); "
    "restarting in 0.5 s",
    "worker 0: process 16032 was killed by SIGSEGV while loading; restarting in 1.0 s",
    "worker gen/1: process 16032 was killed for hanging holding a batch of 4; restarting in 0 s",
    "worker 0: process 16032 was killed, stopped from outside; restarting in 0.5 s",
    "worker 0: process 16032 stopped, as its load failed; not restarted",
]


@pytest.mark.parametrize("line", WORKER_ENDS)
def test_a_worker_s_end_is_read_from_the_log_however_it_ended(line):
    """bench.fault_run waited for 'process N exited' only, and a kill -9 is logged as
    'was killed by SIGKILL': it gave up at its first kill; bench.chaos counted neither
    the server's own kills nor a failed load."""
    assert servers.worker_ended(16032).search(line)
    assert servers.worker_ended().search(line)
    assert not servers.worker_ended(1603).search(line)
    assert not servers.worker_ended(160321).search(line)


def test_a_worker_s_other_lines_are_not_its_end():
    assert not servers.worker_ended().search("worker 0: started (pid 16032)")
    assert not servers.worker_ended().search(
        "worker 0: its process 16032 is stopped (SIGSTOP, a debugger), its batch held"
    )


def sse(*events: str) -> bytes:
    return b"".join(b"data:" + event.encode() + b"\n\n" for event in events)


TOKEN = '{"id":764,"text":" there","logprob":-1.9,"special":false}'


@pytest.mark.parametrize(
    ("answer", "whole"),
    [
        # the README's example: tokens numbered from 1, the text on the last
        (
            sse(
                f'{{"index":1,"token":{TOKEN},"generated_text":null,"details":null}}',
                f'{{"index":2,"token":{TOKEN},"generated_text":" there there","details":null}}',
            ),
            True,
        ),
        (b": keep-alive\n\n" + sse(f'{{"index":1,"token":{TOKEN},"generated_text":"x"}}'), True),
        (
            sse(
                f'{{"index":1,"token":{TOKEN},"generated_text":null}}',
                '{"error":"the worker died","error_type":"generation"}',
            ),
            True,
        ),
        (sse(f'{{"index":0,"token":{TOKEN},"generated_text":"x"}}'), False),  # from 0
        (
            sse(
                f'{{"index":2,"token":{TOKEN},"generated_text":null}}',
                f'{{"index":1,"token":{TOKEN},"generated_text":"x"}}',
            ),
            False,
        ),
        (sse(f'{{"index":1,"token":{TOKEN},"generated_text":null}}'), False),  # cut short
        (b"", False),
    ],
)
def test_a_stream_is_whole_with_its_tokens_numbered_from_1_as_tgi_s(answer, whole):
    """bench.chaos counted every stream as wrong content: it expected indexes from 0."""
    from bench import chaos

    assert chaos.stream_whole(chaos.stream_events(answer)) is whole


def test_the_tokenize_placement_worker_answers_as_the_server_does():
    """bench.tokenize_placement's worker-side handler made TEI's tokens with an old
    signature of rawserve.api.tokens.token_objects (a TypeError at its first request)."""
    import orjson
    import tokenizers

    from bench import tokenize_placement
    from rawserve.api.tokens import tokens_json

    text = "Ça coûte 5 € — the quick brown fox"
    [[answer]] = tokenize_placement.tokenizing_handler()([text])
    tokenizer = tokenizers.Tokenizer.from_file(tokenize_placement.tokenizer_file())
    tokenizer.no_padding()
    assert answer == orjson.loads(tokens_json(tokenizer.encode(text), text))
    assert answer[0]["special"]  # [CLS]
    assert answer[1] == {
        "id": answer[1]["id"],
        "text": "Ça",
        "special": False,
        "start": 0,
        "stop": 3,
    }


def test_a_gpu_round_stopped_by_sigterm_stops_its_stage_and_the_stage_s_servers(tmp_path):
    """SIGTERM (a timeout's, a kill's) ended bench.gpu_round at once, and its stage, in a
    session of its own, ran on orphaned, starting servers and leaving its temp folder: now
    the stage is stopped as by Ctrl-C (its cleanup runs), then its group killed."""
    (tmp_path / "starts_a_server.py").write_text(
        "import pathlib, subprocess, sys, time\n"
        "server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "pathlib.Path('pid').write_text(str(server.pid))\n"
        "try:\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    pathlib.Path('cleaned').write_text('yes')\n"
    )
    code = (
        "import sys; from pathlib import Path; from bench import gpu_round\n"
        "gpu_round.hear_stops()\n"
        "stage = gpu_round.Stage('stuck', 60, ('starts_a_server',))\n"
        "found = gpu_round.run([stage], Path('out'), budget=100)\n"
        "sys.exit(0 if gpu_round.succeeded(found) else 1)\n"
    )
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)])
    round_ = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": path}
    )
    try:
        ends = time.monotonic() + 30
        while not (tmp_path / "pid").is_file() and time.monotonic() < ends:
            time.sleep(0.05)
        server = int((tmp_path / "pid").read_text())
        round_.send_signal(signal.SIGTERM)
        assert round_.wait(timeout=20) == 1
    finally:
        round_.kill()
    assert (tmp_path / "cleaned").read_text() == "yes"
    ends = time.monotonic() + 5
    while running(server) and time.monotonic() < ends:
        time.sleep(0.05)
    assert not running(server)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary == [{"stage": "stuck", "interrupted": True}]


def test_a_gpu_benchmark_without_cuda_says_so_in_one_line(monkeypatch, capsys):
    """bench.gpu_round without --dry-run on a torch without CUDA ran its GPU stages on the
    CPU until each one's limit; bench.attention_shapes and bench.cuda_graphs ended in a
    traceback. Now: one line, exit 2, before anything starts."""
    from bench import gpu, gpu_round

    assert gpu.missing_cuda("cpu") is None
    monkeypatch.setattr(gpu_round, "missing_cuda", lambda device="cuda": "CUDA is not there")
    with pytest.raises(SystemExit) as exited:
        gpu_round.main(["--out", "/nonexistent/round", "--stages", "lone"])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert said.startswith("python -m bench.gpu_round: CUDA is not there") and said.count("\n") == 1


@pytest.mark.parametrize("name", ["attention_shapes", "cuda_graphs"])
def test_a_gpu_benchmark_asked_for_cuda_on_a_torch_without_it_exits_2(name, capsys, monkeypatch):
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (as a CPU torch)
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"bench.{name}").main(["--device", "cuda"])
    assert exited.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_the_profile_says_at_once_that_py_spy_is_missing(tmp_path, monkeypatch, capsys):
    """bench.profile started a server and warmed it (a minute) before it found no py-spy."""
    from bench import profile

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert profile.find_py_spy() is None
    with pytest.raises(SystemExit) as exited:
        profile.main(["--out", str(tmp_path / "prof")])
    assert exited.value.code == 2 and "pip install -e .[bench]" in capsys.readouterr().err
    assert not (tmp_path / "prof").exists()  # nothing started
    (tmp_path / "py-spy").write_text("#!/bin/sh\n")
    (tmp_path / "py-spy").chmod(0o755)
    assert profile.find_py_spy() == str(tmp_path / "py-spy")


# every benchmark with options, and the options the tester found unexplained
BENCHMARKS = sorted(
    path.stem
    for path in (Path(__file__).resolve().parent.parent / "bench").glob("*.py")
    if "ArgumentParser(" in path.read_text()
)
EXPLAINED = {
    "ceiling": ["--model", "--task", "--min-seconds"],
    "flat_cost": "all",
    "scheduler_cost": "all",
    "fault_run": ["--kills", "--concurrency"],
    "chaos": ["--minutes"],
    "compare": ["--scenarios", "--json"],
    "lone_request": ["--scenario"],
    "scheduler_mixed_lengths": "all",
}


def parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The benchmark's parser, as its main builds it (nothing runs)."""
    import importlib

    built = []

    def caught(parser, args=None, namespace=None):
        built.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(SystemExit):
        importlib.import_module(f"bench.{name}").main([])
    return built[0]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmark_s_help_names_its_command_and_says_whole_sentences(name, monkeypatch):
    """Usage said "chaos.py", and `__doc__.splitlines()[0]` cut a wrapped sentence."""
    import importlib

    parser = parser_of(name, monkeypatch)
    assert parser.prog == f"python -m bench.{name}"
    first = importlib.import_module(f"bench.{name}").__doc__.strip().split("\n\n")[0]
    assert " ".join(first.split()) in " ".join(parser.format_help().split())
    wanted = EXPLAINED.get(name, [])
    for action in parser._actions:
        named = action.option_strings[0] if action.option_strings else action.dest
        if wanted == "all" or named in wanted:
            assert action.help, f"{name} {named}"


def test_a_benchmark_s_description_is_its_docstring_s_first_paragraph():
    from bench import described

    assert described("One sentence,\nwrapped.\n\nMore.\n") == "One sentence,\nwrapped."


@pytest.mark.parametrize("name", ["lone_request", "profile"])
def test_the_scenario_names_a_benchmark_takes_are_listed(name, monkeypatch):
    from bench.models import BUILDERS

    usage = parser_of(name, monkeypatch).format_usage()
    assert all(scenario in usage for scenario in BUILDERS)


def test_bench_infinity_without_setup_says_there_is_nothing_to_do(capsys):
    """It did nothing and exited 0, as if a setup had been made."""
    from bench import infinity

    with pytest.raises(SystemExit) as exited:
        infinity.main([])
    assert exited.value.code == 2 and "--setup" in capsys.readouterr().err

"""The typed configuration: what `parse_config` settles, and the worker plan derived from it.

No server: the command line is parsed in-process. The configuration is frozen (nothing
can change it once the parts are built from it), its derived values (parsed devices, the
engine, the chat template's text, the TLS context, the workers' devices and threads) are
computed once, and an invalid command line is refused with the same message and exit
code 2 as argparse's own errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import http.client
import importlib.util
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from rawserve.config import Batching, ServerConfig, plan_workers
from rawserve.fronts import reserve_port
from rawserve.main import model_facts, worker_config
from rawserve.models.folder import FolderFacts
from rawserve.models.plan import ModelPlan
from rawserve.ops.stop_signals import stop_signals
from rawserve.options import OPTIONS, device_unservable, parse_config
from rawserve.shared.messages import Engine
from tests.server import REPO_ROOT, RunningServer, ipv6_loopback

ECHO = ["--handler", "tests.handlers:echo"]


@pytest.fixture(autouse=True)
def no_variables(monkeypatch):
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def run_python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with this checkout's rawserve (and `env` added), as an operator runs
    the server: what it wrote, and its exit code."""
    environment = {**os.environ, "PYTHONPATH": REPO_ROOT, **env}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, env=environment
    )


def handler_plan(name: str = "echo") -> ModelPlan:
    return ModelPlan((name,), "tests.handlers:echo", None, handler="tests.handlers:echo")


def test_the_configuration_is_frozen_all_the_way_down():
    config = parse_config([])
    for target, name in [
        (config, "port"),
        (config.model, "max_queue"),
        (config.http, "head_timeout"),
        (config.app, "api_key"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, None)


def test_the_defaults_are_the_option_table_s(monkeypatch):
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)  # a CPU machine
    config = parse_config([])
    assert isinstance(config, ServerConfig)
    assert (config.host, config.port, config.tls, config.ssl_context) == (
        "127.0.0.1",
        8000,
        None,
        None,
    )
    assert config.models == () and config.handler is None
    model = config.model
    assert (model.device, model.devices, model.threads) == (None, None, None)
    assert (model.engine, model.batching, model.warmup) == (Engine.AUTO, Batching.COST, True)
    assert (model.max_batch_size, model.max_queue, model.batch_timeout) == (32, 256, 120.0)
    assert config.http.max_body_bytes == 1024 * 1024 and config.http.max_connections == 1000
    assert (config.app.timeout, config.app.max_timeout, config.app.api_key) == (30.0, 300.0, None)
    assert (config.log_format, config.access_log, config.download_only) == ("text", True, False)
    # every other setting too, so that none changes unseen (the loop: uvloop where installed)
    settings = dataclasses.asdict(config)
    assert settings.pop("loop") == ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")
    assert abs(settings["app"].pop("started") - time.time()) < 60  # when it was read
    assert settings == {
        "host": "127.0.0.1",
        "port": 8000,
        "tls": None,
        "models": (),
        "handler": None,
        "task": None,
        "pooling": None,
        "revision": None,
        "model": {
            "device": None,
            "devices": None,
            "threads": None,
            "engine": Engine.AUTO,
            "dtype": "auto",
            "batching": Batching.COST,
            "batch_limits": "on the CPU: up to 32 items, no token budget",
            "max_batch_size": 32,
            "max_batch_tokens": None,
            "max_batch_delay_ms": 0.0,
            "max_queue": 256,
            "batch_timeout": 120.0,
            "generation": "continuous",
            "max_sequences": None,
            "join_wait_steps": 0,
            "chat_template": None,
            "cuda_graphs": True,
            "warmup": True,
        },
        "http": {
            "max_body_bytes": 1024 * 1024,
            "max_head_bytes": 16 * 1024,
            "max_connections": 1000,
            "keepalive_timeout": 5.0,
            "head_timeout": 10.0,
            "body_timeout": 30.0,
            "write_timeout": 30.0,
        },
        "app": {
            "timeout": 30.0,
            "max_timeout": 300.0,
            "api_key": None,
            "max_client_batch_size": 32,
            "cors_allow_origins": (),
            "stream_keepalive": 15.0,
            "max_answer_bytes": 32 * 1024 * 1024,
            "thinking_in_content": False,
        },
        "grace": 30.0,
        "http_processes": 1,
        "log_level": "info",
        "log_format": "text",
        "access_log": True,
        "download_only": False,
    }


@pytest.mark.parametrize(
    ("argv", "longest"),
    [
        ([], 300.0),
        (["--timeout", "600"], 600.0),  # a request asking for 600 s gets them, not 300
        (["--timeout", "600", "--max-timeout", "900"], 900.0),
        (["--timeout", "5", "--max-timeout", "5"], 5.0),
    ],
)
def test_a_request_may_ask_for_at_least_the_default_deadline(argv, longest):
    assert parse_config(argv).app.max_timeout == longest


def test_derived_values_are_computed_at_parse_time(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}", encoding="utf-8")
    config = parse_config(
        [
            *["--device", "cuda:0, CUDA:1", "--engine", "auto", "--batching", "count"],
            *["--chat-template", str(template), "--no-warmup", "--no-access-log"],
            *["--cors-allow-origin", "https://a.example", "--cors-allow-origin", "*"],
            "--thinking-in-content",
        ]
    )
    model = config.model
    assert model.device == "cuda:0, CUDA:1" and model.devices == ("cuda:0", "cuda:1")
    assert model.engine is Engine.AUTO and model.batching is Batching.COUNT
    assert model.chat_template == "{{ messages }}"  # the file's text, read once
    assert not model.warmup and not config.access_log
    assert config.app.cors_allow_origins == ("https://a.example", "*")
    assert config.app.thinking_in_content and not parse_config([]).app.thinking_in_content


@pytest.mark.parametrize(
    ("cap", "processes", "each"),
    [("1000", "1", 1000), ("50", "2", 25), ("1001", "8", 126), ("0", "4", 0)],
)
def test_the_connection_cap_is_shared_by_the_http_processes(monkeypatch, cap, processes, each):
    # each process counts only its own connections: with the whole cap each, N processes
    # held N times --max-connections open
    # at most one HTTP process per core
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    argv = ["--max-connections", cap, "--http-processes", processes]
    assert parse_config(argv).http.max_connections == each


def test_tls_files_are_loaded_into_a_context_at_parse_time(tmp_path):
    trustme = pytest.importorskip("trustme")
    issued = trustme.CA().issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(certfile))
    issued.private_key_pem.write_to_path(str(keyfile))
    config = parse_config(["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)])
    assert config.tls is not None
    assert (config.tls.certfile, config.tls.keyfile) == (str(certfile), str(keyfile))
    assert isinstance(config.ssl_context, ssl.SSLContext)
    assert config.ssl_context is config.tls.context


@pytest.mark.parametrize(
    ("given", "mode"),
    [(None, None), ("CLS", "cls"), ("last-token", "lasttoken"), ("splade", "splade")],
)
def test_pooling_is_read_in_sentence_transformers_words_and_tei_s(monkeypatch, given, mode):
    if given is not None:
        monkeypatch.setenv("RAWSERVE_POOLING", given)
    assert parse_config([]).pooling == mode


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([*ECHO, "--model", "org/name"], {}, "--handler serves its own callable"),
        (["--engine", "tensorrt"], {}, "--engine must be torch, onnx or auto"),
        (["--device", "gpu"], {}, "--device: invalid device 'gpu'"),
        (
            [],
            {"RAWSERVE_DEVICE": "gpu"},
            "device 'gpu': use auto, cpu, cuda, cuda:N or mps, "
            "comma-separated (set by RAWSERVE_DEVICE='gpu')",
        ),
        (["--device", "cuda:2"], {"CUDA_VISIBLE_DEVICES": "0,1"}, "CUDA_VISIBLE_DEVICES=0,1"),
        (["--max-batch-size", "0"], {}, "--max-batch-size must be positive"),
        (["--port", "-1"], {}, "--port must be from 0 (any free port) to 65535"),
        (["--port", "70000"], {}, "--port must be from 0 (any free port) to 65535"),
        (["--timeout", "nan"], {}, "argument --timeout: must be a finite number, not 'nan'"),
        (["--keepalive-timeout", "nan"], {}, "argument --keepalive-timeout: must be a finite"),
        ([], {"RAWSERVE_TIMEOUT": "inf"}, "RAWSERVE_TIMEOUT='inf': must be a finite number"),
        (["--grace", "ten"], {}, "argument --grace: not a number: 'ten'"),
        # taken, then every request after the first two was 500 (an overflow scheduling it)
        (["--timeout", "1e308"], {}, "--timeout must be at most 10,000,000"),
        (["--grace", "1e308"], {}, "--grace must be at most 10,000,000"),
        ([], {"RAWSERVE_KEEPALIVE_TIMEOUT": "1e20"}, "--keepalive-timeout must be at most"),
        (["--log-level", "verbose"], {}, "--log-level must be one of debug, info, warning"),
        # each line names the option at fault alone: an empty RAWSERVE_API_KEY was told
        # "--max-connections must not be negative and --api-key not empty"
        (["--grace", "-1"], {}, "--grace must not be negative"),
        (["--batch-timeout", "0"], {}, "--batch-timeout must be positive"),
        (["--timeout", "0"], {}, "--timeout must be positive"),
        (["--max-batch-delay-ms", "-1"], {}, "--max-batch-delay-ms must not be negative"),
        (["--batching", "fifo"], {}, "--batching must be cost or count"),
        (["--max-timeout", "0"], {}, "--max-timeout must be positive"),
        (["--write-timeout", "0"], {}, "--write-timeout must be positive"),
        (["--max-connections", "-1"], {}, "--max-connections must not be negative"),
        (["--api-key", ""], {}, "--api-key must not be empty"),
        ([], {"RAWSERVE_API_KEY": ""}, "error: --api-key must not be empty"),
        (["--log-format", "xml"], {}, "--log-format must be one of text, json"),
        (["--chat-template", "/nonexistent.jinja"], {}, "--chat-template: cannot read"),
        (["--ssl-keyfile", "/nonexistent/key.pem"], {}, "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "/nonexistent/c.pem"], {}, "keyfile: no such file: /nonexistent/c.pem"),
        (["--cors-allow-origin", "https://a.example/"], {}, "is not an origin"),
        # it ended "(no path) (one a flag) (set by ...)": the value's one source, said once
        (
            [],
            {"RAWSERVE_CORS_ALLOW_ORIGIN": "http://a/b"},
            "(no path) (set by RAWSERVE_CORS_ALLOW_ORIGIN='http://a/b')",
        ),
        ([], {"RAWSERVE_PORT": "eighty"}, "RAWSERVE_PORT='eighty': not a whole number"),
        ([], {"RAWSERVE_NO_WARMUP": "maybe"}, "RAWSERVE_NO_WARMUP must be one of"),
        # each failed in every worker after the server listened, or was silently misread
        (["--dtype", "float8"], {}, "--dtype must be auto, float32, float16 or bfloat16"),
        (["--dtype", "int8"], {}, "--dtype must be auto, float32, float16 or bfloat16"),
        ([], {"RAWSERVE_DTYPE": "fp16"}, "--dtype must be auto, float32, float16 or bfloat16"),
        (["--threads", "-2"], {}, "--threads must be positive"),
        (["--threads", "0"], {}, "--threads must be positive"),
        (["--threads", "99999"], {}, "--threads must be from 1 to "),  # the worker crashed
        (["--max-batch-tokens", "0"], {}, "--max-batch-tokens must be positive"),
        (["--max-sequences", "0"], {}, "--max-sequences must be positive"),
        (["--join-wait-steps", "-1"], {}, "--join-wait-steps must not be negative"),
        # a request asking for 20 s would have been given 10, one asking none 30
        (["--max-timeout", "10"], {}, "--max-timeout (10 s) must not be below --timeout (30 s"),
        ([], {"RAWSERVE_TIMEOUT": "60", "RAWSERVE_MAX_TIMEOUT": "45"}, "(45 s) must not be below"),
        # huggingface_hub's own, read by int() as it is imported: its traceback, before
        ([], {"HF_HUB_ETAG_TIMEOUT": "abc"}, "HF_HUB_ETAG_TIMEOUT='abc': not a whole number of"),
        ([], {"HF_HUB_DOWNLOAD_TIMEOUT": "2.5"}, "HF_HUB_DOWNLOAD_TIMEOUT='2.5': not a whole"),
        # each refused by every worker once it had imported torch, after the server listened
        (["--engine", "onnx", "--device", "cpu,cuda:1"], {}, "CPU only, not on cuda:1"),
        (["--engine", "onnx", "--device", "cpu", "--dtype", "bfloat16"], {}, "float32 here, not"),
        (["--pooling", "first"], {}, "--pooling must be one of cls, lasttoken, max, mean"),
        (["--pooling", "splade", *ECHO], {}, "--handler serves its own callable: --pooling"),
        (["--download-only", *ECHO], {}, "--download-only fetches a model: a --handler has"),
        # a URL's credentials never echoed (the review)
        (
            ["--model", "https://user:secret@huggingface.co/org/st"],
            {},
            "--model 'https://<credentials>@huggingface.co/org/st': a URL is not a model id",
        ),
        # an empty value (a variable that expanded to nothing) read as the option left out:
        # plain HTTP where TLS was meant, the default model where a handler was
        *[
            ([flag, value], {}, f"argument {flag}: empty (leave the option out")
            for flag in ("--ssl-certfile", "--handler", "--task", "--device", "--pooling")
            for value in ("", " ")
        ],
        (["--chat-template", ""], {}, "argument --chat-template: empty"),
    ],
)
def test_an_invalid_command_line_is_refused_with_a_clear_line(
    monkeypatch, capsys, argv, env, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        parse_config(argv)
    assert exited.value.code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.startswith("rawserve: error: ") and message in line


@pytest.mark.parametrize(
    ("devices", "torch_version", "refused"),
    [
        (("cuda:7",), "2.13.0+cpu", "--device cuda:7: torch 2.13.0+cpu is a build without CUDA"),
        (("cpu", "cuda:1"), "2.13.0+cpu", "--device cuda:1"),
        (("cuda:0",), "2.13.0", None),  # PyPI's Linux build has CUDA
        (("cuda:0",), "2.13.0+cu128", None),
        (("cpu",), "2.13.0+cpu", None),
        (None, "2.13.0+cpu", None),  # the default layout: auto, the CPU where torch is
    ],
)
def test_a_gpu_the_installed_torch_cannot_have_is_refused_before_the_server_listens(
    devices, torch_version, refused
):
    """A CPU build of torch, known from its version without importing it: the server
    bound its port, said "on a GPU: up to 256 items", and every worker refused it 11-14 s
    later (a tester)."""
    said = device_unservable(devices, torch_version)
    assert said == refused if refused is None else said is not None and refused in said


def test_an_apple_gpu_off_macos_is_refused_before_the_server_listens(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert "macOS only" in (device_unservable(("mps",), "2.13.0") or "")


# rawserve in a process of its own whose torch reads as a CPU build, whatever is installed
AS_CPU_TORCH = (
    "import sys; from rawserve.shared import installed; found = installed.version; "
    "installed.version = lambda name: '2.13.0+cpu' if name == 'torch' else found(name); "
    "from rawserve.main import main; sys.exit(main(sys.argv[1:]))"
)


def started_with_a_cpu_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AS_CPU_TORCH, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_a_gpu_the_installed_torch_cannot_have_stops_the_start_with_one_line(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = started_with_a_cpu_torch("--device", "cuda:7", "--port", str(port))
    assert started.returncode == 1
    [line] = [line for line in started.stderr.splitlines() if "ERROR" in line]
    assert "--device cuda:7: torch" in line and "is a build without CUDA" in line
    assert line.endswith("serve with --device cpu")  # typed: no variable named
    assert "listening" not in started.stderr
    monkeypatch.setenv("RAWSERVE_DEVICE", "cuda:7")  # (a deployment's, not typed)
    started = started_with_a_cpu_torch("--port", str(port))
    [line] = [line for line in started.stderr.splitlines() if "ERROR" in line]
    assert line.endswith("serve with --device cpu (set by RAWSERVE_DEVICE='cuda:7')"), line
    monkeypatch.delenv("RAWSERVE_DEVICE")
    # a download fills a cache for a GPU machine from one without (the README's way)
    downloaded = started_with_a_cpu_torch("--download-only", "--device", "cuda:7")
    assert downloaded.returncode == 0, downloaded.stderr[-2000:]


def said_not_applied(*argv: str) -> list[str]:
    """The lines of a `--download-only` start with `argv` that say an option is not
    applied."""
    started = subprocess.run(
        [sys.executable, "-m", "rawserve", "--download-only", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert started.returncode == 0, started.stderr[-2000:]
    return [line for line in started.stderr.splitlines() if "not applied" in line]


def test_generation_options_beside_no_text_generation_model_are_said_not_applied():
    """As beside a handler: taken silently, they looked honoured (a reader)."""
    [line] = said_not_applied("--generation", "static", "--max-sequences", "4")
    assert "--generation, --max-sequences apply to text-generation models" in line


def test_continuous_options_beside_static_generation_are_said_not_applied(tiny_model):
    """--max-sequences and --join-wait-steps with --generation static were taken silently
    (/info's max_sequences 0): a tester read them as honoured."""
    model = ["--model", str(tiny_model("text-generation"))]
    both = ["--max-sequences", "4", "--join-wait-steps", "2"]
    [line] = said_not_applied(*model, "--generation", "static", *both)
    assert "--max-sequences, --join-wait-steps apply to --generation continuous" in line
    assert said_not_applied(*model, *both) == []
    assert said_not_applied(*model, "--generation", "static") == []


def test_the_workers_per_core_are_planned_once_the_models_are_known(monkeypatch):
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)
    workers = plan_workers(parse_config(ECHO).model, [handler_plan()], cores=3)
    assert workers.devices == ("cpu",) * 3 and workers.threads == 1
    assert workers.share_cores and workers.chosen and "one per core" in workers.layout


@pytest.mark.parametrize(
    ("argv", "models", "threads"),
    [
        (["--device", "cpu,cpu"], 1, 4),  # the 8 cores split between 2 workers
        (["--device", "cpu,cpu"], 2, 2),  # every model has a worker per device
        (["--device", "cuda:0"], 2, 8),  # GPU workers: their threads feed the GPU
        (["--device", "cpu", "--threads", "3"], 1, 3),  # --threads: as given
    ],
)
def test_threads_per_worker_split_the_cores_between_cpu_workers(monkeypatch, argv, models, threads):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))  # --threads 3 fits
    model = parse_config(argv).model
    plans = [handler_plan(f"m{index}") for index in range(models)]
    workers = plan_workers(model, plans, cores=8)
    assert workers.devices == model.devices and workers.threads == threads
    assert workers.share_cores is (model.threads is None)
    assert workers.layout == f"--device {argv[1]}" and not workers.chosen


def test_a_model_s_workers_and_its_info_are_built_from_the_typed_configuration():
    config = parse_config(["--device", "cpu", "--max-batch-size", "8", "--timeout", "12"])
    plan = handler_plan()
    workers = plan_workers(config.model, [plan], cores=2)
    given = worker_config(plan, config.model, workers, name="echo")
    assert (given.handler, given.threads, given.warmup_batch, given.name) == (
        "tests.handlers:echo",
        2,
        8,
        "echo",
    )
    cold = parse_config(["--device", "cpu", "--no-warmup"])
    assert worker_config(plan, cold.model, workers).warmup_batch == 0
    facts = model_facts(plan, config, workers)
    assert (facts["devices"], facts["layout"], facts["threads_per_worker"]) == (
        ["cpu"],
        "--device cpu",
        2,
    )
    assert facts["requested_engine"] == "auto" and facts["warmup"] is False  # not warmed
    assert facts["task"] is None  # a handler says nothing of itself before it loads
    folder = ModelPlan(("emb",), "/m", "/m", facts=FolderFacts("feature-extraction"))
    folder_facts = model_facts(folder, config, workers)
    assert folder_facts["task"] == "feature-extraction" and folder_facts["warmup"] is True
    assert facts["batching"] == {
        "mode": "cost",  # (--batching: it was in neither /info nor the log)
        "max_batch_size": 8,
        "max_batch_delay_ms": 0.0,
        "max_batch_tokens": None,
        "limits": "on the CPU: up to 8 items (as given), no token budget",
        "max_queue": 256,
        "timeout_seconds": 12.0,
    }
    assert "generation" not in facts and "generation" not in folder_facts  # not generating


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], {"requested_mode": "continuous", "join_wait_steps": 0}),
        (["--join-wait-steps", "3"], {"requested_mode": "continuous", "join_wait_steps": 3}),
        # a static batch has no steps to wait: nothing said of them
        (["--join-wait-steps", "3", "--generation", "static"], {"requested_mode": "static"}),
    ],
)
def test_info_says_how_a_generation_model_is_asked_to_batch(argv, said):
    config = parse_config(["--device", "cpu", *argv])
    plan = ModelPlan(("lm",), "/m", "/m", facts=FolderFacts("text-generation"))
    workers = plan_workers(config.model, [plan], cores=2)
    assert model_facts(plan, config, workers)["generation"] == said


@pytest.mark.parametrize("http_processes", ["1", "2"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "reuse_port"])
def test_a_port_in_use_stops_the_server_with_a_clear_line_not_a_traceback(http_processes, shared):
    """`shared`: the port is held as another server's HTTP processes hold it (with
    SO_REUSEPORT), which a second server must not join and split its clients with."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(shared))
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [*ECHO, "--host", "127.0.0.1", "--port", str(port)]
        done = run_python("-m", "rawserve", *argv, "--http-processes", http_processes)
    assert done.returncode == 1, done.stderr[-2000:]
    said = f"ERROR cannot listen on 127.0.0.1 port {port}: Address already in use\n"
    assert said in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract names")
def test_two_servers_started_at_once_cannot_both_reserve_one_port():
    """Two sockets with SO_REUSEADDR bind one port while neither listens: two servers
    with HTTP processes started at the same instant both came up on it (the kernel then
    split the clients between them). The port's claim is held by one process only, and
    let go with it."""
    first = reserve_port("127.0.0.1", 0)
    port = first.port
    try:
        with pytest.raises(OSError) as refused:
            reserve_port("127.0.0.1", port)
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        first.close()
    again = reserve_port("127.0.0.1", port)  # a server stopped: the next takes it
    again.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract names")
def test_a_port_claim_is_of_its_host_and_port_both():
    """The claim names the address and the port: two servers on one host at two ports,
    or at one port on two addresses, each hold their own."""
    first = reserve_port("127.0.0.1", 0)
    try:
        second = reserve_port("127.0.0.1", 0)  # another port
        second.close()
        other_address = reserve_port("127.0.0.2", first.port)
        other_address.close()
    finally:
        first.close()


def test_the_reserved_port_takes_the_http_processes_and_no_time_wait_holds_it():
    """What the HTTP processes need of the reserved port: each listens on it beside the
    reservation (SO_REUSEPORT, as asyncio's reuse_port sets it); and a connection a server
    just stopped left in TIME_WAIT does not keep the next server from it (SO_REUSEADDR)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: it is the one left waiting
    client.close()
    listener.close()
    reserved = reserve_port("127.0.0.1", port)
    try:
        process = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        process.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        process.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        process.bind(("127.0.0.1", port))
        process.listen()
        process.close()
    finally:
        reserved.close()


SIGTERM_WHILE_FINDING_THE_MODEL = """
import os, signal, sys, time
import rawserve.main

def downloading(*args, **kwargs):  # a Hub download, stopped by the orchestrator
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)

rawserve.main.plan_models = downloading
raise SystemExit(rawserve.main.main(sys.argv[1:]))
"""


def test_sigterm_while_the_model_is_found_stops_the_start():
    """A container's PID 1 (the Dockerfile's entry point, no init) is never ended by a
    signal left at its default action: SIGTERM before the server's own handlers (a stop
    during a model's download) was ignored there until the SIGKILL after it. It stops
    the start as Ctrl-C does, in a container or not."""
    done = run_python("-c", SIGTERM_WHILE_FINDING_THE_MODEL, *ECHO, "--port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


SIGHUP_UNDER_NOHUP_WHILE_FINDING_THE_MODEL = """
import os, signal, sys, time
import rawserve.main

def downloading(*args, **kwargs):  # a Hub download, the terminal closed meanwhile
    os.kill(os.getpid(), signal.SIGHUP)
    time.sleep(0.5)
    raise SystemExit(7)  # the start went on: it outlived its terminal

signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
rawserve.main.plan_models = downloading
raise SystemExit(rawserve.main.main(sys.argv[1:]))
"""


def test_sighup_under_nohup_while_the_model_is_found_leaves_the_start_going():
    """Under nohup, a terminal closed during a Hub download stopped the start ("SIGHUP
    received while the models were being found"), where it was to outlive it."""
    done = run_python("-c", SIGHUP_UNDER_NOHUP_WHILE_FINDING_THE_MODEL, *ECHO, "--port", "0")
    assert done.returncode == 7, done.stderr[-2000:]
    assert "SIGHUP" not in done.stderr


def test_any_signal_within_a_second_of_the_first_is_the_same_stop(monkeypatch):
    """Within a second, a second signal is the first delivered again: `make` forwards the
    SIGTERM its process group got, and a wrapper turns a terminal's Ctrl-C (SIGINT to
    the group) into a SIGTERM to its child; a later one exits at once."""
    import rawserve.main as server_main

    exits: list[int] = []
    killed: list[str] = []
    now = [100.0]
    monkeypatch.setattr(server_main.os, "_exit", exits.append)
    monkeypatch.setattr(server_main, "kill_leftover_children", lambda: None)
    monkeypatch.setattr(server_main.time, "monotonic", lambda: now[0])

    class Executor:
        def kill(self) -> None:
            killed.append("worker")

    stop = server_main.Stop(30.0, [Executor()])  # type: ignore[list-item]
    stop.on_signal(signal.SIGINT)
    assert stop.asked.is_set() and not exits
    now[0] += 0.001
    stop.on_signal(signal.SIGTERM)  # the wrapper's, for the same Ctrl-C
    assert not exits and not killed
    now[0] += server_main.SIGNAL_REPEAT_SECONDS
    stop.on_signal(signal.SIGTERM)
    assert exits == [1] and killed == ["worker"]


SIGNAL_AT_A_STEP = """
import os, signal, sys
# as a terminal leaves them: a shell's background job (the tests run as one) ignores
# SIGINT, and nohup SIGHUP, which the server then leaves ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
import rawserve.__main__  # its signal handlers, as `python -m rawserve` starts
import rawserve.main

step = getattr(rawserve.main, sys.argv[1])

def signalled(*args, **kwargs):  # the signal arrives just after the step
    done = step(*args, **kwargs)
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    return done

setattr(rawserve.main, sys.argv[1], signalled)
raise SystemExit(rawserve.main.main(sys.argv[3:]))
"""


@pytest.mark.parametrize(
    ("step", "stop"),
    [("parse_config", "SIGTERM"), ("setup_logging", "SIGHUP"), ("plan_workers", "SIGINT")],
)
def test_a_stop_between_the_steps_of_the_start_ends_it_with_code_1(step, stop):
    """Between the steps of the start, outside the model's finding and the serving, a
    stop ended the process with a traceback and SIGINT's exit status (130), not 1."""
    done = run_python("-c", SIGNAL_AT_A_STEP, step, stop, *ECHO, "--port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "stopped while starting" in done.stderr


def test_main_alone_stops_its_start_on_sighup_as_the_command_does():
    """`main()` called without `python -m rawserve` (as a program embedding it does) set
    SIGTERM's handler for the start, not SIGHUP's: a terminal closed then killed the
    process without a word (a reader)."""
    script = SIGNAL_AT_A_STEP.replace("import rawserve.__main__", "pass")
    done = run_python("-c", script, "plan_workers", "SIGHUP", *ECHO, "--port", "0")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "stopped while starting" in done.stderr


EMBEDDED_MAIN = """
import signal
def mine(signum, frame):
    pass
signal.signal(signal.SIGHUP, mine)
signal.signal(signal.SIGTERM, mine)
from rawserve.main import main
code = main(["--download-only"])
print(code, signal.getsignal(signal.SIGHUP) is mine, signal.getsignal(signal.SIGTERM) is mine)
"""


def test_main_gives_back_the_signal_handlers_it_found():
    """A program that runs the server in its own process kept the start's handlers for
    SIGTERM and SIGHUP (Ctrl-C's) after `main()` returned (a reviewer)."""
    done = run_python("-c", EMBEDDED_MAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "True", "True"]


SIGTERM_WHILE_IMPORTING = """
import os, runpy, signal, sys

class StoppedWhileImporting:  # the orchestrator's SIGTERM as the server's modules load
    def find_spec(self, name, path=None, target=None):
        if name == "rawserve.main":
            os.kill(os.getpid(), signal.SIGTERM)

sys.meta_path.insert(0, StoppedWhileImporting())
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_while_the_server_s_modules_are_imported_stops_the_start(signum):
    """`python -m rawserve` as a container's PID 1: a SIGTERM in the half second its
    modules take to import was ignored, and the server went on to serve until the
    SIGKILL after it; a SIGHUP then (a terminal closed) killed it without a word. Each
    stops the start from the command's first line, as Ctrl-C does."""
    script = (
        SIGTERM_WHILE_IMPORTING.replace("signal.SIGTERM", f"signal.{signum.name}")
        # a terminal's SIGHUP: where the tests run under nohup, it would stay ignored
        + "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        + 'runpy.run_module("rawserve", run_name="__main__", alter_sys=True)\n'
    )
    done = run_python("-c", script, *ECHO, "--port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_sigterm_while_the_rawserve_command_s_modules_are_imported_stops_the_start():
    """The `rawserve` command's script (pip's, for the entry point) imported rawserve.main
    before any line of rawserve set SIGTERM: as a container's PID 1 the stop was lost
    there as it was for `python -m rawserve`. It stops the start as that one does."""
    project = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]
    module, _, function = project["scripts"]["rawserve"].partition(":")
    # what pip writes for the entry point
    script = f"{SIGTERM_WHILE_IMPORTING}from {module} import {function}\nsys.exit({function}())\n"
    done = run_python("-c", script, *ECHO, "--port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_hub_variable_huggingface_hub_cannot_read_is_one_line_not_its_traceback():
    """huggingface_hub reads HF_HUB_ETAG_TIMEOUT as it is imported: the command's own
    imports must leave it until the command line is checked."""
    done = run_python(
        "-m", "rawserve", "--model", "org/name", "--download-only", HF_HUB_ETAG_TIMEOUT="abc"
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (
        "rawserve: error: HF_HUB_ETAG_TIMEOUT='abc': not a whole number of seconds from 1 "
        "to 2147483647\n"
    )


def test_engine_onnx_refuses_a_generation_model_before_any_worker_starts(tmp_path):
    """The refusal came from each worker as it loaded, once the server listened; the
    folder's task says it before then."""
    model = tmp_path / "gen"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    for name in ("tokenizer.json", "model.safetensors"):
        (model / name).write_text("{}")
    argv = ["--model", str(model), "--engine", "onnx", "--device", "cpu", "--port", "0"]
    done = run_python("-m", "rawserve", *argv, HF_HUB_OFFLINE="1")
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert line.endswith(
        "ERROR model gen: --engine onnx: ONNX Runtime serves the encoder tasks, not text-generation"
    )
    assert "worker 0: started" not in done.stderr


READ_ONLY_SHARED_MEMORY = """
import errno, sys, tempfile

made = tempfile.mkstemp
refused_prefix = sys.argv.pop(1)

def refused(*args, prefix=None, **kwargs):  # /dev/shm mounted read-only
    if prefix and prefix.startswith(refused_prefix):
        raise OSError(errno.EROFS, "Read-only file system", f"/dev/shm/{prefix}refused")
    return made(*args, prefix=prefix, **kwargs)

tempfile.mkstemp = refused
from rawserve.main import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("http_processes", "refused"),
    [("1", "pym-"), ("2", "rawserve-board-")],
    ids=["worker-flags", "http-board"],
)
def test_shared_memory_that_cannot_be_made_stops_the_server_with_one_line(http_processes, refused):
    """A read-only or full /dev/shm: the workers' stop flags (multiprocessing's `pym-`
    files) or the HTTP processes' board cannot be made, so the server stops at once with
    one line naming the folder, not a traceback, nor a "cannot listen" that blames the
    port."""
    argv = [*ECHO, "--device", "cpu", "--port", "0", "--http-processes", http_processes]
    done = run_python("-c", READ_ONLY_SHARED_MEMORY, refused, *argv)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "ERROR cannot make shared memory in /dev/shm (Read-only file system)" in done.stderr
    assert "Traceback" not in done.stderr and "cannot listen" not in done.stderr


NO_PROCESS_FOR_HTTP = """
import errno, multiprocessing.context, sys

spawn = multiprocessing.context.SpawnProcess.start

def refused(process):  # out of processes (ulimit -u) as the HTTP processes start
    if process.name.startswith("rawserve-http"):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    spawn(process)

multiprocessing.context.SpawnProcess.start = refused
from rawserve.main import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_an_http_process_the_system_refuses_stops_the_server_saying_so():
    """It said "cannot listen on 127.0.0.1 port N: Resource temporarily unavailable",
    blaming the port."""
    argv = [*ECHO, "--device", "cpu", "--port", "0", "--http-processes", "2"]
    done = run_python("-c", NO_PROCESS_FOR_HTTP, *argv)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "ERROR an HTTP process could not be started ([Errno 11] Resource" in done.stderr
    assert "Traceback" not in done.stderr and "cannot listen" not in done.stderr


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("http_processes", ["1", "2"])
def test_an_ipv6_host_serves_and_the_log_gives_its_url_with_brackets(http_processes):
    args = [*ECHO, "--host", "::1", "--http-processes", http_processes]
    with RunningServer(args) as server:
        [line] = [line for line in server.lines if "listening on" in line]
        assert f"listening on http://[::1]:{server.port} " in line  # a URL a client can use
        connection = http.client.HTTPConnection("::1", server.port, timeout=30)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        connection.close()


@pytest.mark.parametrize(
    ("argv", "fetched"),
    [
        (["--device", "cpu"], True),  # --engine auto: ONNX Runtime may win the trial
        (["--device", "cpu", "--engine", "onnx"], True),
        (["--device", "cpu", "--engine", "torch"], False),
        (["--device", "cuda:0"], False),
        (["--device", "mps"], False),  # the worker runs torch there: the graph is unused
        (["--device", "cpu", "--dtype", "bfloat16"], False),
    ],
)
def test_a_repo_s_onnx_graph_is_fetched_only_where_the_onnx_engine_may_run(argv, fetched):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    assert parse_config(argv).model.onnx_graphs is fetched


def test_a_closed_terminal_drains_the_server_unless_nohup_keeps_it_running():
    """SIGHUP (a terminal closed, to the whole process group) killed every process at once,
    its answers in flight lost: it drains as SIGTERM does. Ignored, as `nohup` leaves it,
    it is left ignored: the server outlives its terminal."""
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert stop_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert stop_signals() == (signal.SIGTERM, signal.SIGINT)
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_variable_that_nearly_names_an_option_is_said_at_start():
    """A mistyped flag is refused; a mistyped variable was ignored without a word, its
    setting looking applied. Variables that name no option at all (a handler's own, the
    cache folder's) are left alone."""
    from rawserve.options import misspelled_variables

    environ = {
        "RAWSERVE_MAX_QUEU": "5",
        "RAWSERVE_MAX_QUEUE": "6",
        "RAWSERVE_TIMOUT": "3",
        "RAWSERVE_CACHE_DIR": "/tmp/cache",
        "RAWSERVE_MY_HANDLER_SETTING": "x",
        "PATH": "/bin",
    }
    assert misspelled_variables(environ) == [
        "RAWSERVE_MAX_QUEU is set but names no option (ignored): RAWSERVE_MAX_QUEUE?",
        "RAWSERVE_TIMOUT is set but names no option (ignored): RAWSERVE_TIMEOUT?",
    ]
    assert misspelled_variables({"RAWSERVE_PORT": "8000"}) == []
    # two letters swapped, a name cut short: typos as likely as a letter left out
    assert misspelled_variables({"RAWSERVE_API_KYE": "k", "RAWSERVE_MAX_BATCH": "8"}) == [
        "RAWSERVE_API_KYE is set but names no option (ignored): RAWSERVE_API_KEY?",
        "RAWSERVE_MAX_BATCH is set but names no option (ignored): RAWSERVE_MAX_BATCH_SIZE?",
    ]


def test_sagemaker_s_serve_finds_the_model_as_hugging_face_s_images_do(monkeypatch, tmp_path):
    """A SageMaker endpoint made for TGI's or TEI's image names its model in HF_MODEL_ID
    (HF_MODEL_REVISION, HF_TASK), or ships its files to /opt/ml/model: `serve` served the
    packaged default model instead."""
    from rawserve.options import sagemaker_model

    for name in ("RAWSERVE_MODEL", "RAWSERVE_REVISION", "RAWSERVE_TASK", "RAWSERVE_HANDLER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_MODEL_ID", "BAAI/bge-small-en-v1.5")
    monkeypatch.setenv("HF_MODEL_REVISION", "v1")
    monkeypatch.setenv("HF_TASK", "sentence-embeddings")  # (the inference toolkit's name)
    config = parse_config(["serve"])
    assert (config.models, config.revision, config.task) == (
        ("BAAI/bge-small-en-v1.5",),
        "v1",
        "feature-extraction",
    )
    assert parse_config([]).models == ()  # (only `serve` reads SageMaker's variables)
    given = parse_config(["serve", "--model", "org/mine", "--revision", "v2"])
    assert (given.models, given.revision) == (("org/mine",), "v2")
    # a handler's code is the model (it may read /opt/ml/model itself): a start that
    # failed as though --model had been given beside it
    handled = parse_config(["serve", *ECHO])
    assert (handled.models, handled.handler, handled.task) == ((), "tests.handlers:echo", None)
    monkeypatch.setenv("HF_MODEL_ID", str(tmp_path))  # a folder: no revision for it
    assert parse_config(["serve"]).revision is None
    monkeypatch.setenv("RAWSERVE_MODEL", "org/theirs")
    assert parse_config(["serve"]).models == ("org/theirs",)
    # no name: the files SageMaker unpacked, where there are some
    for name in ("RAWSERVE_MODEL", "HF_MODEL_ID", "HF_MODEL_REVISION", "HF_TASK"):
        monkeypatch.delenv(name)
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(model=None, revision=None, task=None, handler=None)
    sagemaker_model(args, parser, tmp_path)
    assert args.model is None  # an empty /opt/ml/model: the default model, as ever
    (tmp_path / "config.json").write_text("{}")
    sagemaker_model(args, parser, tmp_path)
    assert args.model == [str(tmp_path)]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        # a tarball whose model is a folder inside: the default model answered for it
        ({}, "holds files but no model at its top (its config.json)"),
    ],
)
def test_sagemaker_s_model_that_cannot_be_served_stops_serve_saying_why(
    monkeypatch, capsys, tmp_path, env, message
):
    from rawserve.options import sagemaker_model

    for name in ("RAWSERVE_MODEL", "HF_MODEL_ID", "HF_TASK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "config.json").write_text("{}")
    args = argparse.Namespace(model=None, revision=None, task=None, handler=None)
    with pytest.raises(SystemExit):
        sagemaker_model(args, argparse.ArgumentParser(prog="rawserve"), tmp_path)
    assert message in capsys.readouterr().err


def test_sagemaker_s_task_not_served_is_refused_where_a_task_option_is(monkeypatch, tmp_path):
    """HF_TASK stands in for --task: one not served was argparse's exit 2 where --task's
    and RAWSERVE_TASK's are an ERROR line and exit 1, as README says (a probe keyed on
    the exit code saw two answers to one mistake)."""
    from rawserve.options import sagemaker_model

    monkeypatch.setenv("HF_MODEL_ID", "org/name")
    monkeypatch.setenv("HF_TASK", "bogus")
    args = argparse.Namespace(model=None, revision=None, task=None, handler=None)
    sagemaker_model(args, argparse.ArgumentParser(prog="rawserve"), tmp_path)
    assert args.task == "bogus"  # (what --task bogus gives the model's folder to refuse)


def test_sagemaker_s_task_without_a_model_stops_serve_not_serving_the_default(
    monkeypatch, capsys, tmp_path
):
    from rawserve.options import sagemaker_model

    for name in ("RAWSERVE_MODEL", "HF_MODEL_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TASK", "frob")
    args = argparse.Namespace(model=None, revision=None, task=None, handler=None)
    with pytest.raises(SystemExit):
        sagemaker_model(args, argparse.ArgumentParser(prog="rawserve"), tmp_path / "none")
    assert "HF_TASK='frob' names a task but no model: set HF_MODEL_ID" in capsys.readouterr().err
    monkeypatch.delenv("HF_TASK")
    sagemaker_model(args, argparse.ArgumentParser(prog="rawserve"), tmp_path / "none")
    assert args.model is None  # nothing named: the default model, as ever


def test_sagemaker_s_serve_command_serves_on_its_port(monkeypatch, capsys):
    """SageMaker starts a container as `docker run IMAGE serve` and calls it on 8080 (or the
    port SAGEMAKER_BIND_TO_PORT names); a port given otherwise still wins."""
    monkeypatch.delenv("RAWSERVE_PORT", raising=False)
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    assert parse_config(["serve"]).port == 8080
    assert parse_config(["serve", "--max-batch-size", "8"]).model.max_batch_size == 8
    assert parse_config(["serve", "--port", "9000"]).port == 9000
    assert parse_config(["serve", "--port=9001"]).port == 9001
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "8081")
    assert parse_config(["serve"]).port == 8081
    monkeypatch.setenv("RAWSERVE_PORT", "7000")
    assert parse_config(["serve"]).port == 7000
    assert parse_config([]).port == 7000  # (no `serve`: as ever)
    monkeypatch.delenv("RAWSERVE_PORT")
    for wrong in ("eighty", "70000", "0"):  # 70000 was blamed on a --port nobody typed
        monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", wrong)
        with pytest.raises(SystemExit):
            parse_config(["serve"])
        said = capsys.readouterr().err
        assert f"SAGEMAKER_BIND_TO_PORT={wrong!r}: not a port number" in said, said
    with pytest.raises(SystemExit):  # the word only leads: elsewhere it is no option
        parse_config(["--max-batch-size", "8", "serve"])


def test_cannot_listen_says_the_os_error_s_words_and_an_address_lookup_s():
    """asyncio's sentence carried the errno's words after its own; an address lookup's
    errno is below 0, and its own words are the lookup's ("Unknown error -2" otherwise)."""
    from rawserve.main import reason

    bind = OSError(errno.EADDRINUSE, "error while attempting to bind on address ('h', 1)")
    assert reason(bind) == "Address already in use"
    assert reason(socket.gaierror(-2, "Name or service not known")) == "Name or service not known"

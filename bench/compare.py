"""One command: the ceiling, rawserve and the seed's servers, one after the other, same load.

    python -m bench.compare            # everything, about 8 minutes on 2 cores
    python -m bench.compare --record   # ... and write the Performance section of RESULTS.md
    python -m bench.compare --quick    # a shorter run, to try things out
    python -m bench.compare --device cuda --scenarios classification --text-sets short
                                       # on a GPU: the ceiling at batch 1-1024 in float16,
                                       # rawserve (single texts, lists of 32), the seed's

For each model (a 2-label classifier and token-level embeddings, both all-MiniLM-L6-v2):
1. the ceiling, in a process of its own with nothing else running (bench.ceiling);
2. each server in turn, started fresh, warmed up, then closed-loop runs at 1, 4, 16 and 64
   clients on each text set, with a GET /health prober alongside the 64-client run;
3. for rawserve, an open-loop run at 3x the capacity it just showed.
Then a table of ratios to the ceiling and to the seed's server, the raw figures as JSON
(`--json`), and a picture of throughput against p99 latency beside it, named after it
(`encoders.png` beside `encoders.json`; for the tracked figures and with `--record`,
bench/throughput_vs_p99.png, the one RESULTS.md shows). It exits 1 when a server it was
asked for measured nothing (that server's last log lines are in its own output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import load, servers, spread
from bench.models import BUILDERS, Scenario, scenarios
from bench.workloads import RAW_TEXT, BodyFormat, texts

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_JSON = BENCH_DIR / "results.json"  # tracked, as the picture RESULTS.md shows
CLIENT_COUNTS = (1, 4, 16, 64)
SATURATION_CLIENTS = 64
OVERLOAD_FACTOR = 3.0
OVERLOAD_DEADLINE = 2.0  # seconds, sent as X-Request-Timeout in the open-loop run
HEALTH_INTERVAL = 0.02
READY_TIMEOUT = 180.0
# rawserve's options for every variant (each adds its own: servers.RAWSERVE_VARIANTS)
RAWSERVE_ARGS = ""
OPENAI_MODEL = "all-MiniLM-L6-v2"  # the name the embeddings scenario sends (and serves)
DEFAULT_SERVERS = "rawserve,rawserve-onnx,rawserve-default,seed-batching,seed-per-item"
# on a GPU: the targets' clients (1, 64, 256) and the servers that run there
GPU_CLIENT_COUNTS = (1, 64, 256)
GPU_SERVERS = "rawserve,rawserve-default,rawserve-eager,rawserve-lists,seed-batching"
LIST_LENGTH = 32  # texts per request of rawserve-lists
# one Python client sends ~10,000 requests/s at most: on a GPU the load comes from several
GPU_CLIENT_PROCESSES = 4


@dataclass(frozen=True)
class Settings:
    duration: float  # seconds per closed-loop point
    saturation_duration: float  # seconds of the 64-client point
    warmup: float
    ceiling_seconds: float  # per ceiling point
    overload_duration: float
    client_counts: tuple[int, ...]
    servers: tuple[str, ...]
    scenarios: tuple[str, ...]
    rawserve_args: tuple[str, ...]
    tools: bool
    device: str = "cpu"  # cpu, or cuda[:N]: the ceiling, rawserve and the seed all run there
    client_processes: int = 1  # the load generator's processes (bench.spread)


FULL = dict(duration=5.0, saturation_duration=8.0, warmup=2.0, ceiling_seconds=1.2)
QUICK = dict(duration=2.0, saturation_duration=3.0, warmup=1.0, ceiling_seconds=0.5)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the ceiling ----------------------------------------------------------------------


def run_ceiling(scenario: Scenario, text_set: str, settings: Settings, work: Path) -> dict:
    modes = "forward,pipeline,onnx" if settings.device == "cpu" else "forward,pipeline"
    orders = "arrival,sorted" if text_set == "mixed" else "arrival"
    command = [
        sys.executable,
        "-m",
        "bench.ceiling",
        "--model",
        scenario.model,
        "--task",
        scenario.task,
        "--texts",
        text_set,
        "--modes",
        modes,
        "--orders",
        orders,
        "--min-seconds",
        str(settings.ceiling_seconds),
        "--device",
        settings.device,
    ]
    log(f"ceiling: {scenario.name}, {text_set} texts")
    with open(work / f"ceiling-{scenario.name}-{text_set}.log", "wb") as stderr:
        done = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=servers.base_env(),
            cwd=servers.REPO_ROOT,
            check=True,
            timeout=600,
        )
    found = json.loads(done.stdout)
    for mode, figures in found.items():  # in the log too: the JSON may not outlive the run
        if isinstance(figures, dict) and "curve" in figures:
            log(f"  {mode}: items/s by batch {figures['curve']}")
    return found


# --- one server -----------------------------------------------------------------------


def start_server(name: str, scenario: Scenario, settings: Settings, work: Path):
    log_path = work / f"{name}-{scenario.name}.log"
    if name in servers.RAWSERVE_VARIANTS:
        args = [
            *scenario.rawserve_args,
            *settings.rawserve_args,
            *servers.rawserve_args(name, settings.device),
        ]
        # the OpenAI route names the model: served under the name every server is sent
        model = f"{OPENAI_MODEL}={scenario.model}" if scenario.openai_embeddings else scenario.model
        return servers.rawserve(model, log_path, args, name=name).start()
    if name.startswith("infinity-"):
        from bench import infinity

        infinity.setup(log)
        return infinity.server(name.removeprefix("infinity-"), log_path).start()
    return servers.seed(name, scenario.model, scenario.task, log_path, settings.device).start()


def body_format(name: str, scenario: Scenario) -> BodyFormat:
    listed = LIST_LENGTH if name == "rawserve-lists" else 1
    if scenario.openai_embeddings:
        path = "/embeddings" if name.startswith("infinity-") else "/v1/embeddings"
        return BodyFormat(path=path, openai_model=OPENAI_MODEL, texts_per_request=listed)
    if name in servers.RAWSERVE_VARIANTS and scenario.rawserve_params is not None:
        return BodyFormat(scenario.rawserve_params, texts_per_request=listed)
    if listed > 1:
        return BodyFormat({}, texts_per_request=listed)
    return RAW_TEXT


BATCH_COUNTERS = (
    "rawserve_batch_size_count",
    "rawserve_batch_size_sum",
    "rawserve_batch_compute_seconds_sum",
    "rawserve_queue_seconds_sum",
)


def scrape(port: int) -> str:
    """rawserve's /metrics now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def batch_counters(port: int) -> dict[str, float]:
    """rawserve's batch counters now, every model and worker summed (from /metrics)."""
    text = scrape(port)
    found = dict.fromkeys(BATCH_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
    return found


def refusals(port: int) -> dict[str, float]:
    """rawserve's 503s so far by where they were decided (from /metrics): at the
    connection cap (before or after a request was read), or by the request's route (a
    full queue, a model not ready)."""
    unavailable = at_cap = 0.0
    for line in scrape(port).splitlines():
        if line.startswith("rawserve_requests_total{") and 'status="503"' in line:
            unavailable += float(line.rsplit(" ", 1)[1])
        elif line.startswith("rawserve_connections_refused_total "):
            at_cap += float(line.rsplit(" ", 1)[1])
    return {"connection_cap": at_cap, "routes": unavailable - at_cap}


def batch_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The mean batch of a point, its mean compute time and an item's mean wait in the
    queue: where a server's time goes (the rest of a request's is the hops)."""
    batches, items, seconds, waited = (after[key] - before[key] for key in BATCH_COUNTERS)
    if not batches:
        return {}
    return {
        "mean_batch": round(items / batches, 1),
        "mean_batch_ms": round(1e3 * seconds / batches, 2),
        "mean_queue_ms": round(1e3 * waited / items, 2),
    }


async def measure_server(
    server: servers.ServerProcess,
    scenario: Scenario,
    settings: Settings,
) -> dict[str, Any]:
    """Closed-loop points (and, for rawserve, overload) on each text set of `scenario`."""
    fmt = body_format(server.name, scenario)
    loaded = await load.wait_until_serving(
        server.port, load.build_requests(["warm up"], fmt)[0], READY_TIMEOUT, server.alive
    )
    result: dict[str, Any] = {"ready_seconds": round(loaded, 1), "text_sets": {}}
    for text_set in scenario.text_sets:
        requests = load.build_requests(texts(text_set), fmt)
        await load.warm_up(server.port, requests, settings.warmup)
        points = []
        for clients in settings.client_counts:
            saturated = clients == SATURATION_CLIENTS
            before, idle_before = servers.cpu_snapshot(server.pid), servers.idle_seconds()
            counted = server.name in servers.RAWSERVE_VARIANTS
            batches_before = batch_counters(server.port) if counted else None
            run = await spread.closed_loop(
                server.port,
                requests,
                clients,
                settings.saturation_duration if saturated else settings.duration,
                processes=settings.client_processes,
                health_interval=HEALTH_INTERVAL if saturated else None,
            )
            summary = run.summary()
            if fmt.listed:  # throughput counts items, as for every other server
                summary["requests_per_second"] = summary["throughput"]
                summary["throughput"] = round(summary["throughput"] * fmt.texts_per_request, 2)
            after = servers.cpu_snapshot(server.pid)
            summary.update(servers.cpu_shares(before, after, run.duration))
            # cores nobody used while clients waited (threads waiting on each other)
            summary["idle_cores"] = round((servers.idle_seconds() - idle_before) / run.duration, 3)
            if batches_before is not None:
                summary.update(batch_figures(batches_before, batch_counters(server.port)))
            points.append(summary)
            log(
                f"  {server.name:14} {scenario.name:16} {text_set:6} {clients:3} clients: "
                f"{summary['throughput']:7.1f}/s p50 {summary['p50_ms']} ms "
                f"p99 {summary['p99_ms']} ms {summary['statuses']} "
                f"batch {summary.get('mean_batch')} in {summary.get('mean_batch_ms')} ms "
                f"after {summary.get('mean_queue_ms')} ms queued; "
                f"cores: server {summary.get('server_cpu_share')}, workers "
                f"{summary.get('worker_cpu_share')}, client {summary.get('client_cpu_share')}, "
                f"idle {summary['idle_cores']}"
            )
        entry: dict[str, Any] = {"points": points}
        overloaded = server.name in ("rawserve", "rawserve-onnx", "rawserve-http4") or (
            server.name
            in ("rawserve-default", "rawserve-eager", "rawserve-threads2", "rawserve-connections")
            and settings.device != "cpu"
        )  # on a GPU: with graphs and without
        if overloaded and text_set == "short" and settings.overload_duration:
            entry["overload"] = await overload(server, text_set, fmt, points, settings)
        if settings.tools and text_set == "short":
            entry["tools"] = standard_tools(server.port, texts(text_set)[0], fmt)
        result["text_sets"][text_set] = entry
    result["rss_bytes"] = servers.rss_bytes(server.pid)
    return result


async def overload(
    server: servers.ServerProcess,
    text_set: str,
    fmt: BodyFormat,
    points: list[dict],
    settings: Settings,
) -> dict[str, Any]:
    capacity = max(point["throughput"] for point in points)
    rate = OVERLOAD_FACTOR * capacity
    requests = load.build_requests(texts(text_set), fmt, timeout_header=OVERLOAD_DEADLINE)
    before = servers.cpu_snapshot(server.pid)
    refused_before = refusals(server.port)
    run = await spread.open_loop(
        server.port,
        requests,
        rate,
        settings.overload_duration,
        processes=settings.client_processes,
        deadline=OVERLOAD_DEADLINE,
        health_interval=HEALTH_INTERVAL,
    )
    summary = run.summary()
    summary.update(servers.cpu_shares(before, servers.cpu_snapshot(server.pid), run.duration))
    summary["capacity"] = capacity
    refused_after = refusals(server.port)
    summary["refused"] = {key: refused_after[key] - refused_before[key] for key in refused_after}
    log(
        f"  {server.name:14} overload at {rate:.0f}/s: goodput {summary['goodput']}/s, "
        f"{summary['statuses']}, 503 p99 {summary.get('503', {}).get('p99_ms')} ms "
        f"({summary['refused']['connection_cap']:.0f} at the connection cap, "
        f"{summary['refused']['routes']:.0f} by route), late 200s {summary['late_200']}, "
        f"arrivals given up for want of a connection {summary['dropped_by_client']}"
    )
    return summary


def standard_tools(port: int, text: str, fmt: BodyFormat) -> dict[str, Any]:
    """The same saturation point through `wrk` and `hey`, where they are installed."""
    figures: dict[str, Any] = {}
    body = fmt.body(text)
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory() as folder:
        body_file = Path(folder) / "body"
        body_file.write_bytes(body)
        if shutil.which("wrk"):
            script = Path(folder) / "post.lua"
            script.write_text(
                f'wrk.method = "POST"\nwrk.body = {json.dumps(body.decode())}\n'
                f'wrk.headers["Content-Type"] = "{fmt.content_type}"\n'
            )
            out = _run_tool(
                ["wrk", "-t1", f"-c{SATURATION_CLIENTS}", "-d5s", "--latency", "-s", script, url]
            )
            figures["wrk"] = _parse_wrk(out)
        if shutil.which("hey"):
            out = _run_tool(
                [
                    "hey",
                    "-z",
                    "5s",
                    "-c",
                    str(SATURATION_CLIENTS),
                    "-m",
                    "POST",
                    "-T",
                    fmt.content_type,
                    "-D",
                    body_file,
                    url,
                ]
            )
            figures["hey"] = _parse_hey(out)
    return figures


def _run_tool(command: Sequence[Any]) -> str:
    try:
        done = subprocess.run(
            [str(part) for part in command], capture_output=True, text=True, timeout=30
        )
        return done.stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"


def _parse_wrk(out: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("Requests/sec:"):
            figures["throughput"] = float(words[1])
        elif len(words) == 2 and words[0] in ("50%", "99%"):
            figures[f"p{words[0][:-1]}_ms"] = _ms(words[1])
    return figures


def _parse_hey(out: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for line in out.splitlines():
        words = line.split()
        if line.strip().startswith("Requests/sec:"):
            figures["throughput"] = float(words[1])
        elif len(words) >= 3 and words[0] in ("50%", "99%") and words[1] == "in":
            figures[f"p{words[0][:-1]}_ms"] = round(1000 * float(words[2]), 3)
    return figures


def _ms(value: str) -> float | None:
    for unit, factor in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if value.endswith(unit):
            return round(float(value[: -len(unit)]) * factor, 3)
    return None


# --- memory across many requests ---------------------------------------------------


SOAK_REQUESTS = 100_000
SOAK_WARMUP_REQUESTS = 5_000
SOAK_TIME_LIMIT = 240.0
SOAK_TOLERANCE = 4 * 2**20  # bytes of RSS growth still called flat


async def soak(work: Path, requests_count: int = SOAK_REQUESTS) -> dict[str, Any]:
    """rawserve on the echo handler: server RSS before and after `requests_count` requests."""
    server = servers.rawserve(
        None, work / "rawserve-soak.log", ["--log-level", "warning"], handler="tests.handlers:echo"
    ).start()
    try:
        requests = load.build_requests(texts("mixed"), RAW_TEXT)
        await load.wait_until_serving(server.port, requests[0], READY_TIMEOUT, server.alive)
        await load.closed_loop(
            server.port, requests, 64, SOAK_TIME_LIMIT, max_requests=SOAK_WARMUP_REQUESTS
        )
        rss_before = servers.rss_bytes(server.pid)
        run = await load.closed_loop(
            server.port, requests, 64, SOAK_TIME_LIMIT, max_requests=requests_count
        )
        rss_after = servers.rss_bytes(server.pid)
    finally:
        server.stop()
    summary = run.summary()
    log(
        f"soak: {summary['requests']} requests at {summary['throughput']:.0f}/s, "
        f"server RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB"
    )
    return {
        "requests": summary["requests"],
        "statuses": summary["statuses"],
        "throughput": summary["throughput"],
        "rss_before": rss_before,
        "rss_after": rss_after,
        "tolerance_bytes": SOAK_TOLERANCE,
    }


SOAK_CHUNKS = 10


async def soak_model(work: Path, engine: str, requests_count: int = SOAK_REQUESTS) -> dict:
    """rawserve on the packaged MiniLM (OpenAI embeddings, one worker per core, `engine`):
    the server's and the workers' RSS after each tenth of `requests_count` requests."""
    from bench.models import minilm_path

    server = servers.rawserve(
        f"{OPENAI_MODEL}={minilm_path()}",
        work / f"rawserve-soak-{engine}.log",
        ["--log-level", "warning", "--device", "cpu,cpu", "--engine", engine],
        name=f"rawserve-{engine}",
    ).start()
    fmt = BodyFormat(path="/v1/embeddings", openai_model=OPENAI_MODEL)
    samples: list[dict[str, int]] = []
    statuses: dict[str, int] = {}
    try:
        requests = load.build_requests(texts("mixed"), fmt)
        await load.wait_until_serving(server.port, requests[0], READY_TIMEOUT, server.alive)
        warm = min(2_000, requests_count // 10)
        await load.closed_loop(server.port, requests, 64, SOAK_TIME_LIMIT, max_requests=warm)
        started = time.monotonic()
        for _ in range(SOAK_CHUNKS):
            run = await load.closed_loop(
                server.port, requests, 64, SOAK_TIME_LIMIT, max_requests=requests_count // 10
            )
            for status, count in run.summary()["statuses"].items():
                statuses[status] = statuses.get(status, 0) + count
            pids = servers.descendants(server.pid)
            samples.append(
                {
                    "server": servers.rss_bytes(server.pid),
                    "workers": sum(servers.rss_bytes(pid) for pid in pids[1:]),
                }
            )
        seconds = time.monotonic() - started
    finally:
        server.stop()
    first, last = samples[0], samples[-1]
    log(
        f"soak ({engine}): {sum(statuses.values())} requests in {seconds:.0f} s, server RSS "
        f"{first['server'] / 2**20:.1f} -> {last['server'] / 2**20:.1f} MiB, workers "
        f"{first['workers'] / 2**20:.1f} -> {last['workers'] / 2**20:.1f} MiB"
    )
    return {"engine": engine, "statuses": statuses, "seconds": round(seconds, 1), "rss": samples}


# --- the whole run --------------------------------------------------------------------


def run_scenario(scenario: Scenario, settings: Settings, work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "model": scenario.name,
        "task": scenario.task,
        "outputs": scenario.outputs,
        "ceiling": {},
        "servers": {},
    }
    for text_set in scenario.text_sets:
        result["ceiling"][text_set] = run_ceiling(scenario, text_set, settings, work)
    for name in settings.servers:
        if scenario.servers is not None and name not in scenario.servers:
            continue
        log(f"{name}: {scenario.name}")
        result["servers"][name] = measured_or_error(name, scenario, settings, work)
    return result


def measured_or_error(name: str, scenario: Scenario, settings: Settings, work: Path) -> dict:
    """One server's figures, or {"error": ...} with its log's last lines in ours: one
    server failing, to start or under load, must not stop the rest."""
    server = None
    try:
        server = start_server(name, scenario, settings, work)
        return asyncio.run(measure_server(server, scenario, settings))
    except Exception as exc:  # noqa: BLE001
        log(f"  {name} failed: {exc!r}\n{server.log_tail() if server else ''}")
        return {"error": repr(exc)}
    finally:
        if server is not None:
            server.stop()


def failed_servers(results: dict) -> list[str]:
    """The servers asked for that measured nothing, as `name (model)`."""
    return [
        f"{name} ({scenario['model']})"
        for scenario in results["scenarios"]
        for name, figures in scenario["servers"].items()
        if "error" in figures
    ]


def machine(device: str = "cpu") -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(
                line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_before": os.getloadavg()[0],
        "device": device,
        **(
            {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
            if device.startswith("cuda")
            else {}
        ),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs (about 3 minutes)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda[:N]: the ceiling (batch 1-1024, float16), rawserve and the seed's "
        f"server run there (servers {GPU_SERVERS}, clients "
        f"{','.join(map(str, GPU_CLIENT_COUNTS))} unless given)",
    )
    parser.add_argument("--record", action="store_true", help="rewrite ## Performance")
    parser.add_argument(
        "--servers",
        default=None,
        help=f"from {', '.join(servers.SERVERS)} (default: {DEFAULT_SERVERS} and Infinity's "
        f"two on the CPU; {GPU_SERVERS} on a GPU)",
    )
    parser.add_argument(
        "--scenarios",
        default="classification,token-embeddings,sentence-embeddings",
        help=f"comma-separated, from {', '.join(BUILDERS)} (default: %(default)s)",
    )
    parser.add_argument("--clients", default=None, help="default: 1,4,16,64 (1,64,256 on a GPU)")
    parser.add_argument(
        "--rawserve-args",
        default=RAWSERVE_ARGS,
        help=f"rawserve's options (default: {RAWSERVE_ARGS!r})",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help=f"processes sending the load (default: 1; {GPU_CLIENT_PROCESSES} on a GPU)",
    )
    parser.add_argument("--no-overload", action="store_true")
    parser.add_argument("--tools", action="store_true", help="also run wrk and hey if installed")
    parser.add_argument(
        "--soak", action="store_true", help=f"server RSS across {SOAK_REQUESTS:,} echo requests"
    )
    parser.add_argument(
        "--soak-model",
        action="store_true",
        help=f"worker and server RSS across {SOAK_REQUESTS:,} MiniLM requests, each engine",
    )
    parser.add_argument(
        "--soak-model-requests",
        type=int,
        default=SOAK_REQUESTS,
        help="requests per engine of --soak-model",
    )
    parser.add_argument("--text-sets", help="only these text sets (e.g. short), when given")
    parser.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help="write the figures here (default: the tracked bench/results.json; its picture "
        "beside it, named after it)",
    )
    parser.add_argument("--from-json", type=Path, help="only redo the table and picture")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from bench import report

    args = parse_args(argv)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        timing = QUICK if args.quick else FULL
        gpu = args.device != "cpu"
        chosen_servers = args.servers or (
            GPU_SERVERS if gpu else DEFAULT_SERVERS + ",infinity-torch,infinity-optimum"
        )
        clients = args.clients or ",".join(map(str, GPU_CLIENT_COUNTS if gpu else CLIENT_COUNTS))
        settings = Settings(
            **timing,
            overload_duration=0.0 if args.no_overload else (4.0 if args.quick else 8.0),
            client_counts=tuple(int(c) for c in clients.split(",")),
            servers=tuple(chosen_servers.split(",")),
            scenarios=tuple(args.scenarios.split(",")),
            rawserve_args=tuple(args.rawserve_args.split()),
            tools=args.tools,
            device=args.device,
            client_processes=args.client_processes or (GPU_CLIENT_PROCESSES if gpu else 1),
        )
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rawserve-bench-") as folder:
            work = Path(folder)
            chosen = scenarios(work, settings.scenarios)
            if args.text_sets:
                kept = args.text_sets.split(",")
                chosen = [
                    replace(s, text_sets=tuple(t for t in s.text_sets if t in kept)) for s in chosen
                ]
            results = {
                "command": "python -m bench.compare " + " ".join(argv or sys.argv[1:]),
                "machine": machine(args.device),
                "settings": settings.__dict__,
                "scenarios": [run_scenario(s, settings, work) for s in chosen],
            }
            if args.soak:
                results["soak"] = asyncio.run(soak(work))
            if args.soak_model:
                results["soak_model"] = [
                    asyncio.run(soak_model(work, engine, args.soak_model_requests))
                    for engine in ("torch", "onnx")
                ]
        results["seconds"] = round(time.monotonic() - started, 1)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        log(f"done in {results['seconds']:.0f} s; figures in {args.json}")
    table = report.ratio_table(results)
    print(table)
    picture = report.plot(results, picture_path(args))
    if picture is None:  # (skipped silently before: the picture RESULTS.md shows went stale)
        log("no picture: matplotlib is not installed (pip install -e .[bench])")
    if args.record:
        report.record(results, table, picture, BENCH_DIR / "RESULTS.md")
    failed = failed_servers(results)
    if failed:  # the figures are written, but a run that lost a server did not succeed
        log(f"measured nothing: {', '.join(failed)}")
        return 1
    return 0


def picture_path(args: argparse.Namespace) -> Path:
    """Beside the JSON, named after it; the tracked picture RESULTS.md shows only for the
    tracked figures or --record (a run elsewhere, a GPU's, must not overwrite it)."""
    if args.record or args.json == DEFAULT_JSON:
        return BENCH_DIR / "throughput_vs_p99.png"
    return args.json.with_suffix(".png")


if __name__ == "__main__":
    sys.exit(main())

"""Served generation: rawserve's continuous and static generation over `/v1/completions`,
against in-process static batching of the same prompts (and, where it is installed,
`transformers serve --continuous-batching`, transformers' own server).

    python -m bench.generation_serving                    # 3 rounds, every scenario, CPU
    python -m bench.generation_serving --rounds 1 --scenarios "16 x 64"   # a short try
    python -m bench.generation_serving --device cuda --layers 12 --hidden 768
    python -m bench.generation_serving --transformers-python /tmp/tserve/bin/python
                                         # transformers serve from another environment
    python -m bench.generation_serving --layers 1 --hidden 32 --pass-floor-ms 1.5
                                         # a GPU's flat pass cost, emulated on a CPU

The model: a random GPT-2 (2 layers, hidden 128 by default), saved to a temporary folder
with a word-level tokenizer built here ("w2" ... "w8191", one token a word, nothing from the
Hub). Its end-of-sequence id has a zero embedding, and the LM head is tied to the
embeddings, so its logit is always 0 while the largest of the other 8,190 is positive:
greedy decoding never ends a sequence early, and every request makes exactly the tokens
it asked for.

Scenarios, closed-loop clients on 127.0.0.1, each with a fixed list of requests (prompts of
8-32 tokens, seeded) and a time bound, stopping by themselves: 1, 16 and 64 clients with 64
new tokens each (4 requests a client), 256 requests of 8-256 new tokens (seeded) over 64
clients, and streamed passes (`"stream": true`) at 1, 16 and 64 clients for time to first
token and inter-token latency. Greedy (`temperature` 0) with `max_tokens` given. A client
answered 503 sends the same request again after a short pause (it is counted each time).
After a scenario cut by its time bound, a one-token request is sent until answered 200.

Reported per system and scenario, median and range over the rounds: useful tokens/s (the
tokens asked for and answered with 200), completions/s, answers by status ("unanswered":
still open when the time bound came), and for streamed passes time to first token p50 and
inter-token latency p50/p99. The reference is in-process static batching of the same
prompts (`bench.generation.static`: batches of the scenario's clients, at most 64, each run
to its longest member); each system's ratio to it is in the table. Systems are
interleaved round by round, each round starting with the next one, each server started
fresh in every round (the machine is shared). One JSON line per run as it ends, then one
per system and scenario, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import described, generation, servers
from bench.load import build_request, percentile, wait_until_serving

VOCAB_SIZE = 8192
PAD_ID, EOS_ID = 0, 1  # both with zero embeddings: never chosen by greedy decoding
POSITIONS = 512  # the longest prompt (32) and the longest ask (256) fit
PROMPT_TOKENS = (8, 32)
FIXED_NEW_TOKENS = 64
MIXED_NEW_TOKENS = (8, 256)
MIXED_REQUESTS = 256
REQUESTS_PER_CLIENT = 4  # the fixed-length scenarios: a bounded count, not only a time
REFERENCE_BATCH = 64  # in-process static batches hold at most this many prompts
RETRY_PAUSE = 0.05  # seconds a client answered 503 waits before sending it again
START_TIMEOUT = 300.0
SYSTEMS = (
    "rawserve-continuous",
    "rawserve-eager",
    "rawserve-gathered",
    "rawserve-static",
    "static-in-process",
    "transformers-serve",
)
# rawserve's systems: its generation mode and options (eager: on a GPU, the decoding steps
# run as they are, not replayed from CUDA graphs; gathered: joiners wait up to 4 steps for
# company, one prefill for several)
RAWSERVE_MODES = {
    "rawserve-continuous": ("continuous", []),
    "rawserve-eager": ("continuous", ["--no-cuda-graphs"]),
    "rawserve-gathered": ("continuous", ["--join-wait-steps", "4"]),
    "rawserve-static": ("static", []),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    clients: int
    prompts: list[list[int]]  # token ids, one list per request
    asks: list[int]  # new tokens of each request
    stream: bool = False
    # the clients' first requests spread over a lone request's time, not sent at once: the
    # clients of the other scenarios, asking alike, start together and stay in step, so
    # that their requests come in waves, each wave's first tokens queued behind the
    # wave's own prefills; spread, they come one at a time, as independent users' do
    spread: bool = False


def scenarios(seed: int) -> list[Scenario]:
    rng = random.Random(seed)

    def prompts(count: int) -> list[list[int]]:
        return [
            [rng.randrange(EOS_ID + 1, VOCAB_SIZE) for _ in range(rng.randint(*PROMPT_TOKENS))]
            for _ in range(count)
        ]

    found = []
    for stream in (False, True):
        for clients in (1, 16, 64):
            count = clients * REQUESTS_PER_CLIENT
            name = f"{'stream ' if stream else ''}{clients} x {FIXED_NEW_TOKENS}"
            found.append(
                Scenario(name, clients, prompts(count), [FIXED_NEW_TOKENS] * count, stream)
            )
        if not stream:
            asks = [rng.randint(*MIXED_NEW_TOKENS) for _ in range(MIXED_REQUESTS)]
            found.append(Scenario("mixed 256 x 8-256", 64, prompts(MIXED_REQUESTS), asks))
    count = 16 * REQUESTS_PER_CLIENT
    asks = [FIXED_NEW_TOKENS] * count
    found.append(Scenario("stream 16 x 64 spread", 16, prompts(count), asks, True, True))
    return found


def text_of(prompt: Sequence[int]) -> str:
    return " ".join(f"w{token}" for token in prompt)


# --- the model ------------------------------------------------------------------------


def save_model(folder: Path, layers: int, hidden: int) -> Path:
    """A random GPT-2 with a word-level tokenizer, saved as `--model` reads it."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import models, pre_tokenizers

    words = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    words.update({f"w{i}": i for i in range(EOS_ID + 1, VOCAB_SIZE)})
    backend = tokenizers.Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=POSITIONS,
        n_embd=hidden,
        n_layer=layers,
        n_head=max(2, hidden // 64),
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # tied to the LM head: these two logits are always 0
        model.transformer.wte.weight[[PAD_ID, EOS_ID]] = 0.0
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- one client's exchange ------------------------------------------------------------


@dataclass
class Answer:
    status: int  # -1: the connection failed; 0: unanswered when the time bound came
    tokens: int = 0  # completion tokens of a 200
    first: float | None = None  # seconds from sending to the first streamed token
    gaps: list[float] = field(default_factory=list)  # between streamed tokens
    keep_alive: bool = True


def completion_request(model: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return build_request(
        json.dumps(body).encode(), path="/v1/completions", content_type="application/json"
    )


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> Answer:
    """Send one request and read its answer: a JSON body (Content-Length) or server-sent
    events (chunked), whose token events are timed as they arrive."""
    clock = time.perf_counter
    sent = clock()
    writer.write(request)
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    answer = Answer(int(head[9:12]), keep_alive="connection: close" not in head)
    if "transfer-encoding: chunked" not in head:
        length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
        body = await reader.readexactly(length)
        if answer.status == 200:
            answer.tokens = json.loads(body)["usage"]["completion_tokens"]
        return answer
    events = b""
    last: float | None = None
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        events += (await reader.readexactly(size + 2))[:-2]
        now = clock()
        *complete, events = events.split(b"\n\n")
        for event in complete:
            data = event.removeprefix(b"data:").strip()  # a space after the colon or not
            if not event.startswith(b"data:") or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                answer.tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("error"):
                answer.status = 500  # an error event after the 200 head
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if last is None:
                    answer.first = now - sent
                else:
                    answer.gaps.append(now - last)
                last = now
    await reader.readuntil(b"\r\n")  # the empty trailer
    return answer


async def closed_loop(port: int, requests: list[bytes], asks: list[int], clients: int,
                      duration: float, spread: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """`clients` connections taking the next request as soon as theirs is answered, until
    every request is answered 200 (or refused otherwise) or `duration` seconds passed;
    with `spread`, the clients' first requests evenly over that many seconds."""
    pending = list(zip(requests, asks, strict=True))[::-1]
    answers: list[tuple[Answer, int]] = []
    start = time.perf_counter()
    client_cpu = time.process_time()  # this one process reads every event: is it the limit?
    stop_at = start + duration
    ended = start

    async def client(index: int) -> None:
        nonlocal ended
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        await asyncio.sleep(spread * index / clients)
        while pending and time.perf_counter() < stop_at:
            request, ask = pending.pop()
            while True:
                try:
                    if connection is None:
                        connection = await asyncio.open_connection("127.0.0.1", port)
                    answer = await asyncio.wait_for(
                        exchange(*connection, request), stop_at - time.perf_counter()
                    )
                except TimeoutError:
                    answers.append((Answer(0), ask))
                    break
                except (OSError, ValueError, LookupError, asyncio.IncompleteReadError):
                    answer = Answer(-1, keep_alive=False)  # no answer, or one not understood
                answers.append((answer, ask))
                ended = max(ended, time.perf_counter())
                if not answer.keep_alive and connection is not None:
                    connection[1].close()
                    connection = None
                if answer.status != 503 or time.perf_counter() + RETRY_PAUSE >= stop_at:
                    break
                await asyncio.sleep(RETRY_PAUSE)
        if connection is not None:
            connection[1].close()

    await asyncio.gather(*(client(index) for index in range(clients)))
    seconds = (ended if not pending and all(a.status for a, _ in answers) else stop_at) - start
    done = [(answer, ask) for answer, ask in answers if answer.status == 200]
    firsts = [answer.first for answer, _ in done if answer.first is not None]
    gaps = [gap for answer, _ in done for gap in answer.gaps]
    statuses = Counter(
        "unanswered" if a.status == 0 else "failed" if a.status < 0 else str(a.status)
        for a, _ in answers
    )
    found = figures(
        seconds,
        useful=sum(min(answer.tokens, ask) for answer, ask in done),
        completions=len(done),
        short=sum(answer.tokens < ask for answer, ask in done),
        statuses=dict(statuses) | ({"not sent": len(pending)} if pending else {}),
        firsts=firsts,
        gaps=gaps,
    )
    found["client_cpu_share"] = round((time.process_time() - client_cpu) / max(seconds, 1e-9), 2)
    return found


def figures(seconds: float, *, useful: int, completions: int, short: int = 0,
            statuses: dict[str, int] | None = None, firsts: Sequence[float] = (),
            gaps: Sequence[float] = ()) -> dict[str, Any]:  # fmt: skip
    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 2)

    return {
        "seconds": round(seconds, 3),
        "tokens_per_s": round(useful / seconds, 1),
        "completions_per_s": round(completions / seconds, 2),
        "statuses": statuses or {"200": completions},
        "short_answers": short,  # answered 200 with fewer tokens than asked
        "ttft_p50_ms": ms(statistics.median(firsts)) if firsts else None,
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p99_ms": ms(percentile(gaps, 99)),
    }


# --- the systems ----------------------------------------------------------------------


def server(system: str, folder: Path, log: Path, args: argparse.Namespace) -> servers.ServerProcess:
    if system == "transformers-serve":
        command = [args.transformers_python, "-m", "transformers.cli.transformers", "serve",
                   "--continuous-batching", "--host", "127.0.0.1", "--device", args.device,
                   "--dtype", args.dtype, str(folder)]  # fmt: skip
        return floored(servers.ServerProcess(system, command, servers.base_env(), log), args)
    mode, extra = RAWSERVE_MODES[system]
    # on a CPU rawserve's own layout (a worker per core), as a user starts it: `--device
    # cpu` would make it one worker of every core (slower here, bench/RESULTS.md)
    device = [] if args.device == "cpu" else ["--device", args.device]
    options = ["--task", "text-generation", "--generation", mode, *device, *extra,
               "--dtype", args.dtype, "--no-access-log",
               *shlex.split(args.rawserve_args)]  # fmt: skip
    return floored(servers.rawserve(str(folder), log, options, name=system), args)


def floored(process: servers.ServerProcess, args: argparse.Namespace) -> servers.ServerProcess:
    """With `--pass-floor-ms`, the server's processes wait that long before every forward
    pass of the model (bench/emulated_gpu: a GPU's flat pass cost, on a CPU)."""
    if args.pass_floor_ms:
        emulation = str(servers.REPO_ROOT / "bench" / "emulated_gpu")
        path = os.pathsep.join([emulation, process.env["PYTHONPATH"]])
        process.env.update(PYTHONPATH=path, RAWSERVE_BENCH_PASS_FLOOR_MS=str(args.pass_floor_ms))
    return process


async def serve_round(system: str, folder: Path, chosen: list[Scenario], log: Path,
                      args: argparse.Namespace) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Start the system's server, warm it, run every scenario once, stop it (nothing
    found, and its log's tail shown, if it fails)."""
    model = str(folder)
    process = server(system, folder, log, args).start()
    try:
        probe = completion_request(model, "w2 w3 w4", 1, False)
        await wait_until_serving(process.port, probe, START_TIMEOUT, process.alive)
        # warm at the scenarios' sizes: a first run at a new size is slower (the KV cache
        # grows to its rows and columns, kernels meet new shapes) and is not the system's
        warm = [
            completion_request(model, "w5 w6 w7 w8", ask, stream)
            for ask in (FIXED_NEW_TOKENS, MIXED_NEW_TOKENS[1])
            for stream in (False, True)
        ]
        clients = max(scenario.clients for scenario in chosen)
        copies = max(1, clients // len(warm))  # every client at once: the rows grow too
        await closed_loop(process.port, warm * copies, [0] * len(warm) * copies, clients, 60.0)
        found = {}
        for scenario in chosen:
            texts = [text_of(prompt) for prompt in scenario.prompts]
            requests = [
                completion_request(model, text, ask, scenario.stream)
                for text, ask in zip(texts, scenario.asks, strict=True)
            ]
            spread = 0.0
            if scenario.spread:  # over a lone request's time, as this server answers it
                started = time.perf_counter()
                await closed_loop(process.port, requests[:1], scenario.asks[:1], 1, args.duration)
                spread = time.perf_counter() - started
            before = await asyncio.to_thread(generation_passes, process.port)
            found[scenario.name] = await closed_loop(
                process.port, requests, scenario.asks, scenario.clients, args.duration, spread
            )
            if "unanswered" in found[scenario.name]["statuses"]:
                await settle(process.port, probe, args.duration)
            after = await asyncio.to_thread(generation_passes, process.port)
            found[scenario.name].update(pass_shares(before, after))
        return found
    except Exception as exc:  # noqa: BLE001 - the other systems still run
        print(f"{system} failed: {exc!r}\n{process.log_tail(30)}", file=sys.stderr, flush=True)
        return {}
    finally:
        process.stop()


def generation_passes(port: int) -> Counter[str]:
    """rawserve's generation pass counters from its /metrics, by kind (none elsewhere)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except (OSError, ValueError):
        return Counter()
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in PASS_COUNTERS:
                found[f"{PASS_COUNTERS[sample.name]} {sample.labels['kind']}"] += sample.value
            elif sample.name.removesuffix("_bucket") in LATENCIES:
                name = LATENCIES[sample.name.removesuffix("_bucket")]
                found[f"{name} {sample.labels['le']}"] += sample.value
    return found


PASS_COUNTERS = {
    "rawserve_generation_passes_total": "passes",
    "rawserve_generation_pass_tokens_total": "tokens",
}
# the loop's own latencies (the worker's times: before the sockets, the HTTP and serving
# processes and the client), what the client's figures are compared with
LATENCIES = {
    "rawserve_generation_queue_seconds": "queue",
    "rawserve_generation_time_to_first_token_seconds": "first token",
    "rawserve_generation_inter_token_seconds": "between tokens",
}


def pass_shares(before: Counter[str], after: Counter[str]) -> dict[str, float]:
    """What rawserve's loop ran over a scenario: prefills per decoding step (near 1: a
    prefill beside nearly every step, on a GPU about a step's cost each) and the rows a
    step ran. About: a worker counts its passes to the server once a second."""
    ran = after - before
    steps = ran["passes decode"]
    if not steps:
        return {}
    found = {
        "prefills_per_step": round(ran["passes prefill"] / steps, 2),
        "rows_per_step": round(ran["tokens decode"] / steps, 1),
    }
    for key, latency, share in (
        ("worker_queue_p50_ms", "queue", 0.5),
        ("worker_ttft_p50_ms", "first token", 0.5),
        ("worker_itl_p50_ms", "between tokens", 0.5),
        ("worker_itl_p99_ms", "between tokens", 0.99),
    ):
        seconds = bucket_quantile(latency_buckets(ran, latency), share)
        if seconds is not None:
            found[key] = round(seconds * 1000, 2)
    return found


def latency_buckets(counted: Counter[str], latency: str) -> dict[str, float]:
    """One of `LATENCIES`' cumulative bucket counts, by upper bound, from
    `generation_passes`' counts."""
    return {name.split()[-1]: n for name, n in counted.items() if name.startswith(latency)}


def bucket_quantile(cumulative: dict[str, float], share: float) -> float | None:
    """The `share` quantile of a histogram's observations from its cumulative bucket
    counts by upper bound (`le`), interpolated within its bucket as Prometheus's
    histogram_quantile does (the highest finite bound where it falls beyond)."""
    bounds = sorted((float(le), count) for le, count in cumulative.items())
    if not bounds or not bounds[-1][1]:
        return None
    rank = share * bounds[-1][1]
    below, lower = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        below, lower = count, bound
    return lower


async def settle(port: int, probe: bytes, timeout: float) -> None:
    """Wait until a one-token request is answered 200: what the clients left at the time
    bound must not run into the next scenario (a server that does not drop them when
    their clients leave works them off first)."""
    try:
        await wait_until_serving(port, probe, timeout)
    except TimeoutError:
        print(f"port {port}: still busy {timeout:g} s after the time bound", file=sys.stderr)


def in_process_round(model: Any, chosen: list[Scenario]) -> dict[str, dict[str, Any]]:
    """bench.generation's static batching of each scenario's prompts, batches of the
    scenario's clients (at most 64), one after another."""
    found = {}
    for scenario in chosen:
        size = min(scenario.clients, REFERENCE_BATCH)
        runs = [
            generation.static(model, scenario.prompts[i : i + size], scenario.asks[i : i + size])
            for i in range(0, len(scenario.prompts), size)
        ]
        found[scenario.name] = figures(
            sum(run["seconds"] for run in runs),
            useful=sum(scenario.asks),
            completions=len(scenario.asks),
            firsts=[first for run in runs for first in run["first"]],
            gaps=[gap for run in runs for gap in run["gaps"]],
        )
    return found


def load_reference(folder: Path, device: str, dtype: str) -> Any:
    import torch
    import transformers

    from rawserve.worker.loading import choose_attention_kernels

    # the kernels rawserve's worker runs: with cuDNN's, static `generate` planned anew at
    # every new key length and stalled (bench/RESULTS.md)
    choose_attention_kernels(device)
    model = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def transformers_serve_missing(python: str) -> str | None:
    """Why `transformers serve` cannot run with `python` (None: it can)."""
    check = "import fastapi, uvicorn, accelerate, transformers.cli.serve"
    try:
        done = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=120)
    except OSError as error:
        return f"{python}: {error}"
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


# --- the report -----------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("tokens_per_s", "completions_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms",
            "client_cpu_share", "prefills_per_step", "rows_per_step", "worker_queue_p50_ms",
            "worker_ttft_p50_ms", "worker_itl_p50_ms", "worker_itl_p99_ms")  # fmt: skip
    summary: dict[str, Any] = {
        key: spread([run[key] for run in runs if run.get(key) is not None]) for key in keys
    }
    statuses: Counter[str] = Counter()
    for run in runs:
        statuses.update(run["statuses"])
    summary["statuses"] = dict(statuses)
    summary["short_answers"] = sum(run["short_answers"] for run in runs)
    summary["rounds"] = len(runs)
    return summary


def median(summary: dict[str, Any], key: str, places: int = 1) -> str:
    found = summary.get(key)
    return "-" if found is None else f"{found['median']:,.{places}f}"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    rows = ["| scenario | system | tokens/s median [range] | × in-process static | "
            "completions/s | statuses | TTFT p50 ms | ITL p50 / p99 ms | prefills / rows "
            "a step | worker: queue / TTFT p50, ITL p50 / p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for scenario, by_system in results.items():
        unstreamed = results.get(scenario.removeprefix("stream "), {})  # the same load
        reference = unstreamed.get("static-in-process", {}).get("tokens_per_s")
        for system, summary in by_system.items():
            rate = summary["tokens_per_s"]
            if rate is None:
                continue
            ratio = f"{rate['median'] / reference['median']:.2f}" if reference else "-"
            rows.append(
                f"| {scenario} | {system} | {rate['median']:,.0f} "
                f"[{rate['min']:,.0f}–{rate['max']:,.0f}] | {ratio} | "
                f"{median(summary, 'completions_per_s')} | {summary['statuses']} | "
                f"{median(summary, 'ttft_p50_ms')} | "
                f"{median(summary, 'itl_p50_ms')} / {median(summary, 'itl_p99_ms')} | "
                f"{median(summary, 'prefills_per_step', 2)} / {median(summary, 'rows_per_step')} | "
                f"{median(summary, 'worker_queue_p50_ms', 2)} / "
                f"{median(summary, 'worker_ttft_p50_ms', 2)}, "
                f"{median(summary, 'worker_itl_p50_ms', 2)} / "
                f"{median(summary, 'worker_itl_p99_ms', 2)} |"
            )
    return "\n".join(rows)


async def run(args: argparse.Namespace, systems: list[str]) -> dict[str, Any]:
    chosen = [s for s in scenarios(args.seed) if not args.scenarios or s.name in args.scenarios]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="generation-serving-") as tmp:
        folder = save_model(Path(tmp) / "model", args.layers, args.hidden)
        reference = (
            load_reference(folder, args.device, args.dtype)
            if "static-in-process" in systems
            else None
        )
        if reference is not None:  # warm it once, as the servers are warmed
            if args.pass_floor_ms:
                generation.floor_every_pass(reference, args.pass_floor_ms / 1000)
            generation.static(reference, [chosen[0].prompts[0]], [8])
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(systems)  # each round starts with the next system
            for system in systems[shift:] + systems[:shift]:
                if system == "static-in-process":
                    found = in_process_round(reference, [s for s in chosen if not s.stream])
                else:
                    log = Path(tmp) / f"{system}.log"
                    found = await serve_round(system, folder, chosen, log, args)
                for name, result in found.items():
                    runs.setdefault((name, system), []).append(result)
                    line = {"round": round_, "system": system, "scenario": name, **result}
                    print(json.dumps(line), flush=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for (name, system), found_runs in runs.items():
        results.setdefault(name, {})[system] = summarize(found_runs)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.generation_serving", description=described(__doc__)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds a scenario may run")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--rawserve-args", default="", help='more options for rawserve, e.g. "--device cpu"'
    )
    parser.add_argument("--dtype", help="float32 or float16 (default: float16 on cuda)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and mixed lengths")
    parser.add_argument("--scenarios", nargs="+", help='e.g. "16 x 64" "mixed 256 x 8-256"')
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        help="default: all but rawserve-gathered (rawserve-eager on a GPU only)",
    )
    parser.add_argument(
        "--transformers-python",
        default=sys.executable,
        help="the Python that runs transformers-serve: it needs transformers' serving extra "
        "and accelerate (the bench extra installs them; default: this one)",
    )
    parser.add_argument(
        "--pass-floor-ms",
        type=float,
        default=0.0,
        help="idle milliseconds before every forward pass, in the servers and in-process "
        "(a GPU's flat pass cost, emulated on a CPU: bench/emulated_gpu)",
    )
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "float16")
    known = [scenario.name for scenario in scenarios(args.seed)]
    if unknown := set(args.scenarios or ()) - set(known):
        parser.error(f"unknown scenarios {sorted(unknown)}: choose from {known}")
    on_cpu = args.device == "cpu"  # where rawserve-eager is rawserve-continuous
    left_out = {"rawserve-gathered", *(["rawserve-eager"] if on_cpu else [])}
    systems = list(args.systems or [s for s in SYSTEMS if s not in left_out])
    if "transformers-serve" in systems:
        missing = transformers_serve_missing(args.transformers_python)
        if missing:
            print(f"transformers-serve left out: {missing}", file=sys.stderr, flush=True)
            systems.remove("transformers-serve")
    results = asyncio.run(run(args, systems))
    for name, by_system in results.items():
        for system, summary in by_system.items():
            print(json.dumps({"scenario": name, "system": system, **summary}), flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

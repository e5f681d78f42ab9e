"""Served generation past its capacity: goodput, refusals and answers too late.

    python -m bench.generation_overload                   # 3 rounds on the CPU
    python -m bench.generation_overload --rounds 1 --deadline 5 --factor 3
    python -m bench.generation_overload --device cuda --layers 12 --hidden 768

The model is `bench.generation_serving`'s random GPT-2 (every request makes exactly the
tokens it asks for). Each round starts rawserve afresh (continuous generation), warms it,
and measures its capacity: 384 requests of 8-128 new tokens (prompts of 8-32 tokens,
seeded) over 256 closed-loop clients, in completions per second. Then Poisson arrivals
at `--factor` times that rate (or at `--rate`, the same for servers compared) for
`--duration` seconds, each request carrying a deadline (`X-Request-Timeout`), whatever
the answers. With `--default-length N` the requests are chat completions naming no
`max_tokens`: each makes the N new tokens the model's generation config says (what a
chat client that sets no length gets), so the server must count them by the model's.
With `--stop w5,w7` each request names those stop sequences: its answer ends where the
model writes one, for many before their cap (as a chat model's answers end at its end of
sequence), so the server must not judge a full answer by the short ones.
With `--contend N`, N processes spin on the CPU while the arrivals come (not while the
capacity is measured): the rows run slower than the server measured them, as on a
machine shared with other work, and the server must not count them free on time.

Reported per round: the capacity; the goodput (answers 200 within their deadline, per
second) and its ratio to the capacity; answers by status (a 504 is a request admitted and
then dropped at its deadline: the rows it held were spent for nothing, unless it expired
queued, `expired_queued`); the 503s' latency
(a refusal should be at once) and the 200s'. A server that admits only what it can answer
in time keeps the goodput near the capacity with few 504s. The wait the last second's
refusals asked for (`Retry-After-Ms`), against the seconds everything took to be answered
once the arrivals stopped (`drain_s`): said much longer, it keeps clients away from a
server gone idle. Then what the scheduler learned
(its /metrics): a decoding step's seconds beside one row and beside the most rows
measured, those rows, and the new tokens nine in ten answers stayed within.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bench import described, generation_serving, load, servers

CAPACITY_CLIENTS = 256  # past the rows of a CPU's workers (2 x 64) and a GPU's (256)
CAPACITY_REQUESTS = 384
NEW_TOKENS = (8, 128)
PROMPTS = 1024  # the open loop cycles through them


# a chat template for the model's tokenizer, which has none: the turns' texts in a row
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def requests(
    folder: Path,
    seed: int,
    deadline: float | None,
    default_length: int | None = None,
    stop: str | None = None,
) -> tuple[list[bytes], list[int]]:
    """Seeded prompts and asks, as completions requests (with a deadline, when given), or
    as chat completions naming no length (`default_length`: what the model makes then);
    each naming the stop sequences in `stop` (comma-separated), when given."""
    rng = random.Random(seed)
    headers = [] if deadline is None else [("X-Request-Timeout", f"{deadline:g}")]
    built, asks = [], []
    for _ in range(PROMPTS):
        words = rng.randint(*generation_serving.PROMPT_TOKENS)
        vocabulary = generation_serving.VOCAB_SIZE
        prompt = " ".join(f"w{rng.randrange(2, vocabulary)}" for _ in range(words))
        ask = rng.randint(*NEW_TOKENS)
        body: dict[str, Any] = {"model": str(folder), "temperature": 0}
        if stop:
            body["stop"] = stop.split(",")
        if default_length:
            ask, path = default_length, "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body.update(prompt=prompt, max_tokens=ask)
        built.append(
            load.build_request(
                json.dumps(body).encode(),
                path=path,
                content_type="application/json",
                extra_headers=headers,
            )
        )
        asks.append(ask)
    return built, asks


def scrape(port: int) -> list[Sample]:
    """The samples of the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def queued_expired(samples: list[Sample]) -> int:
    """Items whose deadline passed while they were queued."""
    return round(
        sum(
            sample.value
            for sample in samples
            if sample.name == "rawserve_items_dropped_total"
            and sample.labels.get("reason") == "expired"
        )
    )


# the scheduler's learned sequences, as /metrics names them: (series, rows label) -> key
LEARNED = {
    ("rawserve_generation_step_seconds", "one"): "step_s_one_row",
    ("rawserve_generation_step_seconds", "most"): "step_s_most_rows",
    ("rawserve_generation_rows_measured", None): "rows_measured",
    ("rawserve_generation_likely_new_tokens", None): "likely_new_tokens",
}


def learned(samples: list[Sample]) -> dict[str, float | str]:
    """What the scheduler learned of the sequences: a step's seconds beside one row and
    beside the most rows measured, those rows, and the new tokens nine in ten answers
    stayed within (how a step grows with its rows is the figure to read on a GPU)."""
    return {
        LEARNED[sample.name, sample.labels.get("rows")]: (
            round(sample.value, 5) if math.isfinite(sample.value) else "all they ask"
        )
        for sample in samples
        if (sample.name, sample.labels.get("rows")) in LEARNED
    }


async def one_round(folder: Path, log: Path, args: argparse.Namespace) -> dict[str, Any]:
    device = [] if args.device == "cpu" else ["--device", args.device]
    options = ["--task", "text-generation", *device, "--no-access-log",
               *shlex.split(args.rawserve_args)]  # fmt: skip
    if args.default_length:
        template = log.with_suffix(".jinja")
        template.write_text(CHAT_TEMPLATE)
        options += ["--chat-template", str(template)]
    process = servers.rawserve(str(folder), log, options, name="rawserve").start()
    try:
        probe = generation_serving.completion_request(str(folder), "w2 w3 w4", 1, False)
        await load.wait_until_serving(
            process.port, probe, generation_serving.START_TIMEOUT, process.alive
        )
        plain, asks = requests(folder, args.seed, None, args.default_length, args.stop)
        await generation_serving.closed_loop(  # warm: every row, both ends of the asks
            process.port, plain[:CAPACITY_CLIENTS], asks[:CAPACITY_CLIENTS], CAPACITY_CLIENTS, 120.0
        )
        capacity = await generation_serving.closed_loop(
            process.port,
            plain[:CAPACITY_REQUESTS],
            asks[:CAPACITY_REQUESTS],
            CAPACITY_CLIENTS,
            120.0,
        )
        rate = capacity["completions_per_s"]
        arrivals = args.rate or args.factor * rate
        timed, _ = requests(folder, args.seed + 1, args.deadline, args.default_length, args.stop)
        with contending(args.contend):
            run = await load.open_loop(
                process.port, timed, arrivals, args.duration, deadline=args.deadline
            )
        summary = run.summary()
        metrics = scrape(process.port)
        return {
            "capacity_per_s": rate,
            "capacity_tokens_per_s": capacity["tokens_per_s"],
            "rate": round(arrivals, 2),
            "goodput_per_s": summary["goodput"],
            "goodput_ratio": round(summary["goodput"] / rate, 3) if rate else None,
            "statuses": summary["statuses"],
            "late_200": summary["late_200"],
            "ok_p50_ms": summary["p50_ms"],
            "ok_p99_ms": summary["p99_ms"],
            "refused_p99_ms": summary.get("503", {}).get("p99_ms"),
            "expired_queued": queued_expired(metrics),  # of the 504s: never reached a row
            **retry_after_against_drain(run),
            **learned(metrics),
        }
    finally:
        process.stop()


def retry_after_against_drain(run: load.LoadResult) -> dict[str, float | None]:
    """What the refusals of the arrivals' last second asked clients to wait (the median
    and the most, seconds), against the seconds the server took to answer everything
    after the arrivals stopped (a new request sent then found a row by that time at the
    latest): a wait said much longer keeps clients away from a server gone idle."""
    samples = run.samples
    last = [said for at, said in samples.retry_after if run.duration - 1.0 <= at <= run.duration]
    ends = [sent + latency for sent, latency in zip(samples.sent, samples.latency, strict=True)]
    return {
        "retry_after_last_s": round(statistics.median(last), 3) if last else None,
        "retry_after_last_max_s": round(max(last), 3) if last else None,
        "drain_s": round(max(ends) - run.duration, 3) if ends else None,
    }


@contextlib.contextmanager
def contending(processes: int) -> Iterator[None]:
    """`processes` busy loops on the CPU for the block's length."""
    spinning = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    found = []
    with tempfile.TemporaryDirectory(prefix="generation-overload-") as tmp:
        folder = generation_serving.save_model(Path(tmp) / "model", args.layers, args.hidden)
        if args.default_length:  # what a request naming no length makes
            path = folder / "generation_config.json"
            config = json.loads(path.read_text())
            path.write_text(json.dumps({**config, "max_new_tokens": args.default_length}))
        for round_ in range(1, args.rounds + 1):
            result = await one_round(folder, Path(tmp) / f"round{round_}.log", args)
            print(json.dumps({"round": round_, **result}), flush=True)
            found.append(result)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.generation_overload", description=described(__doc__)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--factor", type=float, default=3.0, help="times the capacity")
    parser.add_argument(
        "--rate", type=float, help="arrivals a second, instead of --factor x the capacity"
    )
    parser.add_argument("--deadline", type=float, default=5.0, help="seconds a request has")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--rawserve-args", default="", help="more options for rawserve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--contend", type=int, default=0, help="processes spinning on the CPU during arrivals"
    )
    parser.add_argument(
        "--default-length",
        type=int,
        help="chat requests naming no max_tokens; the model's generation config makes this many",
    )
    parser.add_argument(
        "--stop",
        help="stop sequences each request names, comma-separated (w5,w7: a third of the "
        "answers run to their cap, half end before 41 tokens, as a chat model's end early)",
    )
    args = parser.parse_args(argv)
    found = asyncio.run(run(args))
    ratios = [r["goodput_ratio"] for r in found if r["goodput_ratio"] is not None]
    if ratios:
        print(
            f"goodput / capacity: median {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} round(s)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

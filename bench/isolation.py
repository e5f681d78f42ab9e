"""Isolation between served models, measured: the p99 latency of one model's requests
alone, then beside a second model that is saturated (its queue at its bound, its worker
never resting). The tests assert what holds on any machine (every request of the other
model answered 200, its queue empty); the latency beside the saturated model depends on
the machine and is measured here, where a figure is reported, not asserted.

Two models are served by one `python -m rawserve`: `cls`, all-MiniLM-L6-v2 with a
random 2-label head, and `gen`, a small random GPT-2 asked for 48 new tokens per request.
Loopback only; every load stops by itself.

    python -m bench.isolation --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import h11

from bench import described
from bench.load import build_request, wait_until_serving
from bench.models import build_classifier
from bench.servers import REPO_ROOT, rawserve
from tests.load import exchange

JSON = [("Content-Type", "application/json")]
SATURATE_AT_MOST = 120.0  # seconds: the saturating load stops by itself after it
REQUESTS = 300  # timed requests per measurement


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


async def timed_requests(port: int, path: str, count: int) -> list[float]:
    """`count` requests one after another on one keep-alive connection; each latency."""
    body = json.dumps({"inputs": "i like this movie"}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    latencies = []
    try:
        for _ in range(count):
            conn = h11.Connection(h11.CLIENT)
            started = time.perf_counter()
            status, answer = await exchange(reader, writer, "POST", path, body, JSON, conn)
            latencies.append(time.perf_counter() - started)
            assert status == 200, answer
    finally:
        writer.close()
    return latencies


async def saturate(port: int, path: str, clients: int, stop: asyncio.Event) -> dict[int, int]:
    """`clients` closed loops posting long generations until `stop`: more than the model
    computes, so its worker never rests and its queue stays at its bound; a refused
    client waits the Retry-After it is given, as a client should. Prints "saturated" at
    the first 503; returns the statuses counted."""
    body = json.dumps({"inputs": "the movie", "parameters": {"max_new_tokens": 48}}).encode()
    counts: dict[int, int] = {}
    until = time.monotonic() + SATURATE_AT_MOST

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not stop.is_set() and time.monotonic() < until:
                conn = h11.Connection(h11.CLIENT)
                status, answer = await exchange(reader, writer, "POST", path, body, JSON, conn)
                counts[status] = counts.get(status, 0) + 1
                if status == 503:
                    if counts[status] == 1:
                        print("saturated", flush=True)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return counts


def saturate_main(port: int, path: str, clients: int) -> None:
    """The saturating load in a process of its own, so the measuring client's event loop
    is not the one driving it; it stops when its stdin closes and prints the statuses."""

    async def until_stdin_closes() -> dict[int, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wait_for_eof() -> None:
            sys.stdin.read()
            with contextlib.suppress(RuntimeError):  # the load ended first: its loop is closed
                loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_for_eof, daemon=True).start()
        return await saturate(port, path, clients, stop)

    print(json.dumps(asyncio.run(until_stdin_closes())), flush=True)


@contextlib.contextmanager
def saturating(port: int, path: str, clients: int) -> Iterator[dict[str, int]]:
    """The model at `path` saturated (its queue full: some clients refused) while the
    block runs; yields the statuses the load got, filled in when the block ends."""
    code = "from bench.isolation import saturate_main; "
    code += f"saturate_main({port}, {path!r}, {clients})"
    load = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    counts: dict[str, int] = {}
    try:
        assert load.stdout is not None
        if load.stdout.readline() != "saturated\n":
            raise RuntimeError(f"{clients} clients never filled {path}'s queue (no 503)")
        yield counts
    finally:
        output, _ = load.communicate(timeout=60)  # closes its stdin: it stops
    counts.update(json.loads(output))


def build_generator(folder: Path) -> Path:
    """A small random GPT-2 (2 layers, hidden 128) with MiniLM's WordPiece tokenizer:
    the generation's cost, not its text, is what saturates the model (once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    from bench.models import minilm_path

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    config = transformers.GPT2Config(
        vocab_size=tokenizer.vocab_size,
        n_positions=256,
        n_embd=128,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def measure(work: Path, rounds: int, clients: int) -> None:
    """Serve both models from `work` and print each round's figures."""
    cls = build_classifier(work / "cls")
    gen = build_generator(work / "gen")
    models = ["--model", f"cls={cls}:text-classification", "--model", f"gen={gen}:text-generation"]
    # one sequence a worker (as tests/test_multi_model.py's saturated server): with the
    # default's several, the clients never filled the queue and no 503 came
    bounds = ["--max-queue", "8", "--max-batch-size", "4", "--max-sequences", "1"]
    server = rawserve(None, work / "server.log", [*models, *bounds])
    server.start()
    try:
        probe = build_request(
            json.dumps({"inputs": "hi"}).encode(),
            path="/models/cls",
            content_type="application/json",
        )
        asyncio.run(wait_until_serving(server.port, probe, 300, server.alive))
        asyncio.run(timed_requests(server.port, "/models/cls", 30))  # connections, caches
        for round_ in range(1, rounds + 1):
            alone = p99(asyncio.run(timed_requests(server.port, "/models/cls", REQUESTS)))
            with saturating(server.port, "/models/gen", clients) as counts:
                busy = p99(asyncio.run(timed_requests(server.port, "/models/cls", REQUESTS)))
            figures = {
                "round": round_,
                "p99_alone_ms": round(alone * 1000, 2),
                "p99_beside_saturated_ms": round(busy * 1000, 2),
                "ratio": round(busy / alone, 2),
                "saturating_statuses": counts,
            }
            print(json.dumps(figures), flush=True)
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.isolation", description=described(__doc__)
    )
    parser.add_argument("--rounds", type=int, default=3, help="alone, then beside the saturated")
    parser.add_argument("--clients", type=int, default=16, help="saturating clients")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rawserve-isolation-"))
    try:
        measure(work, args.rounds, args.clients)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # two models, ~100 MB
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where TEI's /tokenize and /decode should run: in the server process, with the torch-free
`tokenizers` library, or in the model workers, through the scheduler and the pipe.

On all-MiniLM-L6-v2's tokenizer it reports:
- what holding a tokenizer costs the server process: import and load time, resident memory;
- the server-side cost of one answer (encode, TEI's token objects, JSON) for a sentence,
  a 512-token passage, 32 sentences, and a body of the largest default size (1 MiB);
- the latency of a request that never leaves the server process (`GET /v1/models`): the
  fixed part of a server-side answer, which the encode above adds to;
- the latency of the same tokenization through a worker (a `--handler` that tokenizes,
  `POST /`), with the worker idle, and while it runs 200 ms model batches back to back.

    python -m bench.tokenize_placement            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench import described, load, servers
from bench.models import minilm_path
from rawserve.api.tokens import token_objects, tokens_json, utf8_starts  # the server's own

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
BUSY_BATCH_SECONDS = 0.2


def tokenizer_file() -> str:
    return str(Path(minilm_path()) / "tokenizer.json")


def tokenizing_handler() -> Callable[..., list[Any]]:
    """A `--handler` factory: the worker-side path (sleep > 0 stands for a model batch)."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file())
    tokenizer.no_truncation()
    tokenizer.no_padding()  # its file pads to 128 for the model; an answer lists real tokens

    def handle(inputs: list[str], sleep: float = 0.0, **params: Any) -> list[Any]:
        if sleep:
            time.sleep(sleep)
            return [None] * len(inputs)
        encodings = tokenizer.encode_batch(inputs)
        return [[tei_tokens(e, t)] for e, t in zip(encodings, inputs, strict=True)]

    return handle


def tei_tokens(encoding: Any, text: str) -> list[dict[str, Any]]:
    """TEI's token objects for one whole input, as the server makes them (its offsets in
    UTF-8 bytes): what a worker would send back for the server to write."""
    raw = text.encode()
    byte_at = None if len(raw) == len(text) else utf8_starts(text)
    specials, names = encoding.special_tokens_mask, encoding.tokens
    return token_objects(encoding.ids, encoding.offsets, specials, names, raw, byte_at, 0)


# --- the server process's side --------------------------------------------------------

LOAD_PROBE = """
import json, time, resource
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
t0 = time.perf_counter()
import tokenizers
t1 = time.perf_counter()
imported = rss()
tok = tokenizers.Tokenizer.from_file({path!r})
t2 = time.perf_counter()
print(json.dumps({{"import_ms": 1000 * (t1 - t0), "load_ms": 1000 * (t2 - t1),
    "import_rss_mib": (imported - before) / 2**20, "load_rss_mib": (rss() - imported) / 2**20}}))
"""


def load_cost() -> dict[str, float]:
    """Import and load in a fresh interpreter, as the server process would at start."""
    probe = LOAD_PROBE.format(path=tokenizer_file())
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                  check=True).stdout)
        for _ in range(3)
    ]  # fmt: skip
    return {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]}


def in_process_costs() -> dict[str, dict[str, float]]:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file())
    tokenizer.no_truncation()
    tokenizer.no_padding()  # its file pads to 128 for the model; an answer lists real tokens
    passage = " ".join([SENTENCE] * 38)  # about 512 tokens
    megabyte = (SENTENCE + " ") * (2**20 // (len(SENTENCE) + 1))
    cases = {
        "sentence": [SENTENCE],
        "passage_512_tokens": [passage],
        "32_sentences": [SENTENCE] * 32,
        "1_MiB_body": [megabyte],
    }
    found = {}
    for name, texts in cases.items():
        repeats = 3 if name == "1_MiB_body" else 200

        def answer(texts: list[str] = texts) -> bytes:  # as ServerTokenizer writes it
            encodings = tokenizer.encode_batch(texts)
            parts = [tokens_json(e, t) for e, t in zip(encodings, texts, strict=True)]
            return b"[" + b",".join(parts) + b"]"

        def encode_only(texts: list[str] = texts) -> Any:
            return tokenizer.encode_batch(texts)

        ids = tokenizer.encode_batch(texts)[0].ids
        found[name] = {
            "tokens": len(tokenizer.encode_batch(texts)[0].ids) * len(texts),
            "encode_ms": _median_ms(encode_only, repeats),
            "answer_ms": _median_ms(answer, repeats),
            "decode_ms": _median_ms(lambda ids=ids: tokenizer.decode(ids), repeats),
        }
    return found


def _median_ms(call: Callable[[], Any], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 4)


# --- over HTTP ------------------------------------------------------------------------


async def latencies(port: int, request: bytes, count: int) -> dict[str, float | None]:
    connection = await load.connect(port)
    try:
        for _ in range(20):
            await connection.request(request)
        measured = []
        loop = asyncio.get_running_loop()
        for _ in range(count):
            sent = loop.time()
            status, _ = await connection.request(request)
            assert status == 200, status
            measured.append(loop.time() - sent)
    finally:
        connection.close()
    return load.latency_summary(measured)


async def while_busy(port: int, request: bytes, count: int) -> dict[str, float | None]:
    """Latencies of `request` while another client keeps the worker in 200 ms batches."""
    busy = load.build_request(
        orjson.dumps({"inputs": "x", "parameters": {"sleep": BUSY_BATCH_SECONDS}}),
        content_type="application/json",
    )
    stop = asyncio.Event()

    async def keep_busy() -> None:
        connection = await load.connect(port)
        try:
            while not stop.is_set():
                await connection.request(busy)
        finally:
            connection.close()

    busy_tasks = [asyncio.ensure_future(keep_busy()) for _ in range(2)]
    await asyncio.sleep(BUSY_BATCH_SECONDS)
    try:
        return await latencies(port, request, count)
    finally:
        stop.set()
        await asyncio.gather(*busy_tasks)


async def over_http(port: int, count: int) -> dict[str, Any]:
    tokenize = load.build_request(
        orjson.dumps({"inputs": SENTENCE}), content_type="application/json"
    )
    in_server = load.build_request(b"", method="GET", path="/v1/models")
    await load.wait_until_serving(port, load.build_request(b"", method="GET", path="/ready"), 120)
    return {
        "answered_in_server_GET_v1_models": await latencies(port, in_server, count),
        "through_worker_idle": await latencies(port, tokenize, count),
        "answered_in_server_while_worker_busy": await while_busy(port, in_server, count // 5),
        "through_worker_while_busy": await while_busy(port, tokenize, count // 5),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tokenize_placement", description=described(__doc__)
    )
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"load": load_cost(), "in_process": in_process_costs()}
    with tempfile.TemporaryDirectory() as folder:
        server = servers.rawserve(
            None,
            Path(folder) / "rawserve.log",
            ["--threads", "1", "--max-batch-delay-ms", "0"],
            handler="bench.tokenize_placement:tokenizing_handler",
        ).start()
        try:
            report["http"] = asyncio.run(over_http(server.port, args.requests))
        finally:
            server.stop()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each served model costs in memory: the RSS of the server and of every worker.

Starts rawserve with one model on one CPU worker, the same model twice (two aliases,
one worker each) and one model on two CPU workers (`--device cpu,cpu`); once /ready
says 200 (the warm-up batch has run), each model computes one batch of 32 texts of
about 120 tokens, then the resident memory of the server process and of each worker
(from /proc, worker pids from /info) is read.

    python -m bench.model_memory

The packaged all-MiniLM-L6-v2 (22.7 M parameters, 90 MB of float32 weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.load import build_request, wait_until_serving
from bench.servers import rawserve, rss_bytes
from rawserve.models.folder import default_model

READY = build_request(b"", method="GET", path="/ready")
LONG_TEXT = " ".join(["a sentence of several words that the tokenizer splits"] * 12)
SETUPS = {
    "one model, one worker": (["m0"], "cpu"),
    "two models, one worker each": (["m0", "m1"], "cpu"),
    "one model, two workers": (["m0"], "cpu,cpu"),
}
MIB = 1024 * 1024


def get_json(port: int, path: str, body: object | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.load(answer)


def measure(aliases: Sequence[str], devices: str, logs: Path) -> tuple[float, list[float]]:
    """(server RSS, every worker's RSS) in MiB, after each model ran a full batch."""
    args = ["--device", devices, "--max-batch-size", "32"]
    for alias in aliases:
        args += ["--model", f"{alias}={default_model()}"]
    server = rawserve(None, logs / f"rawserve-{len(aliases)}-{devices}.log", args)
    server.start()
    try:
        asyncio.run(wait_until_serving(server.port, READY, 600, alive=server.alive))
        for alias in aliases:
            get_json(server.port, f"/models/{alias}", {"inputs": [LONG_TEXT] * 32})
        info = get_json(server.port, "/info")
        assert isinstance(info, dict)
        pids = [pid for model in info["models"] for pid in model["worker_pids"]]
        return rss_bytes(server.pid) / MIB, [rss_bytes(pid) / MIB for pid in pids]
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    # no options: --help says what it measures, rather than starting the measurement
    argparse.ArgumentParser(
        prog="python -m bench.model_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    print("| served | server RSS | worker RSS (each) | total |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="rawserve-memory-") as logs:
        for name, (aliases, devices) in SETUPS.items():
            server, workers = measure(aliases, devices, Path(logs))
            each = ", ".join(f"{rss:.0f}" for rss in workers)
            total = server + sum(workers)
            print(f"| {name} | {server:.0f} MiB | {each} MiB | {total:.0f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

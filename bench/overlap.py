"""Two batches in flight per worker against one, on the same warm workers, A B A B.

The worker pool (rawserve.serving.pool) runs the packaged all-MiniLM-L6-v2's embeddings
on `--device` (default: one single-threaded CPU worker per core, the default CPU layout)
and is fed closed-loop: a batch of `--batch` short texts is submitted whenever a worker
has room. Rounds alternate between one batch in flight per worker and two (the worker
keeps its process between rounds: only the pool's choice changes), and the median and
range of each are printed.

    python -m bench.overlap --rounds 4 --seconds 4

With `--prepare`: two batches in flight on both sides, each batch tokenized ahead on the
worker's preparing thread against tokenized by the model's thread (two pools, one of
each, fed in turn). `--layers` / `--hidden` replace MiniLM by a random encoder of that
size with its tokenizer: a model whose forward pass costs about what tokenizing its batch
does, as BERT-base does on a GPU (an H100: ~9 ms for 256 short texts, the tokenizer ~7).

    python -m bench.overlap --prepare --device cpu --threads 1 --batch 64 --layers 1 --hidden 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def closed_loop(
    pool, wake: asyncio.Event, texts: list[str], batch: int, seconds: float
) -> float:
    """Items per second while every free slot of the pool is kept filled (`wake`: set by
    the pool whenever a worker may take a batch, as it wakes the scheduler; a worker's
    second slot opens near the end of its running batch, not only when one is answered)."""
    done = 0
    pending: set[asyncio.Future] = set()
    start = time.perf_counter()
    cursor = 0
    while time.perf_counter() - start < seconds:
        while pool.idle_workers():
            inputs = [texts[(cursor + i) % len(texts)] for i in range(batch)]
            cursor += batch
            pending.add(pool.submit(inputs, {}))
        wake.clear()
        woken = asyncio.ensure_future(wake.wait())
        finished, pending = await asyncio.wait(
            pending | {woken}, return_when=asyncio.FIRST_COMPLETED, timeout=1.0
        )
        woken.cancel()
        finished.discard(woken)
        pending.discard(woken)
        done += sum(len(future.result().outputs) for future in finished)
    finished, _ = await asyncio.wait(pending) if pending else (set(), set())
    done += sum(len(future.result().outputs) for future in finished)
    return done / (time.perf_counter() - start)


def small_encoder(layers: int, hidden: int, folder: Path) -> str:
    """A random BERT encoder of that size with MiniLM's tokenizer, saved into `folder`."""
    import torch
    import transformers

    from bench.models import tokenizer_path

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path())
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
    )
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


async def ready_pool(config, devices: list[str], overlap: bool | None = None):
    """A started pool whose workers are all ready, and the event it sets when one is free."""
    from rawserve.serving.pool import WorkerPool

    wake = asyncio.Event()
    pool = WorkerPool(config, devices, overlap=overlap, on_idle=wake.set)
    pool.start()
    await pool.wait_ready()
    while not all(worker.ready for worker in pool.workers):
        await asyncio.sleep(0.2)
    return pool, wake


async def main_async(args: argparse.Namespace, work: Path) -> dict:
    from bench.models import minilm_path
    from bench.workloads import texts
    from rawserve.shared.messages import WorkerConfig

    devices = args.device.split(",") if args.device else ["cpu"] * (os.cpu_count() or 1)
    model = small_encoder(args.layers, args.hidden, work) if args.layers else minilm_path()
    config = WorkerConfig(
        model=model, task="feature-extraction", pooling="mean", threads=args.threads
    )
    corpus = texts("short")
    rates: dict[str, list[float]] = {}
    if args.prepare:  # a pool of each, both with two batches in flight
        pools = {
            "model thread tokenizes": await ready_pool(
                replace(config, prepare_ahead=False), devices, overlap=True
            ),
            "prepared ahead": await ready_pool(
                replace(config, prepare_ahead=True), devices, overlap=True
            ),
        }
    else:  # one pool, its choice switched
        both = await ready_pool(config, devices)
        pools = {"one": both, "two": both}
    for name, (pool, wake) in pools.items():
        await closed_loop(pool, wake, corpus, args.batch, 2.0)  # warm
        rates[name] = []
    for _ in range(args.rounds):
        for name, (pool, wake) in pools.items():
            if not args.prepare:
                for worker in pool.workers:
                    worker.overlap = name == "two"
            rate = await closed_loop(pool, wake, corpus, args.batch, args.seconds)
            rates[name].append(round(rate, 1))
            print(f"{name}: {rate:.1f} items/s", file=sys.stderr, flush=True)
    for pool, _ in {id(pool): (pool, wake) for pool, wake in pools.values()}.values():
        await pool.shutdown()
    return {
        "devices": devices,
        "model": f"random BERT, {args.layers} layers, hidden {args.hidden}"
        if args.layers
        else "all-MiniLM-L6-v2",
        "threads": args.threads,
        "batch": args.batch,
        "load_average": os.getloadavg()[0],
        **{
            name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
            for name, values in rates.items()
        },
        "rounds": rates,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__)
    parser.add_argument("--device", default=None, help="e.g. cpu,cpu or cuda (default: per core)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument(
        "--prepare", action="store_true", help="tokenized ahead against by the model's thread"
    )
    parser.add_argument("--layers", type=int, default=0, help="a random encoder of this depth")
    parser.add_argument("--hidden", type=int, default=128, help="its width (with --layers)")
    args = parser.parse_args(argv)
    # the random encoder's folder goes with the run (on a lent machine nothing else removes it)
    with tempfile.TemporaryDirectory(prefix="rawserve-bench-encoder-") as work:
        result = asyncio.run(main_async(args, Path(work)))
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

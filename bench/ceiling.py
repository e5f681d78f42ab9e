"""The model's own offline throughput in one process: the ceiling a server is measured against.

Three ways of running the same model on the same texts, at batch sizes 1 to 64 (1 to 1024
on a GPU, `--device cuda`, in float16 unless `--dtype` says otherwise):
- `forward`: the tokenizer on the batch, then one forward pass in PyTorch, the outputs
  brought back to the host (nothing else);
- `pipeline`: the transformers pipeline called on the batch as a list;
- `onnx`: the tokenizer, then one forward pass by ONNX Runtime, on the graph rawserve's
  ONNX engine serves (the model's own, or exported once into its cache).
Batches are taken in corpus order ("arrival"), and, for mixed lengths, also after sorting
a sample by length ("sorted": the least padding any server could get). Each point runs
batches drawn from the same sample of texts for `min_seconds`, in a few rounds of which
the best counts (the machine is shared; interference only ever slows a round down).

    python -m bench.ceiling --model DIR --task text-classification --texts short
    python -m bench.ceiling --model DIR --task text-classification --device cuda
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
GPU_BATCH_SIZES = (1, 4, 16, 64, 256, 1024)  # a GPU's throughput grows into the hundreds
SAMPLE_SIZE = 256
MIN_SECONDS = 1.5  # per point, split into ROUNDS
ROUNDS = 3


def default_dtype(device: str) -> str:
    """What rawserve runs by default on `device`: half precision on a GPU."""
    return "float16" if device.startswith("cuda") else "float32"


def load(
    model: str, task: str, device: str = "cpu", dtype: str = "float32"
) -> tuple[Any, Any, Any]:
    """(tokenizer, model, pipeline) for `task`, on `device` in `dtype`, in eval mode."""
    import torch
    import transformers

    model_class = (
        transformers.AutoModel
        if task == "feature-extraction"
        else transformers.AutoModelForSequenceClassification
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    from rawserve.worker.loading import choose_attention_kernels

    choose_attention_kernels(device)  # the kernels rawserve's worker runs on this device
    network = model_class.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    pipe = transformers.pipeline(task, model=network, tokenizer=tokenizer, device=device)
    return tokenizer, network, pipe


def forward_runner(tokenizer: Any, network: Any, device: str = "cpu") -> Callable[[list[str]], Any]:
    import torch

    def run(batch: list[str]) -> Any:
        encoded = tokenizer(batch, padding=True, truncation=True, return_tensors="pt").to(device)
        with torch.inference_mode():
            return network(**encoded)[0].float().cpu()  # on the host, as a server answers

    return run


def onnx_runner(model: str, task: str, tokenizer: Any, threads: int) -> Callable[[list[str]], Any]:
    from rawserve.worker.onnx_engine import load_network

    network = load_network(model, task, threads)

    def run(batch: list[str]) -> Any:
        encoded = tokenizer(batch, padding=True, truncation=True, return_tensors="pt")
        return network(**encoded)

    return run


def pipeline_runner(pipe: Any) -> Callable[[list[str]], Any]:
    def run(batch: list[str]) -> Any:
        return pipe(batch, batch_size=len(batch))

    return run


def batches(sample: Sequence[str], size: int, order: str, tokenizer: Any) -> list[list[str]]:
    items = list(sample)
    if order == "sorted":
        lengths = [len(ids) for ids in tokenizer(items, truncation=True)["input_ids"]]
        items = [text for _, text in sorted(zip(lengths, items, strict=True))]
    return [items[i : i + size] for i in range(0, len(items), size)]


def throughput(
    run: Callable[[list[str]], Any],
    work: list[list[str]],
    seconds: float,
    rounds: int = ROUNDS,
    whole_passes: bool = False,
) -> tuple[float, list[float]]:
    """Items per second (the best of `rounds` rounds) and every call's duration.

    Each round runs the batches in a shuffled order, cycling, for `seconds / rounds`; the
    best round is kept because what slows a round down here is the rest of the machine.
    With `whole_passes` (batches of unequal cost: mixed lengths) a round is one pass over
    all the batches instead, so that no round is a lucky draw of short ones.
    """
    run(work[0])  # warm-up
    rng = random.Random(0)
    calls: list[float] = []
    best = 0.0
    for _ in range(rounds):
        order = list(work)
        rng.shuffle(order)
        items = 0
        start = time.perf_counter()
        elapsed = 0.0
        for batch in itertools.cycle(order):
            began = time.perf_counter()
            run(batch)
            calls.append(time.perf_counter() - began)
            items += len(batch)
            elapsed = time.perf_counter() - start
            if whole_passes and items >= sum(map(len, work)):
                break
            if not whole_passes and elapsed >= seconds / rounds:
                break
        best = max(best, items / elapsed)
    return best, calls


def measure(
    model: str,
    task: str,
    sample: Sequence[str],
    *,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    orders: Sequence[str] = ("arrival",),
    modes: Sequence[str] = ("forward", "pipeline"),
    min_seconds: float = MIN_SECONDS,
    log: Callable[[str], None] = lambda line: None,
    device: str = "cpu",
    dtype: str | None = None,
) -> dict[str, Any]:
    import torch

    dtype = dtype or default_dtype(device)
    tokenizer, network, pipe = load(model, task, device, dtype)
    runners = {
        "forward": forward_runner(tokenizer, network, device),
        "pipeline": pipeline_runner(pipe),
    }
    if device != "cpu":  # ONNX Runtime runs on the CPU here
        modes = [mode for mode in modes if mode != "onnx"]
    if "onnx" in modes:
        runners["onnx"] = onnx_runner(model, task, tokenizer, torch.get_num_threads())
    result: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "sample": len(sample),
        "device": device,
        "dtype": dtype,
    }
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(device)
    lengths = [len(ids) for ids in tokenizer(list(sample), truncation=True)["input_ids"]]
    uneven = max(lengths) > 2 * min(lengths)  # mixed lengths: measure whole passes
    for mode in modes:
        for order in orders:
            if uneven and mode == "pipeline" and order == "arrival" and "sorted" in orders:
                continue  # mixed lengths are compared with sorted batches: save the time
            curve: dict[str, float] = {}
            for size in batch_sizes:
                work = batches(sample, size, order, tokenizer)
                rate, calls = throughput(
                    runners[mode],
                    work,
                    min_seconds,
                    whole_passes=uneven,
                    rounds=(2 if order == "sorted" else 1) if uneven else ROUNDS,
                )
                curve[str(size)] = round(rate, 2)
                log(f"  {mode:8} {order:7} batch {size:3}: {rate:7.1f} items/s")
                if mode in ("forward", "onnx") and order == "arrival" and size == 1:
                    key = "single_item_ms" if mode == "forward" else "onnx_single_item_ms"
                    result[key] = {
                        "p50": round(1000 * statistics.median(calls), 3),
                        "mean": round(1000 * statistics.fmean(calls), 3),
                    }
            best = max(curve, key=curve.__getitem__)
            result[f"{mode}/{order}"] = {
                "curve": curve,
                "best": curve[best],
                "best_batch": int(best),
            }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from bench.workloads import TEXT_SETS, texts

    parser = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    parser.add_argument("--model", required=True, help="a model folder")
    parser.add_argument(
        "--task", required=True, help="its task: text-classification, feature-extraction, ..."
    )
    parser.add_argument("--texts", choices=TEXT_SETS, default="short")
    parser.add_argument(
        "--sample", type=int, default=None, help="texts (default: 256; 1024 on a GPU)"
    )
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=MIN_SECONDS,
        help=f"timed seconds per batch size, split into rounds (default: {MIN_SECONDS:g})",
    )
    parser.add_argument("--batch-sizes", default=None, help="default: 1-64; 1-1024 on a GPU")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, help="default: float32; float16 on a GPU")
    parser.add_argument("--modes", default="forward,pipeline", help="forward, pipeline, onnx")
    parser.add_argument("--orders", default=None, help="default: arrival (+ sorted for mixed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    orders = args.orders or ("arrival,sorted" if args.texts == "mixed" else "arrival")
    gpu = args.device.startswith("cuda")
    sizes = args.batch_sizes or ",".join(map(str, GPU_BATCH_SIZES if gpu else BATCH_SIZES))
    sample = args.sample or (max(GPU_BATCH_SIZES) if gpu else SAMPLE_SIZE)
    result = measure(
        args.model,
        args.task,
        texts(args.texts)[:sample],
        batch_sizes=[int(b) for b in sizes.split(",")],
        orders=orders.split(","),
        modes=args.modes.split(","),
        min_seconds=args.min_seconds,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        device=args.device,
        dtype=args.dtype,
    )
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The worker's runner with CUDA graphs and without (`--no-cuda-graphs`), batch by batch.

Loads the BERT-base-sized classifier twice on the GPU through the worker's own loading
(`load_runner`: its dtype, its attention kernels), one runner replaying graphs, and runs
each batch size on both in turn (A B A B, `--rounds`), timing `runner.run` as the worker
calls it (tokenizer, forward pass, scores to the host); the graphs are captured before
the timing. Checks that both give the same labels, and scores within fp16's reach.

    python -m bench.cuda_graphs --batches 1 16 64 256 --texts short
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.gpu import missing_cuda

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCORE_TOLERANCE = 0.01  # fp16 logits through other kernels (a padded shape)


def timed(run, inputs: list[str], seconds: float) -> list[float]:
    """Milliseconds of each call of `run(inputs)` for about `seconds`."""
    found = []
    ends = time.perf_counter() + seconds
    while time.perf_counter() < ends or len(found) < 3:
        started = time.perf_counter()
        run(inputs, {})
        found.append(1000 * (time.perf_counter() - started))
    return found


def captured(runner) -> int:
    graphed = getattr(runner, "graphed", None)
    return len(graphed.graphs) if graphed is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_graphs", description=__doc__)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--texts", default="short")
    parser.add_argument("--seconds", type=float, default=0.5, help="per batch size, round, side")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--work",
        type=Path,
        help="a folder to build the model in, kept (default: a temporary one, removed at the end)",
    )
    args = parser.parse_args(argv)
    if said := missing_cuda(args.device):
        parser.exit(2, f"{parser.prog}: {said} (or --device cpu)\n")
    if args.work is not None:
        return compare(args, args.work)
    # the model weighs 419 MB: a folder left in /tmp outlives the run on a lent machine
    with tempfile.TemporaryDirectory(prefix="rawserve-bench-graphs-") as work:
        return compare(args, Path(work))


def compare(args: argparse.Namespace, work: Path) -> int:
    from bench.models import build_bert_base_classifier
    from bench.workloads import texts
    from rawserve.shared.messages import WorkerConfig
    from rawserve.worker.loading import load_runner

    folder = str(build_bert_base_classifier(work / "bert-base-classifier"))
    runners = {
        graphs: load_runner(
            WorkerConfig(model=folder, task="text-classification", cuda_graphs=graphs),
            args.device,
        )
        for graphs in (False, True)
    }
    print(f"graphs: {runners[True].cuda_graphs}", flush=True)
    corpus = texts(args.texts)
    for size in args.batches:
        inputs = [corpus[i % len(corpus)] for i in range(size)]
        answers = {graphs: runner.run(inputs, {}) for graphs, runner in runners.items()}
        labels_agree = all(
            a["label"] == b["label"] for a, b in zip(answers[False], answers[True], strict=True)
        )
        worst = max(abs(a["score"] - b["score"]) for a, b in zip(*answers.values(), strict=True))
        ms: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for graphs, runner in runners.items():
                ms[graphs] += timed(runner.run, inputs, args.seconds)
        found = {
            "batch": size,
            "eager_ms_p50": round(statistics.median(ms[False]), 3),
            "graphs_ms_p50": round(statistics.median(ms[True]), 3),
            "eager_items_per_s": round(1000 * size / statistics.median(ms[False]), 1),
            "graphs_items_per_s": round(1000 * size / statistics.median(ms[True]), 1),
            "labels_agree": labels_agree,
            "largest_score_gap": round(worst, 5),
            "graphs_captured": captured(runners[True]),
        }
        print(json.dumps(found), flush=True)
        if not labels_agree and worst > SCORE_TOLERANCE:
            print("the graphs' answers differ", flush=True)
            return 1
    graphed = getattr(runners[True], "graphed", None)
    if graphed is not None and (graphed.failed or not graphed.graphs):
        # timings of the pass as it is on both sides: no comparison at all
        print("no graph was recorded (the warning above says why): nothing compared", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bfloat16 against float32 on the CPU: how far an encoder's answers move, and the time of
a batch in each, through the worker's own runners (what `--dtype bfloat16` serves).

    python -m bench.bfloat16_accuracy [--model FOLDER] [--texts 256] [--threads 1]

The packaged all-MiniLM-L6-v2 by default, its sentence vectors (mean-pooled, normalized:
what /embed and /v1/embeddings answer) of the mixed-length corpus; a classifier's scores
and labels for a text-classification model. Where the CPU has no bfloat16 units
(`precision_trial.bf16_units`), bfloat16 is emulated and slower: its time says nothing
of a CPU with AMX, but its answers are the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench import described
from bench.workloads import texts
from rawserve.models.folder import default_model, read_facts
from rawserve.shared.messages import WorkerConfig
from rawserve.worker import engine_trial, precision_trial
from rawserve.worker.loading import build_runner

BATCH = 32


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bfloat16_accuracy", description=described(__doc__)
    )
    parser.add_argument("--model", default=None, help="a model folder (default: the packaged)")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.model or default_model()
    facts = read_facts(Path(folder))
    config = WorkerConfig(model=folder, task=facts.task, threads=args.threads)
    params = {"pooling": "mean", "normalize": True} if facts.task == "feature-extraction" else {}
    float32 = build_runner(config, facts.task, "cpu", None)
    bfloat16 = build_runner(dataclasses.replace(config, dtype="bfloat16"), facts.task, "cpu", None)
    corpus = texts("mixed", args.texts)
    batches = [corpus[i : i + BATCH] for i in range(0, len(corpus), BATCH)]
    reference = [answer for batch in batches for answer in float32.run(batch, params)]
    moved = [answer for batch in batches for answer in bfloat16.run(batch, params)]
    drift = precision_trial.compare(reference, moved)
    started = time.perf_counter()
    seconds = engine_trial.timed(
        {
            "float32": lambda: float32.run(batches[0], params),
            "bfloat16": lambda: bfloat16.run(batches[0], params),
        }
    )
    flags = engine_trial.cpu_facts().get("flags", "")
    print(
        json.dumps(
            {
                "model": folder,
                "task": facts.task,
                "texts": len(corpus),
                "largest_difference": drift.largest,
                "lowest_cosine": drift.cosine,
                "same_labels": drift.same_labels,
                "batch": BATCH,
                "float32_ms": round(seconds["float32"] * 1000, 1),
                "bfloat16_ms": round(seconds["bfloat16"] * 1000, 1),
                "bf16_units": precision_trial.bf16_units(flags) or "none (emulated)",
                "cpu": engine_trial.cpu_facts().get("model name"),
                "threads": args.threads,
                "timing_seconds": round(time.perf_counter() - started, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

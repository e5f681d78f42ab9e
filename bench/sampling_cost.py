"""What the continuous loop does to each row's scores at every step beside the model's
forward pass, at a real vocabulary: greedy, log probabilities, sampling with each of
generate's settings, OpenAI's penalties, a logit bias and TGI's watermark.

    python -m bench.sampling_cost [--vocabulary 50257] [--rows 64] [--rounds 3]

A random GPT-2 of one layer and hidden 64 with a real-size vocabulary (GPT-2's 50,257 by
default; Llama 3's 128,256, Qwen2's 151,936), so that its forward pass is a few ms and the
step's time is mostly the work on the scores; prompts are token ids (no tokenizer), and
no row ends before the run does. Per setting, `--rows` rows join, then the median time of
`ContinuousBatcher.step()` over `--steps` steps; the settings are interleaved round by
round (the machine is shared) and each one's median over `--rounds` is printed, with what
it adds to greedy's step. One thread by default: a CPU's figure per core.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.generation import NoTokenizer, build_model

POSITIONS = 512
PROMPT = 8  # tokens a prompt
# each setting's row: a `Generation`'s fields (penalties as OpenAI's request fields)
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "greedy, top_logprobs 5": {"logprobs": True, "top_n": 5},
    "temperature 0.7": {"do_sample": True, "temperature": 0.7},
    "+ top_k 50": {"do_sample": True, "temperature": 0.7, "top_k": 50},
    "+ top_k 50, top_p 0.9": {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "top_p 0.9 alone": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    "min_p 0.05": {"do_sample": True, "min_p": 0.05},
    "typical_p 0.9": {"do_sample": True, "typical_p": 0.9},
    "repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "frequency 0.5, presence 0.3": {"openai": {"frequency_penalty": 0.5, "presence_penalty": 0.3}},
    "logit_bias (2 tokens)": {"openai": {"logit_bias": {"5": 2.0, "7": -1.0}}},
    "watermark (TGI's)": {"watermark": True},
}


def step_time(model: Any, setting: dict[str, Any], rows: int, steps: int) -> float:
    """The median seconds of a step of `rows` rows of `setting`, after they joined."""
    from rawserve.worker.continuous import ContinuousBatcher, Generation
    from rawserve.worker.scores import ScoreAdjustments

    vocabulary = model.config.vocab_size
    fields = {key: value for key, value in setting.items() if key not in ("openai", "logprobs")}
    batcher = ContinuousBatcher(model, NoTokenizer(), POSITIONS, rows)
    rng = random.Random(1)
    for key in range(rows):
        adjustments = ScoreAdjustments.asked(setting.get("openai", {}), vocabulary)
        logprobs: list[float] | None = [] if setting.get("logprobs") else None
        prompt = [rng.randrange(vocabulary) for _ in range(PROMPT)]
        batcher.add(
            Generation(key, prompt, POSITIONS - PROMPT - 1, seed=key, logprobs=logprobs,
                       adjustments=adjustments, **fields)
        )  # fmt: skip
    batcher.step()  # (they join)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        batcher.step()
        times.append(time.perf_counter() - started)
    if len(batcher.rows) != rows:  # (a row that failed would leave a step of fewer)
        failed = [g.failure for g in batcher.rows if g.done]
        raise RuntimeError(f"rows of {setting} ended before the run did: {failed}")
    return statistics.median(times)


def measure(
    vocabulary: int, rows: int, steps: int, rounds: int, names: Sequence[str] = tuple(SETTINGS)
) -> dict[str, float]:
    """Each setting's step in ms, the median of `rounds` interleaved rounds."""
    model = build_model(layers=1, hidden=64, vocabulary=vocabulary)
    step_time(model, SETTINGS["greedy"], rows, 1)  # (warm)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            runs[name].append(step_time(model, SETTINGS[name], rows, steps))
    return {name: 1000 * statistics.median(times) for name, times in runs.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sampling_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vocabulary", type=int, default=50257)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="timed steps a run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    figures = measure(args.vocabulary, args.rows, args.steps, args.rounds)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{args.rows} rows, {args.vocabulary} tokens: ms a step (beside greedy's step)")
    for name, ms in figures.items():
        print(f"  {name:30s} {ms:8.1f}  ({ms - figures['greedy']:+.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

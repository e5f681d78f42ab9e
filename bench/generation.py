"""Generation in-process: static `generate` on a left-padded batch against the
iteration-level loop (`rawserve.worker.continuous`), on the same prompts.

    python -m bench.generation [--rounds 3] [--layers 2] [--hidden 128]
    python -m bench.generation --device cuda --layers 12 --hidden 768   # + CUDA graphs

A random GPT-2 (2 layers, hidden 128 by default: the CPU's "small" model) with no end of
sequence, so every request makes exactly the tokens it asked for. Scenarios: 1, 16 and 64
requests of 64 new tokens at once, and 64 requests of 8-256 new tokens (seeded). Static
batching runs each batch to its longest member; the loop lets each sequence leave when
it is done; 256 requests of 64 new tokens joining one a step (the next as soon as one
leaves, as closed-loop clients' do in a server once their answers have spread out: most
steps then also prefill a joiner; static: batches of 64) say what those joins cost.
Reported per scenario: useful tokens/s (the tokens asked for), time to first
token (p50) and inter-token latency (p50, p99) as a streaming client would see them. On a
GPU the loop runs twice, its decoding steps as they are and replayed from CUDA graphs
(`rawserve.worker.decode_graphs`; the graphs are recorded in the warm-up pass). In the
joining scenario each loop also runs with joiners waiting up to `--join-wait-steps` steps
for company (`gathered`: one prefill for several, rawserve's `--join-wait-steps`).
`--pass-floor-ms` adds that many milliseconds of idle wait to every forward pass, as a
GPU's pass costs about the same whatever its rows: on a CPU, what gathering joins would
win there. The ways are interleaved round by round (the machine is shared), medians and
ranges kept.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench import described

FIXED_NEW_TOKENS = 64
MIXED = (8, 256)
POSITIONS = 512
LOOP_ROWS = 64  # the loop's rows at most (a CPU worker's default)
JOINING_REQUESTS = 256  # "joining one a step": four requests a row
JOIN_WAIT_STEPS = 4  # the gathered ways' (`--join-wait-steps`)


def build_model(
    layers: int,
    hidden: int,
    device: str = "cpu",
    dtype: str | None = None,
    vocabulary: int = 8192,
) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocabulary,
        n_positions=POSITIONS,
        n_embd=hidden,
        n_layer=layers,
        n_head=2,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.pad_token_id = 0
    if dtype:
        model.to(getattr(torch, dtype))
    return model.to(device)


class NoTokenizer:
    """What the loop needs of a tokenizer when nothing stops on text: no end of sequence."""

    eos_token_id = None
    unk_token_id = None
    all_special_ids: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[None]:
        return [None] * len(tokens)  # no byte tokens (a byte-fallback tokenizer's)


def prompts(count: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, 8192) for _ in range(rng.randint(8, 32))] for _ in range(count)]


def static(model: Any, batch: list[list[int]], asks: list[int]) -> dict[str, Any]:
    """One `generate` call on the left-padded batch, run to its longest ask."""
    import torch
    import transformers

    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    times: list[float] = []

    class Clock(transformers.StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    longest = max(asks)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            stopping_criteria=transformers.StoppingCriteriaList([Clock()]),
        )
    total = time.perf_counter() - started
    # a streaming client of row i sees its tokens at the batch's first asks[i] steps
    first = [times[0] - started] * len(batch)
    gaps = [b - a for ask in asks for a, b in zip(times[: ask - 1], times[1:ask], strict=True)]
    return {"seconds": total, "useful": sum(asks), "first": first, "gaps": gaps}


def loop(model: Any, cuda_graphs: bool = False, join_wait_steps: int = 0) -> Any:
    """The iteration-level loop, kept from run to run as a server keeps it (its cache's
    buffers, its graphs)."""
    from rawserve.worker.continuous import ContinuousBatcher

    model.generation_config.eos_token_id = None  # every request makes all its tokens
    return ContinuousBatcher(
        model,
        NoTokenizer(),
        POSITIONS,
        LOOP_ROWS,
        cuda_graphs=cuda_graphs,
        join_wait_steps=join_wait_steps,
    )


def floor_every_pass(model: Any, seconds: float) -> None:
    """Every forward pass of `model` waits `seconds` first, the core idle: a pass whose
    cost hardly grows with its rows, as on a GPU."""

    def wait(module: Any, args: Any) -> None:
        time.sleep(seconds)

    model.register_forward_pre_hook(wait)


def continuous(
    model: Any,
    batch: list[list[int]],
    asks: list[int],
    engine: Any = None,
    one_a_step: bool = False,
) -> dict[str, Any]:
    """Every request added at once to the loop; each leaves when its tokens are made.
    `one_a_step`: the requests join one a step while fewer than the loop's rows run, and
    the next as soon as one leaves, as closed-loop clients' requests do in a server once
    their answers have spread out: most steps then also prefill a joiner."""
    from rawserve.worker.continuous import Generation

    seen: dict[Any, list[float]] = {i: [] for i in range(len(batch))}
    added: dict[Any, float] = {}

    def on_token(generation: Generation, token: int, piece: str) -> None:
        seen[generation.key].append(time.perf_counter())

    engine = engine or loop(model)
    engine.on_token = on_token
    pending = list(enumerate(zip(batch, asks, strict=True)))[::-1]

    def join() -> None:
        key, (prompt, ask) = pending.pop()
        added[key] = time.perf_counter()
        engine.add(Generation(key, prompt, ask))

    engine.passes.taken()
    started = time.perf_counter()
    while pending and not one_a_step:
        join()
    while pending or engine.busy:
        if pending and len(engine.rows) + len(engine.waiting) < engine.max_rows:
            join()
        engine.step()
    total = time.perf_counter() - started
    passes = engine.passes.taken()
    first = [times[0] - added[key] for key, times in seen.items()]
    gaps = [b - a for times in seen.values() for a, b in zip(times, times[1:], strict=False)]
    found = {"seconds": total, "useful": sum(asks), "first": first, "gaps": gaps}
    if passes is not None and passes.steps:
        found["prefills_per_step"] = passes.prefills / passes.steps
    return found


def static_batches(model: Any, batch: list[list[int]], asks: list[int]) -> dict[str, Any]:
    """Static batching of more requests than the loop's rows: `generate` on each batch of
    LOOP_ROWS in turn."""
    runs = [
        static(model, batch[start : start + LOOP_ROWS], asks[start : start + LOOP_ROWS])
        for start in range(0, len(batch), LOOP_ROWS)
    ]
    return {
        "seconds": sum(run["seconds"] for run in runs),
        "useful": sum(run["useful"] for run in runs),
        "first": [first for run in runs for first in run["first"]],
        "gaps": [gap for run in runs for gap in run["gaps"]],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [run["useful"] / run["seconds"] for run in runs]
    firsts = [statistics.median(run["first"]) for run in runs]
    gaps = sorted(g for run in runs for g in run["gaps"])
    return {
        "tokens_per_s": round(statistics.median(rates)),
        "tokens_per_s_range": [round(min(rates)), round(max(rates))],
        "ttft_p50_ms": round(1000 * statistics.median(firsts), 1),
        "itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 2) if gaps else None,
        "itl_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 2) if gaps else None,
        **joins(runs),
    }


def joins(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The loop's prefills per decoding step, median over the runs (the loop's ways only)."""
    shares = [run["prefills_per_step"] for run in runs if "prefills_per_step" in run]
    return {"prefills_per_step": round(statistics.median(shares), 2)} if shares else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.generation", description=described(__doc__)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", help="float32 or float16 (default: float16 on cuda)")
    parser.add_argument(
        "--join-wait-steps",
        type=int,
        default=JOIN_WAIT_STEPS,
        help="the gathered ways' steps a joiner may wait (0: no gathered ways)",
    )
    parser.add_argument(
        "--pass-floor-ms",
        type=float,
        default=0.0,
        help="idle milliseconds added to every forward pass (a GPU-like flat pass cost)",
    )
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    on_cuda = args.device.startswith("cuda")
    model = build_model(args.layers, args.hidden, args.device, args.dtype or on_cuda and "float16")
    if args.pass_floor_ms:
        floor_every_pass(model, args.pass_floor_ms / 1000)
    rng = random.Random(0)
    # name: prompts, new tokens, whether they join one a step (else all at once)
    scenarios: dict[str, tuple[list[list[int]], list[int], bool]] = {
        f"{n} x {FIXED_NEW_TOKENS}": (prompts(n, rng), [FIXED_NEW_TOKENS] * n, False)
        for n in (1, 16, 64)
    }
    scenarios["64 x 8-256"] = (prompts(64, rng), [rng.randint(*MIXED) for _ in range(64)], False)
    joining = f"{JOINING_REQUESTS} x {FIXED_NEW_TOKENS} joining one a step"
    scenarios[joining] = (
        prompts(JOINING_REQUESTS, rng),
        [FIXED_NEW_TOKENS] * JOINING_REQUESTS,
        True,
    )
    engines = {"continuous": loop(model)}
    if on_cuda:
        engines["graphs"] = loop(model, cuda_graphs=True)
    if args.join_wait_steps:  # where joiners come one a step (they make no odds elsewhere)
        for way in list(engines):
            engines[f"{way}, gathered"] = loop(model, way == "graphs", args.join_wait_steps)
    ways: dict[str, Any] = {"static": lambda batch, asks, _: static_batches(model, batch, asks)}
    for way, engine in engines.items():
        ways[way] = lambda batch, asks, one_a_step, engine=engine: continuous(
            model, batch, asks, engine, one_a_step
        )

    def ways_of(scenario: tuple[list[list[int]], list[int], bool]) -> dict[str, Any]:
        one_a_step = scenario[2]
        return {way: run for way, run in ways.items() if one_a_step or "gathered" not in way}

    for scenario in scenarios.values():  # warm every way at every shape (graphs recorded)
        for run in ways_of(scenario).values():
            run(*scenario)
    results: dict[str, dict[str, Any]] = {}
    for name, scenario in scenarios.items():
        chosen = ways_of(scenario)
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in chosen}
        for _ in range(args.rounds):  # interleaved: the machine's speed drifts
            for way, run in chosen.items():
                runs[way].append(run(*scenario))
        results[name] = {way: summary(found) for way, found in runs.items()}
        static_rate = results[name]["static"]["tokens_per_s"]
        for way in runs.keys() - {"static"}:
            ratio = results[name][way]["tokens_per_s"] / static_rate
            results[name][f"ratio_{way}"] = round(ratio, 2)
        print(name, json.dumps(results[name]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a batch of a new shape costs under each of PyTorch's attention kernels.

A server's batches come in ever-new shapes (how many items, how many padded tokens), where
an offline ceiling repeats one. Some of `scaled_dot_product_attention`'s kernels plan
per shape: cuDNN's builds a graph for every new one, on the CPU, before it runs. This
times, in one process, a BERT-base-sized encoder (random weights, half precision) on

- `new shapes`: batches of random sizes (1-256 items) and padded lengths (8-64 tokens),
  each shape drawn once, as a server under load sends them; then the same shapes again
  (`seen shapes`: whatever is left of the difference is a cost per new shape, which
  rounding lengths up to fewer shapes could save);
- `one shape`: the same batch of 256 items of 16 tokens again and again, as a ceiling does;

and a GPT-2-small-sized decoder's `generate` (a left-padded batch, so the attention
carries a mask) at new prompt lengths: every decoding step is a new key length,

under each choice of kernels: PyTorch's own, and with cuDNN's, the memory-efficient or
the math kernel alone.

    python -m bench.attention_shapes --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.gpu import missing_cuda

CHOICES = ("default", "no-cudnn", "cudnn", "efficient", "math")


def kernels(choice: str) -> Any:
    """A context in which SDPA may use only `choice`'s kernels."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "default": None,
        "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
    }[choice]
    return contextlib.nullcontext() if chosen is None else sdpa_kernel(chosen)


def timed(run: Callable[[], Any], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


def encoder_batch(torch: Any, size: int, length: int, vocab: int, device: str) -> dict:
    """`size` rows padded to `length` tokens, the last row shorter (a mask that masks)."""
    ids = torch.randint(1000, vocab, (size, length), device=device)
    mask = torch.ones(size, length, dtype=torch.long, device=device)
    mask[-1, length // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def encoder_figures(args: argparse.Namespace, torch: Any, transformers: Any) -> dict:
    config = transformers.BertConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    )
    dtype = getattr(torch, args.dtype)
    model = transformers.BertModel(config).to(args.device, dtype).eval()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    vocab = config.vocab_size
    with torch.inference_mode():  # kernels loaded, memory reserved: not part of any figure
        model(**encoder_batch(torch, 256, 64, vocab, args.device))
        sync()

    def measure(index: int, choice: str) -> dict:
        shapes = random.Random(index).sample(
            [(size, length) for size in range(1, 257) for length in range(8, 65)], args.batches
        )
        with torch.inference_mode(), kernels(choice):

            def each_shape() -> list[float]:
                return [
                    timed(lambda s=s: model(**encoder_batch(torch, *s, vocab, args.device)), sync)
                    for s in shapes
                ]

            new = each_shape()
            seen = each_shape()  # the same shapes again: what a shape costs once seen
            fixed = encoder_batch(torch, 256, 16, vocab, args.device)
            same = [timed(lambda: model(**fixed), sync) for _ in range(args.batches)]
        items = sum(size for size, _ in shapes)
        return {
            "new_shapes_items_per_s": round(items / sum(new), 1),
            "new_shapes_ms_p50": round(1e3 * statistics.median(new), 2),
            "new_shapes_ms_max": round(1e3 * max(new), 2),
            "seen_shapes_items_per_s": round(items / sum(seen), 1),
            "one_shape_ms_p50": round(1e3 * statistics.median(same[1:]), 2),
            "one_shape_items_per_s": round(256 / statistics.median(same[1:]), 1),
        }

    return each_choice("encoder", args.choices, measure)


def each_choice(name: str, choices: Sequence[str], measure: Callable[[int, str], dict]) -> dict:
    """`measure` under each choice; a choice whose kernels cannot run here says why."""
    found: dict[str, Any] = {}
    for index, choice in enumerate(choices):
        try:
            found[choice] = measure(index, choice)
        except RuntimeError as exc:  # e.g. no kernel of that kind for these inputs
            found[choice] = {"error": str(exc).splitlines()[0][:200]}
        print(f"{name}, {choice}: {found[choice]}", file=sys.stderr, flush=True)
    return found


def decoder_figures(args: argparse.Namespace, torch: Any, transformers: Any) -> dict:
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    dtype = getattr(torch, args.dtype)
    model = transformers.GPT2LMHeadModel(config).to(args.device, dtype).eval()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def generate(rows: int, prompt: int) -> None:
        ids = torch.randint(1000, config.vocab_size, (rows, prompt), device=args.device)
        mask = torch.ones_like(ids)
        mask[0, : prompt // 2] = 0  # left padding: one shorter prompt
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        generate(16, 7)  # warm: kernels loaded
        sync()

    def measure(index: int, choice: str) -> dict:
        prompts = [40 + 9 * index + step for step in range(3)]  # lengths no choice saw
        with torch.inference_mode(), kernels(choice):
            seconds = [timed(lambda p=p: generate(16, p), sync) for p in prompts]
            again = timed(lambda: generate(16, prompts[0]), sync)
        return {
            "new_lengths_tokens_per_s": round(16 * args.new_tokens / statistics.median(seconds), 1),
            "seen_lengths_tokens_per_s": round(16 * args.new_tokens / again, 1),
        }

    return each_choice("decoder", args.choices, measure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_shapes", description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batches", type=int, default=40, help="batches of new shapes a choice")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--choices", nargs="+", choices=CHOICES, default=list(CHOICES))
    args = parser.parse_args(argv)
    if said := missing_cuda(args.device):
        parser.exit(2, f"{parser.prog}: {said} (or --device cpu)\n")
    import torch
    import transformers

    torch.manual_seed(0)
    result = {
        "device": args.device,
        "torch": torch.__version__,
        "encoder": encoder_figures(args, torch, transformers),
        "decoder": decoder_figures(args, torch, transformers),
    }
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

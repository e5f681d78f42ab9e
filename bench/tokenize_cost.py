"""What a text's tokens cost on each side of the pipe: tokenized in an HTTP process (TEI's
way: the torch-free `tokenizers` library, one request's text at a time, ids sent on) or in
the model worker (today: transformers' tokenizer on the whole batch, tensors out).

Per text of the short corpus, on all-MiniLM-L6-v2's WordPiece tokenizer:
- `http_encode_one`: `tokenizers` encoding one text (what an HTTP process would add);
- `encode_batch`: the same library on 256 texts at once (for scale);
- `worker_tokenizes`: the worker's tokenizer on batches of 64, padded, as tensors;
- `worker_collates_ids`: what the worker would do with ids instead: pad them into tensors.

    python -m bench.tokenize_cost
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

BATCH = 64
SAMPLE = 256


def fastest(run: Callable[[], Any], repeats: int = 7) -> float:
    """The best of `repeats` timed runs, in seconds (interference only slows a run down)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def collate(ids: list[list[int]]) -> tuple[Any, Any]:
    """Ids padded into an input and a mask tensor, as a worker sent ids would make them."""
    import numpy as np
    import torch

    width = max(map(len, ids))
    tokens = np.zeros((len(ids), width), dtype=np.int64)
    mask = np.zeros((len(ids), width), dtype=np.int64)
    for row, row_ids in enumerate(ids):
        tokens[row, : len(row_ids)] = row_ids
        mask[row, : len(row_ids)] = 1
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def main(argv: Sequence[str] | None = None) -> int:
    # no options: --help says what it measures, rather than starting the measurement
    argparse.ArgumentParser(
        prog="python -m bench.tokenize_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    import tokenizers
    import transformers

    from bench.models import tokenizer_path
    from bench.workloads import texts

    corpus = texts("short")[:SAMPLE]
    path = tokenizer_path()
    library = tokenizers.Tokenizer.from_file(f"{path}/tokenizer.json")
    library.enable_truncation(512)
    worker = transformers.AutoTokenizer.from_pretrained(path)
    ids = [encoding.ids for encoding in library.encode_batch(corpus)]
    batches = range(0, len(corpus), BATCH)
    seconds = {
        "http_encode_one": fastest(lambda: [library.encode(text).ids for text in corpus]),
        "encode_batch": fastest(lambda: library.encode_batch(corpus)),
        "worker_tokenizes": fastest(
            lambda: [
                worker(corpus[i : i + BATCH], padding=True, truncation=True, return_tensors="pt")
                for i in batches
            ]
        ),
        "worker_collates_ids": fastest(lambda: [collate(ids[i : i + BATCH]) for i in batches]),
    }
    per_text = {name: round(1e6 * value / len(corpus), 1) for name, value in seconds.items()}
    json.dump({"us_per_text": per_text, "texts": len(corpus), "batch": BATCH}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

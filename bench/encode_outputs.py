"""Cost of encoding one item's output as JSON, on the event loop: before and after.

    python -m bench.encode_outputs

"before" is `json.dumps(array.tolist())` (what rawserve.encoding did first); "after"
is `rawserve.encoding.dumps` (orjson, which writes numpy arrays natively). Shapes:
token-level features of a 13-token input from a 384-wide model ([1, 13, 384], the
pipeline's shape), a 128-token one, and a pooled sentence vector.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Sequence

import numpy as np

from rawserve.http import encoding

SHAPES = [(1, 13, 384), (1, 128, 384), (384,), (1, 13, 768)]


def per_call_us(function, repeat: int = 7) -> float:
    function()
    runs = max(1, int(0.2 / max(1e-6, timeit.timeit(function, number=1))))
    return min(timeit.repeat(function, number=runs, repeat=repeat)) / runs * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    # no options: --help says what it measures, rather than starting the measurement
    argparse.ArgumentParser(
        prog="python -m bench.encode_outputs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    rng = np.random.default_rng(0)
    print(
        "| output shape | before (tolist + json) | after (orjson) | speed-up "
        "| bytes before | bytes after |"
    )
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        array = rng.standard_normal(shape).astype(np.float32)
        before = per_call_us(lambda a=array: json.dumps(a.tolist(), separators=(",", ":")).encode())
        after = per_call_us(lambda a=array: encoding.dumps(a))
        size_before = len(json.dumps(array.tolist(), separators=(",", ":")))
        size_after = len(encoding.dumps(array))
        print(
            f"| {list(shape)} | {before:,.0f} µs | {after:,.0f} µs | {before / after:.1f}x "
            f"| {size_before:,} | {size_after:,} |"
        )


if __name__ == "__main__":
    main()

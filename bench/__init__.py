"""Benchmarks for rawserve: a load generator, the model's offline ceiling, the seed's baselines.

Not part of the test suite. Every run is bounded in time and count and targets loopback only.
`python -m bench.compare` runs everything side by side; see bench/RESULTS.md.
"""


def described(doc: str | None) -> str:
    """A benchmark's --help description: its docstring's first paragraph (its first line
    alone cut a wrapped sentence short)."""
    return (doc or "").strip().split("\n\n")[0]

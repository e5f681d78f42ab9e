"""bfloat16 offered, never chosen, on a CPU that computes it in hardware.

On CPUs with bfloat16 matrix units (AMX on recent Xeons; AVX-512's bfloat16 dot products
on some others) a model may run several times as fast in bfloat16, with answers that move
in their low digits (all-MiniLM-L6-v2's sentence vectors by at most 0.0027, cosine
0.99988: bench/RESULTS.md). `--dtype auto` never picks a precision that changes answers,
so a worker that serves float32 on such a CPU measures a bfloat16 copy of its model on the
warm-up batch at its first start, compares its answers with float32's, and says in the
log and /info (`bfloat16_trial`) what `--dtype bfloat16` would give; the copy is dropped.

The finding is kept beside the engine trial's (rawserve.worker.engine_trial), under the
same kind of key, so later starts only read it. Worker process only; the CPU's flags and
the clock are injected (tests fake both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rawserve.worker import engine_trial

# /proc/cpuinfo's names for bfloat16 computed in hardware, the matrix units first
BF16_UNITS = ("amx_bf16", "avx512_bf16")
CACHE_PREFIX = "bfloat16-trial-"
# bfloat16 is advised only where it is at least this much faster: it changes answers,
# and two timings on one machine have differed by more than a tie (1.07x and 0.89x in one
# start), as the layout trial's have (its SWITCH_MARGIN)
ADVICE_MARGIN = 1.1


def bf16_units(flags: str) -> str | None:
    """The CPU's bfloat16 units named in its flags (None: it has none, and bfloat16 is
    emulated there: several times slower than float32)."""
    present = set(flags.split())
    return next((unit for unit in BF16_UNITS if unit in present), None)


@dataclass(frozen=True)
class Drift:
    """How far bfloat16's answers are from float32's: the largest difference of a number
    in them, the lowest cosine of an answer's numbers with float32's (None: the answers
    differ in shape, so their numbers cannot be set side by side), and whether everything
    else (labels, words, spans, tokens) is the same."""

    largest: float | None
    cosine: float | None
    same_labels: bool


@dataclass(frozen=True)
class Offer:
    """What `--dtype bfloat16` would give on this CPU, against the float32 that serves."""

    units: str
    batch: int
    float32_seconds: float
    bfloat16_seconds: float
    drift: Drift
    cached: bool = False
    this_start: bool = False  # cached by this very start (its layout trial's timers)
    share: float = 1.0  # of its cores the timing had (engine_trial.CoreShare; not kept)

    @property
    def speedup(self) -> float:
        return self.float32_seconds / self.bfloat16_seconds

    @property
    def advised(self) -> bool:
        """Whether bfloat16 is the clear gain that is worth its changed answers."""
        return self.speedup >= ADVICE_MARGIN

    def describe(self) -> str:
        """One line for the log and /info's bfloat16_trial."""
        source = engine_trial.verdict_source(self.cached, self.this_start)
        timing = (
            f"bfloat16 on this CPU's {self.units}, {source}: a batch of {self.batch} took "
            f"{self.bfloat16_seconds * 1000:.1f} ms against float32's "
            f"{self.float32_seconds * 1000:.1f} ms ({self.speedup:.2f}x)"
        )
        drift = self.drift
        if drift.largest is None:
            answers = "its answers differ from float32's in shape"
        else:
            labels = "the same" if drift.same_labels else "not all the same"
            answers = (
                f"its answers' numbers differ from float32's by at most {drift.largest:.2g}"
                f" (lowest cosine {drift.cosine:.6f}), labels, words and spans {labels}"
            )
        return f"{timing}; {answers}; {self.verdict()}"

    def verdict(self) -> str:
        if self.advised:
            return "faster: --dtype bfloat16 serves it"
        if self.speedup > 1:
            return (
                f"not clearly faster (under the {ADVICE_MARGIN:g}x that advises it: two "
                "timings on one machine differ by as much): float32 serves"
            )
        return "not faster: float32 serves"


def measure(
    serving: Callable[[], Sequence[Any]],
    bfloat16: Callable[[], Sequence[Any]],
    batch: int,
    units: str,
    clock: Callable[[], float] = time.perf_counter,
    threads: int = 1,
) -> Offer:
    """Time the serving float32 model's batch against the bfloat16 copy's, in turn, and
    set their answers side by side (`threads`: the worker's, of which the timing's share
    is told)."""
    drift = compare(serving(), bfloat16())
    share = engine_trial.CoreShare(threads)
    seconds = engine_trial.timed({"float32": serving, "bfloat16": bfloat16}, clock=clock)
    return Offer(units, batch, seconds["float32"], seconds["bfloat16"], drift, share=share.share())


def compare(reference: Sequence[Any], other: Sequence[Any]) -> Drift:
    """`other`'s answers against `reference`'s, answer by answer (`Drift`)."""
    largest = 0.0
    cosine = 1.0
    same_labels = len(reference) == len(other)
    for expected, got in zip(reference, other, strict=False):
        expected_numbers, expected_rest = split(expected)
        got_numbers, got_rest = split(got)
        same_labels = same_labels and expected_rest == got_rest
        if expected_numbers.shape != got_numbers.shape:
            return Drift(None, None, same_labels=False)
        if expected_numbers.size:
            largest = max(largest, float(np.max(np.abs(expected_numbers - got_numbers))))
            cosine = min(cosine, cosine_of(expected_numbers, got_numbers))
    return Drift(largest, cosine, same_labels)


def cosine_of(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b)) / norms if norms else float(np.array_equal(a, b))


def split(answer: Any) -> tuple[np.ndarray, list[Any]]:
    """An answer's numbers in order (scores, vectors), and everything else in it."""
    numbers: list[float] = []
    rest: list[Any] = []
    for leaf in leaves(answer):
        if isinstance(leaf, np.ndarray):
            numbers.extend(leaf.astype(np.float64).ravel().tolist())
        elif isinstance(leaf, (float, np.floating)):
            numbers.append(float(leaf))
        else:
            rest.append(leaf)
    return np.asarray(numbers, dtype=np.float64), rest


def leaves(answer: Any) -> Iterator[Any]:
    if isinstance(answer, Mapping):
        for key in sorted(answer, key=str):
            yield key
            yield from leaves(answer[key])
    elif isinstance(answer, (list, tuple)):
        for part in answer:
            yield from leaves(part)
    elif isinstance(answer, np.ndarray) and answer.dtype.kind not in "fc":
        yield answer.tolist()
    else:
        yield answer


def recalled(cache_dir: Path, key: Mapping[str, Any], start: str = "") -> Offer | None:
    """What was measured under this key (`start`: this server start's id, to tell one kept
    by this start); None if nothing (readable)."""
    stored = engine_trial.recalled(cache_dir, CACHE_PREFIX, key)
    try:
        return Offer(
            units=str(stored["units"]),
            batch=engine_trial.count(stored["batch"]),
            float32_seconds=engine_trial.positive(stored["float32_seconds"]),
            bfloat16_seconds=engine_trial.positive(stored["bfloat16_seconds"]),
            drift=kept_drift(stored["drift"]),
            cached=True,
            this_start=bool(start) and stored.get("start") == start,
        )
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def kept_drift(stored: Mapping[str, Any]) -> Drift:
    """A kept Drift whose numbers are numbers (both, or neither: answers of another shape):
    `Offer.describe` formats them. ValueError or TypeError for a damaged one."""
    largest, cosine = stored["largest"], stored["cosine"]
    if largest is None and cosine is None:
        return Drift(None, None, same_labels=False)
    return Drift(float(largest), float(cosine), bool(stored["same_labels"]))


def remember(
    cache_dir: Path,
    key: Mapping[str, Any],
    offer: Offer,
    start: str = "",
    model: Mapping[str, str] | None = None,
) -> None:
    """Keep a measurement for the next start (`start`: this server start's id; `model`:
    what names the model, engine_trial.named)."""
    found = asdict(offer)
    for unkept in ("cached", "this_start", "share"):
        found.pop(unkept)
    engine_trial.remember(cache_dir, CACHE_PREFIX, key, {**found, "start": start}, model)

"""`--engine auto` settled by measurement: each candidate engine runs the warm-up batch on
this machine, alternately, for a second or so, and the faster one serves. Which engine
is faster depends on the CPU (ONNX Runtime was 1.18x torch on an AMD EPYC, 0.96-1.03x
on an Intel Xeon with AVX-512 and AMX: bench/RESULTS.md), so no rule about CPUs can say.

The verdict is kept in a small JSON file in the cache folder of the ONNX exports, keyed
by what it depends on: the model's files (by content, so another revision is another
key), the task, the batch, the threads, the engines' versions and the CPU. A second
start with the same key loads only the winner and says it used the cache.

Worker process only; the trial's clock and candidates are injected (tests fake both).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rawserve.shared.messages import Engine

log = logging.getLogger("rawserve.worker")

TRIAL_SECONDS = 1.0  # per candidate: enough rounds to see past a noisy neighbour
MIN_ROUNDS = 2  # timed calls per candidate, however slow the batch (on a loaded machine)
MAX_ROUNDS = 15  # a tiny model stops here, long before the time budget
TRIAL_BATCH = 8  # items of the trial batch when the server runs no warm-up
CACHE_PREFIX = "engine-trial-"


@dataclass(frozen=True)
class Trial:
    """The trial's verdict: the median seconds of a batch per engine, and the winner."""

    seconds: Mapping[Engine, float]
    batch: int
    cached: bool = False

    @property
    def winner(self) -> Engine:
        return min(self.seconds, key=lambda engine: self.seconds[engine])

    def describe(self) -> str:
        """One line for the log and /info's engine_reason."""
        figures = ", ".join(
            f"{engine.value} {seconds * 1000:.1f} ms"
            for engine, seconds in sorted(self.seconds.items(), key=lambda pair: pair[1])
        )
        source = "measured at an earlier start (cached)" if self.cached else "measured now"
        return f"auto: the faster here, {source}: a batch of {self.batch} took {figures}"


def run_trial(
    candidates: Mapping[Engine, Callable[[], object]],
    batch: int,
    budget: float = TRIAL_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
) -> Trial:
    """Time each candidate's batch: one untimed call each (first calls set things up),
    then rounds in turn (A B A B, so a neighbour's burst falls on both) until every one
    has MIN_ROUNDS and the budget is spent, or MAX_ROUNDS. The medians decide."""
    for call in candidates.values():
        call()
    times: dict[Engine, list[float]] = {engine: [] for engine in candidates}
    spent = 0.0
    rounds = 0
    while rounds < MAX_ROUNDS and (rounds < MIN_ROUNDS or spent < budget * len(candidates)):
        for engine, call in candidates.items():
            started = clock()
            call()
            took = clock() - started
            times[engine].append(took)
            spent += took
        rounds += 1
    return Trial({engine: statistics.median(laps) for engine, laps in times.items()}, batch)


def installed_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def machine() -> dict[str, Any]:
    """What identifies this CPU for a timing: its model, its flags and its core count."""
    facts: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            facts.setdefault(key.strip(), value.strip())  # the first core's lines
    except OSError:
        pass
    name = facts.get("model name") or platform.processor()
    flags = facts.get("flags", "")
    return {
        "cpu": name,
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cores": os.cpu_count(),
        "machine": platform.machine(),
    }


def _path(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir / f"{CACHE_PREFIX}{digest}.json"


def cached(cache_dir: Path, key: Mapping[str, Any]) -> Trial | None:
    """The verdict of an earlier trial with this key; None if there is none (or it cannot
    be read: then the trial runs again)."""
    try:
        stored = json.loads(_path(cache_dir, key).read_text())
        if stored["key"] != json.loads(json.dumps(key, sort_keys=True)):
            return None
        seconds = {Engine(name): float(value) for name, value in stored["seconds"].items()}
        return Trial(seconds, int(stored["batch"]), cached=True) if seconds else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store(cache_dir: Path, key: Mapping[str, Any], trial: Trial) -> None:
    """Keep the verdict for the next start (written whole, then renamed: workers starting
    together each write a complete file). A cache that cannot be written is only logged."""
    document = {
        "key": key,
        "batch": trial.batch,
        "seconds": {engine.value: seconds for engine, seconds in trial.seconds.items()},
        "winner": trial.winner.value,
    }
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".trial-", dir=cache_dir)
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, indent=1, sort_keys=True)
        os.replace(scratch, _path(cache_dir, key))
    except OSError:
        log.warning("could not keep the engine trial in %s", cache_dir, exc_info=True)

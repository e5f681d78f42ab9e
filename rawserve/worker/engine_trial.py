"""`--engine auto` settled by measurement: each candidate engine runs the warm-up batch on
this machine, alternately, for a second or so, then one item of it alone, and the faster
over both serves. Which engine is faster depends on the CPU (ONNX Runtime was 1.18x
torch on an AMD EPYC, 0.96-1.03x on an Intel Xeon with AVX-512 and AMX: bench/RESULTS.md),
so no rule about CPUs can say; and it depends on the batch: on one Xeon the two tied at
a batch of 32 while ONNX Runtime ran one item 2.5x as fast, and served it answered a
lone client in half the time and 1.3-1.5x the requests at 4 and 16 clients, the same at
64. Timed at the warm-up batch alone, the tie was a coin's toss, which torch won.

The verdict is kept in a small JSON file in the cache folder of the ONNX exports, keyed
by what it depends on: the model's files (by content, so another revision is another
key), the task, the batch, the threads, the engines' versions and the CPU. A second
start with the same key loads only the winner and says it found it in the cache. Each
file also names the model (`named`), outside its key: a person finds a model's files by
its name, and a model moved keeps its verdicts.

The timing, the cache folder and what identifies a machine are shared with the bfloat16
trial (rawserve.worker.precision_trial) and the server's layout trial
(rawserve.ops.layout_trial), which is why this module never imports torch. The trial's
clock and candidates are injected (tests fake both).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rawserve.shared import installed
from rawserve.shared.devices import FULL_SHARE, attainable_share, cpu_cores
from rawserve.shared.messages import Engine, WorkerConfig

log = logging.getLogger("rawserve.worker")

TRIAL_SECONDS = 1.0  # per candidate: enough rounds to see past a noisy neighbour
MIN_ROUNDS = 2  # timed calls per candidate, however slow the batch (on a loaded machine)
MAX_ROUNDS = 15  # a tiny model stops here, long before the time budget
TRIAL_BATCH = 8  # items of the trial batch when the server runs no warm-up
# how the verdict is had, in the layout trial's key: a layout measured with the engine
# an earlier rule chose (the batch alone) is measured again with the one this rule serves
RULE = "a batch and one item"
CACHE_PREFIX = "engine-trial-"
# ONNX Runtime's failure to load a model's export, kept under the trial's key: a later
# start (the same files, versions and machine) runs torch at once, not the export again
UNLOADABLE_PREFIX = "onnx-unloadable-"

K = TypeVar("K")  # what names a timed candidate


@dataclass(frozen=True)
class Trial:
    """The trial's verdict: the median seconds of a batch and of one item alone per
    engine, and the winner."""

    seconds: Mapping[Engine, float]
    batch: int
    cached: bool = False
    this_start: bool = False  # cached by this very start (its layout trial's timers)
    lone: Mapping[Engine, float] = field(default_factory=dict)  # one item alone
    share: float = 1.0  # of its cores the timing had (`CoreShare`; not kept in the cache)

    @property
    def winner(self) -> Engine:
        return min(self.seconds, key=self.score)

    @property
    def timed_alone(self) -> bool:
        """Whether every engine's one item alone was timed (not by an earlier version)."""
        return set(self.lone) == set(self.seconds)

    def score(self, engine: Engine) -> float:
        """Lower is faster: the product of the engine's times at the batch and alone (their
        geometric mean's square), so that a lone client's time weighs as much as a full
        batch's throughput; the batch's time alone where one item was not timed."""
        if not self.timed_alone:
            return self.seconds[engine]
        return self.seconds[engine] * self.lone[engine]

    def describe(self) -> str:
        """One line for the log and /info's engine_reason: the figures, the winner's
        first, and where one item was timed too, what decided (a winner slower at the
        batch read as a contradiction without it)."""
        engines = sorted(self.seconds, key=self.score)
        source = verdict_source(self.cached, self.this_start)
        batch = f"a batch of {self.batch} took {_ms(self.seconds, engines)}"
        if self.batch == 1 or not self.timed_alone:
            return f"auto: the faster here, {source}: {batch}"
        line = f"auto: the faster here over a batch and one item, {source}: {batch}; "
        line += f"one item alone {_ms(self.lone, engines)}"
        if len(engines) > 1:
            winner, runner_up = engines[:2]
            share = self.score(winner) / self.score(runner_up)
            line += f"; both times multiplied, {winner.value} {share:.2g} of {runner_up.value}'s"
        return line


def _ms(seconds: Mapping[Engine, float], engines: list[Engine]) -> str:
    return ", ".join(f"{engine.value} {seconds[engine] * 1000:.1f} ms" for engine in engines)


def verdict_source(cached: bool, this_start: bool) -> str:
    """How a trial's verdict was had, for its line: measured by this worker now, kept by
    this very start (its layout trial's timers load the model first and keep what they
    measure; a worker restarted finds its sibling's), or found in the cache: kept by an
    earlier start, or by another server sharing the folder (seconds before, it may be:
    "an earlier start" was not true of it)."""
    if not cached:
        return "measured now"
    if this_start:
        return "measured at this start (cached)"
    return "found in the cache"


def run_trial(
    candidates: Mapping[Engine, Callable[[], object]],
    batch: int,
    budget: float = TRIAL_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
    lone: Mapping[Engine, Callable[[], object]] | None = None,
    threads: int = 1,
) -> Trial:
    """Time each engine's batch (`timed`), then each one's `lone` item, in half the time
    (a batch of one: its batch's figures); the faster over both wins (`Trial.score`).
    Both at the worker's own threads, though a lone item served gets every core: what
    decides is how the engines compare, and a second thread sped one item of MiniLM up
    about alike on both (ONNX Runtime 7.8-9.6 ms to 7.0-7.7, torch 12.4-16.0 to
    12.3-14.7), where timing it on every core would take the core a sibling worker
    loads its model on. `threads`: the worker's, of which the timing's share is told."""
    share = CoreShare(threads)
    seconds = timed(candidates, budget, clock)
    if batch == 1:
        return Trial(seconds, batch, lone=seconds, share=share.share())
    alone = timed(lone, budget / 2, clock) if lone else {}
    return Trial(seconds, batch, lone=alone, share=share.share())


def timed(
    candidates: Mapping[K, Callable[[], object]],
    budget: float = TRIAL_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, float]:
    """The median seconds of each candidate's call: one untimed call each (first calls
    set things up), then rounds in turn (A B A B, so a neighbour's burst falls on both)
    until every one has MIN_ROUNDS and the budget is spent, or MAX_ROUNDS."""
    for call in candidates.values():
        call()
    times: dict[K, list[float]] = {name: [] for name in candidates}
    spent = 0.0
    rounds = 0
    while rounds < MAX_ROUNDS and (rounds < MIN_ROUNDS or spent < budget * len(candidates)):
        for name, call in candidates.items():
            started = clock()
            call()
            took = clock() - started
            times[name].append(took)
            spent += took
        rounds += 1
    return {name: statistics.median(laps) for name, laps in times.items()}


class CoreShare:
    """The share of its `threads` cores this process had from its making on: its CPU
    time over the wall time and threads, less where other work on the machine took from
    it. A trial timed with less than FULL_SHARE of what the machine's quota allows keeps
    no verdict (`quiet`; as the layout trial's timers): a tester's engine trial timed
    torch at 366 ms a batch beside other work, 186 ms alone, and kept it for every later
    start. Only the timing itself is counted: making the bfloat16 copy, on one thread,
    had a 2-thread worker's trial at 82 % on a quiet machine."""

    def __init__(
        self,
        threads: int,
        clock: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.process_time,
    ):
        self.threads = max(threads, 1)
        self._clock, self._cpu = clock, cpu
        self._began, self._cpu_began = clock(), cpu()

    def share(self) -> float:
        wall = (self._clock() - self._began) * self.threads
        return (self._cpu() - self._cpu_began) / wall if wall > 0 else 1.0


def quiet(share: float, threads: int) -> bool:
    """Whether a timing on `threads` that had `share` of them ran with nothing else
    taking a telling part of the cores."""
    return share >= FULL_SHARE * attainable_share(max(threads, 1))


def installed_version(name: str) -> str:
    """`name`'s version, whichever distribution provides it ("none": not installed)."""
    return installed.version(name) or "none"


def cpu_facts() -> dict[str, str]:
    """The first core's lines of /proc/cpuinfo ({} where there is none)."""
    facts: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            facts.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return facts


def machine() -> dict[str, Any]:
    """What identifies this CPU for a timing: its model, its flags and its core count."""
    facts = cpu_facts()
    name = facts.get("model name") or platform.processor()
    flags = facts.get("flags", "")
    return {
        "cpu": name,
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cores": cpu_cores(),
        "machine": platform.machine(),
    }


def default_cache_dir() -> Path:
    """$RAWSERVE_CACHE_DIR/onnx, else under $XDG_CACHE_HOME or ~/.cache. A user with no
    home (HOME unset and no entry in the password database, as an arbitrary container
    uid has) gets `/` as home, as Docker gives one: a cache there that cannot be written
    is logged, never a failed start. Blank, it is unset, and blanks around it are no
    part of it, as for every RAWSERVE_* variable (a folder named " " was made in the
    working directory)."""
    configured = os.environ.get("RAWSERVE_CACHE_DIR", "").strip()  # (" /x ": a folder " ")
    if configured:
        return Path(configured) / "onnx"
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(home() / ".cache")
    return Path(base) / "rawserve" / "onnx"


def home() -> Path:
    try:
        return Path.home()
    except RuntimeError:  # "Could not determine home directory."
        return Path("/")


def fingerprint(path: Path, whole_below: int = 256 * 2**20, edge: int = 16 * 2**20) -> str:
    """sha256 of a file; of a large one, of its size, its first and last `edge` bytes
    and its modification time: weights saved again in place, changed only in their
    middle layers (a merged LoRA's), keep their size, head and tail."""
    digest = hashlib.sha256()
    stat = path.stat()
    size = stat.st_size
    with open(path, "rb") as handle:
        if size <= whole_below:
            digest.update(handle.read())
        else:
            digest.update(f"{size} {stat.st_mtime_ns}".encode())
            digest.update(handle.read(edge))
            handle.seek(size - edge)
            digest.update(handle.read(edge))
    return digest.hexdigest()[:32]


def fingerprints(folder: Path, suffixes: tuple[str, ...]) -> dict[str, str]:
    """A model folder's files with these suffixes, each by its content (`fingerprint`)."""
    return {
        path.name: fingerprint(path)
        for path in sorted(folder.iterdir())
        if path.is_file() and path.suffix in suffixes
    }


def _path(cache_dir: Path, prefix: str, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir / f"{prefix}{digest}.json"


@contextmanager
def one_trial_at_a_time(
    cache_dir: Path, key: Mapping[str, Any], prefix: str = CACHE_PREFIX
) -> Iterator[None]:
    """Held while a process looks for the verdict under `key` (of the trial whose files
    are named `prefix`) and, finding none, runs the trial: the processes of one start (a
    layout trial's timers, workers loading together) each measured amid the others' work,
    and could disagree, the last one written winning (a log said ONNX Runtime, then the
    workers read torch's verdict). Another process waits for it, then reads the verdict
    kept. A cache that cannot be written: no wait."""
    path = _path(cache_dir, prefix, key).with_suffix(".lock")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        yield
        return
    with locked(path):
        yield


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Held by one process at a time: an exclusive lock on the file at `path`."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def positive(value: Any) -> float:
    """A kept figure (seconds, items a second) as a number a verdict can use: finite and
    above zero. ValueError for anything else (a file edited or damaged: a null, a string,
    NaN, an integer too large for a float), so the trial runs again instead of a start
    failing on it."""
    try:
        number = float(value)
    except OverflowError:  # 1 followed by 400 digits
        raise ValueError(f"not a positive figure: {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"not a positive figure: {value!r}")
    return number


def count(value: Any) -> int:
    """A kept count (a batch's items) as a whole number above zero. ValueError for
    anything else (1e999 reads back as infinity, which int() refuses with an
    OverflowError: that stopped the server's start)."""
    number = positive(value)
    if number != int(number):
        raise ValueError(f"not a count: {value!r}")
    return int(number)


def cached(cache_dir: Path, key: Mapping[str, Any], start: str = "") -> Trial | None:
    """The verdict of an earlier trial with this key (`start`: this server start's id, to
    tell one kept by this start); None if there is none (or it cannot be read, or names no
    engine that runs: then the trial runs again)."""
    stored = recalled(cache_dir, CACHE_PREFIX, key)
    try:
        seconds = {Engine(name): positive(value) for name, value in stored["seconds"].items()}
        if not seconds or Engine.AUTO in seconds:
            return None
        batch = count(stored["batch"])
        # a verdict without one item's figures was had by the warm-up batch alone (an
        # earlier version): measured again, but where the batch is one item
        kept = stored["lone"] if "lone" in stored or batch != 1 else stored["seconds"]
        lone = {Engine(name): positive(value) for name, value in kept.items()}
        if set(lone) != set(seconds):
            return None
        this_start = bool(start) and stored.get("start") == start
        return Trial(seconds, batch, cached=True, this_start=this_start, lone=lone)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None


def store(
    cache_dir: Path,
    key: Mapping[str, Any],
    trial: Trial,
    start: str = "",
    model: Mapping[str, str] | None = None,
) -> None:
    """Keep the verdict for the next start (`start`: this server start's id; `model`:
    what names the model, `named`)."""
    document = {
        "start": start,
        "batch": trial.batch,
        "seconds": {engine.value: seconds for engine, seconds in trial.seconds.items()},
        "lone": {engine.value: seconds for engine, seconds in trial.lone.items()},
        "winner": trial.winner.value,
    }
    remember(cache_dir, CACHE_PREFIX, key, document, model)


def named(config: WorkerConfig) -> dict[str, str]:
    """What names the model in its trial files, for a person to find them by (`grep -l`):
    as the command line named it, and the folder that resolved to. Never in a key: a
    model moved, or named otherwise, keeps its verdicts."""
    return {"model": config.source or config.model, "folder": config.model}


def recalled(cache_dir: Path, prefix: str, key: Mapping[str, Any]) -> dict[str, Any]:
    """What was measured before under this key ({}: nothing, or nothing readable)."""
    try:
        stored = json.loads(_path(cache_dir, prefix, key).read_text())
        if stored["key"] != json.loads(json.dumps(key, sort_keys=True)):
            return {}
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # RecursionError: [[[[...
        return {}


def remember(
    cache_dir: Path,
    prefix: str,
    key: Mapping[str, Any],
    found: dict[str, Any],
    model: Mapping[str, str] | None = None,
) -> None:
    """Keep a measurement for the next start (written whole, then renamed: workers
    starting together each write a complete file), beside what names the model (`model`:
    `named`'s fields, outside the key). A cache that cannot be written is only logged."""
    scratch = None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".trial-", dir=cache_dir)
        with os.fdopen(fd, "w") as handle:
            document = {"key": key, **(model or {}), **found}
            json.dump(document, handle, indent=1, sort_keys=True)
        os.replace(scratch, _path(cache_dir, prefix, key))
    except OSError as exc:  # one line: the folder and why (a traceback says no more)
        log.warning("could not keep the trial in %s (%s)", cache_dir, exc.strerror or exc)
        if scratch is not None:  # a full disk: else every start leaves one more file
            Path(scratch).unlink(missing_ok=True)

"""The default worker layout: how many model workers a CPU machine runs without `--device`.

Measured on 2 cores (bench/RESULTS.md): one single-threaded worker per core serves
0.93-0.99 of the model's ceiling where one worker with every core served 0.79, since a
team of threads stalls whenever one of them loses its core to the event loop; a lone
item still gets every core (the executor's core sharing). Each worker holds its own copy
of the model, so the count is bounded by memory: never more copies than fit in
`RAM_SHARE` of the RAM this process may use (the machine's, or less where a container's
memory limit says so), a copy counted as COPY_FACTOR x the weights on disk
(the weights, plus the runtime's own buffers) plus WORKER_OVERHEAD (the interpreter,
torch and the tokenizer); a `--handler`'s worker, which loads only what its own code
imports, HANDLER_OVERHEAD (what its code loads is not known before). A GPU machine gets
one worker, on its first GPU (`--device` names more).

Server process; reads /proc, the cgroup's limits and the model folder's file sizes, never
imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rawserve.models.folder import SHIPPED_GRAPH, SHIPPED_GRAPH_DATA
from rawserve.shared import cgroups, installed
from rawserve.shared.devices import AFFINITY, CoreCount, gpu_present

RAM_SHARE = 0.5  # of the machine's RAM, for all the model workers together
COPY_FACTOR = 2.0
WORKER_OVERHEAD = 400 * 2**20  # bytes: measured RSS of a worker before its model
HANDLER_OVERHEAD = 40 * 2**20  # ... of a handler's worker before its code (33 MiB measured)
# The weights' formats, preferred first: a folder with several holds one copy in each.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx")


@dataclass(frozen=True)
class Layout:
    workers: int
    threads: int  # per worker, when they are all busy
    reason: str  # one line for the log


def cpu_layout(
    cores: int,
    ram_bytes: int | None,
    model_bytes: int,
    models: int = 1,
    overhead: int = WORKER_OVERHEAD,
    threads: int = 1,
) -> Layout:
    """One single-threaded worker per core for each of `models` models (`model_bytes` on
    disk together), as many per model as memory allows (at least one); `overhead`: each
    worker's before its model (HANDLER_OVERHEAD for a handler's). `threads` (--threads)
    above 1: one worker per that many cores for each model instead, so that the workers'
    threads do not outnumber the cores (two workers of two threads each on 2 cores ran
    generation at 0.1-0.25 of one thread each: teams of threads stall on each other; one
    thread each, the workers only take turns)."""
    cores = max(1, cores)
    threads = max(1, min(threads, cores))
    per_core = "one per core"
    if threads > 1:
        each = f", {models} models" if models > 1 else ""
        per_core = f"one per {threads * models} cores (--threads {threads}{each})"
    slots = max(1, cores // (threads * models)) if threads > 1 else cores
    per_worker = COPY_FACTOR * model_bytes + models * overhead
    if ram_bytes is None:
        return Layout(slots, threads, f"{per_core}: {slots} worker(s); RAM unknown")
    fit = max(1, int(RAM_SHARE * ram_bytes // per_worker))
    workers = min(slots, fit)
    reason = (
        f"{workers} worker(s) x {threads} thread{'s' if threads > 1 else ''} on {cores} "
        f"core(s): {per_core}, "
        f"bounded by memory ({fit} fit in {RAM_SHARE:.0%} of {ram_bytes / 2**30:.1f} GiB RAM "
        f"at {per_worker / 2**20:.0f} MiB each, the weights {model_bytes / 2**20:.0f} MiB on disk)"
    )
    return Layout(workers, threads, reason)


def ram_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path | None = None) -> int | None:
    """The RAM this process may use: the machine's (MemTotal), or its cgroup's memory
    limit where that is lower (a container's `--memory`: MemTotal there is the host's,
    and copies planned for it would be killed by the kernel); None where neither can be
    read."""
    total = _mem_total(meminfo)
    limit = cgroups.memory_limit(cgroup_root)
    if limit is None:
        return total
    return int(limit.value) if total is None else min(total, int(limit.value))


def _mem_total(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def container_limits(cores: CoreCount, cgroup_root: Path | None = None) -> str:
    """What a container's limits made of the cores and RAM counted, for the log and /info
    ("" where none is set): an operator sees why 2 workers start on a 64-core host."""
    notes = [] if cores.source == AFFINITY else [f"{cores.cores} core(s): {cores.source}"]
    memory = cgroups.memory_limit(cgroup_root)
    if memory is not None:
        notes.append(f"RAM at most {memory.value / 2**30:.1f} GiB ({memory.file})")
    return f" [container limits: {'; '.join(notes)}]" if notes else ""


def model_bytes(folder: Path) -> int:
    """The size of one copy of a model folder's weights on disk (0 if none is found): its
    weights at the top, else its own ONNX graph (an ONNX-only folder, transformers.js'
    kind), with the graph's weights kept apart beside it."""
    try:
        for suffix in WEIGHT_SUFFIXES:
            sizes = [path.stat().st_size for path in folder.glob(f"*{suffix}") if path.is_file()]
            if sizes:
                return sum(sizes)
        shipped = [folder / name for name in (SHIPPED_GRAPH, *SHIPPED_GRAPH_DATA)]
        return sum(path.stat().st_size for path in shipped if path.is_file())
    except OSError:
        return 0


def gpu_usable(handler: bool = False) -> bool:
    """Whether the machine shows a GPU (`gpu_present`) its workers can use: a handler's
    code may use any library; a model's needs a CUDA build of torch (planned as a GPU's
    with a CPU build, one worker took every core with a GPU's batches, on the CPU)."""
    return gpu_present() and (handler or not cpu_only_torch())


def cpu_only_torch() -> bool:
    """Whether the installed torch is a build without CUDA, as far as its distribution's
    version says without importing it (`+cpu`)."""
    return (installed.version("torch") or "").endswith("+cpu")


def on_gpu(
    devices: Sequence[str] | None,
    present: Callable[[], bool] | None = None,
    *,
    handler: bool = False,
) -> bool:
    """Whether the workers of `devices` (--device parsed; None: the default layout) run on
    a GPU: a cuda device named, or auto (or nothing) where the machine shows one they can
    use (`gpu_usable`; a `handler`'s may use any). `present`: the probe (tests fake it)."""
    if devices and any(device.startswith("cuda") for device in devices):
        return True
    if devices and all(device != "auto" for device in devices):
        return False
    return present() if present is not None else gpu_usable(handler)


def engine_device(devices: Sequence[str] | None, present: Callable[[], bool] | None = None) -> str:
    """The device an engine is judged for with `devices` (--device parsed; None: the
    default layout): the first one named that is neither cpu nor auto (cuda:1, mps), else
    cuda where the workers run on a GPU, else cpu."""
    named = next((device for device in devices or () if device not in ("cpu", "auto")), None)
    return named or ("cuda" if on_gpu(devices, present) else "cpu")

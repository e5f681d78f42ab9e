"""Device specs: parsing `--device`, isolating one device per worker process, and the
CPU cores this process may run on (its affinity, and its container's CPU limit).

Pure functions, no torch: the server parses and checks the list; each worker calls
`isolate` before torch initialises CUDA, so worker N sees only its own GPU. When the
server itself was started with CUDA_VISIBLE_DEVICES, `cuda:N` means the N-th GPU of that
list, as it would for torch in the server's environment.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rawserve.shared import cgroups

AFFINITY = "the CPU affinity"


@dataclass(frozen=True)
class CoreCount:
    cores: int
    source: str  # where the count came from, for the log and /info


# The least share of the cores it asked for a timing's process must have had (its CPU
# time over its wall time and threads) for a trial's verdict to be kept: below it other
# work ran beside it (on a shared 2-core machine a layout timer's per-core figure swung
# from 2,944 to 20,962 items/s and the worse verdict was kept; timers had 99 % of their
# cores on the machine alone, 50 % beside a test run)
FULL_SHARE = 0.9


def attainable_share(cores: int) -> float:
    """The share of `cores` a process can have on a quiet machine: all of them, but under
    a cgroup CPU quota below them (2.5 CPUs count as 3 cores, of which a timer has at
    most 2.5 / 3, and a trial would never keep its verdict)."""
    limit = cgroups.cpu_limit()
    return 1.0 if limit is None else min(1.0, limit.value / cores)


def cpu_cores() -> int:
    """The cores this process may run on (`core_count`)."""
    return core_count().cores


def core_count(cgroup_root: Path | None = None) -> CoreCount:
    """The cores this process may run on: its CPU affinity (`taskset`, a container's
    `--cpuset-cpus`), which workers and threads inherit, not every core of the machine
    (os.cpu_count): one worker per core on 2 allowed cores of 64 is 2 workers, not 64.
    Fewer where its cgroup's CPU quota allows fewer (`docker run --cpus 2`, a Kubernetes
    CPU limit: every core stays in the affinity, and 64 threads would be throttled to the
    time of 2), rounded up, as the JVM and .NET round it (Rust's `available_parallelism` rounds
    down)."""
    if hasattr(os, "sched_getaffinity"):  # Linux; elsewhere every core is allowed
        allowed = len(os.sched_getaffinity(0)) or 1
    else:
        allowed = os.cpu_count() or 1
    limit = cgroups.cpu_limit(cgroup_root)
    if limit is not None and math.ceil(limit.value) < allowed:
        cores = max(1, math.ceil(limit.value))
        source = f"a cgroup CPU limit of {limit.value:g} ({limit.file}), of {allowed} allowed"
        return CoreCount(cores, source)
    return CoreCount(allowed, AFFINITY)


def gpu_present(dev: Path = Path("/dev"), wsl: Path = Path("/usr/lib/wsl/lib")) -> bool:
    """Whether this machine shows a GPU torch could use (without importing torch): an
    NVIDIA GPU's node, whichever its number (a container given the host's GPU 3 holds
    /dev/nvidia3 alone, as Docker's `--gpus device=3` and Kubernetes give it), ROCm's,
    or under WSL 2, whose GPUs have no such node, Windows' NVIDIA driver's CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists():
        return True
    return (dev / "dxg").exists() and (wsl / "libcuda.so").exists()


_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")


def parse_devices(spec: str, visible_gpus: str | None = None) -> list[str]:
    """`"cuda:0,cuda:1"` → `["cuda:0", "cuda:1"]`: one worker per entry.

    `visible_gpus` is the server's CUDA_VISIBLE_DEVICES, if set: `cuda:N` must name one.
    """
    devices = [part.strip().lower() for part in spec.split(",")]
    visible = _visible_list(visible_gpus)
    for device in devices:
        if not _DEVICE.match(device):
            raise ValueError(
                f"invalid device {device!r}: use auto, cpu, cuda, cuda:N or mps, comma-separated"
            )
        index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else None
        if visible is not None and index is not None and index >= len(visible):
            raise ValueError(
                f"device {device!r} is not among the {len(visible)} GPU(s) "
                f"that CUDA_VISIBLE_DEVICES={visible_gpus} leaves visible"
            )
    return devices


@dataclass(frozen=True)
class DevicePlan:
    torch_device: str  # what the worker passes to torch ("auto" decides in the worker)
    visible_gpus: str | None  # CUDA_VISIBLE_DEVICES for the worker, None to leave it


def isolate(device: str, visible_gpus: str | None = None) -> DevicePlan:
    """`cuda:3` → the worker sees only GPU 3, as its `cuda:0`.

    `visible_gpus` is the CUDA_VISIBLE_DEVICES the worker inherited, if any: `cuda:1`
    with `"4,5"` is physical GPU 5.
    """
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        visible = _visible_list(visible_gpus)
        if visible is not None and index < len(visible):
            return DevicePlan("cuda:0", visible[index])
        return DevicePlan("cuda:0", str(index))
    if device == "cuda":
        return DevicePlan("cuda:0", None)
    return DevicePlan(device, None)


def _visible_list(visible_gpus: str | None) -> list[str] | None:
    if visible_gpus is None or not visible_gpus.strip():
        return None
    return [part.strip() for part in visible_gpus.split(",") if part.strip()]

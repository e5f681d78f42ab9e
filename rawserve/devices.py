"""Device specs: parsing `--device` and isolating one device per worker process.

Pure functions, no torch: the server parses and checks the list; each worker calls
`isolate` before torch initialises CUDA, so worker N sees only its own GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")


def parse_devices(spec: str) -> list[str]:
    """`"cuda:0,cuda:1"` → `["cuda:0", "cuda:1"]`: one worker per entry."""
    devices = [part.strip().lower() for part in spec.split(",")]
    for device in devices:
        if not _DEVICE.match(device):
            raise ValueError(
                f"invalid device {device!r}: use auto, cpu, cuda, cuda:N or mps, comma-separated"
            )
    return devices


@dataclass(frozen=True)
class DevicePlan:
    torch_device: str  # what the worker passes to torch ("auto" decides in the worker)
    visible_gpus: str | None  # CUDA_VISIBLE_DEVICES for the worker, None to leave it


def isolate(device: str) -> DevicePlan:
    """`cuda:3` → the worker sees only GPU 3, as its `cuda:0`."""
    if device.startswith("cuda:"):
        return DevicePlan("cuda:0", device.split(":", 1)[1])
    if device == "cuda":
        return DevicePlan("cuda:0", None)
    return DevicePlan(device, None)

"""A CUDA graph's recording as a GPU enforces it, for the tests on a CPU.

`recorded_as_a_gpu_records(monkeypatch)` replaces the CUDA part of a recording
(`rawserve.worker.cuda_graphs.record`): the recorded call runs once while the "stream
records", and reading a tensor's values back to the host meanwhile (`bool`, `item`,
`tolist`, ...) fails as CUDA fails it ("operation not permitted when stream is
capturing"), which turns the graphs off for good. Everything else (the graphed pass, its
model, hooks on it, transformers' own checks of whether a stream records) runs as it is.
A replay runs the recorded call again and copies its results into the tensors the
recording returned, as a graph writes them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rawserve.worker import cuda_graphs

HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu")
REFUSAL = "CUDA error: operation not permitted when stream is capturing"


class Rerun:
    """A stand-in for a graph recorded by `cuda_graphs.record`: replay runs the recorded
    call again, into what the recording returned (a tensor, or tensors in tuples, lists
    and objects, such as a prefill's logits and its layers' keys and values)."""

    def __init__(self, run: Callable[[], Any], output: Any):
        self.run, self.output = run, output
        self.replays = 0
        self.shape: tuple[int, ...] = ()  # set by a test that records shapes

    def replay(self) -> None:
        self.replays += 1
        copy_into(self.output, self.run())


def copy_into(target: Any, source: Any) -> None:
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    elif isinstance(target, (tuple, list)):
        for mine, new in zip(target, source, strict=True):
            copy_into(mine, new)
    elif hasattr(target, "__dict__"):
        for name, value in vars(target).items():
            if isinstance(value, torch.Tensor):
                value.copy_(getattr(source, name))


class HostReads:
    """Reads of a tensor's values back to the host (`HOST_READS`), which raise
    `refusal` while `refusing()` (undone with `monkeypatch`): what a GPU refuses in a
    recording, and what costs a round trip to it anywhere else; `count` counts them."""

    def __init__(self, monkeypatch: Any, refusal: str = "a read back to the host, refused"):
        self.refused = False
        self.refusal = refusal
        self.count = 0  # reads so far
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._checked(getattr(torch.Tensor, name)))

    def _checked(self, read: Callable[..., Any]) -> Callable[..., Any]:
        def checked(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.refused:
                raise RuntimeError(self.refusal)
            self.count += 1
            return read(tensor, *args, **kwargs)

        return checked

    @contextlib.contextmanager
    def refusing(self) -> Iterator[None]:
        self.refused = True
        try:
            with WaitsRefused(self.refusal):
                yield
        finally:
            self.refused = False


class WaitsRefused(TorchDispatchMode):
    """The operators that read a tensor's values back to the host inside torch (a scalar
    for `bool` or `item`; the count of what a mask selects, which sizes the result),
    refused: on a GPU each waits for the device, which a recording cannot."""

    def __init__(self, refusal: str):
        super().__init__()
        self.refusal = refusal

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in SIZED_BY_VALUES or func in (aten.where.default,):
            raise RuntimeError(f"{self.refusal} ({func})")
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
            for index in args[1]
        ):
            raise RuntimeError(f"{self.refusal} ({func} with a mask)")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise RuntimeError(f"{self.refusal} ({func} without output_size)")
        return func(*args, **kwargs)


aten = torch.ops.aten
# operators whose result is sized by values read back to the host (one-argument `where`
# is `nonzero`; `_local_scalar_dense` is what `bool`, `item`, `int` and `float` call)
SIZED_BY_VALUES = (
    aten._local_scalar_dense,
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
)


def recorded_as_a_gpu_records(monkeypatch: Any) -> list[Rerun]:
    """Recordings refuse host reads from here on (undone with `monkeypatch`); the graphs
    recorded, in order."""
    reads = HostReads(monkeypatch, REFUSAL)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: reads.refused)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    graphs: list[Rerun] = []

    def record(run: Callable[[], Any], device: Any, pool: Any) -> tuple[Rerun, Any]:
        with reads.refusing():
            output = run()
        graphs.append(Rerun(run, output))
        return graphs[-1], output

    monkeypatch.setattr(cuda_graphs, "record", record)
    return graphs


class CopiesFromHost(TorchDispatchMode):
    """Counts the tensors made from host data (a list made into a tensor, or into an
    index) while it is on: on a GPU each is a copy to the device, and torch waits for the
    device's queue to drain at each."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is aten.lift_fresh.default and args[0].dim() > 0:  # (a scalar is no copy)
            self.count += 1
        return func(*args, **(kwargs or {}))

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

from collections.abc import Callable
from typing import Any

import torch

from rawserve.worker import cuda_graphs

HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy")
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


def recorded_as_a_gpu_records(monkeypatch: Any) -> list[Rerun]:
    """Recordings refuse host reads from here on (undone with `monkeypatch`); the graphs
    recorded, in order."""
    state = {"recording": False}

    def refused_while_recording(read: Callable[..., Any]) -> Callable[..., Any]:
        def checked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if state["recording"]:
                raise RuntimeError(REFUSAL)
            return read(self, *args, **kwargs)

        return checked

    for name in HOST_READS:
        monkeypatch.setattr(
            torch.Tensor, name, refused_while_recording(getattr(torch.Tensor, name))
        )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["recording"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    graphs: list[Rerun] = []

    def record(run: Callable[[], Any], device: Any, pool: Any) -> tuple[Rerun, Any]:
        state["recording"] = True
        try:
            output = run()
        finally:
            state["recording"] = False
        graphs.append(Rerun(run, output))
        return graphs[-1], output

    monkeypatch.setattr(cuda_graphs, "record", record)
    return graphs

"""Whether a benchmark that asks for a GPU can have one, said in one line before it starts
anything (torch's own complaint is a traceback from deep in a model's load, minutes in)."""

from __future__ import annotations


def missing_cuda(device: str = "cuda") -> str | None:
    """Why `device` (`cuda`, `cuda:N`) cannot run here, in one line; None where it can,
    or where it is not a GPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    from rawserve.worker.runner import why_no_cuda  # the server's own words for it

    return f"CUDA is not available: torch {torch.__version__} {why_no_cuda(torch)}"

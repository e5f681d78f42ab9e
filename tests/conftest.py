"""Shared fixtures: tiny local models (built once per session) and a running server."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers started by the tests run torch unless a test asks for ONNX Runtime: an export
# costs 10-50 s per model on 2 cores (tests/test_onnx_engine.py covers that engine).
os.environ.setdefault("RAWSERVE_ENGINE", "torch")
# ... and one worker, as most tests reason about "the worker"; tests/test_info.py starts
# one with the default layout (RAWSERVE_DEVICE="" is no --device).
os.environ.setdefault("RAWSERVE_DEVICE", "auto")

import pytest  # noqa: E402

from tests import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model("fill-mask")` → the folder of a tiny random model for that kind."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = str(tiny_models.build(kind, root / kind))
        return built[kind]

    return get

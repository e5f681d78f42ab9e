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

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests import tiny_models  # noqa: E402

# No example has a time limit: a busy 2-core machine can pause the process for longer
# than hypothesis' 200 ms, which it reports as a failure of the property.
settings.register_profile("rawserve", deadline=None)
settings.load_profile("rawserve")

# the folder of the session's tiny models, passed on to the pytest runs a test starts
# (tests/test_http_processes.py), which then build none of the kinds built here
MODELS_FOLDER = "RAWSERVE_TEST_MODELS"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model("fill-mask")` → the folder of a tiny random model for that kind."""
    given = os.environ.get(MODELS_FOLDER)
    root = Path(given) if given else tmp_path_factory.mktemp("models")

    def get(kind: str) -> str:
        folder, built = root / kind, root / f"{kind}.built"  # once its files are all saved
        if not built.exists():
            tiny_models.build(kind, folder)
            built.touch()
        return str(folder)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODELS_FOLDER, str(root))
        yield get


@pytest.fixture
def ascii_locale(monkeypatch):
    """Text files read as Python reads them in an ASCII locale (`LC_ALL=C PYTHONUTF8=0`):
    a read that names no encoding decodes the locale's, ASCII."""
    read_text = Path.read_text

    def in_the_locale(self, encoding=None, *args, **kwargs):
        return read_text(self, encoding or "ascii", *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", in_the_locale)


@pytest.fixture(autouse=True)
def no_container_limits(monkeypatch):
    """The in-process tests fake the cores and the RAM they count; the cgroup limits of a
    CI runner's own container are not theirs to count (tests/test_devices.py builds its own)."""
    monkeypatch.setattr("rawserve.shared.cgroups.ROOT", Path("/nonexistent-cgroup-root"))

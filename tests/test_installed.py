"""What is installed: a package's version and presence whichever distribution provides
it (onnxruntime-gpu provides the `onnxruntime` module), read without importing it."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import pytest

from rawserve.shared import installed


def provide(folder: Path, distribution: str, version: str, module: str) -> None:
    """An installed distribution `distribution` that provides the module `module`."""
    (folder / module).mkdir()
    (folder / module / "__init__.py").write_text("")
    info = folder / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    )
    (info / "top_level.txt").write_text(f"{module}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    importlib.invalidate_caches()


def test_a_module_is_versioned_by_the_distribution_that_provides_it(site):
    provide(site, "fastmod-gpu", "1.20.1", "fastmod")
    importlib.invalidate_caches()
    assert installed.version("fastmod") == "1.20.1"
    assert installed.version("fastmod-gpu") == "1.20.1"
    assert installed.version("nosuchmodule") is None
    assert installed.version("no-such-distribution") is None


def test_onnxruntime_from_onnxruntime_gpu_is_installed(site, monkeypatch):
    """onnxruntime-gpu (and -openvino, -directml...) installs the `onnxruntime` module
    under another distribution name: --engine onnx was refused as "not installed", and
    the engine trial's key and /info said no version."""
    from rawserve.worker import engine_trial, onnx_engine

    provide(site, "onnxruntime-gpu", "1.20.1", "onnxruntime")
    importlib.invalidate_caches()
    real_version = importlib.metadata.version

    def without_plain_onnxruntime(name: str) -> str:
        if name == "onnxruntime":  # only onnxruntime-gpu is installed here
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_plain_onnxruntime)
    assert onnx_engine.onnxruntime_installed()
    assert engine_trial.installed_version("onnxruntime") == "1.20.1"

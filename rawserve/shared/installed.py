"""What is installed, read from the distributions' metadata without importing anything
(the server process never imports torch): a package's version, whichever distribution
provides it (`onnxruntime-gpu`, `onnxruntime-openvino` and others provide the same
`onnxruntime` module as `onnxruntime` does).

Server and worker processes alike; plain Python.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util


def version(name: str) -> str | None:
    """The installed version of `name`: the distribution so named, else the one that
    provides the importable module `name` (onnxruntime-gpu's for `onnxruntime`); None
    where neither is installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    if not name.isidentifier() or importlib.util.find_spec(name) is None:
        return None
    # every distribution's file list is read: only where the module is there under
    # another distribution's name
    for provider in importlib.metadata.packages_distributions().get(name, ()):
        try:
            return importlib.metadata.version(provider)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None

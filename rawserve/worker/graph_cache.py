"""ONNX graphs kept in rawserve's cache folder: each made once, under a lock, by whichever
worker gets there first, and the one it replaces removed.

Two kinds live there (rawserve.worker.onnx_engine makes both): a model exported to ONNX,
and a copy of a model's own graph with its weights moved beside it. Each sits in a
folder of its own, named by the model folder's name and a digest of what it was made
from (`key`), with that key in `key.json`, so a start finds it again, and a graph made
from other files (weights saved again in place, another exporter) is made anew.

Worker process only (the workers of one start share the folder).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rawserve.worker import engine_trial

log = logging.getLogger("rawserve.onnx")

GRAPH_FILE = "model.onnx"
KEY_FILE = "key.json"


class CacheNotWritable(OSError):
    """A graph could not be written: its cache `folder` is not writable, not a folder,
    or full (`why`). ONNX Runtime never ran; the message names the folder and the
    variable that moves it."""

    def __init__(self, folder: Path, why: str):
        super().__init__(
            f"the ONNX export's cache folder {folder} cannot be written ({why}): "
            "set RAWSERVE_CACHE_DIR to one that can"
        )
        self.folder = folder
        self.why = why


class NothingToCache(Exception):
    """`make`'s answer where the original serves as it is (a model's own graph whose
    weights are beside it already): no graph is cached, and those made before for the
    same folder and head (`folder`) are removed."""

    def __init__(self, folder: str):
        super().__init__(folder)
        self.folder = folder


@dataclass(frozen=True)
class Found:
    """A cached graph, and how it came to be there."""

    graph: Path
    made_in: float | None = None  # seconds this worker took to make it; None: found made
    by_another: bool = False  # made by another worker while this one waited for the lock


def key_digest(key: dict[str, Any]) -> str:
    """What names a cached graph (and its lock, and its folder while it is made)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def identity(path: Path) -> tuple[int, int, int] | None:
    """What tells one file from the one that replaces it at the same path (None: gone,
    removed as another graph's predecessor while this worker was loading it)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def cached_graph(
    cache_dir: Path,
    name: str,
    key: dict[str, Any],
    make: Callable[[Path], dict[str, Any]],
    damaged: tuple[int, int, int] | None = None,
) -> Found:
    """The graph cached under `name` and `key`; made now if missing, or if it is still the
    file `damaged` identifies (one that would not load): `make(path)` writes it at `path`
    (in a scratch folder, moved into place whole) and answers what `key.json` keeps beside
    the key; with "head" in `key` and "folder" in what `make` answers, the graphs of the
    same folder and head made from another key are removed: no start asks for them again.
    `make` raises NothingToCache where no graph is to be kept (raised on, once those of
    the same folder and head are removed)."""
    digest = key_digest(key)
    target = cache_dir / f"{name}-{digest}"
    graph = target / GRAPH_FILE
    if graph.is_file() and damaged is None:
        return Found(graph)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # workers starting together make it once
        with engine_trial.locked(cache_dir / f".{digest}.lock"):
            if graph.is_file() and identity(graph) != damaged:
                return Found(graph, by_another=True)
            shutil.rmtree(target, ignore_errors=True)
            for left in cache_dir.glob(f".export-{digest}-*"):  # of a worker killed making it
                shutil.rmtree(left, ignore_errors=True)
            started = time.monotonic()
            scratch = Path(tempfile.mkdtemp(prefix=f".export-{digest}-", dir=cache_dir))
            try:
                kept = {**key, **make(scratch / GRAPH_FILE)}
                (scratch / KEY_FILE).write_text(json.dumps(kept, indent=1))
                os.replace(scratch, target)
            except NothingToCache as nothing:
                _drop_replaced(cache_dir, target, {**key, "folder": nothing.folder})
                raise
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            _drop_replaced(cache_dir, target, kept)
    except OSError as exc:  # unwritable, not a folder, or full
        raise CacheNotWritable(cache_dir, exc.strerror or str(exc)) from exc
    return Found(graph, made_in=time.monotonic() - started)


def _drop_replaced(cache_dir: Path, target: Path, kept: dict[str, Any]) -> None:
    """The graphs of the same folder and head made before from other files (weights saved
    again in place) or by other versions of the exporter: no start asks for them again, and
    each would keep a whole copy of the model's weights in the cache for good."""
    name = glob.escape(target.name.rpartition("-")[0])  # the folder's name: "[" is no pattern
    for key_file in cache_dir.glob(f"{name}-*/{KEY_FILE}"):
        try:
            made = json.loads(key_file.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(made, dict):
            continue
        same = made.get("folder") == kept["folder"] and made.get("head") == kept["head"]
        if same and key_file.parent != target:
            shutil.rmtree(key_file.parent, ignore_errors=True)
            log.info("ONNX engine: removed %s, this model's graph from before", key_file.parent)

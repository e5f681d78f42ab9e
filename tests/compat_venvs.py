"""Virtual environments for the client libraries the compatibility suite runs unmodified.

Each is made once with pip (pinned versions, `--no-input`) and kept in pytest's cache, so
only the first run pays for it; a fresh temporary folder is used when the cache is off.
A test that needs one is skipped, saying why, only when pip cannot reach the package
index; any other failure to install fails the test. `installing` makes it in a thread,
while the servers the clients will talk to start (pip mostly waits on the network), and
pip leaves the byte-compiling to the first import of each module (the scripts import a
small part of what it installs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.server import module_tests

# what pip says when it cannot reach the index (no network, no proxy)
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish|Temporary failure in name resolution|"
    r"Network is unreachable|ProxyError|from versions: none"
)
INSTALL_SECONDS = 900  # the largest set (litellm, haystack, llama-index) takes ~2 min on 2 cores


@contextmanager
def installing(
    request: pytest.FixtureRequest, name: str, requirements: Sequence[str], waiter: str
) -> Iterator[Future[Path]]:
    """The interpreter of the virtual environment `name` holding `requirements`, made in a
    thread unless the cache already has it with exactly these requirements: the future's
    result (or its skip, or its failure) once it is done; left only once it is done. Made
    only where a test selected in `request`'s module uses the fixture `waiter` (the one
    that waits for it)."""
    used = any(waiter in item.fixturenames for item in module_tests(request))
    if not used:
        yield Future()  # nobody waits for it
        return
    cache = getattr(request.config, "cache", None)
    tmp_path_factory = request.getfixturevalue("tmp_path_factory")
    folder = Path(cache.mkdir(name)) if cache is not None else tmp_path_factory.mktemp(name)
    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        yield pool.submit(made, folder, requirements)


def made(folder: Path, requirements: Sequence[str]) -> Path:
    """The interpreter of the environment in `folder`, made now unless it holds exactly
    `requirements` already."""
    python = folder / "bin" / "python"
    stamp = folder / "installed"
    wanted = "\n".join(requirements)
    if stamp.exists() and stamp.read_text() == wanted and python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    pip = [str(python), "-m", "pip", "install", "--no-input", "--quiet", "--no-compile"]
    installed = subprocess.run(
        [*pip, "--disable-pip-version-check", *requirements],
        capture_output=True,
        text=True,
        timeout=INSTALL_SECONDS,
        check=False,
    )
    if installed.returncode != 0:
        if UNREACHABLE.search(installed.stdout + installed.stderr):
            pytest.skip(f"pip cannot reach the package index to install {' '.join(requirements)}")
        raise AssertionError(f"pip install {requirements} failed:\n{installed.stderr[-3000:]}")
    stamp.write_text(wanted)
    return python


def client_env(**extra: str) -> dict[str, str]:
    """The environment a client script runs in: this one without PYTHONPATH (the script
    imports nothing of rawserve) and without HF_HUB_OFFLINE, which makes huggingface_hub's
    clients refuse every URL, loopback included."""
    dropped = {"PYTHONPATH", "HF_HUB_OFFLINE"}
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}

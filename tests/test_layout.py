"""The layout's promise: only the worker package loads torch and transformers.

Every module outside rawserve.worker is imported in a fresh interpreter (so nothing an
earlier test loaded can hide an import), and torch and transformers must not be loaded.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import rawserve

WORKER_PACKAGE = "rawserve.worker"


def server_side_modules() -> list[str]:
    names = [
        module.name
        for module in pkgutil.walk_packages(rawserve.__path__, "rawserve.")
        if not module.name.startswith(WORKER_PACKAGE + ".")
    ]
    # the worker's entry module is imported by the executor to name the process target
    return [*names, WORKER_PACKAGE, "rawserve.worker.process"]


def test_every_module_outside_the_worker_package_loads_without_torch():
    modules = server_side_modules()
    assert "rawserve.protocol" in modules and "rawserve.api.app" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not loaded, f'loaded {loaded}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_worker_package_is_where_torch_is():
    code = (
        "import sys\n"
        "import rawserve.worker.loading\n"
        "assert 'torch' in sys.modules and 'transformers' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

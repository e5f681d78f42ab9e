"""The layout's promise: only the worker package loads torch and transformers.

Every module outside rawserve.worker is imported in a fresh interpreter (so nothing an
earlier test loaded can hide an import), and torch and transformers must not be loaded.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import rawserve

REPO = Path(__file__).resolve().parent.parent

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


def test_a_handlers_worker_loads_only_what_the_handler_imports():
    """A handler's worker imported torch and transformers (with every runner module)
    though its handler used neither: most of its every start, and the memory they hold.
    The worker's own entry runs here on a handler that uses neither: it loads, answers a
    batch through an out-of-memory error (split, each item answered alone) and a change
    of threads, and leaves both unloaded."""
    code = (
        "import json, os, sys\n"
        "from multiprocessing import Pipe\n"
        "from rawserve.shared.messages import Batch, BatchResult, Shutdown, WorkerConfig\n"
        "from rawserve.shared.pipes import MessageReader\n"
        "from rawserve.worker.process import worker_main\n"
        "batches_in, batches_out = Pipe(duplex=False)\n"
        "replies_in, replies_out = Pipe(duplex=False)\n"
        "batches_out.send(Batch(1, ('a', 'b'), threads=2))\n"
        "batches_out.send(Shutdown())\n"
        "config = WorkerConfig(model='', handler='tests.handlers:faulty', device='auto')\n"
        "worker_main(batches_in, replies_out, config, 0)\n"
        "replies_out.close()\n"
        "messages = MessageReader().read(replies_in.fileno())\n"
        "[result] = [m for m in messages if isinstance(m, BatchResult)]\n"
        # (sys.stdout is the worker's log by now: what it prints becomes log lines)
        "print(json.dumps({\n"
        "    'said': [type(m).__name__ for m in messages],\n"
        "    'answered': [answer['input'] for answer in result.outputs],\n"
        "    'loaded': [m for m in ('torch', 'transformers') if m in sys.modules],\n"
        "}), file=sys.__stdout__)\n"
    )
    environment = {**os.environ, "RAWSERVE_TEST_OOM_ABOVE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts["said"] == ["WorkerReady", "BatchResult"]
    assert facts["answered"] == ["a", "b"]
    assert facts["loaded"] == []

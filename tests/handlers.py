"""Custom `--handler` factories for tests: each returns f(inputs: list, **params) -> list."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time


def echo():
    """Answers each input with the batch it was computed in (to observe batching)."""

    def handle(inputs, **params):
        return [
            {"input": item, "params": params, "batch": list(inputs), "pid": os.getpid()}
            for item in inputs
        ]

    return handle


def environment():
    """Answers each input (a variable's name) with its value in the worker's environment."""

    def handle(inputs, **params):
        return [os.environ.get(name) for name in inputs]

    return handle


def collector():
    """Answers each input with what the worker's garbage collector holds: the objects it
    froze (left out of full collections) and those it still tracks."""

    def handle(inputs, **params):
        state = {"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}
        return [state for _ in inputs]

    return handle


def flat_cost():
    """Sleeps as a GPU computes: a large fixed part per batch and little per item
    (`RAWSERVE_TEST_BATCH_MS`, default 8, and `RAWSERVE_TEST_ITEM_MS`, default 0.01),
    leaving the cores free; answers each input with its batch's size."""
    fixed = float(os.environ.get("RAWSERVE_TEST_BATCH_MS", "8")) / 1000
    per_item = float(os.environ.get("RAWSERVE_TEST_ITEM_MS", "0.01")) / 1000

    def handle(inputs, **params):
        time.sleep(fixed + per_item * len(inputs))
        return [{"batch": len(inputs)} for _ in inputs]

    return handle


def slow_loading():
    """Takes a while to load, then echoes: RAWSERVE_TEST_LOAD_SECONDS, or until the file
    RAWSERVE_TEST_LOADED (when set) exists, whichever comes first."""
    end = time.monotonic() + float(os.environ.get("RAWSERVE_TEST_LOAD_SECONDS", "3"))
    loaded = os.environ.get("RAWSERVE_TEST_LOADED")
    while time.monotonic() < end and not (loaded and os.path.exists(loaded)):
        time.sleep(0.05)
    return echo()


def sleepy():
    """Sleeps `sleep` seconds (a parameter) per batch, then echoes."""
    inner = echo()

    def handle(inputs, sleep=0.0, **params):
        if sleep >= 0.3:  # tests wait for this line to know the worker is busy
            print(f"sleepy handler: sleeping {sleep} s on {list(inputs)}", file=sys.stderr)
            sys.stderr.flush()
        time.sleep(sleep)
        return inner(inputs, **params)

    return handle


def failing_on_marker():
    """Raises ValueError on inputs containing "poison" (a bad input), echoes the rest."""
    inner = echo()

    def handle(inputs, **params):
        if any("poison" in str(item) for item in inputs):
            raise ValueError("this input is poison")
        return inner(inputs, **params)

    return handle


def orphans_file(server_pid: int) -> str:
    """Where the `faulty` handler's workers of the server `server_pid` list the children
    they leave behind (a test kills them)."""
    return os.path.join(tempfile.gettempdir(), f"rawserve-test-orphans-{server_pid}")


def faulty():
    """Echoes, and fails on purpose: an input containing "crash" kills the worker process
    ("orphan": after forking a child that holds its pipes for two minutes, its pid
    appended to the file `orphans_file(the server's pid)` names), one containing "hang"
    never finishes, a batch larger than RAWSERVE_TEST_OOM_ABOVE items
    (when set) raises MemoryError, and the parameter `sleep` sleeps that long per batch
    (with `until`, a file's path: only until that file exists)."""
    inner = echo()
    oom_above = int(os.environ.get("RAWSERVE_TEST_OOM_ABOVE", "0"))

    def handle(inputs, sleep=0.0, until=None, **params):
        if any("orphan" in str(item) for item in inputs):
            child = os.fork()
            if child == 0:
                time.sleep(120)
                os._exit(0)
            with open(orphans_file(os.getppid()), "a") as orphans:
                orphans.write(f"{child}\n")
            os._exit(3)
        if any("crash" in str(item) for item in inputs):
            os._exit(3)
        if any("hang" in str(item) for item in inputs):
            time.sleep(3600)
        if oom_above and len(inputs) > oom_above:
            raise MemoryError(f"out of memory on a batch of {len(inputs)}")
        if sleep >= 0.3:  # tests wait for this line to know the worker is busy
            print(f"faulty handler: sleeping {sleep} s on {list(inputs)}", file=sys.stderr)
            sys.stderr.flush()
        if until is None:
            time.sleep(sleep)
        else:
            end = time.monotonic() + sleep
            while time.monotonic() < end and not os.path.exists(until):
                time.sleep(0.01)
        return inner(inputs, **params)

    return handle


def loads_once():
    """Loads the first time; every later load in the same test (marker file in
    RAWSERVE_TEST_MARKER) dies, to exercise failed restarts."""
    marker = os.environ["RAWSERVE_TEST_MARKER"]
    if os.path.exists(marker):
        os._exit(4)
    with open(marker, "w") as file:
        file.write("loaded")
    return echo()


def recording():
    """Echoes, and appends every input it computes to the file RAWSERVE_TEST_RECORD;
    an input "gate" holds the worker until the file RAWSERVE_TEST_GATE exists."""
    inner = echo()
    record, gate = os.environ["RAWSERVE_TEST_RECORD"], os.environ["RAWSERVE_TEST_GATE"]

    def handle(inputs, **params):
        with open(record, "a") as file:
            file.writelines(f"{item}\n" for item in inputs)
        if "gate" in inputs:
            end = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < end:
                time.sleep(0.01)
        return inner(inputs, **params)

    return handle


def lingering_thread():
    """Starts a thread that never ends and is no daemon: it holds its worker at exit."""
    import threading

    threading.Thread(target=time.sleep, args=(3600,), name="forever").start()

    def handle(inputs, **params):
        return list(inputs)

    return handle


def numbers():
    """Answers each input as a number: `float(text)`, whose ValueError quotes the text."""

    def handle(inputs, **params):
        return [float(item) for item in inputs]

    return handle

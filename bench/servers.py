"""Start and stop the servers under comparison, and read their processes' CPU and memory.

Each server is a child process on a free loopback port, with its log in a file; `stop()`
sends SIGTERM and kills what is still there after a grace period. CPU and RSS come from
/proc (Linux), for the server and every process below it (rawserve's model worker).
`worker_ended` reads a worker's end from rawserve's log (bench.fault_run, bench.chaos).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE = 15.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

SERVERS = (
    "rawserve",
    "rawserve-onnx",
    "rawserve-default",
    "rawserve-lists",
    "rawserve-http4",
    "rawserve-count",
    "rawserve-eager",
    "rawserve-threads2",
    "rawserve-connections",
    "seed-batching",
    "seed-per-item",
    "infinity-torch",
    "infinity-optimum",
)
# rawserve's variants: its options beyond the scenario's (--task, ...)
RAWSERVE_VARIANTS = {
    # one worker per core, PyTorch: the layout the earlier runs measured
    "rawserve": ("--device", "cpu,cpu", "--engine", "torch"),
    "rawserve-onnx": ("--device", "cpu,cpu", "--engine", "onnx"),
    "rawserve-default": (),  # what a user gets with no options
    "rawserve-lists": ("--engine", "torch"),  # each request a list of texts (bench.compare)
    "rawserve-http4": ("--engine", "torch", "--http-processes", "4"),  # HTTP on 4 processes
    # batches in queue order, never grouped by length: what the cost model's plans are worth
    "rawserve-count": ("--engine", "torch", "--batching", "count"),
    # a GPU's forward pass as it is, not replayed from CUDA graphs: what the graphs are worth
    "rawserve-eager": ("--no-cuda-graphs",),
    # a GPU worker with two torch threads: the cores it leaves to the HTTP processes (at
    # 3x overload on an H100 the worker used 8.5 of 16 cores, and refusals waited)
    "rawserve-threads2": ("--threads", "2"),
    # room for a GPU's queue of single texts, each on a connection of its own: at 3x
    # overload on an H200 the default cap (1,000) was nearly all in use by the 200s, and
    # the cap's 503s close their connections (its clients come back on new ones)
    "rawserve-connections": ("--max-connections", "8192"),
}
# ONNX runs on the CPU
GPU_VARIANTS = (
    "rawserve",
    "rawserve-default",
    "rawserve-lists",
    "rawserve-http4",
    "rawserve-count",
    "rawserve-eager",
    "rawserve-threads2",
    "rawserve-connections",
)


def rawserve_args(name: str, device: str = "cpu") -> tuple[str, ...]:
    """The options of rawserve's variant `name` on `device` (cpu: the variants as above;
    a GPU: one worker on it, its defaults otherwise, half precision included)."""
    args = RAWSERVE_VARIANTS[name]
    if device == "cpu":
        return args if name != "rawserve-lists" else ("--device", "cpu,cpu", *args)
    if name not in GPU_VARIANTS:
        raise ValueError(f"{name} runs on the CPU only")
    if name == "rawserve-default":
        return args
    beyond_device = args[2:] if args[:1] == ("--device",) else args
    return ("--device", device, *beyond_device)


def worker_ended(pid: int | None = None) -> re.Pattern[str]:
    """The serving process's log line (rawserve.serving.pool) that says a worker's process
    `pid` (any, if None) ended, however it ended: 'exited with code C', 'was killed by
    SIGKILL (out of memory, or a kill -9)' (a kill from outside), 'was killed for hanging',
    'was killed, stopped from outside' (the server's own kills), 'stopped, as its load
    failed'."""
    process = r"\d+" if pid is None else str(pid)
    return re.compile(rf"worker \S+: process {process} (?:exited|was killed|stopped, as)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path = REPO_ROOT
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.command, "--port", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self.env,
                cwd=self.cwd,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        if self.process is None:
            return None
        return terminate(self.process, STOP_GRACE)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def terminate(process: subprocess.Popen, grace: float = STOP_GRACE) -> int | None:
    """SIGTERM, then SIGKILL if it is still running after `grace` seconds; its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def base_env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }


def rawserve(
    model: str | None,
    log_path: Path,
    args: Sequence[str] = (),
    handler: str | None = None,
    name: str = "rawserve",
) -> ServerProcess:
    command = [sys.executable, "-m", "rawserve", "--host", "127.0.0.1", *args]
    if handler:
        command += ["--handler", handler]
    elif model:
        command += ["--model", model]
    return ServerProcess(name, command, base_env(), log_path)


def seed(name: str, model: str, task: str, log_path: Path, device: str = "cpu") -> ServerProcess:
    """The seed page's server under uvicorn, with uvicorn's defaults (as `uvicorn server:app`);
    on a GPU its pipeline runs there in float16 (as rawserve does by default)."""
    module = {"seed-batching": "seed_batching", "seed-per-item": "seed_per_item"}[name]
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        f"bench.baselines.{module}:app",
        "--host",
        "127.0.0.1",
    ]
    env = {**base_env(), "SEED_MODEL": model, "SEED_TASK": task}
    if device != "cpu":
        env.update(SEED_DEVICE=device, SEED_DTYPE="float16")
    return ServerProcess(name, command, env, log_path)


# --- /proc readings -------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found = [pid]
    index = 0
    while index < len(found):
        current = found[index]
        index += 1
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    found += [int(child) for child in children.read().split()]
        except OSError:
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def idle_seconds() -> float:
    """Seconds the machine's cores have stood idle (or waited on I/O) since it booted,
    summed over the cores (0 where /proc/stat cannot be read)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()  # cpu user nice system idle iowait ...
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except OSError:
        return 0


def cpu_snapshot(root_pid: int) -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in descendants(root_pid)}


def cpu_shares(before: dict[int, float], after: dict[int, float], seconds: float) -> dict:
    """Cores used by the server process itself and by the processes below it."""
    root = next(iter(after), None)
    if root is None or seconds <= 0:
        return {}
    server = after.get(root, 0.0) - before.get(root, 0.0)
    children = sum(after[pid] - before.get(pid, 0.0) for pid in after if pid != root)
    return {
        "server_cpu_share": round(server / seconds, 3),
        "worker_cpu_share": round(children / seconds, 3),
    }

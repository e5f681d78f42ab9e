"""The server's configuration, typed and frozen, and the worker plan derived from it.

`rawserve.options` reads the command line (flags and RAWSERVE_* variables), checks it and
builds a `ServerConfig` once; `main.py` builds every part from it. Nothing changes it
afterwards, and nothing past the parser sees an untyped option bag:

- `ServerConfig`: the server's own settings: which models, where it listens (and TLS),
  each connection's limits (the protocol's own `ProtocolSettings`), the routes' settings
  (`AppSettings`), shutdown and logging;
- `ModelConfig`: how each served model is run: its workers, its engine, its batching
  (every model the server serves is run with the same one);
- `WorkerPlan`: the devices and threads of every model's workers, which depend on the
  models themselves (their number, the size of their weights), so they are settled once
  the models are planned, by `plan_workers`.

Server process; reads only the model folders' sizes and the machine's cores and RAM
(rawserve.ops.layout), never imports torch.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rawserve.api.settings import AppSettings
from rawserve.http.limits import ProtocolSettings
from rawserve.models.plan import ModelPlan
from rawserve.ops import layout
from rawserve.shared.devices import AFFINITY, CoreCount, core_count, parse_devices
from rawserve.shared.messages import Engine
from rawserve.tasks import onnx_unfit


class Batching(enum.Enum):
    """How the scheduler chooses a batch (`--batching`)."""

    COST = "cost"  # planned by input length and the measured cost of a call
    COUNT = "count"  # deadline order, up to --max-batch-size items


@dataclass(frozen=True)
class Tls:
    """TLS on the listening socket: the files as given, and the context loaded from them
    (at parse time, so a bad file stops the server before anything starts)."""

    certfile: str
    keyfile: str | None
    context: ssl.SSLContext = field(compare=False, repr=False)


@dataclass(frozen=True)
class ModelConfig:
    """How each served model is run."""

    device: str | None  # --device as given; None: the default layout
    devices: tuple[str, ...] | None  # --device parsed, one worker per entry
    engine: Engine
    dtype: str
    threads: int | None  # torch threads per worker; None: the CPU workers split the cores
    warmup: bool  # run a batch of max_batch_size examples (at most max_queue) before ready
    cuda_graphs: bool  # on a GPU: forward passes and decoding steps replayed (default)
    chat_template: str | None  # the text of --chat-template's file
    max_batch_size: int
    max_batch_delay_ms: float
    max_batch_tokens: int | None
    batching: Batching
    generation: str  # a causal LM's text generation: "continuous" or "static"
    max_sequences: int | None  # continuous: sequences a worker runs at once (None: by device)
    max_queue: int
    batch_timeout: float  # seconds a batch may run before its worker is restarted
    batch_limits: str = "as given"  # which batch limits are the device's defaults, and why
    # continuous: decoding steps a sequence that comes while rows run may wait for others
    # to join with it (0: it joins at the next step; rawserve.worker.continuous)
    join_wait_steps: int = 0

    @property
    def onnx_graphs(self) -> bool:
        """Whether the ONNX engine may serve an encoder task here (not --engine torch; on
        the CPU, in float32, with onnxruntime): a Hub repo's own graph is then fetched."""
        return self.engine is not Engine.TORCH and onnx_unfit_here(self.devices, self.dtype) is None


def onnx_unfit_here(
    devices: Sequence[str] | None, dtype: str, gpu: Callable[[], bool] | None = None
) -> str | None:
    """Why ONNX Runtime cannot serve an encoder task on the device `devices` name (--device
    parsed; None: the default layout, `gpu` saying whether it is a GPU's), in `dtype`, with
    what is installed; None where it can. What a worker would refuse once loaded, known
    before any starts but for the model's task."""
    installed = importlib.util.find_spec("onnxruntime") is not None  # the `onnx` extra
    return onnx_unfit(None, layout.engine_device(devices, gpu), dtype, installed)


@dataclass(frozen=True)
class ServerConfig:
    """Everything the command line settles, checked."""

    models: tuple[str, ...]  # [ALIAS=]MODEL[@REVISION][:TASK]; none: the packaged model
    revision: str | None
    task: str | None
    pooling: str | None  # --pooling: the feature-extraction models' mode, over their files'
    handler: str | None  # MODULE:FACTORY instead of models
    model: ModelConfig
    host: str
    port: int
    tls: Tls | None
    http: ProtocolSettings  # what each connection is allowed
    app: AppSettings
    grace: float  # seconds to drain on SIGTERM/SIGINT/SIGHUP
    http_processes: int  # processes that speak HTTP; 1: the serving process does too
    loop: str  # the event loop that runs: "uvloop" or "asyncio" (--loop, settled)
    log_level: str
    log_format: str
    access_log: bool
    download_only: bool

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.context if self.tls else None


@dataclass(frozen=True)
class WorkerPlan:
    """Where every served model's workers run: one worker per device, for each model."""

    devices: tuple[str, ...]
    threads: int  # torch threads per worker
    share_cores: bool  # no --threads: the CPU workers split the cores (a lone item takes all)
    layout: str  # why these devices, for /info
    chosen: bool  # the default per-core layout chose them (the log says why at start)
    crowded: str = ""  # --threads whose teams outnumber the cores: the warning to log


def plan_workers(
    model: ModelConfig, plans: Sequence[ModelPlan], cores: int | None = None
) -> WorkerPlan:
    """The devices and threads of every model's workers. With no --device and no GPU: one
    single-threaded worker per core for each model, as many as memory holds copies of all
    the models (rawserve.ops.layout); otherwise one worker per device given (`cores`: the
    machine's, read when not given)."""
    found = core_count() if cores is None else CoreCount(cores, AFFINITY)
    cores = found.cores
    devices = model.devices
    reason = f"--device {model.device or 'auto'}"
    chosen = False
    if devices is None:
        if layout.gpu_usable(handler=any(plan.handler for plan in plans)):
            devices = tuple(parse_devices("auto", os.environ.get("CUDA_VISIBLE_DEVICES")))
        else:
            size = sum(layout.model_bytes(Path(plan.folder)) for plan in plans if plan.folder)
            handler = any(plan.handler for plan in plans)  # (served alone)
            overhead = layout.HANDLER_OVERHEAD if handler else layout.WORKER_OVERHEAD
            per_core = layout.cpu_layout(
                cores,
                layout.ram_bytes(),
                size,
                models=len(plans),
                overhead=overhead,
                threads=model.threads or 1,
            )
            devices, reason, chosen = ("cpu",) * per_core.workers, per_core.reason, True
    threads = model.threads
    # every model has a worker per device
    cpu_workers = sum(device in ("cpu", "auto") for device in devices) * max(1, len(plans))
    if threads is None:
        threads = max(1, cores // max(1, cpu_workers))
    reason += layout.container_limits(found)
    crowded = ""
    if model.threads and model.threads > 1 and cpu_workers * threads > cores:
        crowded = (
            f"{cpu_workers} CPU worker(s) x {threads} threads (--threads) on {cores} core(s): "
            "busy at once, their teams of threads stall each other (5-25 x slower, "
            f"measured); give --threads {max(1, cores // cpu_workers)} or leave it out (the "
            "workers then split the cores evenly)"
        )
    return WorkerPlan(devices, threads, model.threads is None, reason, chosen, crowded)

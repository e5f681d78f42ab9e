"""On a GPU, rawserve runs as a GPU wants: half precision unless --dtype says otherwise,
and batches of hundreds of items bounded by tokens, a queue of several of them, HTTP from
several processes; a CPU keeps its own defaults. No GPU
here: the CUDA probe is faked, and the choices are checked where they are made."""

from __future__ import annotations

import json
import logging

import pytest

from rawserve.config import plan_workers
from rawserve.main import model_facts
from rawserve.models.plan import ModelPlan
from rawserve.ops import layout
from rawserve.options import (
    CPU_MAX_BATCH_SIZE,
    CPU_MAX_QUEUE,
    GPU_MAX_BATCH_SIZE,
    GPU_MAX_BATCH_TOKENS,
    GPU_MAX_QUEUE,
    http_processes_default,
    parse_config,
)
from tests.test_config import handler_plan


@pytest.fixture
def gpu(monkeypatch):
    """A machine that shows a GPU (the probe rawserve reads, faked), and a CUDA torch."""
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: True)
    monkeypatch.setattr("rawserve.ops.layout.cpu_only_torch", lambda: False)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: False)


@pytest.mark.parametrize(
    ("argv", "size", "tokens"),
    [
        ([], GPU_MAX_BATCH_SIZE, GPU_MAX_BATCH_TOKENS),  # no --device: the GPU it finds
        (["--device", "cuda"], GPU_MAX_BATCH_SIZE, GPU_MAX_BATCH_TOKENS),
        (["--device", "auto"], GPU_MAX_BATCH_SIZE, GPU_MAX_BATCH_TOKENS),
        (["--max-batch-size", "64"], 64, GPU_MAX_BATCH_TOKENS),  # what is given stays
        (["--max-batch-tokens", "4096"], GPU_MAX_BATCH_SIZE, 4096),
        (["--device", "cpu"], CPU_MAX_BATCH_SIZE, None),  # the CPU beside the GPU
    ],
)
def test_a_gpu_batches_hundreds_of_items_bounded_by_tokens(gpu, argv, size, tokens):
    model = parse_config(argv).model
    assert (model.max_batch_size, model.max_batch_tokens) == (size, tokens)


def test_a_gpu_a_cpu_torch_cannot_use_is_planned_as_a_cpu_but_for_a_handler(gpu, monkeypatch):
    """A CPU build of torch on a GPU machine (the default install, not overridden): its
    default layout was a GPU's, one worker with every core and a GPU's batches, serving
    on the CPU. A handler's code may use the GPU with another library."""
    monkeypatch.setattr("rawserve.ops.layout.cpu_only_torch", lambda: True)
    monkeypatch.setenv("RAWSERVE_DEVICE", "")  # (no --device: the default layout)
    model = parse_config([]).model
    assert (model.max_batch_size, model.max_batch_tokens) == (CPU_MAX_BATCH_SIZE, None)
    workers = plan_workers(model, [ModelPlan(("m",), "/m", "/m")], cores=4)
    assert workers.devices == ("cpu",) * 4
    handler = parse_config(["--handler", "tests.handlers:echo"]).model
    assert handler.max_batch_size == GPU_MAX_BATCH_SIZE
    assert plan_workers(handler, [handler_plan()], cores=4).devices == ("auto",)


def test_a_cpu_keeps_its_defaults(no_gpu):
    model = parse_config([]).model
    assert (model.max_batch_size, model.max_batch_tokens) == (CPU_MAX_BATCH_SIZE, None)
    assert model.batch_limits == "on the CPU: up to 32 items, no token budget"
    # a cuda device named is a GPU whatever the probe says (the worker checks it is there)
    assert parse_config(["--device", "cuda:0"]).model.max_batch_size == GPU_MAX_BATCH_SIZE


def test_the_variables_set_the_limits_as_the_flags_do(gpu, monkeypatch):
    monkeypatch.setenv("RAWSERVE_MAX_BATCH_SIZE", "128")
    model = parse_config([]).model
    assert (model.max_batch_size, model.max_batch_tokens) == (128, GPU_MAX_BATCH_TOKENS)
    assert model.batch_limits == "on a GPU: up to 128 items (as given), 16384 tokens (TEI's)"


def test_the_gpu_workers_and_info_say_which_limits_and_why(gpu):
    config = parse_config([])
    workers = plan_workers(config.model, [handler_plan()], cores=16)
    assert workers.devices == ("auto",) and not workers.chosen  # one worker per GPU
    facts = model_facts(handler_plan(), config, workers)
    assert facts["batching"]["max_batch_size"] == GPU_MAX_BATCH_SIZE  # type: ignore[index]
    assert facts["batching"]["max_batch_tokens"] == GPU_MAX_BATCH_TOKENS  # type: ignore[index]
    assert facts["batching"]["limits"] == (  # type: ignore[index]
        "on a GPU: up to 256 items, 16384 tokens (TEI's)"
    )


@pytest.mark.parametrize(
    ("devices", "present", "gpu"),
    [
        (None, True, True),
        (None, False, False),
        (("cpu",), True, False),
        (("cpu", "cpu"), True, False),
        (("auto",), True, True),
        (("auto",), False, False),
        (("auto", "cpu"), True, True),  # auto beside the CPU still looks for a GPU
        (("auto", "cpu"), False, False),
        (("cuda:1",), False, True),
        (("cpu", "cuda:0"), False, True),
    ],
)
def test_which_devices_are_a_gpu(devices, present, gpu):
    assert layout.on_gpu(devices, lambda: present) is gpu


@pytest.mark.parametrize(
    ("devices", "present", "device"),
    [
        (None, True, "cuda"),
        (None, False, "cpu"),
        (("auto",), True, "cuda"),
        (("auto",), False, "cpu"),
        (("auto", "mps"), False, "mps"),
        (("cpu", "cuda:1"), False, "cuda:1"),
    ],
)
def test_an_engine_is_judged_for_the_device_auto_resolves_to(devices, present, device):
    """`auto` is no device of its own: judged for it, --device auto on a machine with no
    GPU refused the ONNX engine, which runs on the CPU ("not on auto")."""
    assert layout.engine_device(devices, lambda: present) == device


@pytest.mark.parametrize(("torch", "gpu"), [("2.4.1+cpu", False), ("2.4.1+cu121", True)])
def test_a_cpu_build_of_torch_is_known_by_its_version_without_importing_it(monkeypatch, torch, gpu):
    """The server never imports torch, so its distribution's version says a CPU build: a
    GPU machine with one was planned as a GPU's, one worker with every core and a GPU's
    batches, serving on the CPU. A handler's code may use the GPU all the same."""
    from rawserve.shared import installed

    version = installed.version
    monkeypatch.setattr("rawserve.ops.layout.gpu_present", lambda: True)
    monkeypatch.setattr(
        installed, "version", lambda name: torch if name == "torch" else version(name)
    )
    monkeypatch.setenv("RAWSERVE_DEVICE", "")  # (no --device: the default layout)
    model = parse_config([]).model
    assert (model.max_batch_size == GPU_MAX_BATCH_SIZE) is gpu
    assert layout.gpu_usable() is gpu and layout.gpu_usable(handler=True)


@pytest.mark.parametrize(
    ("requested", "device", "saved", "bf16", "dtype", "why"),
    [
        ("auto", "cuda:0", None, True, "float16", "half precision (float16"),
        ("auto", "cuda:0", "float32", True, "float16", "half precision"),
        ("auto", "cuda:0", "bfloat16", True, "bfloat16", "bfloat16 as the checkpoint"),
        ("auto", "cuda:0", "bfloat16", False, "float16", "half precision (float16"),
        ("float32", "cuda:0", None, True, "float32", "--dtype float32"),
        ("bfloat16", "cuda:0", None, True, "bfloat16", "--dtype bfloat16"),
        # the CPU: the checkpoint's own, never a precision that changes answers
        ("auto", "cpu", None, True, "auto", "the checkpoint's own (float32)"),
        ("auto", "cpu", "bfloat16", True, "auto", "the checkpoint's own (bfloat16)"),
        ("float16", "cpu", None, False, "float16", "--dtype float16"),
    ],
)
def test_the_precision_on_each_device(requested, device, saved, bf16, dtype, why):
    from rawserve.worker.loading import choose_dtype

    chosen, reason = choose_dtype(requested, device, saved, bf16)
    assert chosen == dtype and why in reason
    assert reason.startswith(f"auto on {device}" if requested == "auto" else "--dtype")


def test_the_checkpoint_dtype_is_read_from_its_config(tmp_path):
    from rawserve.worker.loading import saved_dtype

    assert saved_dtype(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert saved_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16", "torch_dtype": "x"}))
    assert saved_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text("[1]")
    assert saved_dtype(tmp_path) is None


def test_the_checkpoint_dtype_is_read_whatever_the_locale(tmp_path, ascii_locale):
    """A config.json beyond ASCII (a label's accent) is read in an ASCII locale too: its
    dtype is not lost (a GPU would load a bfloat16 checkpoint in float16), nor the model
    refused."""
    from rawserve.worker.loading import refuse_unloadable_files, saved_dtype

    config = {"model_type": "bert", "dtype": "bfloat16", "id2label": {"0": "négatif"}}
    (tmp_path / "config.json").write_text(json.dumps(config, ensure_ascii=False), "utf-8")
    assert saved_dtype(tmp_path) == "bfloat16"
    refuse_unloadable_files(tmp_path)  # a model type transformers knows, no weights to check


@pytest.fixture
def attention_choice():
    """torch's attention flags as they were, after a test that sets them."""
    import torch

    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield torch.backends.cuda
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_gpu_worker_attends_without_kernels_that_plan_per_shape(attention_choice):
    """cuDNN's attention plans anew for every input shape, and a server's batches are
    ever-new shapes: a GPU worker turns it off; a CPU worker leaves torch's choice."""
    from rawserve.worker.loading import choose_attention_kernels

    attention_choice.enable_cudnn_sdp(True)
    assert choose_attention_kernels("cpu") is None
    assert attention_choice.cudnn_sdp_enabled()
    assert "not cuDNN" in (choose_attention_kernels("cuda:1") or "")
    assert not attention_choice.cudnn_sdp_enabled()
    assert attention_choice.flash_sdp_enabled() and attention_choice.mem_efficient_sdp_enabled()


def test_a_handler_on_a_gpu_attends_the_same_way_and_says_so(attention_choice, monkeypatch):
    from rawserve.shared.messages import WorkerConfig
    from rawserve.worker import handler
    from rawserve.worker.loading import load_runner

    monkeypatch.setattr(handler, "resolve_device", lambda device: device)  # a GPU, faked
    runner = load_runner(WorkerConfig(model="", handler="tests.handlers:echo"), "cuda:0")
    assert runner.attention.startswith("flash or memory-efficient kernels")
    assert not attention_choice.cudnn_sdp_enabled()


def test_a_worker_on_a_faked_gpu_loads_half_precision_and_says_so(
    tiny_model, monkeypatch, caplog, attention_choice
):
    """The worker's load with torch's CUDA probe faked: the precision chosen for cuda, the
    log line and the reason /info shows (the model itself is put on the CPU: no GPU here)."""
    import logging

    import torch

    from rawserve.worker import loading
    from rawserve.worker.runner import dtype_name
    from tests.tiny_models import worker_config

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(loading, "resolve_device", lambda device: device)  # a GPU, faked
    seen: dict[str, str] = {}

    def build(config, task, device, network):
        seen["dtype"] = config.dtype
        return real_build(config, task, "cpu", network)

    real_build = loading.build_runner
    monkeypatch.setattr(loading, "build_runner", build)
    config = worker_config(tiny_model("text-classification"), engine=loading.Engine.TORCH)
    with caplog.at_level(logging.INFO, logger="rawserve.worker"):
        runner = loading.load_runner(config, "cuda:0")
    assert seen["dtype"] == "float16" and dtype_name(runner.pipe.model) == "float16"
    assert runner.dtype_reason.startswith("auto on cuda:0: half precision (float16")
    assert runner.attention.startswith("flash or memory-efficient kernels")
    lines = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("dtype: float16 (auto on cuda:0") for line in lines)
    assert any(line.startswith("attention: flash or memory-efficient") for line in lines)


def test_a_gpu_queues_several_batches_and_a_cpu_keeps_its_bound(gpu):
    assert parse_config([]).model.max_queue == GPU_MAX_QUEUE
    assert parse_config(["--max-queue", "100"]).model.max_queue == 100  # what is given stays
    assert parse_config(["--device", "cpu"]).model.max_queue == CPU_MAX_QUEUE


def test_a_gpu_machine_speaks_http_from_several_processes(gpu, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert parse_config([]).http_processes == 8
    assert parse_config(["--http-processes", "1"]).http_processes == 1
    assert parse_config(["--device", "cpu"]).http_processes == 1  # the cores are the workers'
    # half the cores at most, one at least
    assert [http_processes_default(True, cores) for cores in (2, 3, 8, 16, 64)] == [1, 1, 4, 8, 8]
    assert http_processes_default(False, 64) == 1


def test_info_names_each_gpu_worker_s_device_as_device_named_it(caplog):
    """A worker of `--device cuda:0,cuda:1` sees its GPU alone, as its cuda:0, and says so
    when ready: /info, /metrics and the ready line gave both workers as cuda:0 (and a
    series labelled cuda:1 while loading, cuda:0 after). `auto` is what its worker made of
    it."""
    from rawserve.api.operations import _worker_info
    from rawserve.serving.pool import WorkerPool
    from rawserve.serving.status import WorkerState
    from rawserve.shared.messages import WorkerConfig, WorkerReady

    named = ["cuda:0", "cuda:1", "auto"]
    executor = WorkerPool(WorkerConfig(model="unused", task="text-classification"), named)
    executor._pump = lambda: None  # type: ignore[method-assign] - nothing to dispatch here
    caplog.set_level(logging.INFO, "rawserve")
    for worker in executor.workers:
        assert worker.status().device == worker.config.device  # loading: as named
        worker.state = WorkerState.LOADING
        ready = WorkerReady(1, "text-classification", "cuda:0", "float16", 1.0)
        executor._on_message(worker, ready)  # what each isolated worker reports
    assert [_worker_info(status)["device"] for status in executor.status()] == [
        "cuda:0",
        "cuda:1",
        "cuda:0",  # auto, on the first GPU
    ]
    assert "model ready on cuda:1" in caplog.text


def test_graphs_turned_off_on_a_gpu_are_said_to_be_off(tiny_model, monkeypatch, caplog):
    """With --no-cuda-graphs (or RAWSERVE_NO_CUDA_GRAPHS left in a deployment) a GPU
    worker said nothing of its graphs: /info's `cuda_graphs` was null, as on a CPU."""
    import dataclasses

    from rawserve.worker import loading
    from tests.tiny_models import worker_config

    monkeypatch.setattr(loading, "resolve_device", lambda device: device)  # a GPU, faked
    monkeypatch.setattr(loading, "choose_attention_kernels", lambda device: "")
    real_build = loading.build_runner

    def build(config, task, device, network):
        runner = real_build(config, task, "cpu", network)  # on the CPU: no GPU here
        runner.device = device
        return runner

    monkeypatch.setattr(loading, "build_runner", build)
    config = worker_config(tiny_model("text-classification"), engine=loading.Engine.TORCH)
    off = dataclasses.replace(config, cuda_graphs=False, dtype="float32")
    with caplog.at_level(logging.INFO, logger="rawserve.worker"):
        runner = loading.load_runner(off, "cuda:0")
    assert runner.cuda_graphs.startswith("off: --no-cuda-graphs") and runner.graphed is None
    assert "CUDA graphs: off: --no-cuda-graphs" in caplog.text

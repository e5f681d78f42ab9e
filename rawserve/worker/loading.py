"""Loads the runner a worker serves: which class wraps the model for its task, in which
precision (half on a GPU unless --dtype says otherwise), and which engine runs its
forward pass (torch, or ONNX Runtime for the encoder tasks on a CPU; with --engine auto,
whichever a short trial on this machine finds faster: rawserve.worker.engine_trial).

Worker process only (imports torch, and every runner module).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import zipfile
from functools import partial
from pathlib import Path
from typing import Any

import safetensors
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from rawserve.models.folder import SHIPPED_GRAPH, TORCH_WEIGHTS
from rawserve.shared.messages import Engine, WorkerConfig
from rawserve.tasks import SEQ2SEQ_TASKS, onnx_unfit
from rawserve.worker import engine_trial, graph_cache, onnx_engine, precision_trial
from rawserve.worker.causal_lm import CausalLMRunner
from rawserve.worker.encoder import EncoderRunner
from rawserve.worker.handler import load_handler
from rawserve.worker.model_classes import refuse_unfit_model_type
from rawserve.worker.pipeline import PipelineRunner
from rawserve.worker.runner import Runner, choose_attention_kernels, resolve_device, resolve_dtype
from rawserve.worker.seq2seq_lm import Seq2SeqLMRunner
from rawserve.worker.span_extraction import SpanExtractionRunner
from rawserve.worker.warmup import example_batch

log = logging.getLogger("rawserve.worker")

# what the log and /info's `cuda_graphs` say of a GPU worker's graphs turned off
NO_GRAPHS = "off: --no-cuda-graphs (every forward pass runs as it is)"
UNREADABLE_TOKENS_NAMED = 5  # of a tokenizer's tokens past the model's embeddings, in the log


def choose_engine(
    requested: Engine,
    task: str,
    device: str,
    dtype: str,
    onnx_installed: bool,
    pooling: str = "none",
) -> tuple[Engine, str]:
    """The engine that runs `task` here, and why; ValueError when `onnx` cannot."""
    unfit = onnx_unfit(task, device, dtype, onnx_installed, pooling)
    if requested is Engine.TORCH:
        return Engine.TORCH, "--engine torch"
    if requested is Engine.ONNX:
        if unfit:
            raise ValueError(f"--engine onnx: {unfit}")
        return Engine.ONNX, "--engine onnx"
    if unfit:
        return Engine.TORCH, f"auto: {unfit}"
    return Engine.ONNX, f"auto: {task} on the CPU with onnxruntime installed"


def choose_dtype(requested: str, device: str, saved: str | None, bf16: bool) -> tuple[str, str]:
    """The precision a model is loaded in on `device`, and why. `saved`: the dtype its
    checkpoint names (None: unnamed); `bf16`: whether the GPU computes in bfloat16.

    On a GPU, --dtype auto means half precision: tensor cores run it several times as
    fast as float32, and an encoder's answers move only in their low digits. float16 (TEI's
    default) keeps more digits than bfloat16; a checkpoint saved in bfloat16 keeps it
    where the GPU has it (such a model may not fit float16's range). On a CPU, auto is
    the checkpoint's own precision, as before: half precision there is slower or changes
    answers, and nothing auto picks may change answers."""
    if requested != "auto":
        return requested, f"--dtype {requested}"
    if not device.startswith("cuda"):
        return "auto", f"auto on {device}: the checkpoint's own ({saved or 'float32'})"
    if saved == "bfloat16" and bf16:
        return "bfloat16", f"auto on {device}: half precision, bfloat16 as the checkpoint"
    return "float16", f"auto on {device}: half precision (float16; --dtype float32 for full)"


def saved_dtype(folder: Path) -> str | None:
    """The dtype a model folder's config.json names (`dtype`, or the older `torch_dtype`)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    named = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return named if isinstance(named, str) else None


def load_runner(config: WorkerConfig, device: str) -> Runner:
    if config.handler:
        return load_handler(config, device)
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(device)
    attention = choose_attention_kernels(device) or ""
    if attention:
        log.info("attention: %s", attention)
    model, task = config.model, config.task
    if task is None:
        raise ValueError("no task: the server names the task of every model it serves")
    if not Path(model).is_dir():  # (transformers would take it for a Hub repo id)
        raise FileNotFoundError(
            f"the model folder {model} is not there any more (moved or removed since the "
            "server started)"
        )
    refuse_unloadable_files(Path(model))
    refuse_unfit_model_type(Path(model), task)
    bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    saved = saved_dtype(Path(model))
    dtype, dtype_reason = choose_dtype(config.dtype, device, saved, bf16)
    log.info("dtype: %s (%s)", dtype, dtype_reason)
    config = dataclasses.replace(config, dtype=dtype)
    engine, reason = choose_engine(
        config.engine,
        task,
        device,
        config.dtype,
        onnx_engine.onnxruntime_installed(),
        config.pooling,
    )
    runner: Runner | None = None
    if engine is Engine.ONNX and config.engine is Engine.AUTO:
        engine, reason, runner = measured_engine(config, task, device)
    elif engine is Engine.ONNX:
        network = onnx_engine.load_network(model, task, config.threads or 1)
        runner = build_runner(config, task, device, network)
    runner = runner or build_runner(config, task, device, None)
    if engine is Engine.ONNX and runner.onnx is not None:  # which graph it runs
        reason = f"{reason}; graph: {runner.onnx.source}"
    log.info("engine: %s (%s)", engine.value, reason)
    refuse_without_vocabulary(runner.tokenizer, Path(model))
    warn_of_unreadable_tokens(runner)
    if runner.onnx is not None:  # what the model the graph was exported from had random
        runner.untrained = runner.onnx.untrained
    runner.engine, runner.engine_reason = engine, reason
    if engine is Engine.ONNX and dtype == "auto" and saved not in (None, "float32"):
        # (torch would have run the checkpoint's own half precision: not what is served)
        dtype_reason = f"float32: ONNX Runtime computes in it (the checkpoint's own: {saved})"
        log.info("dtype: %s", dtype_reason)
    runner.dtype_reason = dtype_reason
    runner.bfloat16_trial = bfloat16_trial(config, task, device, runner)
    if runner.bfloat16_trial:
        log.info("bfloat16 trial: %s", runner.bfloat16_trial)
    runner.attention = attention
    if runner.on_cuda:  # (a CPU's "" reads as none tried)
        runner.cuda_graphs = runner.use_cuda_graphs() if config.cuda_graphs else NO_GRAPHS
        log.info("CUDA graphs: %s", runner.cuda_graphs)
    return runner


def measured_engine(config: WorkerConfig, task: str, device: str) -> tuple[Engine, str, Runner]:
    """--engine auto where both engines serve the task: the faster on this machine, by the
    trial's cached verdict or a trial now; torch alone where ONNX Runtime cannot load it."""
    if not torch_loads(Path(config.model)):  # its own ONNX graph alone: nothing to contest
        network = onnx_engine.load_network(config.model, task, config.threads or 1)
        reason = f"auto: the model has no weights for torch, only {SHIPPED_GRAPH}"
        return Engine.ONNX, reason, build_runner(config, task, device, network)
    size = config.warmup_batch or engine_trial.TRIAL_BATCH
    cache_dir = engine_trial.default_cache_dir()
    key = trial_key(config, task, size)
    with engine_trial.one_trial_at_a_time(cache_dir, key):
        return engine_by_trial(config, task, device, size, cache_dir, key)


def engine_by_trial(
    config: WorkerConfig, task: str, device: str, size: int, cache_dir: Path, key: dict[str, Any]
) -> tuple[Engine, str, Runner]:
    """`measured_engine` where both engines may serve: the kept verdict, or a trial now."""
    trial = engine_trial.cached(cache_dir, key, config.start)
    if trial is not None and trial.winner is Engine.TORCH:
        return Engine.TORCH, trial.describe(), build_runner(config, task, device, None)
    failed = engine_trial.recalled(cache_dir, engine_trial.UNLOADABLE_PREFIX, key).get("error")
    if failed:
        reason = (
            f"auto: ONNX Runtime could not load the model ({failed}) at an earlier start "
            "of these files and versions (in the cache)"
        )
        return Engine.TORCH, reason, build_runner(config, task, device, None)
    try:
        network = onnx_engine.load_network(config.model, task, config.threads or 1)
    except graph_cache.CacheNotWritable as exc:  # ONNX Runtime never ran: nothing to load
        log.warning("the ONNX export could not be written, torch runs the model: %s", exc)
        reason = (
            f"auto: the ONNX export could not be written to {exc.folder} ({exc.why}), so "
            "ONNX Runtime never ran: RAWSERVE_CACHE_DIR names a folder that can be written"
        )
        return Engine.TORCH, reason, build_runner(config, task, device, None)
    except Exception as exc:  # noqa: BLE001 - logged; torch serves the model
        log.debug("the ONNX engine's failure", exc_info=True)
        log.warning("the ONNX engine could not load this model, torch runs it: %s", exc)
        # (the machine's, which may not recur: memory, the disk, an export killed)
        if not isinstance(exc, (OSError, MemoryError, onnx_engine.ExportInterrupted)):
            # each start exported the model again to fail again (5-16 s on a tiny GPT-2)
            found = {"error": onnx_engine.failure_name(exc), "start": config.start}
            unloadable = engine_trial.UNLOADABLE_PREFIX
            engine_trial.remember(cache_dir, unloadable, key, found, engine_trial.named(config))
        reason = f"auto: ONNX Runtime could not load the model ({onnx_engine.failure_name(exc)})"
        return Engine.TORCH, reason, build_runner(config, task, device, None)
    onnx_runner = build_runner(config, task, device, network)
    if trial is not None:
        return Engine.ONNX, trial.describe(), onnx_runner
    batch = example_batch(onnx_runner, size)
    if batch is None:  # nothing to measure with: ONNX Runtime, the faster on most CPUs
        return Engine.ONNX, "auto: no example batch to measure with", onnx_runner
    torch_runner = build_runner(config, task, device, None)
    runners = {Engine.TORCH: torch_runner, Engine.ONNX: onnx_runner}
    inputs, params = batch
    try:
        trial = engine_trial.run_trial(
            {engine: partial(runner.run, inputs, params) for engine, runner in runners.items()},
            size,
            lone={
                engine: partial(runner.run, inputs[:1], params)
                for engine, runner in runners.items()
            },
            threads=config.threads or 1,
        )
    except Exception:  # noqa: BLE001 - a failed trial is logged; ONNX Runtime serves
        log.warning("the engine trial failed", exc_info=True)
        return Engine.ONNX, "auto: the engine trial failed", onnx_runner
    if kept_if_quiet(trial.share, config.threads or 1, "engine"):
        engine_trial.store(cache_dir, key, trial, config.start, engine_trial.named(config))
    winner = runners.pop(trial.winner)
    runners.clear()
    del torch_runner, onnx_runner
    gc.collect()  # the loser's weights go now, not at some later collection
    return trial.winner, trial.describe(), winner


def bfloat16_trial(config: WorkerConfig, task: str, device: str, runner: Runner) -> str:
    """What --dtype bfloat16 would give an encoder served in float32 on a CPU that computes
    bfloat16 in hardware, measured once per model and machine ("": not tried):
    rawserve.worker.precision_trial."""
    units = precision_trial.bf16_units(engine_trial.cpu_facts().get("flags", ""))
    if (
        units is None
        or device != "cpu"
        or config.dtype != "auto"  # a precision given is the one wanted
        or config.engine is Engine.ONNX  # (which takes no --dtype bfloat16 to offer)
        or runner.dtype != "float32"
        or task not in onnx_engine.ONNX_TASKS
        or not torch_loads(Path(config.model))  # no weights to make a bfloat16 copy of
    ):
        return ""
    size = config.warmup_batch or engine_trial.TRIAL_BATCH
    cache_dir = engine_trial.default_cache_dir()
    key = {**trial_key(config, task, size), "serving": runner.engine.value}  # torch's version in it
    # one process of a start measures, the others read its finding: a layout trial's
    # timers measured at once, and one start logged "1.07x faster" and "0.89x not faster"
    with engine_trial.one_trial_at_a_time(cache_dir, key, precision_trial.CACHE_PREFIX):
        offer = precision_trial.recalled(cache_dir, key, config.start)
        if offer is None:
            offer = measured_bfloat16(config, task, device, runner, size, units)
            gc.collect()  # the bfloat16 copy's weights go now
            threads = config.threads or 1
            if offer is not None and kept_if_quiet(offer.share, threads, "bfloat16"):
                model = engine_trial.named(config)
                precision_trial.remember(cache_dir, key, offer, config.start, model)
    return offer.describe() if offer is not None else ""


def kept_if_quiet(share: float, threads: int, trial: str) -> bool:
    """Whether a trial's verdict, timed with `share` of its `threads` cores, may be kept
    for later starts: not where other work shared the machine meanwhile (then it serves
    this start alone, and the next measures again)."""
    if engine_trial.quiet(share, threads):
        return True
    log.warning(
        "the %s trial ran while other work shared the machine (it had %.1f%% of the "
        "cores it ran on): its verdict serves this start and is not kept, so that a later "
        "start measures again",
        trial,
        100 * share,
    )
    return False


def measured_bfloat16(
    config: WorkerConfig, task: str, device: str, runner: Runner, size: int, units: str
) -> precision_trial.Offer | None:
    """A bfloat16 copy of the model timed against `runner` on the warm-up batch."""
    batch = example_batch(runner, size)
    if batch is None:
        return None
    inputs, params = batch
    try:
        bfloat16 = build_runner(dataclasses.replace(config, dtype="bfloat16"), task, device, None)
        return precision_trial.measure(
            partial(runner.run, inputs, params),
            partial(bfloat16.run, inputs, params),
            size,
            units,
            threads=config.threads or 1,
        )
    except Exception:  # noqa: BLE001 - logged; float32 serves as it would have
        log.warning("the bfloat16 trial failed", exc_info=True)
        return None


def torch_loads(folder: Path) -> bool:
    """Whether the folder has weights torch loads (not an ONNX-only folder)."""
    return any((folder / name).is_file() for name in TORCH_WEIGHTS)


def trial_key(config: WorkerConfig, task: str, size: int) -> dict[str, object]:
    """What the trial's verdict depends on (rawserve.worker.engine_trial): the graph
    ONNX Runtime ran is the export of the model's files, or the folder's own graph
    (one that appears, fetched from the Hub later, is another contest)."""
    shipped = Path(config.model) / SHIPPED_GRAPH
    return {
        **onnx_engine.cache_key(Path(config.model), onnx_engine.HEADS[task]),
        **({"shipped": engine_trial.fingerprint(shipped)} if shipped.is_file() else {}),
        "task": task,
        "batch": size,
        "threads": config.threads,
        "dtype": config.dtype,
        "onnxruntime": engine_trial.installed_version("onnxruntime"),
        "machine": engine_trial.machine(),
    }


def refuse_unloadable_files(folder: Path) -> None:
    """Raise ValueError, naming the file, for what transformers would fail to load less
    clearly: a model type it does not know, or only through the model's own Python code
    (it asked on the terminal whether to run it, and failed), and a safetensors file cut
    short or corrupt (safetensors' own error names no file)."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    model_type = config.get("model_type")
    known = model_type in CONFIG_MAPPING_NAMES
    if config.get("auto_map") and not known:
        raise ValueError(
            f"config.json's model_type {model_type!r} is not one transformers knows: it "
            "names the model's own Python code (auto_map), which rawserve does not run "
            "(no trust_remote_code)"
        )
    if model_type is not None and not known:
        raise ValueError(
            f"config.json's model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} knows: a later transformers may serve it"
        )
    labels = config.get("id2label")
    if isinstance(labels, dict) and (odd := [k for k in labels if not str(k).isdigit()]):
        raise ValueError(
            f"config.json's id2label keys are the head's outputs, numbered from 0, not {odd[0]!r}"
        )
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safetensors.safe_open(str(path), framework="pt"):
                pass
        except safetensors.SafetensorError as exc:
            raise ValueError(
                f"{path.name} is not a whole safetensors file ({exc}): download or save it again"
            ) from None
    # (beside safetensors weights, which transformers loads first, a .bin is not read)
    bins = [] if any(folder.glob("*.safetensors")) else sorted(folder.glob("pytorch_model*.bin"))
    for path in bins:
        if not whole_archive(path):
            raise ValueError(
                f"{path.name} is not a whole PyTorch checkpoint (its zip archive is cut short "
                "or corrupt): download or save it again"
            )


def whole_archive(path: Path) -> bool:
    """Whether a torch.save file's zip archive has its directory (at its end: a file cut
    short has none). A checkpoint of torch before 1.6 is a plain pickle, not checked."""
    with path.open("rb") as file:
        if file.read(2) != b"PK":
            return True
    return zipfile.is_zipfile(path)


def refuse_without_vocabulary(tokenizer: Any, folder: Path) -> None:
    """Raise ValueError when the model's tokenizer was built from no file of its folder.

    transformers builds a tokenizer that has only its special tokens when the folder holds
    none of its files (a repo uploaded without them): every word is then the unknown
    token, and every text gets the same answer."""
    files = getattr(tokenizer, "vocab_files_names", None)
    if not files:
        return  # no tokenizer (images), or one that reads no files
    names = sorted({*files.values(), "tokenizer.json"})
    if not any((folder / name).is_file() for name in names):
        raise ValueError(
            f"the model has no tokenizer files (any of {', '.join(names)}): "
            "every text would read as unknown tokens"
        )


def warn_of_unreadable_tokens(runner: Runner) -> None:
    """Log a warning where the tokenizer has more tokens than the model has embeddings
    for (tokens added to it without `model.resize_token_embeddings`, a common mistake
    of fine-tuned checkpoints): an input holding one of them is refused (422)."""
    tokenizer, rows = runner.tokenizer, runner.embedding_rows
    if tokenizer is None or rows is None or len(tokenizer) <= rows:
        return
    past = len(tokenizer) - rows
    first = list(range(rows, rows + min(past, UNREADABLE_TOKENS_NAMED)))
    named = ", ".join(repr(token) for token in tokenizer.convert_ids_to_tokens(first))
    log.warning(
        "the tokenizer has %d tokens and the model's embedding table %d rows (tokens added "
        "to the tokenizer without resizing the model): an input holding one of the %d "
        "past them (%s%s) is refused with 422",
        len(tokenizer),
        rows,
        past,
        named,
        ", ..." if past > UNREADABLE_TOKENS_NAMED else "",
    )


def build_runner(
    config: WorkerConfig, task: str, device: str, network: onnx_engine.OnnxNetwork | None
) -> Runner:
    """The runner for `task`; `network` (ONNX Runtime's) replaces the torch model if given."""
    model, dtype = config.model, config.dtype
    if task == "feature-extraction":
        return EncoderRunner(model, device, dtype, config.pooling, config.normalize, network)
    if task == "text-generation":
        return CausalLMRunner(model, device, resolve_dtype(dtype), config.chat_template)
    if task == "question-answering":
        return SpanExtractionRunner(model, device, resolve_dtype(dtype), network)
    if task in SEQ2SEQ_TASKS:
        return Seq2SeqLMRunner(model, task, device, resolve_dtype(dtype))
    return PipelineRunner(model, task, device, dtype, network)

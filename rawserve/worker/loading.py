"""Loads the runner a worker serves: which class wraps the model for its task, and which
engine runs its forward pass (torch, or ONNX Runtime for the encoder tasks on a CPU).

Worker process only (imports torch, and every runner module).
"""

from __future__ import annotations

import logging

import torch

from rawserve.shared.messages import Engine, WorkerConfig
from rawserve.tasks import SEQ2SEQ_TASKS
from rawserve.worker import onnx_engine
from rawserve.worker.causal_lm import CausalLMRunner
from rawserve.worker.encoder import EncoderRunner
from rawserve.worker.handler import HandlerRunner
from rawserve.worker.pipeline import PipelineRunner
from rawserve.worker.runner import Runner, resolve_device, resolve_dtype
from rawserve.worker.seq2seq_lm import Seq2SeqLMRunner
from rawserve.worker.span_extraction import SpanExtractionRunner

log = logging.getLogger("rawserve.worker")


def choose_engine(
    requested: Engine, task: str, device: str, dtype: str, onnx_installed: bool
) -> tuple[Engine, str]:
    """The engine that runs `task` here, and why; ValueError when `onnx` cannot."""
    unfit = None
    if task not in onnx_engine.ONNX_TASKS:
        unfit = f"ONNX Runtime serves the encoder tasks, not {task}"
    elif device != "cpu":
        unfit = f"ONNX Runtime runs here on the CPU only, not on {device}"
    elif dtype not in ("auto", "float32"):
        unfit = f"ONNX Runtime runs float32 here, not {dtype}"
    elif not onnx_installed:
        unfit = "onnxruntime is not installed (pip install 'rawserve[onnx]')"
    if requested is Engine.TORCH:
        return Engine.TORCH, "--engine torch"
    if requested is Engine.ONNX:
        if unfit:
            raise ValueError(f"--engine onnx: {unfit}")
        return Engine.ONNX, "--engine onnx"
    if unfit:
        return Engine.TORCH, f"auto: {unfit}"
    return Engine.ONNX, f"auto: {task} on the CPU with onnxruntime installed"


def load_runner(config: WorkerConfig, device: str) -> Runner:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(device)
    if config.handler:
        return HandlerRunner(config.handler, device)
    model, task = config.model, config.task
    if task is None:
        raise ValueError("no task: the server names the task of every model it serves")
    engine, reason = choose_engine(
        config.engine, task, device, config.dtype, onnx_engine.onnxruntime_installed()
    )
    network: onnx_engine.OnnxNetwork | None = None
    if engine is Engine.ONNX:
        try:
            network = onnx_engine.load_network(model, task, config.threads or 1)
        except Exception as exc:
            if config.engine is not Engine.AUTO:
                raise
            log.warning("the ONNX engine could not load this model: torch runs it", exc_info=True)
            engine, reason = Engine.TORCH, f"auto: the ONNX export failed ({type(exc).__name__})"
    log.info("engine: %s (%s)", engine.value, reason)
    runner = build_runner(config, task, device, network)
    runner.engine, runner.engine_reason = engine, reason
    return runner


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

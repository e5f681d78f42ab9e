"""Loads the runner a worker serves: which class wraps the model for its task.

Worker process only (imports torch, and every runner module).
"""

from __future__ import annotations

import torch

from rawserve.shared.messages import WorkerConfig
from rawserve.tasks import SEQ2SEQ_TASKS
from rawserve.worker.causal_lm import CausalLMRunner
from rawserve.worker.encoder import EncoderRunner
from rawserve.worker.handler import HandlerRunner
from rawserve.worker.pipeline import PipelineRunner
from rawserve.worker.runner import Runner, resolve_device, resolve_dtype
from rawserve.worker.seq2seq_lm import Seq2SeqLMRunner
from rawserve.worker.span_extraction import SpanExtractionRunner


def load_runner(config: WorkerConfig, device: str) -> Runner:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(device)
    if config.handler:
        return HandlerRunner(config.handler, device)
    model, task = config.model, config.task
    if task is None:
        raise ValueError("no task: the server names the task of every model it serves")
    if task == "feature-extraction":
        return EncoderRunner(model, device, config.dtype, config.pooling, config.normalize)
    if task == "text-generation":
        return CausalLMRunner(model, device, resolve_dtype(config.dtype))
    if task == "question-answering":
        return SpanExtractionRunner(model, device, resolve_dtype(config.dtype))
    if task in SEQ2SEQ_TASKS:
        return Seq2SeqLMRunner(model, task, device, resolve_dtype(config.dtype))
    return PipelineRunner(model, task, device, config.dtype)

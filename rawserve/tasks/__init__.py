"""Per-task rules: which inputs are valid, which parameters are allowed, how outputs are shaped.

One module per task (or family of tasks) holds its rules; `registry` gathers and applies
them. Imported by the server (to check requests before they are queued) and by the worker
(to shape the pipeline's answers), so nothing here may import torch, transformers, h11 or
any part of either process.
"""

from rawserve.tasks.checks import BlankInput
from rawserve.tasks.estimate import estimate_tokens
from rawserve.tasks.registry import (
    CUSTOM_TASK,
    ENCODER_TASKS,
    TASKS,
    batch_key,
    check_generation_length,
    check_input,
    check_new_tokens,
    check_params,
    input_estimate,
    model_tokens,
    onnx_unfit,
    other_tasks_fields,
    shape_answer,
    split_outputs,
    task_rules,
)
from rawserve.tasks.rules import (
    InvalidRequest,
    SingleAnswer,
    Task,
    UnknownParameters,
    UnservedParameter,
)
from rawserve.tasks.seq2seq import GENERATE_PARAMS, SEQ2SEQ_TASKS
from rawserve.tasks.text_classification import LOGITS_PARAM, TRUNCATE_TO
from rawserve.tasks.text_generation import CHAT_PARAM

__all__ = [
    "BlankInput",
    "CHAT_PARAM",
    "CUSTOM_TASK",
    "ENCODER_TASKS",
    "GENERATE_PARAMS",
    "LOGITS_PARAM",
    "SEQ2SEQ_TASKS",
    "TASKS",
    "TRUNCATE_TO",
    "InvalidRequest",
    "SingleAnswer",
    "Task",
    "UnknownParameters",
    "UnservedParameter",
    "batch_key",
    "check_generation_length",
    "check_input",
    "check_new_tokens",
    "check_params",
    "estimate_tokens",
    "input_estimate",
    "model_tokens",
    "onnx_unfit",
    "other_tasks_fields",
    "shape_answer",
    "split_outputs",
    "task_rules",
]

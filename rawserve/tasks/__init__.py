"""Per-task rules: which inputs are valid, which parameters are allowed, how outputs are shaped.

One module per task (or family of tasks) holds its rules; `requests` applies them.
Imported by the server (to validate requests before they are queued) and by the worker
(to shape the pipeline's answers), so nothing here may import torch or transformers.
"""

from rawserve.tasks.requests import (
    CUSTOM_TASK,
    TASKS,
    ParsedRequest,
    batch_key,
    check_input,
    check_params,
    estimate_tokens,
    parse_binary_body,
    parse_json_body,
    parse_text_body,
    shape_answer,
    split_outputs,
    takes_binary_body,
    task_rules,
)
from rawserve.tasks.rules import SingleAnswer, Task
from rawserve.tasks.seq2seq import GENERATE_PARAMS, SEQ2SEQ_TASKS
from rawserve.tasks.text_generation import STREAM_ID_PARAM

__all__ = [
    "CUSTOM_TASK",
    "GENERATE_PARAMS",
    "SEQ2SEQ_TASKS",
    "STREAM_ID_PARAM",
    "TASKS",
    "ParsedRequest",
    "SingleAnswer",
    "Task",
    "batch_key",
    "check_input",
    "check_params",
    "estimate_tokens",
    "parse_binary_body",
    "parse_json_body",
    "parse_text_body",
    "shape_answer",
    "split_outputs",
    "takes_binary_body",
    "task_rules",
]

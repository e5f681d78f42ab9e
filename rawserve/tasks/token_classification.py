"""token-classification: text in; a list of entities out.

The pipeline cuts a text at the model's positions; with `stride` it reads the whole text
instead, in windows of the model's length that overlap by `stride` tokens, and merges
the entities of the overlaps (which needs an `aggregation_strategy`).
"""

from __future__ import annotations

import math
from typing import Any

from rawserve.tasks.checks import NUMBER, checker, int_range, lower_one_of, text, text_list
from rawserve.tasks.rules import Task

SPECIAL_TOKENS = 2  # a window is [CLS] text [SEP]


def window_tokens(tokens: int, limit: int, stride: int) -> int:
    """The tokens the model reads of a text of `tokens` tokens cut into windows of `limit`
    tokens that overlap by `stride`. A stride close to the window starts one every token
    or two, so a few kilobytes of text become thousands of windows."""
    room = limit - SPECIAL_TOKENS  # of the text, in each window
    if tokens <= limit or room - stride < 1:  # one window; or none fits (the worker refuses)
        return min(tokens, limit)
    return (1 + math.ceil((tokens - limit) / (room - stride))) * limit


IGNORED_LABELS = text_list(100, min_items=0)


@checker(IGNORED_LABELS.schema)
def ignore_labels(value: Any) -> list[str]:
    """A list of labels, or one text of them separated by commas, as zero-shot's
    `candidate_labels` is read (the pipeline reads a text by `in`: "B-PER,I-LOC" left both
    out there, where it was read here as one label, which left them in)."""
    if isinstance(value, str) and value.strip():
        value = [label.strip() for label in value.split(",") if label.strip()]
    return IGNORED_LABELS(value)


TASK = Task(
    "token-classification",
    text,
    {
        "aggregation_strategy": lower_one_of("none", "simple", "first", "average", "max"),
        # [] keeps every label, "O" too (the pipeline's default leaves "O" out)
        "ignore_labels": ignore_labels,
        "stride": int_range(0, 4096),
    },
    output_schema={
        "type": "array",
        "items": {
            "type": "object",
            "required": ["score", "word"],
            "properties": {
                "entity": {"type": "string"},
                "entity_group": {"type": "string"},
                "score": NUMBER,
                "word": {"type": "string"},
                "start": {"type": ["integer", "null"]},
                "end": {"type": ["integer", "null"]},
            },
        },
    },
)

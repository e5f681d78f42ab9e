"""token-classification: text in; a list of entities out.

The pipeline cuts a text at the model's positions; with `stride` it reads the whole text
instead, in windows of the model's length that overlap by `stride` tokens, and merges
the entities of the overlaps (which needs an `aggregation_strategy`).
"""

from __future__ import annotations

import math

from rawserve.tasks.checks import NUMBER, int_range, lower_one_of, text, text_list
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


TASK = Task(
    "token-classification",
    text,
    {
        "aggregation_strategy": lower_one_of("none", "simple", "first", "average", "max"),
        # [] keeps every label, "O" too (the pipeline's default leaves "O" out)
        "ignore_labels": text_list(100, min_items=0),
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

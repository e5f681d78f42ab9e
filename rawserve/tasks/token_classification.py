"""token-classification: text in; a list of entities out."""

from __future__ import annotations

from rawserve.tasks.checks import NUMBER, lower_one_of, text, text_list
from rawserve.tasks.rules import Task

TASK = Task(
    "token-classification",
    text,
    {
        "aggregation_strategy": lower_one_of("none", "simple", "first", "average", "max"),
        # [] keeps every label, "O" too (the pipeline's default leaves "O" out)
        "ignore_labels": text_list(100, min_items=0),
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

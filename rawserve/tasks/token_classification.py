"""token-classification: text in; a list of entities out."""

from __future__ import annotations

from rawserve.tasks.checks import one_of, text, text_list
from rawserve.tasks.rules import Task

TASK = Task(
    "token-classification",
    text,
    {
        "aggregation_strategy": one_of("none", "simple", "first", "average", "max"),
        "ignore_labels": text_list(100),
    },
)

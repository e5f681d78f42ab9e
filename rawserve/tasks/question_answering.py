"""question-answering: `{"question", "context"}` in; `{score, start, end, answer}` out
(a list of them when top_k > 1). Served by rawserve's own adapter
(`rawserve.question_answering`): transformers 5 has no pipeline for it.
"""

from __future__ import annotations

from typing import Any

from rawserve.tasks.checks import boolean, int_range
from rawserve.tasks.rules import Task


def question_and_context(value: Any) -> dict[str, str]:
    if (
        isinstance(value, dict)
        and set(value) == {"question", "context"}
        and all(isinstance(v, str) and v for v in value.values())
    ):
        return dict(value)
    raise ValueError('each input must be {"question": "...", "context": "..."}')


TASK = Task(
    "question-answering",
    question_and_context,
    {
        "top_k": int_range(1, 100),
        "max_answer_len": int_range(1, 1000),
        "max_seq_len": int_range(16, 4096),
        "handle_impossible_answer": boolean,
    },
)

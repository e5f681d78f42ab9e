"""text-classification: a text or a text pair in; `{label, score}` out.

One input is answered `[[{label, score}, ...]]`, the Inference API's shape, which
InferenceClient reads as `answer[0]`.
"""

from __future__ import annotations

from typing import Any

from rawserve.tasks.checks import (
    LABEL_SCORE,
    checker,
    int_range,
    lower_one_of,
    one_or_list,
    visible,
)
from rawserve.tasks.rules import SingleAnswer, Task

# Set by the server's TEI routes (/predict, /rerank), never by a client (it is not an
# allowed name): the worker answers each input's logits as a float32 row, and the server
# turns them into scores and labels.
LOGITS_PARAM = "logits"
# Set beside it by vLLM's routes (`truncate_prompt_tokens`), with `truncate`: each input cut
# to this many tokens (special tokens included), fewer than the model's length.
TRUNCATE_TO = "truncate_to"


@checker(
    {
        "oneOf": [
            {"type": "string"},
            {
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string"}, "text_pair": {"type": "string"}},
                "additionalProperties": False,
            },
        ]
    }
)
def text_or_pair(value: Any) -> str | dict[str, str]:
    if isinstance(value, str):
        return visible(value)
    if (
        isinstance(value, dict)
        and "text" in value
        and set(value) <= {"text", "text_pair"}
        and all(isinstance(v, str) for v in value.values())
    ):
        return {name: visible(part, f"the {name}") for name, part in value.items()}
    raise ValueError('each input must be a string or {"text": ..., "text_pair": ...}')


TASK = Task(
    "text-classification",
    text_or_pair,
    {
        "top_k": int_range(1, 1000),
        "function_to_apply": lower_one_of("sigmoid", "softmax", "none"),
    },
    single_answer=SingleAnswer.LIST_OF_LISTS,
    output_schema=one_or_list(LABEL_SCORE),
)

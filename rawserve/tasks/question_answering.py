"""question-answering: `{"question", "context"}` in; `{score, start, end, answer}` out
(a list of them when top_k > 1 leaves more than one). Served by rawserve's own adapter
(`rawserve.worker.span_extraction`): transformers 5 has no pipeline for it.

The parameters are transformers 4's pipeline's, with their names; `topk` is its old
spelling of `top_k`, and `max_question_len` is accepted and, as in that pipeline with a
fast tokenizer, changes nothing (only the context is cut into windows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rawserve.tasks.checks import NUMBER, boolean, checker, int_range, one_or_list, visible
from rawserve.tasks.estimate import text_tokens
from rawserve.tasks.rules import Task

MAX_SEQ_LEN = 384  # the pipeline's window, in tokens
DOC_STRIDE = 128  # the pipeline's overlap of two windows, at most half a window
SPECIAL_TOKENS = 3  # a window is [CLS] question [SEP] context [SEP]


def window_tokens(item: Mapping[str, str], params: Mapping[str, Any], tokens: int) -> int:
    """The tokens the model reads for one (question, context) pair of `tokens` tokens:
    its context cut into windows of `max_seq_len` tokens, each after the question, that
    overlap by `doc_stride`. A stride close to the window's room starts a window every
    token or two, so a few kilobytes of context become thousands of windows."""
    size = params.get("max_seq_len")
    if not isinstance(size, int) or size < 1:  # (unset; or a handler's own, unchecked)
        size = MAX_SEQ_LEN
    stride = params.get("doc_stride")
    if not isinstance(stride, int):
        stride = min(size // 2, DOC_STRIDE)
    question = SPECIAL_TOKENS + text_tokens(item["question"])
    room = size - question  # of the context, in each window
    if room - stride < 1:  # no window fits (the worker refuses it)
        return tokens
    context = tokens - question
    windows = 1 + math.ceil(max(0, context - room) / (room - stride))
    return windows * min(size, tokens)


@checker(
    {
        "type": "object",
        "required": ["question", "context"],
        "properties": {
            "question": {"type": "string", "minLength": 1},
            "context": {"type": "string", "minLength": 1},
        },
        "additionalProperties": False,
    }
)
def question_and_context(value: Any) -> dict[str, str]:
    if (
        isinstance(value, dict)
        and set(value) == {"question", "context"}
        and all(isinstance(v, str) for v in value.values())
    ):
        return {name: visible(value[name], f"the {name}") for name in ("question", "context")}
    raise ValueError('each input must be {"question": "...", "context": "..."}')


TASK = Task(
    "question-answering",
    question_and_context,
    {
        "top_k": int_range(1, 100),
        "topk": int_range(1, 100),
        "max_answer_len": int_range(1, 1000),
        "max_seq_len": int_range(16, 4096),
        "doc_stride": int_range(0, 4096),
        "max_question_len": int_range(1, 4096),
        "handle_impossible_answer": boolean,
        "align_to_words": boolean,
    },
    output_schema=one_or_list(
        {
            "type": "object",
            "required": ["score", "start", "end", "answer"],
            "properties": {
                "score": NUMBER,
                "start": {"type": "integer"},
                "end": {"type": "integer"},
                "answer": {"type": "string"},
            },
        }
    ),
)
